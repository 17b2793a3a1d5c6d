//! The gateway's command-line flags and its start-up with the cluster backend, shared by
//! `fission-gateway` and `fission gateway`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::auth::{self, ApiKey, AuthConfig, KeyStore};
use crate::cluster::{
    policy, ClusterBackend, ClusterConfig, Discovery, EtcdMembers, PolicyKind, Pools,
    StaticDiscovery,
};
use crate::{GatewayConfig, GatewayError};
use clap::Args;
use tokio_util::sync::CancellationToken;

/// The gateway's whole command line: where it listens, its flags, and trace export. Both
/// `fission-gateway` and `fission gateway` parse it and call [`launch`].
#[derive(Args, Debug, Clone)]
pub struct GatewayCli {
    #[arg(long, env = "FISSION_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub addr: String,
    #[command(flatten)]
    pub args: GatewayArgs,
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

/// The gateway's log filter when `RUST_LOG` is unset.
pub const LOG_FILTER: &str = "info";

/// Runs the gateway as this process until SIGTERM or Ctrl-C and its drain end.
pub fn launch(cli: GatewayCli) -> Result<(), telemetry::ProcessError<GatewayError>> {
    telemetry::run_service(
        "fission-gateway",
        LOG_FILTER,
        cli.telemetry.otlp_endpoint.clone(),
        |shutdown| async move {
            let listener = tokio::net::TcpListener::bind(&cli.addr)
                .await
                .map_err(|e| GatewayError::Config {
                    message: format!("binding {}: {e}", cli.addr),
                })?;
            run_cluster(cli.args, listener, shutdown).await
        },
    )
}

/// The gateway's flags. Their defaults are read from [`GatewayConfig::default`] and
/// [`ClusterConfig::default`], the one source of each (a test below holds them together).
#[derive(Args, Debug, Clone)]
pub struct GatewayArgs {
    /// Model directory holding tokenizer.json (and tokenizer_config.json, generation_config.json).
    /// `fission gateway` also takes what the nodes' --model takes: a hub id (org/name[@revision],
    /// resolved through the hub cache; the API's model id is then the repo id) or stories260K.
    #[arg(long, env = "FISSION_MODEL_DIR")]
    pub model_dir: PathBuf,
    /// The model id reported by the APIs; defaults to the directory name.
    #[arg(long, env = "FISSION_MODEL_ID")]
    pub model_id: Option<String>,
    /// Another name clients may give as OpenAI's `model` (repeatable); `/v1/models` lists it.
    /// Any name that is neither this nor the model id gets 404 `model_not_found`.
    #[arg(
        long = "served-model-name",
        env = "FISSION_SERVED_MODEL_NAME",
        value_delimiter = ','
    )]
    pub served_model_names: Vec<String>,
    /// etcd endpoints, comma separated: nodes are discovered there as they register and
    /// leave. Without it, `--decode-nodes` (and `--prefill-nodes`) give a static cluster.
    #[arg(long, env = "FISSION_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// The cluster's name in etcd (its key prefix).
    #[arg(long, env = "FISSION_CLUSTER", default_value = "fission")]
    pub cluster: String,
    /// TLS and user for etcd.
    #[command(flatten)]
    pub etcd_security: cluster::EtcdSecurityArgs,
    /// How prefill and decode nodes are picked.
    #[arg(long, env = "FISSION_ROUTING", value_enum, default_value_t = PolicyKind::CacheAware)]
    pub routing: PolicyKind,
    /// Prefill nodes' gRPC `host:port`, comma separated (static clusters).
    #[arg(long, env = "FISSION_PREFILL_NODES", value_delimiter = ',')]
    pub prefill_nodes: Vec<String>,
    /// Decode nodes' gRPC `host:port`, comma separated (static clusters).
    #[arg(
        long,
        env = "FISSION_DECODE_NODES",
        value_delimiter = ',',
        required_unless_present = "etcd"
    )]
    pub decode_nodes: Vec<String>,
    /// Prompts shorter than this are prefilled on the decode node (conditional disaggregation).
    #[arg(long, env = "MAX_LOCAL_PREFILL_TOKENS", default_value_t = ClusterConfig::default().max_local_prefill_tokens)]
    pub max_local_prefill_tokens: usize,
    #[arg(long, env = "MAX_INPUT_TOKENS", default_value_t = GatewayConfig::default().max_input_tokens)]
    pub max_input_tokens: usize,
    #[arg(long, env = "MAX_TOTAL_TOKENS", default_value_t = GatewayConfig::default().max_total_tokens)]
    pub max_total_tokens: usize,
    /// Requests placed on the nodes at once; more wait in the admission queue.
    #[arg(long, env = "MAX_CONCURRENT_REQUESTS", default_value_t = GatewayConfig::default().max_concurrent_requests)]
    pub max_concurrent_requests: usize,
    /// Requests that may wait in the admission queue; one more gets 429 at once.
    #[arg(long, env = "FISSION_MAX_WAITING_REQUESTS", default_value_t = GatewayConfig::default().max_waiting_requests)]
    pub max_waiting_requests: usize,
    /// Prompt tokens the waiting requests may hold together; a request over it gets 429.
    #[arg(long, env = "FISSION_MAX_QUEUED_TOKENS", default_value_t = GatewayConfig::default().max_queued_tokens)]
    pub max_queued_tokens: u64,
    /// The longest a request waits in the queue for room before it gets 429.
    #[arg(long, env = "FISSION_MAX_QUEUE_WAIT_MS", default_value_t = GatewayConfig::default().max_queue_wait_ms)]
    pub max_queue_wait_ms: u64,
    /// A request's node that sends nothing (and, while generating, no token) for this long is
    /// suspect: it takes no new work and the request moves on. Slower requests get more: up to
    /// 8 times their own time per output token.
    #[arg(long, env = "FISSION_MAX_STALL_MS", default_value_t = ClusterConfig::default().max_stall.as_millis() as u64)]
    pub max_stall_ms: u64,
    /// How many times one request may move to another decode node mid-stream.
    #[arg(long, env = "FISSION_MIGRATION_LIMIT", default_value_t = ClusterConfig::default().migration_limit)]
    pub migration_limit: usize,
    #[arg(long, env = "MAX_NEW_TOKENS", default_value_t = GatewayConfig::default().max_new_tokens_default)]
    pub max_new_tokens_default: usize,
    #[arg(long, env = "FISSION_REQUEST_TIMEOUT_MS", default_value_t = GatewayConfig::default().request_timeout_ms)]
    pub request_timeout_ms: u64,
    // The HTTP edge: API keys and body size (see `crate::auth`, `crate::body_limit`).
    /// An API key clients must send (`Authorization: Bearer KEY` or `x-api-key: KEY`);
    /// repeatable. FISSION_API_KEY holds one. With no key here or in --api-key-file, the API
    /// is open. Keys on a command line are visible to local users (`ps`): prefer the
    /// variable or the file.
    #[arg(long = "api-key", env = "FISSION_API_KEY", hide_env_values = true)]
    pub api_keys: Vec<ApiKey>,
    /// A file of API keys, one a line (blank lines and `#` comments ignored), re-read on
    /// SIGHUP; a reload that fails keeps the keys in force.
    #[arg(long, env = "FISSION_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Serve /health without an API key (for load balancers' probes).
    #[arg(long, env = "FISSION_PUBLIC_HEALTH")]
    pub public_health: bool,
    /// Serve /metrics without an API key (for a Prometheus without credentials).
    #[arg(long, env = "FISSION_PUBLIC_METRICS")]
    pub public_metrics: bool,
    /// Request bodies larger than this get 413.
    #[arg(long, env = "FISSION_MAX_BODY_BYTES", default_value_t = GatewayConfig::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// The gateway's certificate for mutual TLS with the nodes (role gateway).
    #[command(flatten)]
    pub tls: identity::TlsArgs,
}

/// eos ids from generation_config.json (or config.json), plus bos: a model that emits bos
/// has started a new document.
fn stop_ids(dir: &Path) -> Vec<u32> {
    let read = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    let ids = |v: Option<&serde_json::Value>| -> Vec<u32> {
        match v {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64().map(|x| x as u32))
                .collect(),
            _ => Vec::new(),
        }
    };
    let mut out = Vec::new();
    for f in ["generation_config.json", "config.json"] {
        if let Some(v) = read(f) {
            if out.is_empty() {
                out = ids(v.get("eos_token_id"));
            }
            for b in ids(v.get("bos_token_id")) {
                if !out.contains(&b) {
                    out.push(b);
                }
            }
        }
    }
    out
}

/// Builds the config and the cluster backend from flags and serves until `shutdown`.
pub async fn run_cluster(
    cli: GatewayArgs,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<(), GatewayError> {
    // First: from here on a SIGHUP reloads the keys instead of ending the process.
    let auth = auth_config(&cli, &shutdown)?;
    let model_id = cli.model_id.clone().unwrap_or_else(|| {
        cli.model_dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into())
    });
    // Checked first: a gateway without a usable identity fails at once, not at its first
    // request.
    let security = cli
        .tls
        .grpc(identity::PeerRole::Gateway)
        .map_err(|e| GatewayError::Config {
            message: e.to_string(),
        })?;
    let mut config = gateway_config(&cli, model_id);
    config.auth = auth;
    let discovery: Arc<dyn Discovery> = if cli.etcd.is_empty() {
        Arc::new(StaticDiscovery::new(&cli.prefill_nodes, &cli.decode_nodes))
    } else {
        // The gateway's own weights define the cluster's model when it has them; otherwise
        // the first node to register does.
        let fingerprint = cluster::model_fingerprint(&cli.model_dir).ok();
        tracing::info!(etcd = ?cli.etcd, cluster = %cli.cluster, fingerprint = ?fingerprint, routing = %cli.routing, "discovering nodes in etcd");
        let security = cli
            .etcd_security
            .security()
            .map_err(|e| GatewayError::Config {
                message: e.to_string(),
            })?;
        let etcd =
            cluster::EtcdConfig::new(cli.etcd.clone(), cli.cluster.clone()).with_security(security);
        Arc::new(
            EtcdMembers::start(etcd, fingerprint)
                .await
                .map_err(|e| GatewayError::Config {
                    message: format!("etcd: {e}"),
                })?,
        )
    };
    let pools = Pools::spawn(discovery, security);
    let backend = Arc::new(ClusterBackend::new(
        pools,
        cluster_config(&cli),
        policy(cli.routing),
    ));
    crate::run(config, listener, backend, shutdown).await
}

/// The gateway's settings from its flags and the model directory, the API keys aside.
fn gateway_config(cli: &GatewayArgs, model_id: String) -> GatewayConfig {
    let mut config = GatewayConfig::new(model_id, cli.model_dir.join("tokenizer.json"));
    let tc = cli.model_dir.join("tokenizer_config.json");
    config.tokenizer_config_path = tc.is_file().then_some(tc);
    config.served_model_names = cli.served_model_names.clone();
    config.max_input_tokens = cli.max_input_tokens;
    config.max_total_tokens = cli.max_total_tokens;
    config.max_concurrent_requests = cli.max_concurrent_requests;
    config.max_waiting_requests = cli.max_waiting_requests;
    config.max_queued_tokens = cli.max_queued_tokens;
    config.max_queue_wait_ms = cli.max_queue_wait_ms;
    config.max_new_tokens_default = cli.max_new_tokens_default;
    config.request_timeout_ms = cli.request_timeout_ms;
    config.eos_token_ids = stop_ids(&cli.model_dir);
    config.max_body_bytes = cli.max_body_bytes;
    config
}

fn cluster_config(cli: &GatewayArgs) -> ClusterConfig {
    ClusterConfig {
        max_local_prefill_tokens: cli.max_local_prefill_tokens,
        max_stall: std::time::Duration::from_millis(cli.max_stall_ms.max(1)),
        migration_limit: cli.migration_limit,
    }
}

/// The API keys from flags, with the key file's reloaded on SIGHUP until `shutdown`.
fn auth_config(
    cli: &GatewayArgs,
    shutdown: &CancellationToken,
) -> Result<AuthConfig, GatewayError> {
    let keys = KeyStore::load(cli.api_keys.clone(), cli.api_key_file.clone())?;
    if keys.key_file().is_some() {
        auth::spawn_reload_on_sighup(keys.clone(), shutdown.clone())?;
    }
    if keys.is_required() {
        tracing::info!(keys = keys.len(), file = ?keys.key_file(), public_health = cli.public_health, public_metrics = cli.public_metrics, "api keys required");
    } else {
        tracing::info!("no api key configured: the API is open to anyone who reaches it");
    }
    Ok(AuthConfig {
        keys,
        public_health: cli.public_health,
        public_metrics: cli.public_metrics,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        args: GatewayArgs,
    }

    #[test]
    fn the_flags_default_to_the_configs_defaults() {
        let args = Flags::try_parse_from(["gateway", "--model-dir", "m", "--decode-nodes", "d:1"])
            .unwrap()
            .args;
        let limits = |c: &GatewayConfig| {
            (
                (
                    c.max_input_tokens,
                    c.max_total_tokens,
                    c.max_new_tokens_default,
                ),
                (c.max_concurrent_requests, c.max_waiting_requests),
                (
                    c.max_queued_tokens,
                    c.max_queue_wait_ms,
                    c.request_timeout_ms,
                ),
                c.max_body_bytes,
            )
        };
        let flags = gateway_config(&args, "m".into());
        assert_eq!(limits(&flags), limits(&GatewayConfig::default()));
        let cluster =
            |c: &ClusterConfig| (c.max_local_prefill_tokens, c.max_stall, c.migration_limit);
        assert_eq!(
            cluster(&cluster_config(&args)),
            cluster(&ClusterConfig::default())
        );
    }
}
