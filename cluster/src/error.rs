use std::time::Duration;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    #[error("etcd {op} failed: {source}")]
    Etcd {
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },

    #[error("etcd {op} timed out after {timeout_ms} ms")]
    Timeout { op: &'static str, timeout_ms: u64 },

    /// etcd refused the user or password. Never carries the password.
    /// `password_source` names where the password came from (`FISSION_ETCD_PASSWORD`,
    /// `--etcd-password`, `--etcd-password-file`).
    #[error("authentication failed for etcd user {user}: {reason}; check the user (--etcd-user) and its password (from {password_source})")]
    EtcdAuth {
        user: String,
        reason: String,
        password_source: &'static str,
    },

    /// A certificate, key or password file for etcd could not be read.
    #[error("etcd credentials: reading {path}: {source}")]
    EtcdFile {
        path: String,
        #[source]
        source: std::io::Error,
    },

    #[error("local etcd: {0}")]
    LocalEtcd(String),

    #[error("invalid node record at key {key}: {source}")]
    InvalidRecord {
        key: String,
        #[source]
        source: serde_json::Error,
    },

    #[error("invalid cluster config: {field} {reason}, got {value:?}")]
    InvalidConfig {
        field: &'static str,
        reason: &'static str,
        value: String,
    },

    #[error("node {node_id} is not registered with etcd right now; the change is kept and written when it registers again")]
    NotRegistered { node_id: String },

    #[error("registration of node {node_id} has stopped")]
    RegistrationStopped { node_id: String },
}

impl ClusterError {
    pub(crate) fn etcd(op: &'static str) -> impl FnOnce(etcd_client::Error) -> ClusterError {
        move |source| ClusterError::Etcd { op, source }
    }

    pub(crate) fn timeout(op: &'static str, timeout: Duration) -> ClusterError {
        ClusterError::Timeout {
            op,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }
}
