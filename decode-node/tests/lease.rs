//! A reservation lives as long as the node filling it renews it: one that is renewed keeps its
//! blocks past many leases (a long prompt queued on a live prefill node), and one that is not
//! expires, frees its blocks and ends its stream with a timeout error. A real decode node over
//! real sockets, in-process.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use proto::v1::RenewRequest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_reservation_outlives_its_lease_and_an_abandoned_one_expires() {
    let common::TestNode {
        client,
        task: node,
        shutdown,
        ..
    } = common::start(&["--num-kv-blocks", "8", "--lease-ms", "300"]).await;
    // 12 tokens in blocks of 4 = 3 blocks; the pool holds half of 8 = 4 blocks.
    let spec = || common::spec("r", 12, 4);
    let (mut stream, r) = common::reserve(&client, spec(), 1)
        .await
        .expect("the first reservation fits");
    assert_eq!(r.block_ids.len(), 3);
    assert_eq!(r.lease_ms, 300);
    let busy = common::reserve(&client, spec(), 1)
        .await
        .err()
        .expect("a second one does not fit while the first holds its blocks");
    assert_eq!(busy.code(), tonic::Code::ResourceExhausted, "{busy:?}");

    // Renewed every 100 ms for four leases: still held.
    let renew = RenewRequest {
        xfer_id: r.xfer_id,
        epoch: r.epoch,
    };
    let held = Instant::now();
    while held.elapsed() < Duration::from_millis(1200) {
        client.clone().renew(renew).await.expect("renewed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Abandoned: it expires within a lease or so.
    let started = Instant::now();
    let err = loop {
        match stream.down.message().await {
            Ok(Some(_heartbeat)) => continue,
            Ok(None) => panic!("the stream ends with an error, not silently"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("lease"), "{}", err.message());
    assert!(started.elapsed() < Duration::from_secs(2));
    let late = client
        .clone()
        .renew(renew)
        .await
        .expect_err("an expired reservation cannot be renewed");
    assert_eq!(late.code(), tonic::Code::NotFound, "{late:?}");
    // The blocks are back: a new reservation fits again.
    testkit::wait_until_async(
        "the blocks freed after the lease",
        Duration::from_secs(2),
        || {
            let client = client.clone();
            async move { common::reserve(&client, spec(), 1).await.is_ok() }
        },
    )
    .await;
    shutdown.cancel();
    node.await.expect("join").expect("clean shutdown");
}
