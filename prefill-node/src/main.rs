//! `fission-prefill`: flags, tracing and signals around [`prefill_node::run`].

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "fission-prefill", version, about = "Fission prefill node")]
struct Cli {
    #[command(flatten)]
    config: prefill_node::PrefillConfig,
    #[command(flatten)]
    telemetry: telemetry::TelemetryArgs,
    #[arg(long, env = "FISSION_GRPC_ADDR", default_value = "127.0.0.1:7000")]
    grpc_addr: String,
    #[arg(long, env = "FISSION_METRICS_ADDR", default_value = "127.0.0.1:9000")]
    metrics_addr: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _telemetry = node_common::init_process(
        "fission-prefill",
        prefill_node::LOG_FILTER,
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
    prefill_node::run(
        cli.config,
        prefill_node::PrefillListeners { grpc, metrics },
        shutdown,
    )
    .await?;
    Ok(())
}
