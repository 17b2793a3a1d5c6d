//! What the decode node's component tests share: a real decode node on stories260K, in-process,
//! over real sockets on 127.0.0.1.

use std::net::SocketAddr;

use decode_node::DecodeNode;
use kvtransfer::{KvConnection, KvTransport};
use node_common::NodeError;
use proto::v1::decode_client::DecodeClient;
use proto::v1::node_client::NodeClient;
use proto::v1::InfoRequest;
use testkit::serving::wait_until_serving;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub struct TestNode {
    pub client: DecodeClient<Channel>,
    // Each test binary compiles this module; the lease test reads neither.
    #[allow(dead_code)]
    pub node: NodeClient<Channel>,
    #[allow(dead_code)]
    pub metrics_addr: SocketAddr,
    /// `decode_node::run`: ends when the node has stopped.
    pub task: JoinHandle<Result<(), NodeError>>,
    pub shutdown: CancellationToken,
}

/// Starts a decode node on stories260K with blocks of 4 and the TCP data plane, plus `flags`,
/// and returns once it answers Info.
pub async fn start(flags: &[&str]) -> TestNode {
    let dir = testkit::shared_model("stories260K");
    let mut argv = vec![
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--block-size",
        "4",
        "--kv-transport",
        "tcp",
        // In-process node tests are plaintext; deploy/tests/trust_boundary.rs covers mTLS.
        "--insecure",
        "--kv-addr",
        "127.0.0.1:0",
    ];
    argv.extend_from_slice(flags);
    let spawned = node_common::test_util::spawn::<DecodeNode>(&argv).await;
    let addr = spawned.grpc_addr;
    let channel = wait_until_serving(&spawned.task, || async move {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .ok()?
            .connect()
            .await
            .ok()?;
        NodeClient::new(channel.clone())
            .info(InfoRequest {})
            .await
            .ok()?;
        Some(channel)
    })
    .await;
    TestNode {
        client: DecodeClient::new(channel.clone()),
        node: NodeClient::new(channel),
        metrics_addr: spawned.metrics_addr,
        task: spawned.task,
        shutdown: spawned.shutdown,
    }
}

/// One request's open `Generate` stream: its up side (for Reprefill) and its down side.
pub struct Generating {
    #[allow(dead_code)]
    pub up: tokio::sync::mpsc::Sender<proto::v1::GenerateUp>,
    pub down: tonic::Streaming<proto::v1::GenerateDown>,
}

/// A request for `max_new_tokens` after `prompt_len` prompt tokens.
pub fn spec(request_id: &str, prompt_len: u32, max_new_tokens: u32) -> proto::v1::GenerationSpec {
    proto::v1::GenerationSpec {
        request_id: request_id.into(),
        prompt_ids: (0..prompt_len).map(|i| 300 + i).collect(),
        stopping: Some(proto::v1::StoppingCriteria {
            max_new_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Opens a `Generate` stream with `start`; the node's answer to it is the call's result.
pub async fn generate(
    client: &DecodeClient<Channel>,
    start: proto::v1::GenerateStart,
) -> Result<Generating, tonic::Status> {
    let (up, rx) = tokio::sync::mpsc::channel(4);
    up.send(proto::v1::GenerateUp {
        msg: Some(proto::v1::generate_up::Msg::Start(start)),
    })
    .await
    .expect("the up side is open");
    let down = client
        .clone()
        .generate(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    Ok(Generating { up, down })
}

/// Opens a remote-prefill `Generate` stream at `epoch` and reads its reservation.
#[allow(dead_code)]
pub async fn reserve(
    client: &DecodeClient<Channel>,
    spec: proto::v1::GenerationSpec,
    epoch: u64,
) -> Result<(Generating, proto::v1::Reserved), tonic::Status> {
    let start = proto::v1::GenerateStart {
        spec: Some(spec),
        local_prefill: false,
        epoch,
    };
    let mut g = generate(client, start).await?;
    let reserved = next_reserved(&mut g.down).await;
    Ok((g, reserved))
}

/// The next reservation on a stream, past heartbeats.
#[allow(dead_code)]
pub async fn next_reserved(
    down: &mut tonic::Streaming<proto::v1::GenerateDown>,
) -> proto::v1::Reserved {
    loop {
        match down
            .message()
            .await
            .expect("the stream is open")
            .expect("a message")
            .msg
        {
            Some(proto::v1::generate_down::Msg::Reserved(r)) => return r,
            Some(proto::v1::generate_down::Msg::Heartbeat(_)) => continue,
            other => panic!("expected a reservation, got {other:?}"),
        }
    }
}

/// Reads tokens to the end of the stream, past heartbeats: how many, and the last finish.
#[allow(dead_code)]
pub async fn read_tokens(
    down: &mut tonic::Streaming<proto::v1::GenerateDown>,
) -> Result<Vec<proto::v1::Token>, tonic::Status> {
    let mut tokens = Vec::new();
    while let Some(m) = down.message().await? {
        if let Some(proto::v1::generate_down::Msg::Token(t)) = m.msg {
            tokens.push(t);
        }
    }
    Ok(tokens)
}

/// Sends every layer of `r`'s reservation, zeros: their content does not matter here.
#[allow(dead_code)]
pub async fn push_kv(r: &proto::v1::Reserved) {
    let layout = proto::convert::layout(r.layout.as_ref()).expect("reserved layout");
    assert_eq!(layout.dtype, kvtransfer::KvDtype::F32);
    let conn = kvtransfer::TcpTransport::default()
        .connect(&r.kv_endpoint)
        .await
        .expect("kv connect");
    let payload = bytes::Bytes::from(vec![
        0u8;
        2 * r.block_ids.len() * layout.block_bytes() as usize
    ]);
    let block_ids: std::sync::Arc<[u32]> = r.block_ids.clone().into();
    for layer in 0..layout.num_layers {
        let header = kvtransfer::LayerHeader {
            xfer_id: kv_types::TransferId(r.xfer_id),
            epoch: r.epoch,
            layer,
            layout,
            block_ids: std::sync::Arc::clone(&block_ids),
            traceparent: None,
        };
        conn.send_layer(header, payload.clone())
            .await
            .expect("layer accepted");
    }
}
