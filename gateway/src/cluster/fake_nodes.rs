//! In-process fake nodes for the backend's unit tests: real tonic servers on loopback that
//! answer from a script and record every call, so placement, prefill retries, stall detection
//! and migration are tested against real gRPC streams without an engine.
//!
//! The fakes keep the real protocol's shape: a decode node reserves on `GenerateStart`,
//! activates on `Done` at the reservation's epoch only, and streams tokens from the index it
//! was asked to resume at; a prefill node sends its first token and calls the decode node's
//! `Done`. Token ids depend only on the index (200 + index), as a seeded request's do, so a
//! resumed stream must read exactly like an uninterrupted one.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use proto::v1::decode_client::DecodeClient;
use proto::v1::decode_server::{Decode, DecodeServer};
use proto::v1::node_server::{Node as NodeRpc, NodeServer};
use proto::v1::prefill_server::{Prefill, PrefillServer};
use proto::v1::{self, generate_down, generate_up, prefill_event};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::backend::ClusterBackend;
use super::config::ClusterConfig;
use super::discovery::{Role, StaticDiscovery};
use super::pairs::PairConfig;
use super::pool::Pools;
use super::routing::{Candidate, Ranking, RoutingPolicy};
use crate::request::{FinishReason, SamplingParams, StoppingParams, ValidRequest};

type DownTx = mpsc::Sender<Result<v1::GenerateDown, Status>>;

/// How a fake decode node serves a request.
#[derive(Clone, Copy, Debug)]
pub(crate) enum DecodeScript {
    /// Reserves (or prefills locally) and streams every token.
    Serve,
    /// As `Serve`, yielding between tokens: a stream still going when its client leaves.
    Paced,
    /// Answers RESOURCE_EXHAUSTED: out of KV blocks.
    NoRoom,
    /// Fails the call with this code.
    Fail(tonic::Code),
    /// Streams tokens up to and including this index, then its connection breaks.
    DieAfter(u32),
    /// Streams tokens up to and including this index, then goes silent: a hung process.
    HangAfter(u32),
    /// Killed as the prefill node sends Done: the call breaks, and the request's stream breaks
    /// at the gateway's next message on it, so the gateway hears of the death from the
    /// prefill node first.
    DieAtDone,
    /// Sends its first answer (the reservation, or the queued heartbeat of a local prefill),
    /// then nothing: no heartbeat, no token, no answer to Done. A node stopped once it had
    /// taken the request.
    SilentAfterStart,
}

/// How a fake prefill node serves a prompt.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PrefillScript {
    /// First token, Done on the decode node, Pushed.
    Push,
    /// Fails the call with this code.
    Fail(tonic::Code),
    /// Sends its first token, then its connection breaks before the push ends.
    DieMidPush,
    /// Takes the prompt, then sends nothing.
    Hang,
    /// As `Push`, then four heartbeats a moment after `Pushed`, as a loaded node's stream may
    /// still carry when the gateway has what it needs.
    PushThenTrail,
    /// Sends its first token, then fails the push as a prefill node that cannot reach the
    /// decode node's KV address does (DATA_LOSS): the node itself is healthy.
    PushFails,
}

/// A node's SIGSTOP: while stopped, every call it receives waits, unanswered, until it is
/// continued. The connection stays up, as a stopped process's does.
#[derive(Clone)]
pub(crate) struct Freeze(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Freeze {
    fn default() -> Self {
        Freeze(Arc::new(tokio::sync::watch::channel(false).0))
    }
}

impl Freeze {
    pub(crate) fn stop(&self) {
        self.0.send_replace(true);
    }

    pub(crate) fn cont(&self) {
        self.0.send_replace(false);
    }

    /// Returns once the node runs.
    async fn running(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives as long as `self`: the wait cannot fail.
        let _ = rx.wait_for(|stopped| !stopped).await;
    }
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

/// The token at `index`; the last one (`index + 1 == max`) finished by length.
fn token(index: u32, max: u32) -> v1::Token {
    let mut t = v1::Token {
        token_id: 200 + index,
        index,
        text: format!(" t{index}"),
        ..Default::default()
    };
    if index + 1 >= max {
        t.set_finish_reason(v1::FinishReason::Length);
    }
    t
}

fn down(msg: generate_down::Msg) -> Result<v1::GenerateDown, Status> {
    Ok(v1::GenerateDown { msg: Some(msg) })
}

/// A reservation waiting for its Done.
struct Waiting {
    epoch: u64,
    /// Where tokens go once the reservation is activated: the index of the first one (the
    /// prefill node's, which a real decode node sends on too), and the request's length.
    from: u32,
    max: u32,
    down: DownTx,
    alive: CancellationToken,
}

#[derive(Clone)]
struct FakeDecode {
    script: DecodeScript,
    freeze: Freeze,
    calls: Calls,
    next_xfer: Arc<AtomicU64>,
    waiting: Arc<Mutex<HashMap<u64, Waiting>>>,
}

impl FakeDecode {
    /// Streams tokens `from..max` as the script allows, on a task of their own. A hang
    /// stops the stream's heartbeats too.
    fn stream(&self, from: u32, max: u32, down: DownTx, alive: CancellationToken) {
        let script = self.script;
        tokio::spawn(async move {
            for i in from..max {
                if down.send(down_token(i, max)).await.is_err() {
                    return;
                }
                match script {
                    DecodeScript::DieAfter(k) if i >= k => {
                        let _ = down
                            .send(Err(Status::unavailable("connection reset")))
                            .await;
                        return;
                    }
                    DecodeScript::HangAfter(k) if i >= k => {
                        alive.cancel();
                        // Holds the stream open and silent until the gateway leaves.
                        down.closed().await;
                        return;
                    }
                    DecodeScript::Paced => tokio::task::yield_now().await,
                    _ => {}
                }
            }
        });
    }
}

/// A live node's heartbeats: one per quarter stall deadline until the stream ends or the
/// node hangs.
async fn heartbeats(tx: DownTx, alive: CancellationToken) {
    loop {
        tokio::select! {
            () = alive.cancelled() => return,
            () = tx.closed() => return,
            () = tokio::time::sleep(TEST_STALL / 4) => {}
        }
        let beat = down(generate_down::Msg::Heartbeat(v1::Heartbeat::default()));
        if tx.send(beat).await.is_err() {
            return;
        }
    }
}

fn down_token(i: u32, max: u32) -> Result<v1::GenerateDown, Status> {
    down(generate_down::Msg::Token(token(i, max)))
}

type DownStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateDown, Status>> + Send>>;

#[tonic::async_trait]
impl Decode for FakeDecode {
    type GenerateStream = DownStream;

    async fn generate(
        &self,
        r: Request<Streaming<v1::GenerateUp>>,
    ) -> Result<Response<DownStream>, Status> {
        self.freeze.running().await;
        let mut up = r.into_inner();
        let Some(v1::GenerateUp {
            msg: Some(generate_up::Msg::Start(start)),
        }) = up.message().await?
        else {
            return Err(Status::invalid_argument("expected GenerateStart"));
        };
        let spec = start.spec.unwrap_or_default();
        let max = spec.stopping.map_or(4, |s| s.max_new_tokens);
        self.calls.push(
            "start",
            format!(
                "prompt={} generated={} local={} epoch={}",
                spec.prompt_ids.len(),
                spec.num_generated,
                start.local_prefill,
                start.epoch
            ),
        );
        match self.script {
            DecodeScript::NoRoom => return Err(Status::resource_exhausted("out of KV blocks")),
            DecodeScript::Fail(code) => return Err(Status::new(code, "scripted failure")),
            _ => {}
        }
        let (tx, rx) = mpsc::channel(64);
        let alive = CancellationToken::new();
        if matches!(self.script, DecodeScript::SilentAfterStart) {
            let first = if start.local_prefill {
                generate_down::Msg::Heartbeat(v1::Heartbeat {
                    phase: v1::Phase::Queued as i32,
                })
            } else {
                generate_down::Msg::Reserved(reserved(1, start.epoch))
            };
            tx.try_send(down(first)).expect("room");
            // Holds both sides open and silent until the gateway leaves.
            tokio::spawn(async move {
                let _up = up;
                tx.closed().await;
            });
            return Ok(Response::new(Box::pin(ReceiverStream::new(rx))));
        }
        tokio::spawn(heartbeats(tx.clone(), alive.clone()));
        if start.local_prefill {
            self.stream(spec.num_generated, max, tx.clone(), alive);
            // The gateway closes its side when the request ends or the client leaves.
            let calls = self.calls.clone();
            tokio::spawn(async move {
                while let Ok(Some(_)) = up.message().await {}
                calls.push("closed", "");
            });
        } else {
            let xfer_id = self.next_xfer.fetch_add(1, Ordering::Relaxed) + 1;
            tx.try_send(down(generate_down::Msg::Reserved(reserved(
                xfer_id,
                start.epoch,
            ))))
            .expect("room");
            self.waiting.lock().expect("no panics").insert(
                xfer_id,
                Waiting {
                    epoch: start.epoch,
                    from: spec.num_generated,
                    max,
                    down: tx.clone(),
                    alive,
                },
            );
            // Reprefills move the reservation to a newer epoch, or here.
            let (this, calls) = (self.clone(), self.calls.clone());
            tokio::spawn(async move {
                while let Ok(Some(v1::GenerateUp {
                    msg: Some(generate_up::Msg::Reprefill(r)),
                })) = up.message().await
                {
                    calls.push(
                        "reprefill",
                        format!("epoch={} local={}", r.epoch, r.local_prefill),
                    );
                    let mut waiting = this.waiting.lock().expect("no panics");
                    if matches!(this.script, DecodeScript::DieAtDone) {
                        if let Some(w) = waiting.remove(&xfer_id) {
                            w.alive.cancel();
                            let _ = w
                                .down
                                .try_send(Err(Status::unavailable("connection reset")));
                        }
                        break;
                    }
                    if r.local_prefill {
                        if let Some(w) = waiting.remove(&xfer_id) {
                            this.stream(w.from, w.max, w.down, w.alive);
                        }
                    } else if let Some(w) = waiting.get_mut(&xfer_id) {
                        w.epoch = r.epoch;
                        let _ = w.down.try_send(down(generate_down::Msg::Reserved(reserved(
                            xfer_id, r.epoch,
                        ))));
                    }
                }
                calls.push("closed", "");
            });
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn done(
        &self,
        r: Request<v1::DoneRequest>,
    ) -> Result<Response<v1::DoneResponse>, Status> {
        self.freeze.running().await;
        let d = r.into_inner();
        self.calls
            .push("done", format!("xfer={} epoch={}", d.xfer_id, d.epoch));
        if matches!(self.script, DecodeScript::SilentAfterStart) {
            return std::future::pending().await;
        }
        let w = {
            let mut waiting = self.waiting.lock().expect("no panics");
            match waiting.get(&d.xfer_id) {
                None => return Err(Status::not_found("no reservation")),
                Some(w) if w.epoch != d.epoch => {
                    return Err(Status::invalid_argument("stale epoch"))
                }
                Some(_) if matches!(self.script, DecodeScript::DieAtDone) => {
                    // What tonic makes of the connection the killed process reset.
                    return Err(Status::unknown("transport error"));
                }
                Some(_) => waiting.remove(&d.xfer_id).expect("present"),
            }
        };
        self.stream(w.from, w.max, w.down, w.alive);
        Ok(Response::new(v1::DoneResponse {}))
    }

    async fn renew(
        &self,
        _: Request<v1::RenewRequest>,
    ) -> Result<Response<v1::RenewResponse>, Status> {
        Ok(Response::new(v1::RenewResponse {}))
    }
}

fn reserved(xfer_id: u64, epoch: u64) -> v1::Reserved {
    v1::Reserved {
        xfer_id,
        epoch,
        block_ids: vec![0],
        kv_endpoint: "127.0.0.1:1".into(),
        lease_ms: 10_000,
        layout: None,
        ..Default::default()
    }
}

#[derive(Clone)]
struct FakePrefill {
    script: PrefillScript,
    freeze: Freeze,
    calls: Calls,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<v1::PrefillEvent, Status>> + Send>>;

fn event(e: prefill_event::Event) -> Result<v1::PrefillEvent, Status> {
    Ok(v1::PrefillEvent { event: Some(e) })
}

#[tonic::async_trait]
impl Prefill for FakePrefill {
    type PrefillStream = EventStream;

    async fn prefill(
        &self,
        r: Request<v1::PrefillRequest>,
    ) -> Result<Response<EventStream>, Status> {
        self.freeze.running().await;
        let r = r.into_inner();
        let dest = r.dest.unwrap_or_default();
        let (decode_endpoint, dest) = (dest.decode_endpoint, dest.reserved.unwrap_or_default());
        let spec = r.spec.unwrap_or_default();
        self.calls.push(
            "prefill",
            format!("xfer={} epoch={}", dest.xfer_id, dest.epoch),
        );
        if let PrefillScript::Fail(code) = self.script {
            return Err(Status::new(code, "scripted failure"));
        }
        let max = spec.stopping.map_or(4, |s| s.max_new_tokens);
        let first = token(spec.num_generated, max);
        let (tx, rx) = mpsc::channel(8);
        let script = self.script;
        tokio::spawn(async move {
            match script {
                PrefillScript::Hang => return tx.closed().await,
                PrefillScript::Fail(_) => unreachable!("answered above"),
                PrefillScript::Push
                | PrefillScript::DieMidPush
                | PrefillScript::PushThenTrail
                | PrefillScript::PushFails => {}
            }
            let first_event = prefill_event::Event::First(v1::FirstToken {
                token: Some(first.clone()),
            });
            let _ = tx.send(event(first_event)).await;
            if matches!(script, PrefillScript::DieMidPush) {
                let _ = tx.send(Err(Status::unavailable("connection reset"))).await;
                return;
            }
            if matches!(script, PrefillScript::PushFails) {
                let why = format!(
                    "kv transfer to {}: connect: Invalid argument (os error 22)",
                    dest.kv_endpoint
                );
                let _ = tx.send(Err(Status::data_loss(why))).await;
                return;
            }
            let done = async {
                let mut client = DecodeClient::connect(format!("http://{decode_endpoint}"))
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
                client
                    .done(v1::DoneRequest {
                        xfer_id: dest.xfer_id,
                        epoch: dest.epoch,
                        first_token: Some(first),
                        ..Default::default()
                    })
                    .await
            };
            let _ = match done.await {
                Ok(_) => tx.send(event(prefill_event::Event::Pushed(true))).await,
                // As a real prefill node reports a Done that broke on the way: a failed
                // transfer.
                Err(s) if s.code() == tonic::Code::Unknown => {
                    tx.send(Err(Status::data_loss(s.message().to_string())))
                        .await
                }
                Err(s) => tx.send(Err(s)).await,
            };
            if matches!(script, PrefillScript::PushThenTrail) {
                tokio::time::sleep(Duration::from_millis(1)).await;
                for _ in 0..4 {
                    let beat = prefill_event::Event::Heartbeat(v1::Heartbeat::default());
                    if tx.send(event(beat)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The `Node` service of a fake: its Info and an idle CacheEvents stream.
#[derive(Clone)]
struct FakeNodeRpc {
    role: Role,
    freeze: Freeze,
}

type CacheEventStream = Pin<Box<dyn Stream<Item = Result<v1::CacheEventBatch, Status>> + Send>>;

#[tonic::async_trait]
impl NodeRpc for FakeNodeRpc {
    async fn info(&self, _: Request<v1::InfoRequest>) -> Result<Response<v1::NodeInfo>, Status> {
        self.freeze.running().await;
        Ok(Response::new(v1::NodeInfo {
            role: self.role.to_string(),
            layout: Some(kv_types::KvLayout::SMOLLM2_135M_F32.into()),
            total_kv_blocks: 64,
            architecture: "LlamaForCausalLM".into(),
            weight_dtype: "f32".into(),
            ..Default::default()
        }))
    }

    async fn drain(
        &self,
        _: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type CacheEventsStream = CacheEventStream;

    async fn cache_events(
        &self,
        _: Request<v1::CacheEventsRequest>,
    ) -> Result<Response<CacheEventStream>, Status> {
        let snapshot = v1::CacheEventBatch {
            seq: 1,
            snapshot: true,
            events: Vec::new(),
        };
        Ok(Response::new(Box::pin(futures::StreamExt::chain(
            futures::stream::once(async move { Ok(snapshot) }),
            futures::stream::pending(),
        ))))
    }
}

/// A fake node serving on a free loopback port until the test ends.
pub(crate) struct FakeNode {
    pub(crate) endpoint: String,
    pub(crate) calls: Calls,
    /// Stops and continues the node, as SIGSTOP and SIGCONT do.
    pub(crate) freeze: Freeze,
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

pub(crate) async fn decode(script: DecodeScript) -> FakeNode {
    let calls = Calls::default();
    let freeze = Freeze::default();
    let router = tonic::transport::Server::builder()
        .add_service(DecodeServer::new(FakeDecode {
            script,
            freeze: freeze.clone(),
            calls: calls.clone(),
            next_xfer: Arc::new(AtomicU64::new(0)),
            waiting: Arc::new(Mutex::new(HashMap::new())),
        }))
        .add_service(NodeServer::new(FakeNodeRpc {
            role: Role::Decode,
            freeze: freeze.clone(),
        }));
    let (endpoint, stop) = serve(router).await;
    FakeNode {
        endpoint,
        calls,
        freeze,
        _stop: stop.drop_guard(),
    }
}

pub(crate) async fn prefill(script: PrefillScript) -> FakeNode {
    let calls = Calls::default();
    let freeze = Freeze::default();
    let router = tonic::transport::Server::builder()
        .add_service(PrefillServer::new(FakePrefill {
            script,
            freeze: freeze.clone(),
            calls: calls.clone(),
        }))
        .add_service(NodeServer::new(FakeNodeRpc {
            role: Role::Prefill,
            freeze: freeze.clone(),
        }));
    let (endpoint, stop) = serve(router).await;
    FakeNode {
        endpoint,
        calls,
        freeze,
        _stop: stop.drop_guard(),
    }
}

/// Ranks candidates in the order discovery listed them: the tests decide who is tried first.
pub(crate) struct InOrder;

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

/// The stall deadline the tests use: short, so a hang is found fast.
pub(crate) const TEST_STALL: Duration = Duration::from_millis(400);

/// A backend over the fakes, once every one of them answers `Info`.
pub(crate) async fn backend(prefills: &[&FakeNode], decodes: &[&FakeNode]) -> ClusterBackend {
    backend_with(
        prefills,
        decodes,
        ClusterConfig {
            max_local_prefill_tokens: 0,
            max_stall: TEST_STALL,
            migration_limit: 2,
        },
    )
    .await
}

pub(crate) async fn backend_with(
    prefills: &[&FakeNode],
    decodes: &[&FakeNode],
    config: ClusterConfig,
) -> ClusterBackend {
    backend_with_policy(prefills, decodes, config, Box::new(InOrder)).await
}

/// As [`backend_with`], routing with `policy`.
pub(crate) async fn backend_with_policy(
    prefills: &[&FakeNode],
    decodes: &[&FakeNode],
    config: ClusterConfig,
    policy: Box<dyn RoutingPolicy>,
) -> ClusterBackend {
    backend_with_pairs(prefills, decodes, config, policy, PairConfig::default()).await
}

/// As [`backend_with_policy`], marking prefill→decode pairs bad as `pairs` says.
pub(crate) async fn backend_with_pairs(
    prefills: &[&FakeNode],
    decodes: &[&FakeNode],
    config: ClusterConfig,
    policy: Box<dyn RoutingPolicy>,
    pairs: PairConfig,
) -> ClusterBackend {
    let endpoints =
        |nodes: &[&FakeNode]| -> Vec<String> { nodes.iter().map(|n| n.endpoint.clone()).collect() };
    let discovery = StaticDiscovery::new(&endpoints(prefills), &endpoints(decodes));
    let pools = Pools::spawn_with(Arc::new(discovery), identity::GrpcSecurity::Insecure, pairs);
    let ready = |role| pools.ready(role).len();
    testkit::wait_until_async("the fakes answer Info", Duration::from_secs(10), || {
        let all = ready(Role::Prefill) == prefills.len() && ready(Role::Decode) == decodes.len();
        async move { all }
    })
    .await;
    ClusterBackend::new(pools, config, policy)
}

/// A 5-token prompt for `max_new_tokens` new tokens.
pub(crate) fn request(max_new_tokens: usize) -> ValidRequest {
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
            max_new_tokens,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        grammar: None,
        prompt_logprobs: false,
        received_at: std::time::Instant::now(),
    }
}

/// What a client read from a stream.
#[derive(Debug)]
pub(crate) struct Read {
    pub(crate) ids: Vec<u32>,
    pub(crate) indices: Vec<usize>,
    pub(crate) finish: Option<FinishReason>,
    pub(crate) error: Option<crate::error::GatewayError>,
}

/// Reads a stream to its end.
pub(crate) async fn drain(mut stream: crate::request::TokenStream) -> Read {
    use futures::StreamExt;
    let mut read = Read {
        ids: Vec::new(),
        indices: Vec::new(),
        finish: None,
        error: None,
    };
    while let Some(t) = stream.next().await {
        match t {
            Ok(t) => {
                read.ids.push(t.id);
                read.indices.push(t.index);
                read.finish = t.finish_reason;
            }
            Err(e) => {
                read.error = Some(e);
                break;
            }
        }
    }
    read
}

/// The ids and indices of an uninterrupted `n`-token stream.
pub(crate) fn complete(n: u32) -> (Vec<u32>, Vec<usize>) {
    ((200..200 + n).collect(), (0..n as usize).collect())
}
