//! `fission`: the command-line entry point. Subcommands live in `cmd/`, one file each.

mod cmd;
use node_common::default_model;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "fission",
    version,
    about = "Fission: disaggregated LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text for one prompt with the local engine.
    Generate(cmd::generate::GenerateArgs),
    /// Write a random-weight model with a known shape (for benchmarks).
    MakeRandomModel(cmd::random_model::RandomModelArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// Start a local cluster (prefill nodes, decode nodes, gateway) as separate processes.
    Up(cmd::up::UpArgs),
    /// Run one node.
    #[command(subcommand)]
    Node(cmd::serve::NodeCommand),
    /// Run the gateway.
    Gateway(gateway::cli::GatewayCli),
    /// Inspect or drain the nodes of a running cluster.
    #[command(subcommand)]
    Nodes(cmd::nodes::NodesCommand),
    /// Create a cluster CA and issue role certificates.
    #[command(subcommand)]
    Certs(cmd::certs::CertsCommand),
}

fn main() -> anyhow::Result<()> {
    // Before any thread exists (see the function).
    node_common::launch::set_engine_threads();
    let cli = Cli::parse();
    // Services install their own subscriber, with trace export (see `cmd::serve`).
    if !matches!(cli.command, Command::Node(_) | Command::Gateway(_)) {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .init();
    }
    match cli.command {
        Command::Generate(args) => cmd::generate::run(args),
        Command::MakeRandomModel(args) => cmd::random_model::run(args),
        Command::Bench(c) => cmd::bench::run(c),
        Command::Up(args) => cmd::up::run(args),
        Command::Certs(c) => cmd::certs::run(c),
        Command::Node(c) => cmd::serve::run_node(c),
        Command::Gateway(c) => cmd::serve::run_gateway(c),
        Command::Nodes(c) => cmd::nodes::run(c),
    }
}
