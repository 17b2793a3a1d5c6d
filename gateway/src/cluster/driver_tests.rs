//! The backend's request life against fake nodes over real gRPC: placement, prefill retries at
//! new epochs, stall detection and migration.

use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::cluster::fake_nodes::{
    self, complete, drain, request, DecodeScript, PrefillScript, TEST_STALL,
};
use crate::cluster::ClusterConfig;
use crate::request::FinishReason;

fn ready_of(backend: &crate::cluster::ClusterBackend, role: &str) -> Vec<bool> {
    let info = backend.describe();
    info["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter(|n| n["role"] == role)
        .map(|n| n["ready"].as_bool().expect("ready"))
        .collect()
}

#[tokio::test]
async fn a_disaggregated_request_streams_the_prefill_token_then_the_decode_tokens() {
    let prefill = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&prefill], &[&decode]).await;

    let read = drain(backend.generate(request(4)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(4), "{:?}", read.error);
    assert_eq!(read.finish, Some(FinishReason::Length));
    assert!(read.error.is_none());
    assert_eq!(
        decode.calls.of("start"),
        ["prompt=5 generated=0 local=false epoch=1"]
    );
    assert_eq!(prefill.calls.of("prefill"), ["xfer=1 epoch=1"]);
    assert_eq!(decode.calls.of("done"), ["xfer=1 epoch=1"]);
}

#[tokio::test]
async fn round_robin_takes_turns_over_the_prefill_nodes() {
    let a = fake_nodes::prefill(PrefillScript::Push).await;
    let b = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend_with_policy(
        &[&a, &b],
        &[&decode],
        ClusterConfig {
            max_local_prefill_tokens: 0,
            max_stall: TEST_STALL,
            migration_limit: 2,
        },
        crate::cluster::routing::policy(crate::cluster::routing::PolicyKind::RoundRobin),
    )
    .await;
    for _ in 0..4 {
        let read = drain(backend.generate(request(2)).await.expect("served")).await;
        assert!(read.error.is_none(), "{:?}", read.error);
    }
    // Each request takes one turn: ranking the prefill pool twice per request once sent
    // every request to the same node of two.
    assert_eq!(a.calls.of("prefill").len(), 2);
    assert_eq!(b.calls.of("prefill").len(), 2);
}

#[tokio::test]
async fn a_prefill_node_that_fails_like_a_dead_one_costs_a_retry_not_the_request() {
    let dead = fake_nodes::prefill(PrefillScript::Fail(tonic::Code::Unavailable)).await;
    let good = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&dead, &good], &[&decode]).await;

    let read = drain(backend.generate(request(4)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(4), "{:?}", read.error);
    // The refused call never touched the reservation: the next node fills it at its epoch.
    assert_eq!(dead.calls.of("prefill"), ["xfer=1 epoch=1"]);
    assert_eq!(good.calls.of("prefill"), ["xfer=1 epoch=1"]);
    assert!(decode.calls.of("reprefill").is_empty());
    // The dead node is skipped for a while.
    assert_eq!(ready_of(&backend, "prefill"), [false, true]);
}

#[tokio::test]
async fn a_prefill_node_lost_mid_push_is_retried_at_a_new_epoch_and_its_stale_done_refused() {
    let dying = fake_nodes::prefill(PrefillScript::DieMidPush).await;
    let good = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&dying, &good], &[&decode]).await;

    let read = drain(backend.generate(request(5)).await.expect("served")).await;
    // The first token came from both attempts; the client sees it once.
    assert_eq!((read.ids, read.indices), complete(5), "{:?}", read.error);
    assert_eq!(read.finish, Some(FinishReason::Length));
    assert_eq!(decode.calls.of("reprefill"), ["epoch=2 local=false"]);
    assert_eq!(good.calls.of("prefill"), ["xfer=1 epoch=2"]);
    assert_eq!(decode.calls.of("done"), ["xfer=1 epoch=2"]);
}

#[tokio::test]
async fn a_prompt_the_prefill_node_rejects_is_not_retried() {
    let strict = fake_nodes::prefill(PrefillScript::Fail(tonic::Code::InvalidArgument)).await;
    let other = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&strict, &other], &[&decode]).await;

    let read = drain(backend.generate(request(4)).await.expect("placed")).await;
    let err = read.error.expect("a rejected prompt fails");
    assert_eq!(err.code(), proto::ErrorCode::Validation, "{err}");
    assert!(read.ids.is_empty());
    assert!(other.calls.of("prefill").is_empty(), "no retry");
}

#[tokio::test]
async fn when_every_prefill_node_fails_the_decode_node_prefills() {
    let dead = fake_nodes::prefill(PrefillScript::DieMidPush).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&dead], &[&decode]).await;

    let read = drain(backend.generate(request(4)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(4), "{:?}", read.error);
    // The only prefill node is quarantined after its failure: the next epoch runs here.
    assert_eq!(decode.calls.of("reprefill"), ["epoch=2 local=true"]);
}

#[tokio::test]
async fn a_hung_prefill_node_is_suspect_and_the_prompt_moves_within_the_stall_deadline() {
    let hung = fake_nodes::prefill(PrefillScript::Hang).await;
    let good = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&hung, &good], &[&decode]).await;

    let started = Instant::now();
    let read = drain(backend.generate(request(4)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(4), "{:?}", read.error);
    assert!(started.elapsed() < TEST_STALL + Duration::from_secs(2));
    assert_eq!(decode.calls.of("reprefill"), ["epoch=2 local=false"]);
    assert_eq!(good.calls.of("prefill"), ["xfer=1 epoch=2"]);
}

#[tokio::test]
async fn a_decode_node_that_dies_mid_stream_hands_the_request_to_another_without_a_seam() {
    let prefill = fake_nodes::prefill(PrefillScript::Push).await;
    let dying = fake_nodes::decode(DecodeScript::DieAfter(3)).await;
    let good = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&prefill], &[&dying, &good]).await;

    let read = drain(backend.generate(request(8)).await.expect("served")).await;
    assert!(read.error.is_none(), "{:?}", read.error);
    assert_eq!((read.ids, read.indices), complete(8), "{:?}", read.error);
    assert_eq!(read.finish, Some(FinishReason::Length));
    // Tokens 0..=3 were streamed: the new node prefills prompt + 4 at the next epoch.
    assert_eq!(
        good.calls.of("start"),
        ["prompt=9 generated=4 local=false epoch=2"]
    );
    assert_eq!(
        prefill.calls.of("prefill"),
        ["xfer=1 epoch=1", "xfer=1 epoch=2"]
    );
}

#[tokio::test]
async fn a_decode_node_killed_as_the_prefill_node_sends_done_hands_the_request_over() {
    let prefill = fake_nodes::prefill(PrefillScript::Push).await;
    let dying = fake_nodes::decode(DecodeScript::DieAtDone).await;
    let good = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&prefill], &[&dying, &good]).await;

    let read = drain(backend.generate(request(6)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(6), "{:?}", read.error);
    assert_eq!(dying.calls.of("reprefill"), ["epoch=2 local=false"]);
    // The prefill node's first token was streamed; the new node takes prompt + 1, and the
    // prefill node, whose push failed through no fault of its own, prefills it again.
    assert_eq!(
        good.calls.of("start"),
        ["prompt=6 generated=1 local=false epoch=3"]
    );
    assert_eq!(
        prefill.calls.of("prefill"),
        ["xfer=1 epoch=1", "xfer=1 epoch=3"]
    );
}

#[tokio::test]
async fn a_decode_node_that_hangs_mid_stream_is_suspect_and_the_stream_continues_elsewhere() {
    let prefill = fake_nodes::prefill(PrefillScript::Push).await;
    let hung = fake_nodes::decode(DecodeScript::HangAfter(2)).await;
    let good = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&prefill], &[&hung, &good]).await;

    let started = Instant::now();
    let read = drain(backend.generate(request(6)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(6), "{:?}", read.error);
    assert!(started.elapsed() < TEST_STALL + Duration::from_secs(2));
    assert_eq!(
        good.calls.of("start"),
        ["prompt=8 generated=3 local=false epoch=2"]
    );
}

#[tokio::test]
async fn a_request_that_used_its_migrations_ends_with_an_error_event() {
    let prefill = fake_nodes::prefill(PrefillScript::Push).await;
    let dying = fake_nodes::decode(DecodeScript::DieAfter(2)).await;
    let good = fake_nodes::decode(DecodeScript::Serve).await;
    let config = ClusterConfig {
        max_local_prefill_tokens: 0,
        max_stall: TEST_STALL,
        migration_limit: 0,
    };
    let backend = fake_nodes::backend_with(&[&prefill], &[&dying, &good], config).await;

    let read = drain(backend.generate(request(8)).await.expect("placed")).await;
    assert_eq!(read.ids, vec![200, 201, 202]);
    let err = read.error.expect("an error event ends the stream");
    assert_eq!(err.code(), proto::ErrorCode::Unavailable, "{err}");
    assert!(err.to_string().contains("migration-limit"), "{err}");
    assert!(good.calls.of("start").is_empty());
}

#[tokio::test]
async fn a_colocated_request_resumes_colocated() {
    let dying = fake_nodes::decode(DecodeScript::DieAfter(1)).await;
    let good = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[], &[&dying, &good]).await;

    let read = drain(backend.generate(request(5)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(5), "{:?}", read.error);
    assert_eq!(
        dying.calls.of("start"),
        ["prompt=5 generated=0 local=true epoch=1"]
    );
    assert_eq!(
        good.calls.of("start"),
        ["prompt=7 generated=2 local=true epoch=2"]
    );
}

#[tokio::test]
async fn decode_nodes_out_of_room_answer_overloaded_so_the_queue_holds_the_request() {
    let full = fake_nodes::decode(DecodeScript::NoRoom).await;
    let backend = fake_nodes::backend(&[], &[&full]).await;

    let err = match backend.generate(request(4)).await {
        Ok(_) => panic!("no room"),
        Err(e) => e,
    };
    assert!(err.is_no_room(), "{err}");
    // Out of room is not a failure: the node stays ready.
    assert_eq!(ready_of(&backend, "decode"), [true]);
}

#[tokio::test]
async fn a_decode_node_that_fails_the_call_is_skipped_for_the_next() {
    let dead = fake_nodes::decode(DecodeScript::Fail(tonic::Code::Unavailable)).await;
    let good = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[], &[&dead, &good]).await;

    let read = drain(backend.generate(request(3)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(3), "{:?}", read.error);
    assert_eq!(ready_of(&backend, "decode"), [false, true]);
}

#[tokio::test]
async fn a_client_that_leaves_closes_the_request_on_its_decode_node() {
    let prefill = fake_nodes::prefill(PrefillScript::Push).await;
    // The stream hangs after its first tokens: only the client's leaving ends it.
    let decode = fake_nodes::decode(DecodeScript::HangAfter(1)).await;
    let config = ClusterConfig {
        max_local_prefill_tokens: 0,
        max_stall: Duration::from_secs(60),
        migration_limit: 2,
    };
    let backend = fake_nodes::backend_with(&[&prefill], &[&decode], config).await;

    let mut stream = backend.generate(request(8)).await.expect("served");
    use futures::StreamExt;
    let first = stream.next().await.expect("a token").expect("not an error");
    assert_eq!(first.index, 0);
    assert!(decode.calls.of("closed").is_empty());
    drop(stream);
    // The gateway closes the Generate stream: the node frees what the request held.
    testkit::wait_until_async(
        "the decode node sees the close",
        Duration::from_secs(5),
        || {
            let closed = decode.calls.of("closed");
            async move { closed.len() == 1 }
        },
    )
    .await;
}

/// Runs `n` requests, 32 at a time, and fails with the first error if any request failed.
async fn assert_none_fail<F, Fut>(n: usize, one: F)
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    use futures::StreamExt;
    let failures: Vec<String> = futures::stream::iter(0..n)
        .map(one)
        .buffer_unordered(32)
        .filter_map(|r| async move { r.err() })
        .collect()
        .await;
    assert!(
        failures.is_empty(),
        "{} of {n} requests failed, the first: {:?}",
        failures.len(),
        failures.first()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_after_the_gateway_has_what_it_needs_fail_no_request_over_thousands() {
    // Each prefill node sends four heartbeats after `Pushed`. A gateway that reset the stream
    // at `Pushed` met them on a stream h2 had forgotten (it remembers 50 resets for a second),
    // and h2 counts such frames: at 1,024 over a connection's life it sent GOAWAY
    // ENHANCE_YOUR_CALM, and every request then on the connection failed as 429 "overloaded".
    let prefill = fake_nodes::prefill(PrefillScript::PushThenTrail).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = std::sync::Arc::new(fake_nodes::backend(&[&prefill], &[&decode]).await);
    let requests = 6_000;
    assert_none_fail(requests, |_| {
        let backend = std::sync::Arc::clone(&backend);
        async move {
            let stream = backend
                .generate(request(2))
                .await
                .map_err(|e| e.to_string())?;
            let read = drain(stream).await;
            match read.error {
                Some(e) => Err(e.to_string()),
                None if (read.ids, read.indices) == complete(2) => Ok(()),
                None => Err("an incomplete stream".to_string()),
            }
        }
    })
    .await;
    assert_eq!(prefill.calls.of("prefill").len(), requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_clients_that_leave_mid_stream_cost_no_other_request() {
    // A client that leaves resets its streams while the node is still sending tokens, which
    // then reach streams h2 may have forgotten. Those frames must not count toward closing
    // the connection that every other request shares (h2's default closes it at 1,024).
    let decode = fake_nodes::decode(DecodeScript::Paced).await;
    let backend = std::sync::Arc::new(fake_nodes::backend(&[], &[&decode]).await);
    use futures::StreamExt;
    let leavers = 4_000;
    assert_none_fail(leavers, |_| {
        let backend = std::sync::Arc::clone(&backend);
        async move {
            let mut stream = backend
                .generate(request(64))
                .await
                .map_err(|e| e.to_string())?;
            // The first token, then the client is gone.
            match stream.next().await {
                Some(Ok(_)) => Ok(()),
                Some(Err(e)) => Err(e.to_string()),
                None => Err("no token".to_string()),
            }
        }
    })
    .await;
    let read = drain(backend.generate(request(4)).await.expect("served")).await;
    assert_eq!((read.ids, read.indices), complete(4), "{:?}", read.error);
}

/// Issues 32, 33: `/info` and `/v1/models` name what the nodes serve, from their `Info`.
#[tokio::test]
async fn the_backend_reports_the_nodes_architecture_and_types() {
    let prefill = fake_nodes::prefill(PrefillScript::Push).await;
    let decode = fake_nodes::decode(DecodeScript::Serve).await;
    let backend = fake_nodes::backend(&[&prefill], &[&decode]).await;
    let expected = crate::backend::ModelTypes {
        architecture: "LlamaForCausalLM".into(),
        weight_dtype: "f32".into(),
        kv_cache_dtype: "f32".into(),
    };
    assert_eq!(backend.model_types(), Some(expected.clone()));
    for node in backend.describe()["nodes"].as_array().expect("nodes") {
        assert_eq!(node["model_types"]["architecture"], "LlamaForCausalLM");
        assert_eq!(node["model_types"]["kv_cache_dtype"], "f32");
    }
}
