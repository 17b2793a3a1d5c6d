//! `fission-decode`: flags, tracing and signals around [`decode_node::run`].

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "fission-decode", version, about = "Fission decode node")]
struct Cli {
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _telemetry = node_common::init_process(
        "fission-decode",
        "info",
        cli.telemetry.otlp_endpoint.clone(),
    )?;
    let grpc = tokio::net::TcpListener::bind(&cli.grpc_addr)
        .await
        .with_context(|| format!("binding {}", cli.grpc_addr))?;
    let metrics = tokio::net::TcpListener::bind(&cli.metrics_addr)
        .await
        .with_context(|| format!("binding {}", cli.metrics_addr))?;
    let shutdown = CancellationToken::new();
    node_common::spawn_signal_handler(shutdown.clone());
    decode_node::run(
        cli.config,
        decode_node::DecodeListeners {
            grpc,
            metrics,
            kv_addr: cli.kv_addr,
        },
        shutdown,
    )
    .await?;
    Ok(())
}
