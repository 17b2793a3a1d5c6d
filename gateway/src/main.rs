//! `fission-gateway`: the gateway as a process (see [`gateway::cli::launch`]).

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "fission-gateway",
    version,
    about = "Fission gateway: HTTP/SSE front door"
)]
struct Cli {
    #[command(flatten)]
    gateway: gateway::cli::GatewayCli,
}

fn main() -> anyhow::Result<()> {
    Ok(gateway::cli::launch(Cli::parse().gateway)?)
}
