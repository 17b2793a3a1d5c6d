//! The engine thread and its cheap `Clone` handle. The engine is synchronous and owns the KV
//! cache; everything else talks to it through one FIFO command channel, which is what orders
//! a transfer's layer imports before the activation that reads them.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Instant;

use bytes::Bytes;
use engine::engine::{Engine, Request, TokenEvent};
use engine::error::EngineError;
use engine::ids::{BlockId, SeqId};
use engine::sampling::SampledToken;
use engine::stopping::FinishReason;
use telemetry::OpenTelemetrySpanExt;
use tokio::sync::{mpsc as tmpsc, oneshot};
use tracing::Span;

use node_common::engine_state::EngineState;
use node_common::NodeError;

/// Tokens of one sequence, or the error that ended it.
pub type TokenMsg = Result<TokenEvent, String>;
pub type TokenTx = tmpsc::UnboundedSender<TokenMsg>;

enum Command {
    Reserve {
        req: Request,
        reply: oneshot::Sender<Result<Vec<BlockId>, EngineError>>,
    },
    Import {
        seq_id: SeqId,
        layer: usize,
        blocks: Vec<BlockId>,
        payload: Bytes,
    },
    Activate {
        seq_id: SeqId,
        first: SampledToken,
        tokens: TokenTx,
        reply: oneshot::Sender<Result<Option<FinishReason>, EngineError>>,
        span: Span,
    },
    Generate {
        req: Request,
        tokens: TokenTx,
        reply: oneshot::Sender<Result<(), EngineError>>,
        span: Span,
    },
    Cancel {
        seq_id: SeqId,
    },
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

impl EngineHandle {
    /// Starts the engine thread. It ends when every handle is dropped.
    pub fn spawn(engine: Engine, state: EngineState) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("decode-engine".into())
            .spawn(move || run_engine_task(engine, state, rx))
            .expect("spawning the engine thread");
        EngineHandle { tx }
    }

    fn send(&self, c: Command) -> Result<(), NodeError> {
        self.tx.send(c).map_err(|_| NodeError::EngineStopped)
    }

    pub async fn reserve(&self, req: Request) -> Result<Vec<BlockId>, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Reserve { req, reply })?;
        Ok(rx.await.map_err(|_| NodeError::EngineStopped)??)
    }

    /// Queues one received layer for import; the engine thread drops it if the reservation
    /// is gone by then (cancelled or expired), so freed blocks are never written.
    pub fn import(
        &self,
        seq_id: SeqId,
        layer: usize,
        blocks: Vec<BlockId>,
        payload: Bytes,
    ) -> Result<(), NodeError> {
        self.send(Command::Import {
            seq_id,
            layer,
            blocks,
            payload,
        })
    }

    /// `trace` is the context of the request that reserved the sequence (the gateway's), so
    /// the `decode` span joins its trace rather than the prefill node's Done call.
    pub async fn activate(
        &self,
        seq_id: SeqId,
        first: SampledToken,
        tokens: TokenTx,
        trace: telemetry::Context,
    ) -> Result<Option<FinishReason>, NodeError> {
        let span = decode_span();
        telemetry::set_parent(&span, trace);
        let (reply, rx) = oneshot::channel();
        self.send(Command::Activate {
            seq_id,
            first,
            tokens,
            reply,
            span,
        })?;
        Ok(rx.await.map_err(|_| NodeError::EngineStopped)??)
    }

    pub async fn generate(&self, req: Request, tokens: TokenTx) -> Result<(), NodeError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Generate {
            req,
            tokens,
            reply,
            span: decode_span(),
        })?;
        Ok(rx.await.map_err(|_| NodeError::EngineStopped)??)
    }

    /// Cancels a sequence or reservation; unknown ids are ignored.
    pub fn cancel(&self, seq_id: SeqId) {
        let _ = self.send(Command::Cancel { seq_id });
    }
}

/// The `decode` span of a sequence, a child of the caller's span: tokens and steps are recorded
/// on it, with no span per token.
fn decode_span() -> Span {
    tracing::info_span!(
        "decode",
        tokens = tracing::field::Empty,
        steps = tracing::field::Empty,
        finish_reason = tracing::field::Empty,
    )
}

/// A running sequence's spans.
struct SeqSpans {
    span: Span,
    /// Open from admission until the first step that includes the sequence.
    queue_wait: Option<Span>,
    steps: i64,
    tokens: i64,
    admitted: Instant,
}

impl SeqSpans {
    fn new(span: Span) -> Self {
        let queue_wait = Some(tracing::info_span!(parent: &span, "queue_wait"));
        SeqSpans {
            span,
            queue_wait,
            steps: 0,
            tokens: 0,
            admitted: Instant::now(),
        }
    }
}

/// The span of the current batch composition.
struct BatchSpan {
    span: Span,
    members: Vec<SeqId>,
    steps: i64,
}

struct Task {
    engine: Engine,
    streams: HashMap<SeqId, TokenTx>,
    spans: HashMap<SeqId, SeqSpans>,
    batch: Option<BatchSpan>,
    /// Sequences with a failed layer import: their activation must fail.
    poisoned: HashMap<SeqId, String>,
}

fn run_engine_task(mut engine: Engine, state: EngineState, rx: mpsc::Receiver<Command>) {
    engine.enable_cache_events();
    // The idle engine's figures, before the loop blocks waiting for work: routers read free
    // blocks from this, and a node that reported none would never be picked.
    state.publish(&mut engine, 0);
    // Test-only: slows every step so tests can act mid-generation on a tiny model.
    let step_delay = std::env::var("FISSION_DEBUG_STEP_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(std::time::Duration::from_millis);
    let mut t = Task {
        engine,
        streams: HashMap::new(),
        spans: HashMap::new(),
        batch: None,
        poisoned: HashMap::new(),
    };
    loop {
        // Block only when there is nothing to compute.
        let first = if t.engine.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        if let Some(c) = first {
            t.handle(c);
            while let Ok(c) = rx.try_recv() {
                t.handle(c);
            }
        }
        if t.engine.has_work() {
            t.step();
            if let Some(d) = step_delay {
                std::thread::sleep(d);
            }
        }
        t.publish_gauges();
        state.publish(&mut t.engine, 0);
    }
}

impl Task {
    fn handle(&mut self, c: Command) {
        match c {
            Command::Reserve { req, reply } => {
                let _ = reply.send(self.engine.reserve(req));
            }
            Command::Import {
                seq_id,
                layer,
                blocks,
                payload,
            } => {
                if !self.engine.is_reserved(seq_id) {
                    metrics::counter!("fission_decode_kv_late_imports_total").increment(1);
                    return;
                }
                let started = Instant::now();
                match self
                    .engine
                    .cache_mut()
                    .import_blocks(layer, &blocks, &payload)
                {
                    Ok(()) => {
                        metrics::counter!("fission_decode_kv_received_bytes_total")
                            .increment(payload.len() as u64);
                        metrics::histogram!("fission_decode_kv_import_seconds")
                            .record(started.elapsed().as_secs_f64());
                    }
                    Err(e) => {
                        tracing::error!(%seq_id, layer, error = %e, "kv import failed");
                        self.poisoned.insert(seq_id, e.to_string());
                    }
                }
            }
            Command::Activate {
                seq_id,
                first,
                tokens,
                reply,
                span,
            } => {
                if let Some(reason) = self.poisoned.remove(&seq_id) {
                    self.engine.release_reservation(seq_id);
                    let _ = reply.send(Err(EngineError::InvalidParameter {
                        field: "kv",
                        reason: format!("a layer import failed: {reason}"),
                        given: seq_id.to_string(),
                    }));
                    return;
                }
                let result = self.engine.activate(seq_id, first);
                if let Ok(None) = result {
                    self.streams.insert(seq_id, tokens);
                    self.spans.insert(seq_id, SeqSpans::new(span));
                }
                let _ = reply.send(result);
            }
            Command::Generate {
                req,
                tokens,
                reply,
                span,
            } => {
                let seq_id = req.seq_id;
                let result = self.engine.add_request(req);
                if result.is_ok() {
                    self.streams.insert(seq_id, tokens);
                    self.spans.insert(seq_id, SeqSpans::new(span));
                }
                let _ = reply.send(result);
            }
            Command::Cancel { seq_id } => {
                self.poisoned.remove(&seq_id);
                if self.engine.cancel(seq_id) {
                    metrics::counter!("fission_decode_cancelled_total").increment(1);
                }
                self.streams.remove(&seq_id);
                self.spans.remove(&seq_id);
            }
        }
    }

    fn step(&mut self) {
        let started = Instant::now();
        // One span per batch composition, linked to the sequences in it (a root: a batch
        // belongs to no single trace). A new one starts when a sequence joins or leaves; a span
        // per step would cost more than a small model's step.
        let members: Vec<SeqId> = {
            let mut m: Vec<SeqId> = self.spans.keys().copied().collect();
            m.sort_unstable();
            m
        };
        if self.batch.as_ref().is_none_or(|b| b.members != members) {
            let span = tracing::info_span!(
                parent: None,
                "decode_batch",
                sequences = members.len() as i64,
                steps = tracing::field::Empty
            );
            for s in self.spans.values() {
                telemetry::add_link(&span, &s.span.context());
            }
            // The previous batch span ends here.
            self.batch = Some(BatchSpan {
                span,
                members,
                steps: 0,
            });
        }
        for s in self.spans.values_mut() {
            if s.queue_wait.take().is_some() {
                metrics::histogram!("fission_decode_queue_time_seconds")
                    .record(s.admitted.elapsed().as_secs_f64());
            }
            s.steps += 1;
        }
        let batch = self.batch.as_mut().map(|b| {
            b.steps += 1;
            b.span.record("steps", b.steps);
            b.span.clone()
        });
        let batch = batch.unwrap_or_else(tracing::Span::none);
        let _in_batch = batch.enter();
        match self.engine.step() {
            Ok(events) => {
                metrics::histogram!("fission_decode_step_seconds")
                    .record(started.elapsed().as_secs_f64());
                metrics::histogram!("fission_decode_batch_size").record(events.len() as f64);
                metrics::counter!("fission_decode_generated_tokens_total")
                    .increment(events.len() as u64);
                for ev in events {
                    let seq_id = ev.seq_id;
                    let done = ev.finish.is_some();
                    let finish = ev.finish.clone();
                    if let Some(s) = self.spans.get_mut(&seq_id) {
                        s.tokens += 1;
                    }
                    let delivered = self
                        .streams
                        .get(&seq_id)
                        .is_some_and(|tx| tx.send(Ok(ev)).is_ok());
                    if done {
                        self.streams.remove(&seq_id);
                        if let Some(s) = self.spans.remove(&seq_id) {
                            s.span.record("tokens", s.tokens);
                            s.span.record("steps", s.steps);
                            if let Some(f) = &finish {
                                s.span.record("finish_reason", format!("{f:?}").as_str());
                            }
                        }
                    } else if !delivered {
                        // The receiver is gone: the client left. Free its blocks now.
                        self.engine.cancel(seq_id);
                        self.streams.remove(&seq_id);
                        self.spans.remove(&seq_id);
                        metrics::counter!("fission_decode_cancelled_total").increment(1);
                    }
                }
            }
            Err(e) => {
                // A failed step leaves no sequence in a usable state: end them all loudly.
                tracing::error!(error = %e, "decode step failed");
                self.spans.clear();
                for (seq_id, tx) in self.streams.drain() {
                    let _ = tx.send(Err(format!("decode step failed: {e}")));
                    self.engine.cancel(seq_id);
                }
            }
        }
    }

    fn publish_gauges(&self) {
        let s = self.engine.stats();
        metrics::gauge!("fission_decode_kv_blocks_capacity").set(s.num_blocks_total as f64);
        metrics::gauge!("fission_decode_kv_blocks_used")
            .set((s.num_blocks_used - self.engine.num_reserved_blocks()) as f64);
        metrics::gauge!("fission_decode_kv_blocks_reserved")
            .set(self.engine.num_reserved_blocks() as f64);
        metrics::gauge!("fission_decode_reservations_outstanding")
            .set(self.engine.num_reservations() as f64);
        metrics::gauge!("fission_decode_kv_usage_ratio")
            .set(s.num_blocks_used as f64 / s.num_blocks_total.max(1) as f64);
        metrics::gauge!("fission_decode_running_sequences").set(s.num_running as f64);
        metrics::gauge!("fission_decode_waiting_sequences").set(s.num_waiting as f64);
        metrics::counter!("fission_decode_preemptions_total").absolute(s.preemptions);
        metrics::gauge!("fission_decode_prefix_cache_hit_ratio")
            .set(s.prefix_hit_blocks as f64 / s.prefix_query_blocks.max(1) as f64);
    }
}
