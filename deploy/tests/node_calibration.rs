//! `fission-loadtest simulate calibrate --node-gateway`: a node's steps timed through real
//! clusters (one colocated node, and 1P+1D for the push), read from the nodes' own step
//! histograms, against the same steps of the engine alone (stories260K).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use simulator::cost::CostModel;
use simulator::node_probe::{NodeEndpoint, NodeProbe};
use testkit::fission::{stories_dir, Up, UpConfig};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_steps_are_timed_against_the_engines_through_real_clusters() {
    let colocated = tokio::task::spawn_blocking(|| Up::start(&UpConfig::new(FISSION, 0, 1)))
        .await
        .unwrap();
    let disaggregated = tokio::task::spawn_blocking(|| Up::start(&UpConfig::new(FISSION, 1, 1)))
        .await
        .unwrap();
    let model = engine::model::LoadedModel::load(
        &engine::loader::ModelSource::parse(stories_dir().to_str().unwrap()),
        None,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let probe = NodeProbe {
        model: &model,
        colocated: NodeEndpoint {
            gateway: colocated.url.clone(),
            metrics: colocated.metrics_url("decode-0").to_string(),
        },
        disaggregated: Some(NodeEndpoint {
            gateway: disaggregated.url.clone(),
            metrics: disaggregated.metrics_url("prefill-0").to_string(),
        }),
        // Short enough for stories260K's context whatever its tokenizer makes of the
        // benchmark prompt's `<extra_N>` words.
        prompt_tokens: 8,
        new_tokens: 8,
        rounds: 2,
        // stories260K's steps are short: a long batch outlasts the prefill timed beside it.
        beside_new_tokens: 200,
        prompt_kv_bytes: 1e4,
        first_extra_id: 512,
        vocab: 49152,
    };
    let factors = probe.run().await.expect("timed");
    // Both rounds reached the table, with the prefill node's step.
    assert_eq!(
        factors.report.matches("\n| 1 |").count(),
        1,
        "{}",
        factors.report
    );
    assert_eq!(
        factors.report.matches("\n| 2 |").count(),
        1,
        "{}",
        factors.report
    );
    for f in [factors.prefill, factors.decode] {
        assert!(f.is_finite() && f > 0.0, "{factors:?}");
    }
    let push = factors
        .push_step_s_per_byte
        .expect("the 1P+1D cluster was timed");
    assert!(push.is_finite() && push >= 0.0, "{factors:?}");
    let decode_cores = factors
        .decode_step_cores
        .expect("the prefill node was timed beside a decode batch");
    assert!(
        decode_cores.is_finite() && decode_cores >= 0.0,
        "{factors:?}"
    );

    // Folded into a profile: the fits scale by the factors and the push takes the node's price.
    let mut profile = CostModel::load("h100-llama8b").unwrap();
    profile.step = engine::cost::StepCost::Linear(engine::cost::LinearCost {
        prefill: engine::cost::Linear3 {
            a: 1.0,
            b: 2.0,
            c: 3.0,
        },
        decode: engine::cost::Linear3 {
            a: 4.0,
            b: 5.0,
            c: 6.0,
        },
    });
    factors.apply(&mut profile);
    let engine::cost::StepCost::Linear(l) = &profile.step else {
        unreachable!("set above")
    };
    assert!((l.prefill.b - 2.0 * factors.prefill).abs() < 1e-12);
    assert!((l.decode.c - 6.0 * factors.decode).abs() < 1e-12);
    assert_eq!(profile.link.push_step_s_per_byte, push);
    assert_eq!(profile.decode_step_cores, Some(decode_cores));
}
