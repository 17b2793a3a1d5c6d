//! The real [`Backend`]: routes each request to a decode node (and, unless it is short or no
//! prefill node is up, a prefill node) and streams the tokens back.
//!
//! Disaggregated flow: Reserve on a decode node → open its token Stream → Prefill on a prefill
//! node with the reserved blocks as destination. The prefill response carries the first token
//! (so TTFT does not wait for the KV transfer tail); the rest comes from the decode stream.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use proto::v1::{self, reserve_response};
use proto::ErrorCode;
use tracing::Instrument;

use super::discovery::Role;
use super::pool::{InFlight, Node, Pools};
use super::routing::{Candidate, RoutingPolicy};
use crate::backend::Backend;
use crate::error::GatewayError;
use crate::request::{FinishReason, GeneratedToken, TokenStream, ValidRequest};

#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Prompts shorter than this are prefilled on the decode node itself.
    pub max_local_prefill_tokens: usize,
}

pub struct ClusterBackend {
    pools: Arc<Pools>,
    config: ClusterConfig,
    policy: Arc<dyn RoutingPolicy>,
}

impl ClusterBackend {
    pub fn new(pools: Arc<Pools>, config: ClusterConfig, policy: Box<dyn RoutingPolicy>) -> Self {
        ClusterBackend {
            pools,
            config,
            policy: Arc::from(policy),
        }
    }
}

impl Backend for ClusterBackend {
    fn generate(
        &self,
        request: ValidRequest,
    ) -> BoxFuture<'static, Result<TokenStream, GatewayError>> {
        let pools = Arc::clone(&self.pools);
        let config = self.config.clone();
        let policy = Arc::clone(&self.policy);
        let span = tracing::info_span!(
            "route",
            policy = policy.name(),
            mode = tracing::field::Empty,
            decode_node = tracing::field::Empty,
            prefill_node = tracing::field::Empty,
            decode_reason = tracing::field::Empty,
            prefill_reason = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        Box::pin(
            async move { route(&pools, &config, policy.as_ref(), request).await }.instrument(span),
        )
    }

    fn is_ready(&self) -> bool {
        !self.pools.ready(Role::Decode).is_empty()
    }

    fn describe(&self) -> serde_json::Value {
        let nodes: Vec<serde_json::Value> = self
            .pools
            .all()
            .iter()
            .map(|n| {
                serde_json::json!({
                    "node_id": n.entry.node_id,
                    "role": n.entry.role.as_str(),
                    "endpoint": n.entry.grpc_endpoint,
                    "ready": n.is_ready(),
                    "draining": n.entry.draining,
                    "registered": n.entry.registered,
                    "in_flight": n.in_flight(),
                    "cached_blocks": self.pools.cached_blocks(n),
                    "load": self.pools.load(n).map(|l| serde_json::json!({
                        "free_blocks": l.free_blocks,
                        "queued_prefill_tokens": l.queued_prefill_tokens,
                        "running_sequences": l.running_sequences,
                    })),
                })
            })
            .collect();
        serde_json::json!({
            "kind": "cluster",
            "max_local_prefill_tokens": self.config.max_local_prefill_tokens,
            "routing": self.policy.name(),
            "nodes": nodes,
        })
    }
}

fn upstream(s: tonic::Status) -> GatewayError {
    GatewayError::backend(ErrorCode::from_grpc(s.code()), s.message().to_string())
}

fn sampling(r: &ValidRequest) -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: r.sampling.temperature,
        top_k: r.sampling.top_k as u32,
        top_p: r.sampling.top_p,
        repetition_penalty: r.sampling.repetition_penalty,
        seed: r.sampling.seed,
        top_n_logprobs: r.sampling.top_n_logprobs as u32,
    }
}

fn stopping(r: &ValidRequest) -> v1::StoppingCriteria {
    v1::StoppingCriteria {
        max_new_tokens: r.stopping.max_new_tokens as u32,
        stop_token_ids: r.stopping.stop_token_ids.clone(),
        stop_strings: r.stopping.stop_strings.clone(),
        ignore_eos: r.stopping.ignore_eos,
    }
}

fn generated(t: v1::Token) -> GeneratedToken {
    GeneratedToken {
        id: t.token_id,
        text: t.text,
        logprob: t.logprob,
        top_logprobs: t
            .top_logprobs
            .iter()
            .map(|x| (x.token_id, x.logprob))
            .collect(),
        special: t.special,
        index: t.index as usize,
        finish_reason: match t.finish_reason.as_str() {
            "length" => Some(FinishReason::Length),
            "eos" => Some(FinishReason::Eos),
            "stop" => Some(FinishReason::Stop),
            _ => None,
        },
    }
}

/// Ready nodes of one role in the order the policy ranks them, and why.
struct Ranked {
    nodes: Vec<Arc<Node>>,
    reason: String,
}

fn rank(
    pools: &Pools,
    policy: &dyn RoutingPolicy,
    role: Role,
    prompt_ids: &[u32],
    block_size: usize,
    hashes: &[u64],
) -> Ranked {
    let nodes = pools.ready(role);
    let candidates: Vec<Candidate> = nodes
        .iter()
        .map(|n| {
            let load = pools.load(n);
            let total = n.total_blocks();
            Candidate {
                node_id: n.entry.node_id.clone(),
                // Without published load (static clusters) a node counts as empty: in-flight
                // counts still spread the work.
                free_blocks: load.map_or(total, |l| l.free_blocks),
                total_blocks: total,
                running_sequences: load.map_or(0, |l| l.running_sequences),
                queued_prefill_tokens: load.map_or(0, |l| l.queued_prefill_tokens),
                in_flight: n.in_flight() as u64,
                cached_prefix_blocks: pools.overlap_blocks(n, hashes),
            }
        })
        .collect();
    let ranking = match role {
        Role::Decode => policy.rank_decode(prompt_ids.len(), block_size, &candidates),
        Role::Prefill => policy.rank_prefill(prompt_ids.len(), block_size, &candidates),
    };
    Ranked {
        nodes: ranking
            .order
            .iter()
            .map(|&i| Arc::clone(&nodes[i]))
            .collect(),
        reason: ranking.reason,
    }
}

async fn route(
    pools: &Pools,
    config: &ClusterConfig,
    policy: &dyn RoutingPolicy,
    r: ValidRequest,
) -> Result<TokenStream, GatewayError> {
    let ready = pools.ready(Role::Decode);
    let Some(first) = ready.first() else {
        return Err(GatewayError::Unavailable {
            reason: "no decode node is ready".into(),
        });
    };
    let block_size = first.block_size();
    let hashes = prefix_hash::block_hashes(&r.prompt_ids, block_size);
    let decodes = rank(
        pools,
        policy,
        Role::Decode,
        &r.prompt_ids,
        block_size,
        &hashes,
    );
    let prefills = rank(
        pools,
        policy,
        Role::Prefill,
        &r.prompt_ids,
        block_size,
        &hashes,
    );
    let short = r.prompt_ids.len() < config.max_local_prefill_tokens;
    if prefills.nodes.is_empty() || short {
        let why = if short {
            "short_prompt"
        } else {
            "no_prefill_node"
        };
        metrics::counter!("fission_gateway_route_total", "mode" => "colocated", "reason" => why)
            .increment(1);
        let span = tracing::Span::current();
        span.record("mode", "colocated");
        span.record("prefill_reason", why);
        span.record("decode_reason", decodes.reason.as_str());
        tracing::debug!(request_id = %r.request_id, mode = "colocated", reason = why, decode_reason = %decodes.reason, "route");
        return colocated(&decodes.nodes, &r).await;
    }
    metrics::counter!("fission_gateway_route_total", "mode" => "disaggregated", "reason" => "default").increment(1);
    let span = tracing::Span::current();
    span.record("mode", "disaggregated");
    span.record("decode_reason", decodes.reason.as_str());
    span.record("prefill_reason", prefills.reason.as_str());
    tracing::debug!(
        request_id = %r.request_id,
        mode = "disaggregated",
        policy = policy.name(),
        decode_reason = %decodes.reason,
        prefill_reason = %prefills.reason,
        "route"
    );
    // A prefill node that fails before answering (killed, restarting, draining) costs a retry
    // on the next one, with a fresh reservation: the failed push may have written part of the
    // old.
    for (attempt, prefill) in prefills.nodes.iter().take(MAX_PREFILL_ATTEMPTS).enumerate() {
        span.record("attempts", attempt as i64 + 1);
        match disaggregated(&decodes.nodes, prefill, &r).await {
            Ok(stream) => return Ok(stream),
            Err(Attempt::Retry(e)) => {
                prefill.quarantine();
                metrics::counter!("fission_gateway_prefill_retries_total").increment(1);
                tracing::info!(
                    request_id = %r.request_id,
                    attempt = attempt as i64 + 1,
                    prefill_node = %prefill.entry.node_id,
                    error = %e,
                    "prefill attempt failed; trying the next prefill node"
                );
            }
            Err(Attempt::Fail(e)) => return Err(e),
        }
    }
    // Every prefill node tried has failed (a pool that just lost its only node, say): the
    // decode node can still prefill the prompt itself, which beats failing the request.
    metrics::counter!("fission_gateway_route_total", "mode" => "colocated", "reason" => "prefill_failed")
        .increment(1);
    span.record("mode", "colocated");
    span.record("prefill_reason", "prefill_failed");
    tracing::info!(request_id = %r.request_id, "no prefill node answered; prefilling on the decode node");
    colocated(&decodes.nodes, &r).await
}

/// Prefill nodes tried for one request before giving up.
const MAX_PREFILL_ATTEMPTS: usize = 3;

/// The outcome of one disaggregated attempt that did not produce a stream.
enum Attempt {
    /// The prefill node failed as a dead or unreachable node does: try another.
    Retry(GatewayError),
    Fail(GatewayError),
}

/// Codes a dead or restarting node produces; the request itself was fine.
fn node_failed(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

async fn colocated(decodes: &[Arc<Node>], r: &ValidRequest) -> Result<TokenStream, GatewayError> {
    let mut last = None;
    for node in decodes {
        let in_flight = InFlight::new(node);
        tracing::Span::current().record("decode_node", node.entry.node_id.as_str());
        let call = node
            .decode_client()
            .local_generate(telemetry::with_trace(v1::LocalGenerateRequest {
                request_id: r.request_id.to_string(),
                prompt_ids: r.prompt_ids.clone(),
                sampling: Some(sampling(r)),
                stopping: Some(stopping(r)),
            }))
            .await;
        match call {
            Ok(stream) => {
                let inner = stream
                    .into_inner()
                    .map(|t| t.map(generated).map_err(upstream));
                return Ok(Box::pin(Guarded {
                    inner: Box::pin(inner),
                    cancel: None,
                    finished: false,
                    _in_flight: vec![in_flight],
                }));
            }
            Err(s) if s.code() == tonic::Code::ResourceExhausted => last = Some(s),
            Err(s) if node_failed(&s) => {
                node.quarantine();
                last = Some(s)
            }
            Err(s) => return Err(upstream(s)),
        }
    }
    Err(last.map(upstream).unwrap_or(GatewayError::Unavailable {
        reason: "no decode node accepted the request".into(),
    }))
}

async fn disaggregated(
    decodes: &[Arc<Node>],
    prefill: &Arc<Node>,
    r: &ValidRequest,
) -> Result<TokenStream, Attempt> {
    // 1. Reserve blocks on the best-ranked decode node that has room, and 2. open its token
    // stream before the KV can arrive, so no token is missed. A node that fails either call as
    // a dead or draining node does is skipped for the next one.
    let mut reserved = None;
    for node in decodes {
        let resp = node
            .decode_client()
            .reserve(telemetry::with_trace(v1::ReserveRequest {
                request_id: r.request_id.to_string(),
                prompt_ids: r.prompt_ids.clone(),
                sampling: Some(sampling(r)),
                stopping: Some(stopping(r)),
            }))
            .await;
        let res = match resp.map(|x| x.into_inner().result) {
            Ok(Some(reserve_response::Result::Reserved(res))) => res,
            Ok(Some(reserve_response::Result::Busy(why))) => {
                tracing::debug!(node_id = %node.entry.node_id, %why, "decode node busy");
                continue;
            }
            Ok(None) => {
                return Err(Attempt::Fail(GatewayError::backend(
                    ErrorCode::Internal,
                    "empty reserve response",
                )))
            }
            Err(s) if node_failed(&s) => {
                decode_failed(node, "reserve", &s);
                continue;
            }
            Err(s) => return Err(Attempt::Fail(upstream(s))),
        };
        let cancel = RemoteCancel::new(Arc::clone(node), res.xfer_id);
        match node
            .decode_client()
            .stream(telemetry::with_trace(v1::StreamRequest {
                xfer_id: res.xfer_id,
            }))
            .await
        {
            Ok(tokens) => {
                reserved = Some((Arc::clone(node), res, cancel, tokens.into_inner()));
                break;
            }
            Err(s) if node_failed(&s) => {
                cancel.fire();
                decode_failed(node, "stream", &s);
            }
            Err(s) => {
                cancel.fire();
                return Err(Attempt::Fail(upstream(s)));
            }
        }
    }
    let Some((decode, res, cancel, tokens)) = reserved else {
        metrics::counter!("fission_gateway_no_capacity_total").increment(1);
        return Err(Attempt::Fail(GatewayError::backend(
            ErrorCode::Overloaded,
            "every decode node is out of KV blocks",
        )));
    };
    let decode_guard = InFlight::new(&decode);
    // 3. Prefill, pushing into the reserved blocks.
    let prefill_guard = InFlight::new(prefill);
    // Watched from before the call: the node may die the moment it has answered.
    let lost = prefill.watch_lost();
    let span = tracing::Span::current();
    span.record("decode_node", decode.entry.node_id.as_str());
    span.record("prefill_node", prefill.entry.node_id.as_str());
    tracing::debug!(
        request_id = %r.request_id,
        decode = %decode.entry.node_id,
        prefill = %prefill.entry.node_id,
        xfer_id = res.xfer_id,
        "route"
    );
    let resp = prefill
        .prefill_client()
        .prefill(telemetry::with_trace(v1::PrefillRequest {
            request_id: r.request_id.to_string(),
            prompt_ids: r.prompt_ids.clone(),
            sampling: Some(sampling(r)),
            stopping: Some(stopping(r)),
            dest: Some(v1::KvDestination {
                kv_endpoint: res.kv_endpoint.clone(),
                xfer_id: res.xfer_id,
                epoch: res.epoch,
                block_ids: res.block_ids.clone(),
                decode_endpoint: decode.entry.grpc_endpoint.clone(),
                layout: res.layout.clone(),
            }),
        }))
        .await;
    drop(prefill_guard);
    let first = match resp {
        Ok(p) => p.into_inner().first_token.map(generated),
        Err(s) => {
            cancel.fire();
            return Err(if node_failed(&s) {
                Attempt::Retry(upstream(s))
            } else {
                Attempt::Fail(upstream(s))
            });
        }
    };
    let Some(first) = first else {
        cancel.fire();
        return Err(Attempt::Fail(GatewayError::backend(
            ErrorCode::Internal,
            "prefill returned no first token",
        )));
    };
    let rest = tokens.map(|t| t.map(generated).map_err(upstream));
    let finished_at_first = first.finish_reason.is_some();
    let inner: TokenStream = if finished_at_first {
        // The decode node frees its blocks when it sees the first token end the request.
        cancel.fire();
        Box::pin(futures::stream::once(async move { Ok(first) }))
    } else {
        let resume = Resume {
            decodes: decodes.to_vec(),
            request: r.clone(),
            first_id: first.id,
            cancel: cancel.clone(),
            prefill_node: prefill.entry.node_id.clone(),
        };
        let rest = watch_push(Box::pin(rest), lost, resume);
        Box::pin(futures::stream::once(async move { Ok(first) }).chain(rest))
    };
    Ok(Box::pin(Guarded {
        inner,
        cancel: (!finished_at_first).then_some(cancel),
        finished: finished_at_first,
        _in_flight: vec![decode_guard],
    }))
}

/// A decode node failed a call as a dead or draining node does: skip it for a while.
fn decode_failed(node: &Node, call: &str, s: &tonic::Status) {
    tracing::info!(node_id = %node.entry.node_id, call, code = ?s.code(), message = s.message(), "decode node failed a call; trying the next one");
    node.quarantine();
}

/// The decode stream after the first token, watched until its first item arrives. Until then
/// the decode node is waiting for KV that the prefill node pushes after it has answered; if the
/// prefill node dies in that window (its connection breaks), the push will never finish, and
/// the decode node would only give up when the reservation's lease runs out. So the request is
/// resumed instead: see [`Resume`].
fn watch_push(
    mut rest: TokenStream,
    mut lost: tokio::sync::watch::Receiver<u64>,
    resume: Resume,
) -> TokenStream {
    let continuation = async move {
        let mut watching = true;
        let head = loop {
            tokio::select! {
                biased;
                item = rest.next() => break Some(item),
                changed = lost.changed(), if watching => match changed {
                    Ok(()) => break None,
                    // The node left the pool cleanly; nothing more to watch.
                    Err(_) => watching = false,
                },
            }
        };
        match head {
            Some(item) => Box::pin(futures::stream::iter(item).chain(rest)) as TokenStream,
            None => resume.run().await,
        }
    }
    .instrument(tracing::Span::current());
    Box::pin(futures::stream::once(continuation).flatten())
}

/// What it takes to resume a request whose prefill node died before its KV push finished:
/// generate the rest on a decode node with the prompt plus the first token as the prompt.
/// Positions are unchanged, and a request's random draws depend only on its seed and the
/// position, so the tokens are those the interrupted run would have produced.
struct Resume {
    decodes: Vec<Arc<Node>>,
    request: ValidRequest,
    first_id: u32,
    /// The interrupted reservation, released first.
    cancel: RemoteCancel,
    prefill_node: String,
}

impl Resume {
    async fn run(self) -> TokenStream {
        self.cancel.fire();
        metrics::counter!("fission_gateway_resumed_total", "reason" => "prefill_lost").increment(1);
        tracing::warn!(
            request_id = %self.request.request_id,
            prefill_node = %self.prefill_node,
            "prefill node lost before its KV push finished; resuming on a decode node"
        );
        let mut r = self.request;
        r.prompt_ids.push(self.first_id);
        r.stopping.max_new_tokens = r.stopping.max_new_tokens.saturating_sub(1);
        match colocated(&self.decodes, &r).await {
            Ok(stream) => Box::pin(stream.map(|t| {
                t.map(|mut t| {
                    t.index += 1;
                    t
                })
            })),
            Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
        }
    }
}

/// Cancels a reservation or sequence on a decode node, without waiting.
#[derive(Clone)]
struct RemoteCancel {
    node: Arc<Node>,
    xfer_id: u64,
    /// The request's span, so the cancel joins its trace even when it fires from a `Drop`.
    span: tracing::Span,
}

impl RemoteCancel {
    fn new(node: Arc<Node>, xfer_id: u64) -> Self {
        RemoteCancel {
            node,
            xfer_id,
            span: tracing::Span::current(),
        }
    }

    fn fire(&self) {
        let mut client = self.node.decode_client();
        let request = self.span.in_scope(|| {
            telemetry::with_trace(v1::CancelRequest {
                request_id: String::new(),
                xfer_id: self.xfer_id,
            })
        });
        tokio::spawn(async move {
            let _ = client.cancel(request).await;
        });
    }
}

/// Cancels upstream when the client drops the stream before its last token.
struct Guarded {
    inner: TokenStream,
    cancel: Option<RemoteCancel>,
    finished: bool,
    _in_flight: Vec<InFlight>,
}

impl Stream for Guarded {
    type Item = Result<GeneratedToken, GatewayError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(t))) if t.finish_reason.is_some() => self.finished = true,
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => self.finished = true,
            _ => {}
        }
        polled
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if !self.finished {
            if let Some(c) = &self.cancel {
                metrics::counter!("fission_gateway_client_cancelled_total").increment(1);
                c.fire();
            }
        }
    }
}
