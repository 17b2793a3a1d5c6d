//! A reservation whose KV never arrives expires: its blocks are freed and its token stream
//! ends with a timeout error. A real decode node over real sockets, in-process.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use proto::v1::decode_client::DecodeClient;
use proto::v1::{reserve_response, ReserveRequest, StoppingCriteria, StreamRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfilled_reservation_expires_and_frees_its_blocks() {
    let common::TestNode {
        mut client,
        task: node,
        shutdown,
        ..
    } = common::start(&["--num-kv-blocks", "8", "--lease-ms", "300"]).await;
    let reserve = |client: &mut DecodeClient<tonic::transport::Channel>| {
        let mut c = client.clone();
        async move {
            c.reserve(ReserveRequest {
                request_id: "r".into(),
                prompt_ids: (0..12).map(|i| 300 + i).collect(),
                sampling: None,
                stopping: Some(StoppingCriteria {
                    max_new_tokens: 4,
                    ..Default::default()
                }),
            })
            .await
            .expect("reserve answers")
            .into_inner()
            .result
        }
    };
    // 12 tokens in blocks of 4 = 3 blocks; the pool holds half of 8 = 4 blocks.
    let Some(reserve_response::Result::Reserved(r)) = reserve(&mut client).await else {
        panic!("the first reservation fits");
    };
    assert_eq!(r.block_ids.len(), 3);
    assert!(
        matches!(
            reserve(&mut client).await,
            Some(reserve_response::Result::Busy(_))
        ),
        "a second one does not fit while the first holds its blocks"
    );
    let started = Instant::now();
    let mut stream = client
        .stream(StreamRequest { xfer_id: r.xfer_id })
        .await
        .expect("stream")
        .into_inner();
    let err = stream
        .message()
        .await
        .expect_err("the stream ends with an error, not silently");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("lease"), "{}", err.message());
    assert!(started.elapsed() < Duration::from_secs(5));
    // The blocks are back: a new reservation fits again.
    testkit::wait_until_async(
        "the blocks freed after the lease",
        Duration::from_secs(2),
        || {
            let reserved = reserve(&mut client);
            async move { matches!(reserved.await, Some(reserve_response::Result::Reserved(_))) }
        },
    )
    .await;
    shutdown.cancel();
    node.await.expect("join").expect("clean shutdown");
}
