//! The stall deadline before the first token, against fake nodes over real gRPC: a request
//! that arrives while a node is stopped (SIGSTOP, a cut link: the connection stays up and
//! nothing answers) moves on within the deadline, whatever phase it is in: placement, the
//! prefill call, its reservation, or queued on the node.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::cluster::fake_nodes::{
    self, complete, drain, request, DecodeScript, FakeNode, PrefillScript, Read, TEST_STALL,
};

/// Fails the test, rather than hanging it, when a request waits out the fault.
async fn within<T>(limit: Duration, what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not done {limit:?} into the fault"))
}

fn ready_of(backend: &crate::cluster::ClusterBackend, role: &str) -> Vec<bool> {
    backend.describe()["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter(|n| n["role"] == role)
        .map(|n| n["ready"].as_bool().expect("ready"))
        .collect()
}

/// `n` requests at once, each read to its end.
async fn concurrent(backend: &Arc<crate::cluster::ClusterBackend>, n: usize) -> Vec<Read> {
    futures::future::join_all((0..n).map(|_| {
        let backend = Arc::clone(backend);
        async move { drain(backend.generate(request(4)).await.expect("placed")).await }
    }))
    .await
}

/// How long a request that meets a stopped node may take: the stall deadline, then serving
/// elsewhere (milliseconds here).
const BOUND: Duration = Duration::from_secs(2);

#[tokio::test]
async fn requests_arriving_while_a_decode_node_is_stopped_move_within_the_stall_deadline() {
    for disaggregated in [true, false] {
        let prefill = fake_nodes::prefill(PrefillScript::Push).await;
        let stopped = fake_nodes::decode(DecodeScript::Serve).await;
        let good = fake_nodes::decode(DecodeScript::Serve).await;
        let prefills: Vec<&FakeNode> = if disaggregated {
            vec![&prefill]
        } else {
            Vec::new()
        };
        // The stopped node ranks first: every request is placed there first.
        let backend = Arc::new(fake_nodes::backend(&prefills, &[&stopped, &good]).await);
        stopped.freeze.stop();

        let started = Instant::now();
        let reads = within(
            TEST_STALL + BOUND,
            "requests placed on a stopped decode node",
            concurrent(&backend, 4),
        )
        .await;
        for read in reads {
            assert_eq!((read.ids, read.indices), complete(4), "{:?}", read.error);
        }
        assert!(
            started.elapsed() >= TEST_STALL,
            "each waited for its answer"
        );
        assert_eq!(good.calls.of("start").len(), 4, "{disaggregated}");
        // Suspect, and it stays out while it answers no health check.
        assert_eq!(ready_of(&backend, "decode"), [false, true]);
        let after = within(
            BOUND,
            "a request after the fault was found",
            concurrent(&backend, 1),
        )
        .await;
        assert!(after[0].error.is_none(), "{:?}", after[0].error);
        assert!(started.elapsed() < 2 * TEST_STALL + BOUND);

        stopped.freeze.cont();
        testkit::wait_until_async(
            "the continued node answers its health check and takes work again",
            Duration::from_secs(5),
            || {
                let ready = ready_of(&backend, "decode");
                async move { ready == [true, true] }
            },
        )
        .await;
    }
}

#[tokio::test]
async fn a_prefill_node_that_answers_no_call_costs_one_stall_then_another_takes_the_prompt() {
    let stopped = fake_nodes::prefill(PrefillScript::Push).await;
    let good = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = Arc::new(fake_nodes::backend(&[&stopped, &good], &[&decode]).await);
    stopped.freeze.stop();

    let reads = within(
        TEST_STALL + BOUND,
        "a prompt sent to a stopped prefill node",
        concurrent(&backend, 1),
    )
    .await;
    assert_eq!(
        (reads[0].ids.clone(), reads[0].indices.clone()),
        complete(4),
        "{:?}",
        reads[0].error
    );
    // The unanswered call may still reach the node when it wakes: the next attempt goes in
    // at a new epoch, so a late push from it would be refused.
    assert_eq!(decode.calls.of("reprefill"), ["epoch=2 local=false"]);
    assert_eq!(good.calls.of("prefill"), ["xfer=1 epoch=2"]);
    assert_eq!(ready_of(&backend, "prefill"), [false, true]);
    stopped.freeze.cont();
}

#[tokio::test]
async fn a_decode_node_that_goes_silent_after_taking_the_request_loses_it_within_the_deadline() {
    // Remote prefill: silent once it reserved (the prefill node's Done gets no answer either).
    // Local prefill: silent once the prompt is queued.
    for disaggregated in [true, false] {
        let prefill = fake_nodes::prefill(PrefillScript::Push).await;
        let silent = fake_nodes::decode(DecodeScript::SilentAfterStart).await;
        let good = fake_nodes::decode(DecodeScript::Serve).await;
        let prefills: Vec<&FakeNode> = if disaggregated {
            vec![&prefill]
        } else {
            Vec::new()
        };
        let backend = Arc::new(fake_nodes::backend(&prefills, &[&silent, &good]).await);

        let reads = within(
            2 * TEST_STALL + BOUND,
            "a request on a decode node silent before its first token",
            concurrent(&backend, 1),
        )
        .await;
        assert_eq!(
            (reads[0].ids.clone(), reads[0].indices.clone()),
            complete(4),
            "{:?}",
            reads[0].error
        );
        assert_eq!(silent.calls.of("start").len(), 1);
        assert_eq!(good.calls.of("start").len(), 1, "{disaggregated}");
    }
}
