//! The simulator's defaults are the cluster's: a simulated node schedules as a node started
//! without flags, and the simulated gateway routes and admits as `fission gateway` does by
//! default. The simulator does not link the gateway, so its gateway defaults are written in
//! `cluster.rs`; this test is what holds them to the gateway's.

use clap::Parser;
use engine::engine::EngineConfig;
use gateway::cluster::ClusterConfig;
use gateway::GatewayConfig;
use simulator::{GatewaySettings, NodeSettings};

#[derive(Parser)]
struct GatewayFlags {
    #[command(flatten)]
    args: gateway::cli::GatewayArgs,
}

#[test]
fn the_simulated_gateway_defaults_to_the_gateway_s_defaults() {
    let sim = GatewaySettings::default();
    assert_eq!(
        sim.max_total_tokens,
        GatewayConfig::default().max_total_tokens
    );
    assert_eq!(
        sim.max_local_prefill_tokens,
        ClusterConfig::default().max_local_prefill_tokens
    );
    // The routing policy is a flag's default only.
    let flags =
        GatewayFlags::try_parse_from(["gateway", "--model-dir", "m", "--decode-nodes", "d:1"])
            .expect("the gateway's flags parse")
            .args;
    assert_eq!(sim.routing, flags.routing);
}

#[test]
fn a_simulated_node_defaults_to_the_engine_s_defaults() {
    let sim = NodeSettings::default();
    let e = EngineConfig::default();
    assert_eq!(
        (
            sim.max_batch_prefill_tokens,
            sim.max_batch_total_tokens,
            sim.max_num_seqs,
            sim.max_prefill_chunk_tokens,
            sim.enable_prefix_caching,
        ),
        (
            e.max_batch_prefill_tokens,
            e.max_batch_total_tokens,
            e.max_num_seqs,
            e.max_prefill_chunk_tokens,
            e.enable_prefix_caching,
        )
    );
    assert_eq!(sim.reservation_fraction, e.reservation_fraction);
}
