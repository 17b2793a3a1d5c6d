//! A decode node admits a request only when its pool holds every admitted request at its
//! longest (prompt plus `max_new_tokens`), not its prompt alone: one that admitted by prompt ran
//! out of blocks as its sequences grew and preempted them in a storm. Refused requests are
//! busy (RESOURCE_EXHAUSTED), which keeps them in the gateway's queue; room comes back when a
//! request ends. A real decode node over real sockets, in-process.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_leave_room_for_their_outputs() {
    let common::TestNode {
        client,
        task: node,
        shutdown,
        ..
    } = common::start(&["--num-kv-blocks", "16"]).await;
    // 4 prompt tokens (1 block of 4) that grow to 16 tokens (4 blocks): 4 fit in 16 blocks,
    // though their prompts alone would fit 8 times in the reservation pool (half of 16).
    let spec = |i: usize| common::spec(&format!("r{i}"), 4, 12);
    let mut held = Vec::new();
    for i in 0..4 {
        let (stream, r) = common::reserve(&client, spec(i), 1)
            .await
            .unwrap_or_else(|e| panic!("reservation {i} fits: {e:?}"));
        assert_eq!(r.block_ids.len(), 1);
        held.push(stream);
    }
    let busy = common::reserve(&client, spec(4), 1)
        .await
        .err()
        .expect("a fifth would not fit once the four grow");
    assert_eq!(busy.code(), tonic::Code::ResourceExhausted, "{busy:?}");
    // One request ends (its client leaves): its room comes back.
    drop(held.pop());
    testkit::wait_until_async(
        "room for a request after one ended",
        Duration::from_secs(5),
        || {
            let client = client.clone();
            async move {
                match common::reserve(&client, spec(5), 1).await {
                    Ok((stream, _)) => {
                        drop(stream);
                        true
                    }
                    Err(_) => false,
                }
            }
        },
    )
    .await;
    drop(held);
    shutdown.cancel();
    node.await.expect("join").expect("clean shutdown");
}
