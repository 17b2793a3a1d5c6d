//! `fission node prefill|decode` and `fission gateway`: the services, run from the one binary
//! so `fission up` can start each as its own process.

use anyhow::Context;
use clap::{Args, Subcommand};
use tokio_util::sync::CancellationToken;

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Run a prefill node.
    Prefill(PrefillArgs),
    /// Run a decode node.
    Decode(DecodeArgs),
}

#[derive(Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    config: prefill_node::PrefillConfig,
    #[arg(long, env = "FISSION_GRPC_ADDR", default_value = "127.0.0.1:7000")]
    grpc_addr: String,
    #[arg(long, env = "FISSION_METRICS_ADDR", default_value = "127.0.0.1:9000")]
    metrics_addr: String,
}

#[derive(Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    config: decode_node::DecodeConfig,
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
}

async fn bind(addr: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
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
        match cmd {
            NodeCommand::Prefill(a) => {
                let listeners = prefill_node::PrefillListeners {
                    grpc: bind(&a.grpc_addr).await?,
                    metrics: bind(&a.metrics_addr).await?,
                };
                prefill_node::run(a.config, listeners, shutdown).await?;
            }
            NodeCommand::Decode(a) => {
                let listeners = decode_node::DecodeListeners {
                    grpc: bind(&a.grpc_addr).await?,
                    metrics: bind(&a.metrics_addr).await?,
                    kv_addr: a.kv_addr,
                };
                decode_node::run(a.config, listeners, shutdown).await?;
            }
        }
        Ok(())
    })
}

pub fn run_gateway(cmd: GatewayCmd) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let shutdown = CancellationToken::new();
        node_common::spawn_signal_handler(shutdown.clone());
        let listener = bind(&cmd.addr).await?;
        gateway::cli::run_cluster(cmd.args, listener, shutdown).await?;
        Ok(())
    })
}
