//! In-process fake nodes for the backend's unit tests: real tonic servers on loopback that
//! answer from a script and record every call, so retry, resume and cancel are tested against
//! real gRPC without an engine.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use proto::v1::decode_server::{Decode, DecodeServer};
use proto::v1::node_server::{Node as NodeRpc, NodeServer};
use proto::v1::prefill_server::{Prefill, PrefillServer};
use proto::v1::{self, reserve_response};
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::backend::{ClusterBackend, ClusterConfig};
use super::discovery::{Role, StaticDiscovery};
use super::pool::Pools;
use super::routing::{Candidate, Ranking, RoutingPolicy};
use crate::request::{FinishReason, SamplingParams, StoppingParams, ValidRequest};

type TokenStream = Pin<Box<dyn Stream<Item = Result<v1::Token, Status>> + Send>>;
type TokenTx = mpsc::Sender<Result<v1::Token, Status>>;

/// How a fake decode node answers `Reserve`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ReserveScript {
    Reserve,
    Busy,
    Fail(tonic::Code),
}

/// How a fake prefill node answers `Prefill`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PrefillScript {
    /// Answers with this first token.
    Answer(u32),
    /// Answers with this first token, then its connection breaks (as when the process is
    /// killed after answering): its `CacheEvents` stream ends with an error.
    AnswerThenDie(u32),
    Fail(tonic::Code),
}

/// Every call a fake node received, in order: the RPC and its main argument.
#[derive(Clone, Default)]
pub(crate) struct Calls(Arc<Mutex<Vec<(&'static str, String)>>>);

impl Calls {
    fn push(&self, rpc: &'static str, arg: impl ToString) {
        self.0
            .lock()
            .expect("no test panics holding it")
            .push((rpc, arg.to_string()));
    }

    /// The arguments of every call to `rpc`.
    pub(crate) fn of(&self, rpc: &str) -> Vec<String> {
        self.0
            .lock()
            .expect("no test panics holding it")
            .iter()
            .filter(|(r, _)| *r == rpc)
            .map(|(_, a)| a.clone())
            .collect()
    }
}

/// The tokens a decode node streams: `count` tokens from `index`, ids from 200, the last one
/// finished by length.
fn tokens(index: u32, count: u32) -> Vec<v1::Token> {
    (0..count)
        .map(|i| {
            let mut t = v1::Token {
                token_id: 200 + index + i,
                index: index + i,
                text: format!(" t{}", index + i),
                ..Default::default()
            };
            if i + 1 == count {
                t.set_finish_reason(v1::FinishReason::Length);
            }
            t
        })
        .collect()
}

#[derive(Clone)]
struct FakeDecode {
    reserve: ReserveScript,
    /// Tokens after the first one that a reservation's stream yields once the request starts;
    /// `None`: the stream stays open and silent (its KV never arrives).
    rest: Option<u32>,
    calls: Calls,
    next_xfer: Arc<AtomicU64>,
    /// The still-open streams, by transfer id: they end when the transfer is cancelled.
    streams: Arc<Mutex<HashMap<u64, TokenTx>>>,
}

#[tonic::async_trait]
impl Decode for FakeDecode {
    async fn reserve(
        &self,
        r: Request<v1::ReserveRequest>,
    ) -> Result<Response<v1::ReserveResponse>, Status> {
        self.calls.push("reserve", r.get_ref().prompt_ids.len());
        let result = match self.reserve {
            ReserveScript::Fail(code) => return Err(Status::new(code, "scripted failure")),
            ReserveScript::Busy => reserve_response::Result::Busy("full".into()),
            ReserveScript::Reserve => reserve_response::Result::Reserved(v1::Reserved {
                xfer_id: self.next_xfer.fetch_add(1, Ordering::Relaxed) + 1,
                epoch: 1,
                block_ids: vec![0],
                kv_endpoint: "127.0.0.1:1".into(),
                lease_ms: 10_000,
                layout: None,
            }),
        };
        Ok(Response::new(v1::ReserveResponse {
            result: Some(result),
        }))
    }

    type StreamStream = TokenStream;

    async fn stream(&self, r: Request<v1::StreamRequest>) -> Result<Response<TokenStream>, Status> {
        let xfer_id = r.get_ref().xfer_id;
        self.calls.push("stream", xfer_id);
        let (tx, rx) = mpsc::channel(64);
        match self.rest {
            // The whole script at once, then the end of the stream, as after a last token.
            Some(n) => {
                for t in tokens(1, n) {
                    tx.try_send(Ok(t)).expect("room for the script");
                }
            }
            // Open until the transfer is cancelled.
            None => {
                self.streams
                    .lock()
                    .expect("no test panics holding it")
                    .insert(xfer_id, tx);
            }
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type LocalGenerateStream = TokenStream;

    async fn local_generate(
        &self,
        r: Request<v1::LocalGenerateRequest>,
    ) -> Result<Response<TokenStream>, Status> {
        let r = r.into_inner();
        let prompt: Vec<String> = r.prompt_ids.iter().map(u32::to_string).collect();
        self.calls.push("local_generate", prompt.join(","));
        let n = r.stopping.map_or(4, |s| s.max_new_tokens);
        let items: Vec<Result<v1::Token, Status>> = tokens(0, n).into_iter().map(Ok).collect();
        Ok(Response::new(Box::pin(futures::stream::iter(items))))
    }

    async fn done(
        &self,
        _: Request<v1::DoneRequest>,
    ) -> Result<Response<v1::DoneResponse>, Status> {
        Err(Status::unimplemented("fake decode nodes get no Done"))
    }

    async fn cancel(
        &self,
        r: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        let xfer_id = r.get_ref().xfer_id;
        self.calls.push("cancel", xfer_id);
        let found = self
            .streams
            .lock()
            .expect("no test panics holding it")
            .remove(&xfer_id)
            .is_some();
        Ok(Response::new(v1::CancelResponse { found }))
    }
}

#[derive(Clone)]
struct FakePrefill {
    script: PrefillScript,
    calls: Calls,
    /// Notified when the node "dies": its CacheEvents stream breaks.
    died: Arc<Notify>,
}

#[tonic::async_trait]
impl Prefill for FakePrefill {
    async fn prefill(
        &self,
        r: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let r = r.into_inner();
        self.calls
            .push("prefill", r.dest.as_ref().map_or(0, |d| d.xfer_id));
        let first = match self.script {
            PrefillScript::Fail(code) => return Err(Status::new(code, "scripted failure")),
            PrefillScript::Answer(id) => id,
            PrefillScript::AnswerThenDie(id) => {
                // After the answer has left: the window the resume covers.
                let died = Arc::clone(&self.died);
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    died.notify_one();
                });
                id
            }
        };
        Ok(Response::new(v1::PrefillResponse {
            first_token: Some(v1::Token {
                token_id: first,
                text: " first".into(),
                ..Default::default()
            }),
            num_tokens: r.prompt_ids.len() as u32,
            cached_tokens: 0,
            prefill_us: 1,
        }))
    }
}

/// The `Node` service of a fake: its Info, and a CacheEvents stream that breaks when the node
/// dies.
#[derive(Clone)]
struct FakeNodeRpc {
    role: Role,
    died: Arc<Notify>,
}

#[tonic::async_trait]
impl NodeRpc for FakeNodeRpc {
    async fn info(&self, _: Request<v1::InfoRequest>) -> Result<Response<v1::NodeInfo>, Status> {
        Ok(Response::new(v1::NodeInfo {
            role: self.role.to_string(),
            layout: Some(kv_types::KvLayout::SMOLLM2_135M_F32.into()),
            total_kv_blocks: 64,
            ..Default::default()
        }))
    }

    async fn drain(
        &self,
        _: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type CacheEventsStream = TokenlessEvents;

    async fn cache_events(
        &self,
        _: Request<v1::CacheEventsRequest>,
    ) -> Result<Response<TokenlessEvents>, Status> {
        let snapshot = v1::CacheEventBatch {
            seq: 1,
            snapshot: true,
            events: Vec::new(),
            block_size: 16,
        };
        let died = Arc::clone(&self.died);
        let broken = async move {
            died.notified().await;
            Err(Status::unavailable("connection reset"))
        };
        Ok(Response::new(Box::pin(futures::StreamExt::chain(
            futures::stream::once(async move { Ok(snapshot) }),
            futures::stream::once(broken),
        ))))
    }
}

type TokenlessEvents = Pin<Box<dyn Stream<Item = Result<v1::CacheEventBatch, Status>> + Send>>;

/// A fake node serving on a free loopback port until the test ends.
pub(crate) struct FakeNode {
    pub(crate) endpoint: String,
    pub(crate) calls: Calls,
    _stop: tokio_util::sync::DropGuard,
}

async fn serve(router: tonic::transport::server::Router) -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = listener.local_addr().expect("addr").to_string();
    let stop = CancellationToken::new();
    tokio::spawn(router.serve_with_incoming_shutdown(
        TcpListenerStream::new(listener),
        stop.clone().cancelled_owned(),
    ));
    (endpoint, stop)
}

/// A decode node answering Reserve with `reserve`, whose streams yield `rest` tokens after
/// the first (`None`: never).
pub(crate) async fn decode(reserve: ReserveScript, rest: Option<u32>) -> FakeNode {
    let calls = Calls::default();
    let died = Arc::new(Notify::new());
    let router = tonic::transport::Server::builder()
        .add_service(DecodeServer::new(FakeDecode {
            reserve,
            rest,
            calls: calls.clone(),
            next_xfer: Arc::new(AtomicU64::new(0)),
            streams: Arc::new(Mutex::new(HashMap::new())),
        }))
        .add_service(NodeServer::new(FakeNodeRpc {
            role: Role::Decode,
            died,
        }));
    let (endpoint, stop) = serve(router).await;
    FakeNode {
        endpoint,
        calls,
        _stop: stop.drop_guard(),
    }
}

pub(crate) async fn prefill(script: PrefillScript) -> FakeNode {
    let calls = Calls::default();
    let died = Arc::new(Notify::new());
    let router = tonic::transport::Server::builder()
        .add_service(PrefillServer::new(FakePrefill {
            script,
            calls: calls.clone(),
            died: Arc::clone(&died),
        }))
        .add_service(NodeServer::new(FakeNodeRpc {
            role: Role::Prefill,
            died,
        }));
    let (endpoint, stop) = serve(router).await;
    FakeNode {
        endpoint,
        calls,
        _stop: stop.drop_guard(),
    }
}

/// Ranks candidates in the order discovery listed them: the tests decide who is tried first.
struct InOrder;

impl RoutingPolicy for InOrder {
    fn name(&self) -> &'static str {
        "in-order"
    }

    fn rank_decode(&self, _: usize, _: usize, c: &[Candidate]) -> Ranking {
        Ranking {
            order: (0..c.len()).collect(),
            reason: "in order".into(),
        }
    }

    fn rank_prefill(&self, p: usize, b: usize, c: &[Candidate]) -> Ranking {
        self.rank_decode(p, b, c)
    }
}

/// A backend over the fakes, once every one of them answers `Info`.
pub(crate) async fn backend(prefills: &[&FakeNode], decodes: &[&FakeNode]) -> ClusterBackend {
    let endpoints =
        |nodes: &[&FakeNode]| -> Vec<String> { nodes.iter().map(|n| n.endpoint.clone()).collect() };
    let discovery = StaticDiscovery::new(&endpoints(prefills), &endpoints(decodes));
    let pools = Pools::spawn(Arc::new(discovery));
    let ready = |role| pools.ready(role).len();
    testkit::wait_until_async("the fakes answer Info", Duration::from_secs(10), || {
        let all = ready(Role::Prefill) == prefills.len() && ready(Role::Decode) == decodes.len();
        async move { all }
    })
    .await;
    ClusterBackend::new(
        pools,
        ClusterConfig {
            max_local_prefill_tokens: 0,
        },
        Box::new(InOrder),
    )
}

/// A 5-token prompt for 4 new tokens.
pub(crate) fn request() -> ValidRequest {
    ValidRequest {
        request_id: crate::request::RequestId("req-1".into()),
        prompt_ids: vec![11, 12, 13, 14, 15],
        sampling: SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 7,
            top_n_logprobs: 0,
        },
        stopping: StoppingParams {
            max_new_tokens: 4,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        received_at: std::time::Instant::now(),
    }
}

/// Reads a stream to its end: the token ids and the finish reason of the last one.
pub(crate) async fn drain(
    mut stream: crate::request::TokenStream,
) -> (Vec<u32>, Vec<usize>, Option<FinishReason>) {
    use futures::StreamExt;
    let (mut ids, mut indices, mut finish) = (Vec::new(), Vec::new(), None);
    while let Some(t) = stream.next().await {
        let t = t.expect("a token, not an error");
        ids.push(t.id);
        indices.push(t.index);
        finish = t.finish_reason;
    }
    (ids, indices, finish)
}
