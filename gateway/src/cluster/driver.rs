//! One request's life on the cluster from its first placement: the driver ranks the decode
//! nodes and places the request ([`Driver::placement`], [`Driver::place_once`]), the same way
//! the first time and every time it moves, then reads its decode stream and, for remote prefill,
//! its prefill call on a task of its own, and hands the tokens to the client's stream.
//!
//! Every hop has a progress deadline. Nodes heartbeat while they have nothing else to say, so
//! silence for `max_stall` means a hung or dead node; while a decode node generates, a token is
//! due every step, so a gap beyond `max_stall` (or 8 times the request's own time per output
//! token, when that is longer) is a stall too. A stalled node is marked suspect: it takes no new
//! work until a health check passes. The deadline holds before the first token as after it:
//! a decode node must answer a placement ([`super::placement`]) and a prefill node a prefill
//! call within `max_stall`, so a request that arrives while a node is stopped or cut off
//! moves on instead of waiting out the fault.
//!
//! - A prefill attempt that fails or stalls is retried into the same reservation at the next
//!   epoch (Reprefill) on another prefill node; after `MAX_PREFILL_ATTEMPTS`, the decode node
//!   prefills the prompt itself. Stale frames, Done and Renew of the old attempt are refused by
//!   the decode node. Every failed attempt counts against its prefill→decode pair
//!   ([`super::pairs`]); a pair that keeps failing is routed around for a while.
//! - A decode node that fails or stalls mid-stream loses the request: it is placed again, on
//!   another decode node, with the prompt plus every token already streamed as its prompt
//!   (`num_generated` of them). A request's random draws depend only on its seed and the
//!   position, and the new node's text and stop-string state are primed with the streamed
//!   tokens, so the client sees the uninterrupted text: no token twice, none missing, one
//!   finish. At most `migration_limit` times; after that, or when no node takes it within
//!   [`MIGRATION_TIMEOUT`], the stream ends with an error.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::{self, generate_down, generate_up, prefill_event};
use proto::ErrorCode;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tracing::Instrument;

use super::config::ClusterConfig;
use super::discovery::Role;
use super::placement::{drain_to_end, place, DecodeCall, NotPlaced};
use super::pool::{InFlight, Node, Pools};
use super::rank::{rank, Ranked};
use super::retry::{node_failed, MAX_PREFILL_ATTEMPTS};
use super::routing::RoutingPolicy;
use super::wire::{generated, spec, upstream};
use crate::error::GatewayError;
use crate::request::{GeneratedToken, TokenStream, ValidRequest};

/// How long a request may look for a new decode node after it lost one.
pub(crate) const MIGRATION_TIMEOUT: Duration = Duration::from_secs(10);

/// How a stall deadline stretches for slow requests: this many times their own TPOT.
const STALL_TPOT_FACTOR: u32 = 8;

pub(crate) type Out = mpsc::Sender<Result<GeneratedToken, GatewayError>>;

/// What ended the request's time on one decode node.
enum Served {
    /// The last token is out.
    Finished,
    /// The client left: the node's streams are reset, which stops its work.
    Left,
    /// The decode node failed or stalled: move the request.
    DecodeLost {
        why: String,
        stalled: bool,
    },
    /// The decode node gave the reservation up (its prefill node stopped renewing it): place
    /// the request again, on any node.
    ReservationLost(String),
    Fail(GatewayError),
}

/// The request's prefill attempt in flight.
struct PrefillAttempt {
    node: Arc<Node>,
    events: Streaming<v1::PrefillEvent>,
    last_event: Instant,
    _in_flight: InFlight,
}

impl PrefillAttempt {
    /// The push is over: the node owes only its stream's end, read off the request's path.
    fn finish(self) {
        drain_to_end(self.events);
    }
}

pub(crate) struct Driver {
    pools: Arc<Pools>,
    policy: Arc<dyn RoutingPolicy>,
    config: ClusterConfig,
    request: ValidRequest,
    /// The ids of the tokens the client has been sent, in order.
    emitted: Vec<u32>,
    /// The request's attempt: one more on every prefill retry and every migration.
    epoch: u64,
    migrations: usize,
    prefill_attempts: usize,
    /// The prefill node chosen with the last Reprefill, to fill the reservation it brings.
    next_prefill: Option<Arc<Node>>,
    /// The `kv_identity` the reservation's current epoch is bound to on the decode node
    /// (empty: none, and the first prefill certificate to push binds it).
    bound: Vec<u8>,
    out: Out,
}

/// Where the request goes next, as it stands now (its prompt plus every token streamed): the
/// ready decode nodes in the policy's order, and whether the decode node prefills it itself.
pub(crate) struct Placement {
    pub(crate) decodes: Ranked,
    pub(crate) local_prefill: bool,
}

/// The prefill node's `kv_identity`: the hash of the certificate it pushes KV with, by which
/// the decode node refuses frames from any other node. Empty while its Info is unknown, and
/// without TLS.
fn kv_identity(node: &Node) -> Vec<u8> {
    node.info().map(|i| i.kv_identity).unwrap_or_default()
}

impl Driver {
    /// The driver of `request`, placed nowhere yet, and the stream its tokens come out on.
    pub(crate) fn new(
        pools: &Arc<Pools>,
        policy: &Arc<dyn RoutingPolicy>,
        config: &ClusterConfig,
        request: ValidRequest,
    ) -> (Driver, TokenStream) {
        // Room for every token the request may produce and an error, so that the driver never
        // waits on a slow client: it reads the node's stream at once. Tokens a driver left
        // unread stay in h2's buffers, where ~10,000 small frames over a connection (its budget
        // for them) close it with GOAWAY ENHANCE_YOUR_CALM, failing every request on it.
        let (out, tokens) = mpsc::channel(request.stopping.max_new_tokens + 2);
        let driver = Driver {
            pools: Arc::clone(pools),
            policy: Arc::clone(policy),
            config: config.clone(),
            request,
            emitted: Vec::new(),
            epoch: 1,
            migrations: 0,
            prefill_attempts: 0,
            next_prefill: None,
            bound: Vec::new(),
            out,
        };
        (driver, Box::pin(ReceiverStream::new(tokens)))
    }

    pub(crate) fn request(&self) -> &ValidRequest {
        &self.request
    }

    /// Ranks the ready decode nodes for the request as it stands now, and says whether the
    /// decode node is to prefill it itself. Ranking takes a turn of the policy (round robin's),
    /// so each placement ranks once.
    pub(crate) fn placement(&self) -> Placement {
        Placement {
            decodes: self.ranked(Role::Decode),
            local_prefill: self.prefill_locally(),
        }
    }

    /// One placement: opens the request, at its current epoch and with every token streamed
    /// so far, on the first of `placement`'s decode nodes that takes it. The first placement
    /// and every later one (a migration, a lost reservation) come here.
    pub(crate) async fn place_once(&self, placement: Placement) -> Result<DecodeCall, NotPlaced> {
        let start = v1::GenerateStart {
            spec: Some(spec(&self.request, &self.emitted)),
            local_prefill: placement.local_prefill,
            epoch: self.epoch,
        };
        place(&placement.decodes.nodes, start, self.config.max_stall).await
    }

    /// The first placement. Placed, the driver serves the request to its end on a task of its
    /// own; `Err`, no node holds it (every node out of room: the queue holds it and comes back).
    pub(crate) async fn start(self, placement: Placement) -> Result<(), NotPlaced> {
        let call = self.place_once(placement).await?;
        let span = tracing::Span::current();
        span.record("decode_node", call.node.entry.node_id.as_str());
        tokio::spawn(self.run(call).instrument(span));
        Ok(())
    }

    /// Serves the request from `call` to its end, migrating as needed.
    async fn run(mut self, mut call: DecodeCall) {
        loop {
            let node = Arc::clone(&call.node);
            let served = self.serve(call).await;
            let reason = match served {
                Served::Finished | Served::Left => return,
                Served::Fail(e) => {
                    let _ = self.out.send(Err(e)).await;
                    return;
                }
                Served::DecodeLost { why, stalled } => {
                    if stalled {
                        node.suspect("stalled mid-stream");
                    } else {
                        node.quarantine();
                    }
                    if self.migrations >= self.config.migration_limit {
                        let e = GatewayError::Unavailable {
                            reason: format!(
                                "decode node {} {why}, and the request has moved {} times (--migration-limit)",
                                node.entry.node_id, self.migrations
                            ),
                        };
                        let _ = self.out.send(Err(e)).await;
                        return;
                    }
                    self.migrations += 1;
                    tracing::warn!(request_id = %self.request.request_id, node_id = %node.entry.node_id, %why, generated = self.emitted.len(), "decode node lost; migrating the request");
                    if stalled {
                        "stalled"
                    } else {
                        "failed"
                    }
                }
                Served::ReservationLost(why) => {
                    tracing::info!(request_id = %self.request.request_id, %why, "reservation lost; placing the request again");
                    self.prefill_attempts += 1;
                    "reservation_lost"
                }
            };
            metrics::counter!("fission_gateway_migrations_total", "reason" => reason).increment(1);
            self.epoch += 1;
            // A new reservation, bound to no prefill node yet.
            self.next_prefill = None;
            self.bound.clear();
            call = match self.replace().await {
                Ok(call) => call,
                Err(e) => {
                    let _ = self.out.send(Err(e)).await;
                    return;
                }
            };
        }
    }

    /// Places the request again, from where it is, within [`MIGRATION_TIMEOUT`].
    async fn replace(&mut self) -> Result<DecodeCall, GatewayError> {
        let deadline = Instant::now() + MIGRATION_TIMEOUT;
        loop {
            match self.place_once(self.placement()).await {
                Ok(call) => return Ok(call),
                Err(NotPlaced::Refused(e)) => return Err(e),
                Err(not_placed) if Instant::now() >= deadline => {
                    let e = not_placed.into_error();
                    return Err(GatewayError::Unavailable {
                        reason: format!("no decode node took the request back within 10 s: {e}"),
                    });
                }
                Err(_) => {
                    tokio::select! {
                        () = self.out.closed() => return Err(GatewayError::Unavailable { reason: "the client left".into() }),
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
            }
        }
    }

    /// Local prefill when the prompt is short, when no prefill node is ready, or when the
    /// request has used up its prefill attempts.
    fn prefill_locally(&self) -> bool {
        self.request.prompt_ids.len() + self.emitted.len() < self.config.max_local_prefill_tokens
            || self.prefill_attempts >= MAX_PREFILL_ATTEMPTS
            || self.pools.ready(Role::Prefill).is_empty()
    }

    fn ranked(&self, role: Role) -> Ranked {
        let prompt = self.prompt_ids();
        let block_size = self
            .pools
            .ready(Role::Decode)
            .first()
            .map_or(16, |n| n.block_size());
        let hashes = prefix_hash::block_hashes(&prompt, block_size);
        rank(
            &self.pools,
            self.policy.as_ref(),
            role,
            &prompt,
            block_size,
            &hashes,
        )
    }

    fn prompt_ids(&self) -> Vec<u32> {
        let mut ids = self.request.prompt_ids.clone();
        ids.extend_from_slice(&self.emitted);
        ids
    }

    /// Reads the request's streams on one decode node until it ends there.
    async fn serve(&mut self, mut call: DecodeCall) -> Served {
        let mut prefill: Option<PrefillAttempt> = None;
        let served = self.serve_on(&mut call, &mut prefill).await;
        if let Served::Finished = served {
            call.finish();
            if let Some(p) = prefill {
                p.finish();
            }
        }
        served
    }

    async fn serve_on(
        &mut self,
        call: &mut DecodeCall,
        prefill: &mut Option<PrefillAttempt>,
    ) -> Served {
        // `call` counts the request against its node (`DecodeCall::_in_flight`) until it ends.
        if let Some(reserved) = call.reserved.take() {
            match self.start_prefill(call, &reserved).await {
                Ok(attempt) => *prefill = attempt,
                Err(served) => return served,
            }
        }
        let mut decode_seen = Instant::now();
        let mut last_token: Option<Instant> = None;
        let mut tpot: Option<Duration> = None;
        let mut generating = false;
        if let Some(first) = call.first.take() {
            if let Some(served) = self
                .on_decode(first, &mut generating, &mut last_token, &mut tpot)
                .await
            {
                return served;
            }
        }
        loop {
            // A generating node owes a token every step; any node owes a message per heartbeat.
            let stall = self.stall_limit(tpot);
            let decode_deadline = match (generating, last_token) {
                (true, Some(t)) => t.max(decode_seen) + stall,
                _ => decode_seen + self.config.max_stall,
            };
            let prefill_deadline = prefill
                .as_ref()
                .map(|p| p.last_event + self.config.max_stall);
            let deadline = prefill_deadline.map_or(decode_deadline, |p| p.min(decode_deadline));
            tokio::select! {
                biased;
                () = self.out.closed() => return Served::Left,
                msg = call.down.message() => {
                    decode_seen = Instant::now();
                    match msg {
                        Ok(Some(down)) => {
                            if let Some(generate_down::Msg::Reserved(r)) = &down.msg {
                                match self.start_prefill(call, r).await {
                                    Ok(attempt) => *prefill = attempt,
                                    Err(served) => return served,
                                }
                                continue;
                            }
                            if let Some(served) = self
                                .on_decode(down, &mut generating, &mut last_token, &mut tpot)
                                .await
                            {
                                return served;
                            }
                        }
                        Ok(None) => {
                            return Served::DecodeLost { why: "ended the stream early".into(), stalled: false };
                        }
                        Err(s) if s.code() == tonic::Code::DeadlineExceeded => {
                            return Served::ReservationLost(s.message().to_string());
                        }
                        Err(s) if node_failed(&s) => {
                            return Served::DecodeLost { why: format!("failed: {}", s.message()), stalled: false };
                        }
                        Err(s) => return Served::Fail(upstream(s)),
                    }
                }
                event = next_event(prefill) => {
                    match self.on_prefill_event(call, prefill, event).await {
                        Ok(()) => {}
                        Err(served) => return served,
                    }
                }
                () = tokio::time::sleep_until(deadline) => {
                    let now = Instant::now();
                    if prefill_deadline.is_some_and(|d| now >= d) {
                        if let Some(p) = prefill.take() {
                            p.node.suspect("stalled on a prompt");
                            let why = format!("prefill node {} sent nothing for {:?}", p.node.entry.node_id, self.config.max_stall);
                            self.pair_failed(&p.node, call, &why);
                            if let Err(served) = self.retry_prefill(call, why).await {
                                return served;
                            }
                        }
                        continue;
                    }
                    let why = if generating {
                        format!("sent no token for {stall:?}")
                    } else {
                        format!("sent nothing for {:?}", self.config.max_stall)
                    };
                    return Served::DecodeLost { why, stalled: true };
                }
            }
        }
    }

    /// How long a generating node may go without a token.
    fn stall_limit(&self, tpot: Option<Duration>) -> Duration {
        tpot.map_or(self.config.max_stall, |t| {
            self.config.max_stall.max(t * STALL_TPOT_FACTOR)
        })
    }

    /// A message from the decode node. `Some` ends the request there.
    async fn on_decode(
        &mut self,
        down: v1::GenerateDown,
        generating: &mut bool,
        last_token: &mut Option<Instant>,
        tpot: &mut Option<Duration>,
    ) -> Option<Served> {
        match down.msg {
            Some(generate_down::Msg::Token(t)) => {
                let now = Instant::now();
                if let Some(prev) = *last_token {
                    let gap = now - prev;
                    // A smoothed time per output token: one slow step does not stretch it much.
                    *tpot = Some(tpot.map_or(gap, |t| (t * 4 + gap) / 5));
                }
                *last_token = Some(now);
                *generating = true;
                self.emit(generated(t)).await
            }
            Some(generate_down::Msg::Heartbeat(h)) => {
                if h.phase() == v1::Phase::Running && last_token.is_none() {
                    // Tokens are due from now on.
                    *last_token = Some(Instant::now());
                    *generating = true;
                }
                None
            }
            Some(generate_down::Msg::Reserved(_)) | None => None,
        }
    }

    /// Sends `token` to the client unless it was sent already (a migrated or retried request
    /// sees its streamed tokens again). `Some(Done)` after the last token or when the client
    /// is gone.
    async fn emit(&mut self, token: GeneratedToken) -> Option<Served> {
        let expected = self.emitted.len();
        if token.index < expected {
            return None;
        }
        if token.index > expected {
            return Some(Served::Fail(GatewayError::backend(
                ErrorCode::Internal,
                format!(
                    "token {} arrived before token {expected}: the stream lost tokens",
                    token.index
                ),
            )));
        }
        self.emitted.push(token.id);
        let last = token.finish_reason.is_some();
        if self.out.send(Ok(token)).await.is_err() {
            return Some(Served::Left);
        }
        last.then_some(Served::Finished)
    }

    /// Starts a prefill attempt into `reserved` on the best ready prefill node; with none (or
    /// attempts used up), has the decode node prefill the prompt itself.
    async fn start_prefill(
        &mut self,
        call: &DecodeCall,
        reserved: &v1::Reserved,
    ) -> Result<Option<PrefillAttempt>, Served> {
        loop {
            if self.prefill_locally() {
                self.reprefill(call, true, "prefill_failed").await?;
                return Ok(None);
            }
            let node = match self.next_prefill.take() {
                Some(node) => node,
                None => match self.choose_prefill(call) {
                    Ok(node) => node,
                    Err(reason) => {
                        self.reprefill(call, true, reason).await?;
                        return Ok(None);
                    }
                },
            };
            let node = &node;
            let identity = kv_identity(node);
            if !identity.is_empty() && identity != self.bound {
                self.bind(call, reserved.epoch, identity.clone()).await?;
                self.bound = identity;
            }
            let request = v1::PrefillRequest {
                spec: Some(spec(&self.request, &self.emitted)),
                dest: Some(v1::KvDestination {
                    decode_endpoint: call.node.entry.grpc_endpoint.clone(),
                    reserved: Some(reserved.clone()),
                }),
            };
            let span = tracing::Span::current();
            span.record("prefill_node", node.entry.node_id.as_str());
            let in_flight = InFlight::new(node);
            let answer = tokio::time::timeout(
                self.config.max_stall,
                node.prefill_client()
                    .prefill(telemetry::with_trace(request)),
            )
            .await;
            match answer {
                Ok(Ok(events)) => {
                    return Ok(Some(PrefillAttempt {
                        node: Arc::clone(node),
                        events: events.into_inner(),
                        last_event: Instant::now(),
                        _in_flight: in_flight,
                    }))
                }
                Ok(Err(s)) if node_failed(&s) => {
                    node.quarantine();
                    self.pair_failed(node, call, s.message());
                    self.prefill_attempts += 1;
                    metrics::counter!("fission_gateway_prefill_retries_total").increment(1);
                    tracing::info!(request_id = %self.request.request_id, prefill_node = %node.entry.node_id, error = %s.message(), "prefill node failed to take the prompt; trying the next");
                    // The reservation is untouched: try the next node at the same epoch.
                }
                Ok(Err(s)) => return Err(Served::Fail(upstream(s))),
                Err(_) => {
                    // A hung or cut-off node holds the call open and answers nothing. The
                    // call may still reach it later, so the next attempt goes in at a new
                    // epoch (its reservation comes down the decode stream): a late push from
                    // this one is then refused as stale.
                    node.suspect("did not answer a prefill call");
                    let why = format!(
                        "prefill node {} did not answer the call within {:?}",
                        node.entry.node_id, self.config.max_stall
                    );
                    self.pair_failed(node, call, &why);
                    self.retry_prefill(call, why).await?;
                    return Ok(None);
                }
            }
        }
    }

    /// The best ready prefill node whose pair with `call`'s decode node is not bad; `Err` with
    /// the reason to prefill on the decode node instead.
    fn choose_prefill(&self, call: &DecodeCall) -> Result<Arc<Node>, &'static str> {
        let prefills = self.ranked(Role::Prefill);
        tracing::Span::current().record("prefill_reason", prefills.reason.as_str());
        let decode_id = call.node.entry.node_id.as_str();
        let pairs = self.pools.pairs();
        match prefills
            .nodes
            .iter()
            .find(|n| !pairs.is_bad(&n.entry.node_id, decode_id))
        {
            Some(node) => Ok(Arc::clone(node)),
            // Every ready prefill node's pushes to this decode node keep failing: prefill
            // here rather than spend the request's attempts on them.
            None if prefills.nodes.is_empty() => Err("prefill_failed"),
            None => {
                tracing::info!(request_id = %self.request.request_id, decode_node = decode_id, "every prefill node's pair with the decode node is bad; prefilling on the decode node");
                Err("bad_pair")
            }
        }
    }

    /// Tells the decode node that `identity` fills the reservation at `epoch`, before the
    /// Prefill call: its frames are the only ones admitted.
    async fn bind(&self, call: &DecodeCall, epoch: u64, identity: Vec<u8>) -> Result<(), Served> {
        let msg = v1::GenerateUp {
            msg: Some(generate_up::Msg::Bind(v1::Bind {
                epoch,
                prefill: identity,
            })),
        };
        self.send_up(call, msg).await
    }

    async fn on_prefill_event(
        &mut self,
        call: &DecodeCall,
        prefill: &mut Option<PrefillAttempt>,
        event: Result<Option<v1::PrefillEvent>, tonic::Status>,
    ) -> Result<(), Served> {
        let Some(attempt) = prefill.as_mut() else {
            return Ok(());
        };
        attempt.last_event = Instant::now();
        match event {
            Ok(Some(v1::PrefillEvent { event: Some(e) })) => match e {
                prefill_event::Event::First(first) => {
                    if let Some(token) = first.token {
                        if let Some(served) = self.emit(generated(token)).await {
                            return Err(served);
                        }
                    }
                    Ok(())
                }
                prefill_event::Event::Pushed(_) => {
                    if let Some(done) = prefill.take() {
                        self.pools
                            .pairs()
                            .succeeded(&done.node.entry.node_id, &call.node.entry.node_id);
                        done.finish();
                    }
                    Ok(())
                }
                prefill_event::Event::Heartbeat(_) => Ok(()),
            },
            Ok(Some(_)) => Ok(()),
            Ok(None) => {
                let node = prefill.take().map(|p| p.node);
                let why = format!(
                    "prefill node {} ended the call before its push",
                    node.as_ref()
                        .map(|n| n.entry.node_id.clone())
                        .unwrap_or_default()
                );
                if let Some(n) = &node {
                    self.pair_failed(n, call, &why);
                }
                self.retry_prefill(call, why).await
            }
            Err(s) if node_failed(&s) || s.code() == tonic::Code::DataLoss => {
                if let Some(p) = prefill.take() {
                    // A failed push is the pair's failure above all: the node's own health
                    // is judged apart, below.
                    self.pair_failed(&p.node, call, s.message());
                    // The node itself is fine when it gave the prompt up because the
                    // reservation moved on (Cancelled: its lease ended on the decode node), and
                    // when its push to the decode node failed (DataLoss): that node's own stream
                    // says whether it died, and the request then migrates.
                    if !matches!(s.code(), tonic::Code::Cancelled | tonic::Code::DataLoss) {
                        p.node.quarantine();
                    }
                }
                self.retry_prefill(call, s.message().to_string()).await
            }
            Err(s) => Err(Served::Fail(upstream(s))),
        }
    }

    /// The prefill attempt failed: the next one goes into the same reservation at a newer
    /// epoch, on another prefill node (or here, once attempts are used up).
    async fn retry_prefill(&mut self, call: &DecodeCall, why: String) -> Result<(), Served> {
        self.prefill_attempts += 1;
        metrics::counter!("fission_gateway_prefill_retries_total").increment(1);
        tracing::info!(request_id = %self.request.request_id, attempt = self.prefill_attempts, %why, "prefill attempt failed; retrying at a new epoch");
        let local = self.prefill_locally();
        self.reprefill(call, local, "prefill_failed").await
    }

    /// Sends `msg` up the decode stream, bounded like every other hop: a hung node's full
    /// stream must not hold the request.
    async fn send_up(&self, call: &DecodeCall, msg: v1::GenerateUp) -> Result<(), Served> {
        match tokio::time::timeout(self.config.max_stall, call.up.send(msg)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Served::DecodeLost {
                why: "closed the request's stream".into(),
                stalled: false,
            }),
            Err(_) => Err(Served::DecodeLost {
                why: format!("took no message for {:?}", self.config.max_stall),
                stalled: true,
            }),
        }
    }

    /// Moves the reservation to the next epoch, for another prefill node or (`local`) for the
    /// decode node itself, counted under `reason`.
    async fn reprefill(
        &mut self,
        call: &DecodeCall,
        local: bool,
        reason: &'static str,
    ) -> Result<(), Served> {
        self.epoch += 1;
        // The next prefill node is chosen now, so that the reservation is bound to it from
        // the moment it moves to the new epoch: a node of an older epoch, which knows the
        // transfer id, cannot race it to the first frame.
        self.next_prefill = None;
        self.bound.clear();
        if !local {
            if let Ok(node) = self.choose_prefill(call) {
                self.bound = kv_identity(&node);
                self.next_prefill = Some(node);
            }
        }
        let msg = v1::GenerateUp {
            msg: Some(generate_up::Msg::Reprefill(v1::Reprefill {
                epoch: self.epoch,
                local_prefill: local,
                prefill: self.bound.clone(),
            })),
        };
        self.send_up(call, msg).await?;
        if local {
            metrics::counter!("fission_gateway_route_total", "mode" => "colocated", "reason" => reason)
                .increment(1);
        }
        Ok(())
    }

    /// Counts a failed prefill attempt of `prefill` into `call`'s decode node against the pair.
    fn pair_failed(&self, prefill: &Node, call: &DecodeCall, why: &str) {
        self.pools
            .pairs()
            .failed(&prefill.entry.node_id, &call.node.entry.node_id, why);
    }
}

/// The next event of the prefill attempt in flight; pending when there is none.
async fn next_event(
    prefill: &mut Option<PrefillAttempt>,
) -> Result<Option<v1::PrefillEvent>, tonic::Status> {
    match prefill {
        Some(p) => p.events.message().await,
        None => std::future::pending().await,
    }
}
