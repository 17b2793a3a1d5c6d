//! How a process reaches etcd safely: TLS that checks etcd's certificate against the CA that
//! signed it (and presents a client certificate to an etcd started with
//! `--client-cert-auth`), and etcd's own user/password authentication.
//!
//! TLS keeps anyone on the network from reading or forging membership; the client certificate
//! and the password decide who may write it. With authentication on, etcd runs a call that
//! carries no password token as the user named by the client certificate's common name.

use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Certificate, Client, Identity, TlsOptions};
use tonic::Code;

use crate::error::ClusterError;

/// What secures the connection to etcd. The default is plaintext and no user.
#[derive(Debug, Clone, Default)]
pub struct EtcdSecurity {
    pub tls: Option<EtcdTls>,
    pub credentials: Option<EtcdCredentials>,
}

/// TLS to etcd: the CA its server certificate must chain to, and this process's certificate
/// for an etcd that requires one.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub ca_cert: PathBuf,
    pub client_cert: Option<EtcdClientCert>,
}

/// A client certificate and its private key, PEM files.
#[derive(Debug, Clone)]
pub struct EtcdClientCert {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// An etcd user and its password.
#[derive(Debug, Clone)]
pub struct EtcdCredentials {
    pub user: String,
    pub password: EtcdPassword,
}

/// A password that never shows in logs or `Debug` output; [`EtcdPassword::expose`] is the one
/// way to read it. It knows where it came from, so that an error can send the operator to the
/// right place.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdPassword {
    secret: String,
    source: &'static str,
}

impl EtcdPassword {
    pub fn new(password: impl Into<String>) -> Self {
        EtcdPassword {
            secret: password.into(),
            source: "the configured password",
        }
    }

    pub fn expose(&self) -> &str {
        &self.secret
    }

    /// Where the password came from: a flag, a file or the environment.
    pub fn source(&self) -> &'static str {
        self.source
    }

    /// The same password, said to come from `source`.
    pub fn with_source(self, source: &'static str) -> Self {
        EtcdPassword { source, ..self }
    }

    /// The password in `path`: its contents without the trailing newline editors add.
    pub fn from_file(path: &Path) -> Result<Self, ClusterError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::EtcdFile {
            path: path.display().to_string(),
            source,
        })?;
        Ok(EtcdPassword::new(text.trim_end_matches(['\n', '\r']))
            .with_source("--etcd-password-file"))
    }
}

impl std::fmt::Debug for EtcdPassword {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EtcdPassword(<redacted>)")
    }
}

// For clap: `--etcd-password` parses into one directly, so the flag structs never hold the
// password as a plain `String` that a `{:?}` would print.
impl From<String> for EtcdPassword {
    fn from(password: String) -> Self {
        EtcdPassword::new(password).with_source("--etcd-password or FISSION_ETCD_PASSWORD")
    }
}

impl EtcdSecurity {
    /// Endpoints must say `https://` exactly when TLS is configured (or name no scheme): etcd
    /// client would otherwise fail later and less clearly, or go plaintext.
    pub(crate) fn validate(&self, endpoints: &[String]) -> Result<(), ClusterError> {
        for endpoint in endpoints {
            let (bad, reason) = if self.tls.is_some() {
                (
                    endpoint.starts_with("http://"),
                    "must be https:// (or host:port) when the etcd CA is given",
                )
            } else {
                (
                    endpoint.starts_with("https://"),
                    "is https://: give the CA that signed etcd's certificate (--etcd-ca)",
                )
            };
            if bad {
                return Err(ClusterError::InvalidConfig {
                    field: "etcd endpoint",
                    reason,
                    value: endpoint.clone(),
                });
            }
        }
        if self
            .credentials
            .as_ref()
            .is_some_and(|c| c.user.is_empty() || c.password.expose().is_empty())
        {
            return Err(ClusterError::InvalidConfig {
                field: "etcd credentials",
                reason: "need a non-empty user and password",
                value: String::new(),
            });
        }
        Ok(())
    }

    /// The TLS options for etcd client, with the PEM files read now: a missing file is a
    /// start-up error, not a connection that never comes up.
    pub(crate) fn tls_options(&self) -> Result<Option<TlsOptions>, ClusterError> {
        let Some(tls) = &self.tls else {
            return Ok(None);
        };
        let mut options =
            TlsOptions::new().ca_certificate(Certificate::from_pem(read(&tls.ca_cert)?));
        if let Some(client) = &tls.client_cert {
            options = options.identity(Identity::from_pem(read(&client.cert)?, read(&client.key)?));
        }
        Ok(Some(options))
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ClusterError> {
    std::fs::read(path).map_err(|source| ClusterError::EtcdFile {
        path: path.display().to_string(),
        source,
    })
}

/// How an authentication attempt ended.
enum AuthOutcome {
    Authenticated,
    /// etcd runs without authentication: there is no token to get, and calls work without one.
    AuthDisabled,
    /// etcd did not answer (down, or the connection failed): try again later.
    Unreachable(etcd_client::Error),
}

/// Authenticates `client` as `credentials`; the token (and the credentials, for refreshing it
/// when it expires) are shared by every clone of the client.
///
/// A refusal (wrong user or password) is an error now, so a misconfigured process stops at
/// start-up. When etcd does not answer, the process starts anyway, as it does without
/// credentials: a task keeps trying and every call fails as unauthenticated until it succeeds.
pub(crate) async fn authenticate(
    client: &mut Client,
    credentials: &EtcdCredentials,
    timeout: Duration,
    retry: crate::backoff::Backoff,
) -> Result<(), ClusterError> {
    match try_authenticate(client, credentials, timeout).await? {
        AuthOutcome::Authenticated | AuthOutcome::AuthDisabled => Ok(()),
        AuthOutcome::Unreachable(error) => {
            tracing::warn!(user = %credentials.user, %error, "etcd did not answer; authenticating when it does");
            tokio::spawn(run_authenticate_task(
                client.clone(),
                credentials.clone(),
                timeout,
                retry,
            ));
            Ok(())
        }
    }
}

/// Retries authentication until etcd answers, then ends (also on a refusal, which it logs:
/// every call then fails with etcd's permission errors, which the callers log as they retry).
async fn run_authenticate_task(
    mut client: Client,
    credentials: EtcdCredentials,
    timeout: Duration,
    mut retry: crate::backoff::Backoff,
) {
    loop {
        tokio::time::sleep(retry.next_delay()).await;
        match try_authenticate(&mut client, &credentials, timeout).await {
            Ok(AuthOutcome::Unreachable(_)) => continue,
            Ok(AuthOutcome::Authenticated | AuthOutcome::AuthDisabled) => return,
            Err(error) => {
                tracing::error!(%error, "etcd refused this process's credentials");
                return;
            }
        }
    }
}

async fn try_authenticate(
    client: &mut Client,
    credentials: &EtcdCredentials,
    timeout: Duration,
) -> Result<AuthOutcome, ClusterError> {
    let creds = Some((
        credentials.user.clone(),
        credentials.password.expose().to_owned(),
    ));
    let error = match tokio::time::timeout(timeout, client.update_user(creds)).await {
        Ok(Ok(())) => {
            tracing::debug!(user = %credentials.user, "authenticated with etcd");
            return Ok(AuthOutcome::Authenticated);
        }
        Ok(Err(error)) => error,
        Err(_) => {
            return Ok(AuthOutcome::Unreachable(etcd_client::Error::Internal(
                format!("authenticate timed out after {} ms", timeout.as_millis()),
            )))
        }
    };
    let etcd_client::Error::GRpcStatus(status) = &error else {
        return Ok(AuthOutcome::Unreachable(error));
    };
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
            Ok(AuthOutcome::Unreachable(error))
        }
        Code::FailedPrecondition if status.message().contains("authentication is not enabled") => {
            tracing::warn!(user = %credentials.user, "etcd has authentication disabled: the etcd user and password are not checked");
            Ok(AuthOutcome::AuthDisabled)
        }
        _ => Err(ClusterError::EtcdAuth {
            user: credentials.user.clone(),
            reason: status.message().to_owned(),
            password_source: credentials.password.source(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_never_shows_in_debug_output() {
        let security = EtcdSecurity {
            tls: None,
            credentials: Some(EtcdCredentials {
                user: "fission".into(),
                password: EtcdPassword::new("hunter2"),
            }),
        };
        let shown = format!("{security:?}");
        assert!(shown.contains("fission"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn a_password_file_loses_its_trailing_newline_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, " s3cret \r\n").unwrap();
        assert_eq!(EtcdPassword::from_file(&path).unwrap().expose(), " s3cret ");
        let missing = EtcdPassword::from_file(&dir.path().join("nope")).unwrap_err();
        assert!(missing.to_string().contains("nope"), "{missing}");
    }

    #[test]
    fn endpoint_schemes_must_match_tls() {
        let tls = EtcdSecurity {
            tls: Some(EtcdTls {
                ca_cert: "ca.pem".into(),
                client_cert: None,
            }),
            credentials: None,
        };
        let plain = EtcdSecurity::default();
        let http = vec!["http://127.0.0.1:2379".to_owned()];
        let https = vec!["https://127.0.0.1:2379".to_owned()];
        let bare = vec!["127.0.0.1:2379".to_owned()];
        assert!(tls.validate(&https).is_ok() && tls.validate(&bare).is_ok());
        assert!(plain.validate(&http).is_ok() && plain.validate(&bare).is_ok());
        let err = tls.validate(&http).unwrap_err();
        assert!(err.to_string().contains("must be https://"), "{err}");
        let err = plain.validate(&https).unwrap_err();
        assert!(err.to_string().contains("--etcd-ca"), "{err}");
    }

    #[test]
    fn a_missing_certificate_file_is_named() {
        let tls = EtcdSecurity {
            tls: Some(EtcdTls {
                ca_cert: "/nonexistent/etcd-ca.pem".into(),
                client_cert: None,
            }),
            credentials: None,
        };
        let err = tls.tls_options().unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/etcd-ca.pem"),
            "{err}"
        );
    }
}
