//! A client that leaves mid-stream is one cancellation: `fission_decode_cancelled_total` counts
//! it once, though both its session and the engine thread see it go. A real decode node over
//! real sockets, in-process (one test per binary: the metrics recorder is the process's).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use testkit::metrics::{sample, scrape};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_is_counted_once() {
    let common::TestNode {
        client,
        metrics_addr,
        task: node,
        shutdown,
        ..
    } = common::start(&[]).await;
    let start = proto::v1::GenerateStart {
        spec: Some(common::spec("leaves", 8, 500)),
        local_prefill: true,
        epoch: 0,
    };
    let mut g = common::generate(&client, start).await.expect("admitted");
    // Running: a token came.
    loop {
        let m = g.down.message().await.expect("open").expect("a message");
        if let Some(proto::v1::generate_down::Msg::Token(_)) = m.msg {
            break;
        }
    }
    drop(g);
    // The sequence is gone from the engine once no block is in use: by then both the session
    // and the engine thread have done what they do for a cancellation.
    testkit::wait_until_async(
        "the cancelled sequence's blocks freed",
        Duration::from_secs(10),
        || async move {
            let text = scrape(metrics_addr).await;
            sample(&text, "fission_decode_cancelled_total") >= 1.0
                && sample(&text, "fission_decode_running_sequences") == 0.0
                && sample(&text, "fission_decode_kv_blocks_used") == 0.0
        },
    )
    .await;
    let text = scrape(metrics_addr).await;
    assert_eq!(
        sample(&text, "fission_decode_cancelled_total"),
        1.0,
        "one client left\n{text}"
    );
    shutdown.cancel();
    node.await.expect("join").expect("clean shutdown");
}
