//! `fission-decode`: the decode node as a process (see [`node_common::launch`]).

use clap::Parser;
use decode_node::{DecodeConfig, DecodeNode};
use node_common::launch::{launch, NodeCli};

#[derive(Parser)]
#[command(name = "fission-decode", version, about = "Fission decode node")]
struct Cli {
    #[command(flatten)]
    node: NodeCli<DecodeConfig>,
}

fn main() -> anyhow::Result<()> {
    Ok(launch::<DecodeNode>(Cli::parse().node)?)
}
