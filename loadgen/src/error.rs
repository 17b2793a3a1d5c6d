//! The crate's one error type. Failed requests are not errors: they are measurements, recorded
//! in [`crate::record::ErrorKind`]. These are the failures that stop a run.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("invalid {field}: {reason} (given {given})")]
    InvalidSetting {
        field: &'static str,
        reason: String,
        given: String,
    },
    #[error("building the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("warm-up request {index} failed: {reason}")]
    Warmup { index: usize, reason: String },
    #[error("{what} failed: {reason}")]
    RequestFailed { what: String, reason: String },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("serializing the report: {0}")]
    Json(#[from] serde_json::Error),
    /// A failure of a tool built on this crate, as that tool words it (the simulator's cost
    /// profiles).
    #[error(transparent)]
    External(Box<dyn std::error::Error + Send + Sync>),
    #[error("plotting {path}: {message}")]
    Plot { path: PathBuf, message: String },
}

impl LoadError {
    pub fn invalid(field: &'static str, reason: impl Into<String>, given: impl ToString) -> Self {
        Self::InvalidSetting {
            field,
            reason: reason.into(),
            given: given.to_string(),
        }
    }
}
