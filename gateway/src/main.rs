//! `fission-gateway`: flags, tracing and signals around [`gateway::cli::run_cluster`].

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "fission-gateway",
    version,
    about = "Fission gateway: HTTP/SSE front door"
)]
struct Cli {
    #[arg(long, env = "FISSION_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    addr: String,
    #[command(flatten)]
    args: gateway::cli::GatewayArgs,
    #[command(flatten)]
    telemetry: telemetry::TelemetryArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _telemetry = telemetry::init(
        "fission-gateway",
        cli.telemetry.otlp_endpoint.clone(),
        "info",
    )?;
    let listener = tokio::net::TcpListener::bind(&cli.addr)
        .await
        .with_context(|| format!("binding {}", cli.addr))?;
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = term.recv() => {},
        }
        s.cancel();
    });
    gateway::cli::run_cluster(cli.args, listener, shutdown).await?;
    Ok(())
}
