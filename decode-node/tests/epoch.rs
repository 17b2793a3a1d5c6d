//! Epochs fence retried prefills: once the gateway moves a reservation to a newer epoch, the
//! old attempt's KV frames, Renew and Done are refused, and only the new attempt activates
//! the sequence. A real decode node over real sockets, in-process.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use proto::v1::{generate_up, DoneRequest, GenerateUp, RenewRequest, Reprefill, Token};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_epoch_is_refused_and_the_new_one_activates() {
    let common::TestNode {
        client,
        task: node,
        shutdown,
        ..
    } = common::start(&["--num-kv-blocks", "32"]).await;
    let (mut g, first) = common::reserve(&client, common::spec("e", 6, 3), 1)
        .await
        .expect("reserved");
    assert_eq!(first.epoch, 1);
    // The first attempt pushed its KV, then the gateway gave up on it and retried.
    common::push_kv(&first).await;
    g.up.send(GenerateUp {
        msg: Some(generate_up::Msg::Reprefill(Reprefill {
            epoch: 2,
            local_prefill: false,
            prefill: Vec::new(),
        })),
    })
    .await
    .unwrap();
    let second = common::next_reserved(&mut g.down).await;
    assert_eq!(
        (second.xfer_id, second.epoch, &second.block_ids),
        (first.xfer_id, 2, &first.block_ids),
        "the same blocks at the next epoch"
    );
    let done = |epoch| DoneRequest {
        xfer_id: first.xfer_id,
        epoch,
        first_token: Some(Token {
            token_id: 310,
            ..Default::default()
        }),
        checksums: Vec::new(),
    };
    // The old attempt's Renew and Done are refused: its KV is not the reservation's.
    let stale = client
        .clone()
        .renew(RenewRequest {
            xfer_id: first.xfer_id,
            epoch: 1,
        })
        .await
        .expect_err("a stale renew is refused");
    assert_eq!(stale.code(), tonic::Code::InvalidArgument, "{stale:?}");
    let stale = client
        .clone()
        .done(done(1))
        .await
        .expect_err("a stale done is refused");
    assert_eq!(stale.code(), tonic::Code::InvalidArgument, "{stale:?}");
    assert!(stale.message().contains("stale"), "{}", stale.message());
    // The new attempt's KV and Done activate the sequence.
    common::push_kv(&second).await;
    client
        .clone()
        .done(done(2))
        .await
        .expect("the current epoch's done");
    let tokens = common::read_tokens(&mut g.down).await.expect("tokens");
    assert_eq!(tokens.len(), 3);
    assert_eq!(tokens[0].token_id, 310);
    shutdown.cancel();
    node.await.expect("join").expect("clean shutdown");
}
