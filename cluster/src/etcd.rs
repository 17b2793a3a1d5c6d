//! Connecting to etcd, per-call timeouts and retry backoff.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::backoff::Backoff;
use crate::error::ClusterError;
use crate::etcd_security::{authenticate, EtcdSecurity};

/// Where etcd is, how to reach it safely, and how patiently to talk to it.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// For example `["http://127.0.0.1:2379"]`, or `https://` with [`EtcdSecurity::tls`].
    pub endpoints: Vec<String>,
    pub security: EtcdSecurity,
    /// Names the key space: `/fission/{cluster}/...`.
    pub cluster: String,
    pub connect_timeout_ms: u64,
    /// Limit on each unary call (get, put, grant, revoke).
    pub request_timeout_ms: u64,
    /// First wait before retrying after etcd fails; doubles up to `retry_max_ms`.
    pub retry_min_ms: u64,
    pub retry_max_ms: u64,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>, cluster: impl Into<String>) -> Self {
        EtcdConfig {
            endpoints,
            security: EtcdSecurity::default(),
            cluster: cluster.into(),
            connect_timeout_ms: 1_000,
            request_timeout_ms: 2_000,
            retry_min_ms: 100,
            retry_max_ms: 1_000,
        }
    }

    pub fn with_security(mut self, security: EtcdSecurity) -> Self {
        self.security = security;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), ClusterError> {
        if self.endpoints.is_empty() {
            return Err(ClusterError::InvalidConfig {
                field: "etcd endpoints",
                reason: "must name at least one endpoint",
                value: String::new(),
            });
        }
        if self.cluster.is_empty() || self.cluster.contains('/') {
            return Err(ClusterError::InvalidConfig {
                field: "cluster",
                reason: "must be non-empty and contain no '/'",
                value: self.cluster.clone(),
            });
        }
        self.security.validate(&self.endpoints)
    }

    pub(crate) fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// Builds a client. The channel connects lazily and reconnects by itself, so this succeeds
    /// while etcd is down; calls fail until it is back. With credentials it authenticates
    /// first, and fails at once when etcd refuses them (see [`authenticate`]).
    pub(crate) async fn connect(&self) -> Result<Client, ClusterError> {
        self.validate()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(self.connect_timeout_ms))
            // etcd answers pings more often than every 5 s (its --grpc-keepalive-min-time)
            // with GOAWAY, which broke every watch every few seconds; 10 s stays clear of it.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            // etcd forgets tokens when it restarts and when they sit unused (--auth-token-ttl):
            // a call refused for its token authenticates again and is retried once.
            .with_auto_token_refresh(true);
        if let Some(tls) = self.security.tls_options()? {
            options = options.with_tls(tls);
        }
        let mut client = Client::connect(&self.endpoints, Some(options))
            .await
            .map_err(ClusterError::etcd("connect"))?;
        if let Some(credentials) = &self.security.credentials {
            authenticate(
                &mut client,
                credentials,
                self.request_timeout(),
                self.backoff(),
            )
            .await?;
        }
        Ok(client)
    }

    /// Checks the configuration and, with credentials, that etcd accepts them: a process runs
    /// it before its slow start-up (loading weights) so that a wrong password fails in
    /// milliseconds. An etcd that does not answer yet is not an error.
    pub async fn check_access(&self) -> Result<(), ClusterError> {
        self.connect().await.map(drop)
    }

    pub(crate) fn backoff(&self) -> Backoff {
        Backoff::new(
            Duration::from_millis(self.retry_min_ms.max(1)),
            Duration::from_millis(self.retry_max_ms.max(self.retry_min_ms.max(1))),
        )
    }
}

/// Runs one etcd call under the request timeout.
pub(crate) async fn call<T>(
    op: &'static str,
    timeout: Duration,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ClusterError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result.map_err(ClusterError::etcd(op)),
        Err(_) => Err(ClusterError::timeout(op, timeout)),
    }
}
