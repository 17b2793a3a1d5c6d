//! `fission-prefill`: the prefill node as a process (see [`node_common::launch`]).

use clap::Parser;
use node_common::launch::{launch, NodeCli};
use prefill_node::{PrefillConfig, PrefillNode};

#[derive(Parser)]
#[command(name = "fission-prefill", version, about = "Fission prefill node")]
struct Cli {
    #[command(flatten)]
    node: NodeCli<PrefillConfig>,
}

fn main() -> anyhow::Result<()> {
    Ok(launch::<PrefillNode>(Cli::parse().node)?)
}
