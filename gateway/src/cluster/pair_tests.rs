//! Prefill→decode pairs whose pushes keep failing, against fake nodes over real gRPC: counted,
//! marked bad after consecutive failures, routed around for the cool-off, shown in `/info`'s
//! backend, and tried again once it ends.

use std::time::Duration;

use crate::backend::Backend;
use crate::cluster::fake_nodes::{
    self, complete, drain, request, DecodeScript, FakeNode, InOrder, PrefillScript, TEST_STALL,
};
use crate::cluster::pairs::PairConfig;
use crate::cluster::ClusterBackend;
use crate::cluster::ClusterConfig;

async fn backend(
    prefills: &[&FakeNode],
    decodes: &[&FakeNode],
    cool_off: Duration,
) -> ClusterBackend {
    fake_nodes::backend_with_pairs(
        prefills,
        decodes,
        ClusterConfig {
            max_local_prefill_tokens: 0,
            max_stall: TEST_STALL,
            migration_limit: 2,
        },
        Box::new(InOrder),
        PairConfig {
            failures_to_mark: 3,
            cool_off,
        },
    )
    .await
}

async fn serve_one(backend: &ClusterBackend) {
    let read = drain(backend.generate(request(4)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(4), "{:?}", read.error);
}

fn bad_pairs(backend: &ClusterBackend) -> Vec<(String, String)> {
    backend.describe()["bad_pairs"]
        .as_array()
        .expect("bad_pairs")
        .iter()
        .map(|p| {
            (
                p["prefill_node"].as_str().expect("prefill").to_string(),
                p["decode_node"].as_str().expect("decode").to_string(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_pair_whose_pushes_keep_failing_is_marked_bad_and_its_decode_node_prefilled_elsewhere() {
    // prefill-0 cannot reach the decode node's KV address; prefill-1 can.
    let broken = fake_nodes::prefill(PrefillScript::PushFails).await;
    let good = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = backend(&[&broken, &good], &[&decode], Duration::from_secs(60)).await;

    // The first request spends its attempts on the pair (ranked first, and the node itself is
    // healthy), marks it on the third failure, and is prefilled on the decode node.
    serve_one(&backend).await;
    assert_eq!(
        broken.calls.of("prefill"),
        ["xfer=1 epoch=1", "xfer=1 epoch=2", "xfer=1 epoch=3"]
    );
    assert_eq!(
        decode.calls.of("reprefill"),
        [
            "epoch=2 local=false",
            "epoch=3 local=false",
            "epoch=4 local=true"
        ]
    );
    assert_eq!(
        bad_pairs(&backend),
        [("prefill-0".to_string(), "decode-0".to_string())]
    );
    let info = backend.describe();
    let pair = &info["bad_pairs"][0];
    assert_eq!(pair["consecutive_failures"], 3);
    assert!(
        pair["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("Invalid argument")),
        "{pair}"
    );
    assert!(pair["cool_off_left_ms"].as_u64() > Some(50_000), "{pair}");
    // The pair is bad, not the node: it stays ready for other decode nodes.
    assert_eq!(
        info["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .filter(|n| n["ready"] == true)
            .count(),
        3
    );

    // Later requests skip the pair at once: the next prefill node takes the prompt.
    for _ in 0..3 {
        serve_one(&backend).await;
    }
    assert_eq!(
        broken.calls.of("prefill").len(),
        3,
        "no attempt on the bad pair"
    );
    assert_eq!(good.calls.of("prefill").len(), 3);
}

#[tokio::test]
async fn with_every_pair_of_a_decode_node_bad_it_prefills_itself_until_the_cool_off_ends() {
    let broken = fake_nodes::prefill(PrefillScript::PushFails).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let cool_off = Duration::from_millis(1500);
    let backend = backend(&[&broken], &[&decode], cool_off).await;

    serve_one(&backend).await;
    assert_eq!(broken.calls.of("prefill").len(), 3);
    assert_eq!(bad_pairs(&backend).len(), 1);

    // No attempt on the bad pair: the decode node prefills at the next epoch.
    serve_one(&backend).await;
    assert_eq!(broken.calls.of("prefill").len(), 3);
    assert_eq!(
        decode.calls.of("reprefill").last().map(String::as_str),
        Some("epoch=2 local=true")
    );

    // Once the cool-off ends the pair gets one attempt; failing, it is bad again at once.
    testkit::wait_until_async("the cool-off ends", Duration::from_secs(10), || {
        let none = bad_pairs(&backend).is_empty();
        async move { none }
    })
    .await;
    serve_one(&backend).await;
    assert_eq!(
        broken.calls.of("prefill").len(),
        4,
        "one attempt, half-open"
    );
    assert_eq!(bad_pairs(&backend).len(), 1);
}
