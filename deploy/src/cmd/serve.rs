//! `fission node prefill|decode` and `fission gateway`: the services, run from the one binary
//! so `fission up` can start each as its own process.

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio_util::sync::CancellationToken;

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Run a prefill node.
    Prefill(PrefillArgs),
    /// Run a decode node.
    Decode(DecodeArgs),
    /// Add a node to a running cluster: registers in etcd, on free ports unless told otherwise.
    /// Takes the flags of `fission node prefill|decode` after `--role`.
    Start(StartArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum NodeRole {
    Prefill,
    Decode,
}

#[derive(Args)]
pub struct StartArgs {
    #[arg(long, value_enum)]
    role: NodeRole,
    /// The role's own flags (`--model DIR_OR_REPO`, `--etcd URL`, ...).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    rest: Vec<String>,
}

#[derive(Parser)]
struct PrefillCli {
    #[command(flatten)]
    args: PrefillArgs,
}

#[derive(Parser)]
struct DecodeCli {
    #[command(flatten)]
    args: DecodeArgs,
}

/// `rest` with free ports for every address it does not set: a node added at runtime must not
/// collide with the ones already running.
fn with_free_ports(role: NodeRole, rest: Vec<String>) -> Vec<String> {
    let mut argv = vec!["fission-node".to_string()];
    let has = |flag: &str| {
        rest.iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    let mut defaults = vec!["--grpc-addr", "--metrics-addr"];
    if matches!(role, NodeRole::Decode) {
        defaults.push("--kv-addr");
    }
    for flag in defaults {
        if !has(flag) {
            argv.push(format!("{flag}=127.0.0.1:0"));
        }
    }
    argv.extend(rest);
    argv
}

#[derive(Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    config: prefill_node::PrefillConfig,
    #[command(flatten)]
    telemetry: telemetry::TelemetryArgs,
    #[arg(long, env = "FISSION_GRPC_ADDR", default_value = "127.0.0.1:7000")]
    grpc_addr: String,
    #[arg(long, env = "FISSION_METRICS_ADDR", default_value = "127.0.0.1:9000")]
    metrics_addr: String,
}

#[derive(Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    config: decode_node::DecodeConfig,
    #[command(flatten)]
    telemetry: telemetry::TelemetryArgs,
    #[arg(long, env = "FISSION_GRPC_ADDR", default_value = "127.0.0.1:7100")]
    grpc_addr: String,
    #[arg(long, env = "FISSION_METRICS_ADDR", default_value = "127.0.0.1:9100")]
    metrics_addr: String,
    #[arg(long, env = "FISSION_KV_ADDR", default_value = "127.0.0.1:7200")]
    kv_addr: std::net::SocketAddr,
}

#[derive(Args)]
pub struct GatewayCmd {
    #[arg(long, env = "FISSION_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    addr: String,
    #[command(flatten)]
    args: gateway::cli::GatewayArgs,
    #[command(flatten)]
    telemetry: telemetry::TelemetryArgs,
}

async fn bind(addr: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

/// Prints where the node listens, so whoever started it on free ports can find it.
fn announce(
    role: &str,
    grpc: &tokio::net::TcpListener,
    metrics: &tokio::net::TcpListener,
) -> anyhow::Result<()> {
    use std::io::Write;
    println!(
        "{role} node grpc={} metrics=http://{}/metrics",
        grpc.local_addr()?,
        metrics.local_addr()?
    );
    std::io::stdout().flush()?;
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

pub fn run_node(cmd: NodeCommand) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let shutdown = CancellationToken::new();
        node_common::spawn_signal_handler(shutdown.clone());
        let cmd = match cmd {
            NodeCommand::Start(s) => {
                let argv = with_free_ports(s.role, s.rest);
                let cmd = match s.role {
                    NodeRole::Prefill => {
                        NodeCommand::Prefill(PrefillCli::try_parse_from(argv)?.args)
                    }
                    NodeRole::Decode => NodeCommand::Decode(DecodeCli::try_parse_from(argv)?.args),
                };
                // `start` joins a running cluster: without etcd the node would serve, unseen
                // by any gateway, and look healthy while it never gets a request.
                let etcd = match &cmd {
                    NodeCommand::Prefill(a) => &a.config.cluster.etcd,
                    NodeCommand::Decode(a) => &a.config.cluster.etcd,
                    NodeCommand::Start(_) => unreachable!("just resolved"),
                };
                if etcd.is_empty() {
                    anyhow::bail!(
                        "fission node start joins a cluster through etcd: pass --etcd URL (fission up prints it) or set FISSION_ETCD"
                    );
                }
                cmd
            }
            other => other,
        };
        match cmd {
            NodeCommand::Start(_) => unreachable!("resolved above"),
            NodeCommand::Prefill(a) => {
                let _telemetry =
                    telemetry::init("fission-prefill", a.telemetry.otlp_endpoint.clone(), "warn")?;
                let listeners = prefill_node::PrefillListeners {
                    grpc: bind(&a.grpc_addr).await?,
                    metrics: bind(&a.metrics_addr).await?,
                };
                announce("prefill", &listeners.grpc, &listeners.metrics)?;
                prefill_node::run(a.config, listeners, shutdown).await?;
            }
            NodeCommand::Decode(a) => {
                let _telemetry =
                    telemetry::init("fission-decode", a.telemetry.otlp_endpoint.clone(), "warn")?;
                let listeners = decode_node::DecodeListeners {
                    grpc: bind(&a.grpc_addr).await?,
                    metrics: bind(&a.metrics_addr).await?,
                    kv_addr: a.kv_addr,
                };
                announce("decode", &listeners.grpc, &listeners.metrics)?;
                decode_node::run(a.config, listeners, shutdown).await?;
            }
        }
        Ok(())
    })
}

pub fn run_gateway(cmd: GatewayCmd) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let _telemetry = telemetry::init(
            "fission-gateway",
            cmd.telemetry.otlp_endpoint.clone(),
            "warn",
        )?;
        let shutdown = CancellationToken::new();
        node_common::spawn_signal_handler(shutdown.clone());
        let listener = bind(&cmd.addr).await?;
        gateway::cli::run_cluster(cmd.args, listener, shutdown).await?;
        Ok(())
    })
}
