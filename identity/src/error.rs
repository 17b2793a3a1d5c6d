//! The crate's one error type.

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    #[error("tls: {what}: {reason}")]
    Tls { what: &'static str, reason: String },

    #[error("{path}: {source}")]
    File {
        path: String,
        #[source]
        source: std::io::Error,
    },

    /// Flags that do not make a usable identity (a key without a certificate, no TLS and no
    /// `--insecure`).
    #[error("{0}")]
    Config(String),
}

pub(crate) fn tls_err(what: &'static str) -> impl FnOnce(String) -> IdentityError {
    move |reason| IdentityError::Tls { what, reason }
}
