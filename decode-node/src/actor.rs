//! The engine thread and its cheap `Clone` handle. The engine is synchronous and owns the KV
//! cache; everything else talks to it through one FIFO command channel, which is what orders
//! a transfer's layer imports before the activation that reads them.

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use engine::engine::{Engine, Request, TokenEvent};
use engine::error::EngineError;
use engine::ids::{BlockId, SeqId};
use engine::sampling::SampledToken;
use engine::stopping::FinishReason;
use kv_types::TransferId;
use kvtransfer::KvTransferError;
use proto::ErrorCode;
use tokio::sync::{mpsc as tmpsc, oneshot};
use tracing::Span;

use node_common::engine_state::EngineState;
use node_common::engine_thread::{self, Commands, EngineTask};
use node_common::failure::{mark_failed, Failure};
use node_common::NodeError;

use crate::metrics::ERRORS;
use crate::spans::{decode_span, BatchSpan, SeqSpans, StepTracker};

/// Tokens of one sequence, or the error that ended it.
pub type TokenMsg = Result<TokenEvent, Failure>;
pub type TokenTx = tmpsc::UnboundedSender<TokenMsg>;

enum Command {
    Reserve {
        req: Request,
        link: bool,
        reply: oneshot::Sender<Result<(Vec<BlockId>, usize), EngineError>>,
    },
    Import {
        xfer_id: TransferId,
        seq_id: SeqId,
        layer: usize,
        blocks: Vec<BlockId>,
        payload: Bytes,
    },
    Activate {
        seq_id: SeqId,
        first: SampledToken,
        tokens: TokenTx,
        reply: oneshot::Sender<Result<Option<FinishReason>, NodeError>>,
        span: Span,
    },
    Generate {
        req: Request,
        tokens: TokenTx,
        reply: oneshot::Sender<Result<(), NodeError>>,
        span: Span,
    },
    Cancel {
        seq_id: SeqId,
    },
}

#[derive(Clone)]
pub struct EngineHandle {
    commands: Commands<Command>,
}

impl EngineHandle {
    /// Starts the engine thread. It ends when every handle is dropped.
    pub fn spawn(engine: Engine, state: EngineState) -> Self {
        EngineHandle {
            commands: engine_thread::spawn("decode-engine", Task::new(engine, state)),
        }
    }

    /// Blocks for `req`'s prompt, and how many of the leading ones hold their KV already:
    /// with `link`, the prefix this node caches is linked in and only the rest is pushed
    /// ([`Engine::reserve_linking`]).
    pub async fn reserve(
        &self,
        req: Request,
        link: bool,
    ) -> Result<(Vec<BlockId>, usize), NodeError> {
        Ok(self
            .commands
            .call(|reply| Command::Reserve { req, link, reply })
            .await??)
    }

    /// Queues one received layer for import; the engine thread drops it if the reservation
    /// is gone by then (cancelled or expired), so freed blocks are never written.
    pub fn import(
        &self,
        xfer_id: TransferId,
        seq_id: SeqId,
        layer: usize,
        blocks: Vec<BlockId>,
        payload: Bytes,
    ) -> Result<(), NodeError> {
        self.commands.send(Command::Import {
            xfer_id,
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
        request_id: &str,
    ) -> Result<Option<FinishReason>, NodeError> {
        let span = decode_span(request_id);
        telemetry::set_parent(&span, trace);
        self.commands
            .call(|reply| Command::Activate {
                seq_id,
                first,
                tokens,
                reply,
                span,
            })
            .await?
    }

    pub async fn generate(
        &self,
        req: Request,
        tokens: TokenTx,
        request_id: &str,
    ) -> Result<(), NodeError> {
        let span = decode_span(request_id);
        self.commands
            .call(|reply| Command::Generate {
                req,
                tokens,
                reply,
                span,
            })
            .await?
    }

    /// Cancels a sequence or reservation; unknown ids are ignored.
    pub fn cancel(&self, seq_id: SeqId) {
        let _ = self.commands.send(Command::Cancel { seq_id });
    }
}

struct Task {
    engine: Engine,
    state: EngineState,
    streams: HashMap<SeqId, TokenTx>,
    spans: HashMap<SeqId, SeqSpans>,
    /// Open while the same sequences run; none while the engine is idle.
    batch: Option<BatchSpan>,
    /// Sequences with a failed layer import: their activation must fail.
    poisoned: HashMap<SeqId, KvTransferError>,
    /// Reservations by sequence, with the blocks each will hold at its longest (prompt plus
    /// `max_new_tokens`): admission counts them with the engine's sequences.
    committed: HashMap<SeqId, usize>,
}

/// `FISSION_DEBUG_STEP_DELAY_MS`: slows every step so tests can act mid-generation on a tiny
/// model. A test failpoint: only builds with the `failpoints` feature read it.
#[cfg(feature = "failpoints")]
fn step_delay() -> Option<std::time::Duration> {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("FISSION_DEBUG_STEP_DELAY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(std::time::Duration::from_millis)
    })
}

impl EngineTask for Task {
    type Command = Command;

    fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Reserve { req, link, reply } => {
                let _ = reply.send(self.reserve(req, link));
            }
            Command::Import {
                xfer_id,
                seq_id,
                layer,
                blocks,
                payload,
            } => self.import(xfer_id, seq_id, layer, &blocks, &payload),
            Command::Activate {
                seq_id,
                first,
                tokens,
                reply,
                span,
            } => {
                let result = self.activate(seq_id, first, &tokens, &span);
                if let Ok(None) = result {
                    self.streams.insert(seq_id, tokens);
                    // The first token (the prefill node's) is known now.
                    self.spans
                        .insert(seq_id, SeqSpans::new(span, Some(Instant::now())));
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
                let result = self.engine.add_request(req).map_err(NodeError::from);
                match &result {
                    Ok(()) => {
                        self.streams.insert(seq_id, tokens);
                        self.spans.insert(seq_id, SeqSpans::new(span, None));
                    }
                    Err(e) => mark_failed(&span, e.code()),
                }
                let _ = reply.send(result);
            }
            Command::Cancel { seq_id } => {
                // Not counted here: the session that sends Cancel counts a client that left
                // (it also cancels after failures and reprefills, which are no cancellation).
                self.poisoned.remove(&seq_id);
                self.engine.cancel(seq_id);
                self.streams.remove(&seq_id);
                if let Some(s) = self.spans.remove(&seq_id) {
                    s.end("cancelled");
                }
            }
        }
    }

    fn step(&mut self) {
        self.step_batch();
        #[cfg(feature = "failpoints")]
        if let Some(d) = step_delay() {
            std::thread::sleep(d);
        }
    }

    fn publish(&mut self) {
        self.publish_gauges();
        self.state.publish(&mut self.engine, 0);
    }

    /// Ends the batch span: it would otherwise stay open, idle, until the next batch starts.
    fn idle(&mut self) {
        self.batch = None;
    }
}

impl Task {
    fn new(mut engine: Engine, state: EngineState) -> Self {
        engine.enable_cache_events();
        Task {
            engine,
            state,
            streams: HashMap::new(),
            spans: HashMap::new(),
            batch: None,
            poisoned: HashMap::new(),
            committed: HashMap::new(),
        }
    }

    /// Reserves `req`'s prompt blocks only when the pool also holds every admitted request at
    /// its longest: a node that admitted by prompt alone ran out of blocks as its sequences
    /// grew and preempted them in a storm (594 preemptions for 200 requests on 128 blocks).
    /// `OutOfBlocks` (busy) keeps the request in the gateway's queue until room comes back.
    /// An idle node takes any request the engine takes.
    fn reserve(&mut self, req: Request, link: bool) -> Result<(Vec<BlockId>, usize), EngineError> {
        let seq_id = req.seq_id;
        let block_size = self.engine.scheduler().allocator().block_size().max(1);
        let need = (req.prompt_ids.len() + req.remaining_new_tokens()).div_ceil(block_size);
        // Reservations the engine no longer holds (activated, released) are no longer ours
        // to count: the engine's sequences count the activated ones.
        self.committed.retain(|id, _| self.engine.is_reserved(*id));
        let committed =
            self.engine.scheduler().num_committed_blocks() + self.committed.values().sum::<usize>();
        let total = self.engine.stats().num_blocks_total;
        if committed > 0 && committed + need > total {
            return Err(EngineError::OutOfBlocks {
                needed: need,
                free: total.saturating_sub(committed),
            });
        }
        let reserved = match link {
            true => self.engine.reserve_linking(req)?,
            false => (self.engine.reserve(req)?, 0),
        };
        self.committed.insert(seq_id, need);
        Ok(reserved)
    }

    fn import(
        &mut self,
        xfer_id: TransferId,
        seq_id: SeqId,
        layer: usize,
        blocks: &[BlockId],
        payload: &Bytes,
    ) {
        if !self.engine.is_reserved(seq_id) {
            metrics::counter!("fission_decode_kv_late_imports_total").increment(1);
            return;
        }
        let started = Instant::now();
        // `blocks` are the reservation's full-attention blocks; the engine maps a sliding
        // layer to its own group's blocks and keeps only its window's part of the payload.
        debug_assert!(self.engine.is_reserved(seq_id) && !blocks.is_empty());
        match self.engine.import_layer(seq_id, layer, payload) {
            Ok(()) => {
                metrics::counter!("fission_decode_kv_received_bytes_total")
                    .increment(payload.len() as u64);
                metrics::histogram!("fission_decode_kv_import_seconds")
                    .record(started.elapsed().as_secs_f64());
            }
            Err(e) => {
                // A received frame that failed, like one the data plane refuses.
                ERRORS.count(ErrorCode::KvTransfer);
                tracing::error!(%seq_id, layer, error = %e, "kv import failed");
                self.poisoned.insert(
                    seq_id,
                    KvTransferError::Sink {
                        xfer_id,
                        layer: layer as u32,
                        reason: e.to_string(),
                    },
                );
            }
        }
    }

    /// Joins a reservation whose KV arrived to the running batch. On failure the sequence's
    /// stream and span learn why.
    fn activate(
        &mut self,
        seq_id: SeqId,
        first: SampledToken,
        tokens: &TokenTx,
        span: &Span,
    ) -> Result<Option<FinishReason>, NodeError> {
        let result = match self.poisoned.remove(&seq_id) {
            Some(e) => {
                self.engine.release_reservation(seq_id);
                let e = NodeError::KvTransfer(e);
                let _ = tokens.send(Err(Failure::new(e.code(), e.to_string())));
                Err(e)
            }
            None => self.engine.activate(seq_id, first).map_err(NodeError::from),
        };
        if let Err(e) = &result {
            mark_failed(span, e.code());
        }
        result
    }

    fn step_batch(&mut self) {
        let started = Instant::now();
        let mut tracker = StepTracker {
            spans: &mut self.spans,
            batch: &mut self.batch,
            entered: None,
            started,
        };
        let result = self.engine.step_with_observer(&mut tracker);
        // In the batch span while its tokens are handed out.
        let _in_batch = tracker.entered.take();
        let now = Instant::now();
        match result {
            Ok(events) => {
                metrics::histogram!("fission_decode_step_seconds")
                    .record(now.duration_since(started).as_secs_f64());
                metrics::histogram!("fission_decode_batch_size").record(events.len() as f64);
                metrics::counter!("fission_decode_generated_tokens_total")
                    .increment(events.len() as u64);
                let tpot = metrics::histogram!("fission_decode_time_per_output_token_seconds");
                for ev in events {
                    let seq_id = ev.seq_id;
                    let finish = ev.finish;
                    if let Some(s) = self.spans.get_mut(&seq_id) {
                        s.tokens += 1;
                        if let Some(last) = s.last_token_at {
                            tpot.record(now.duration_since(last).as_secs_f64());
                        }
                        s.last_token_at = Some(now);
                    }
                    let delivered = self
                        .streams
                        .get(&seq_id)
                        .is_some_and(|tx| tx.send(Ok(ev)).is_ok());
                    if let Some(f) = finish {
                        self.streams.remove(&seq_id);
                        if let Some(s) = self.spans.remove(&seq_id) {
                            s.end(f.as_str());
                        }
                    } else if !delivered {
                        // The receiver is gone: its session ended (and counted a client
                        // that left). Free its blocks now.
                        self.engine.cancel(seq_id);
                        self.streams.remove(&seq_id);
                        if let Some(s) = self.spans.remove(&seq_id) {
                            s.end("cancelled");
                        }
                    }
                }
                self.end_failed();
            }
            Err(e) => {
                // A failed step leaves no sequence in a usable state: end them all loudly.
                // Each stream counts its error where it ends.
                tracing::error!(error = %e, "decode step failed");
                for (_, s) in self.spans.drain() {
                    mark_failed(&s.span, ErrorCode::Internal);
                    s.end("error");
                }
                for (seq_id, tx) in self.streams.drain() {
                    let _ = tx.send(Err(Failure::new(
                        ErrorCode::Internal,
                        format!("decode step failed: {e}"),
                    )));
                    self.engine.cancel(seq_id);
                }
            }
        }
    }

    /// Sequences the engine ended with an error (a grammar that failed): their streams end
    /// with it, rather than with a token or a finish reason that did not happen.
    fn end_failed(&mut self) {
        for (seq_id, e) in self.engine.take_failed() {
            let e = NodeError::from(e);
            if let Some(s) = self.spans.remove(&seq_id) {
                mark_failed(&s.span, e.code());
                s.end("error");
            }
            if let Some(tx) = self.streams.remove(&seq_id) {
                let _ = tx.send(Err(Failure::from(e)));
            }
        }
    }

    fn publish_gauges(&self) {
        let s = self.engine.stats();
        metrics::gauge!("fission_decode_kv_blocks_capacity").set(s.num_blocks_total as f64);
        metrics::gauge!("fission_decode_kv_blocks_used")
            .set((s.num_blocks_used - self.engine.num_reserved_blocks()) as f64);
        // The blocks above are the full-attention group's; this counts every layer group's,
        // the sliding windows' included (reservations too).
        metrics::gauge!("fission_decode_kv_bytes_in_use").set(self.engine.kv_bytes_in_use() as f64);
        metrics::gauge!("fission_decode_kv_blocks_reserved")
            .set(self.engine.num_reserved_blocks() as f64);
        metrics::gauge!("fission_decode_reservations_outstanding")
            .set(self.engine.num_reservations() as f64);
        metrics::gauge!("fission_decode_kv_usage_ratio")
            .set(s.num_blocks_used as f64 / s.num_blocks_total.max(1) as f64);
        metrics::gauge!("fission_decode_running_sequences").set(s.num_running as f64);
        metrics::gauge!("fission_decode_waiting_sequences").set(s.num_waiting as f64);
        metrics::counter!("fission_decode_preemptions_total").absolute(s.preemptions);
        // Lifetime counts, as counters: rate(hit) / rate(queried) is the recent hit rate.
        metrics::counter!("fission_decode_prefix_cache_hit_blocks_total")
            .absolute(s.prefix_hit_blocks);
        metrics::counter!("fission_decode_prefix_cache_queried_blocks_total")
            .absolute(s.prefix_query_blocks);
        metrics::gauge!("fission_decode_prefix_cache_hit_ratio")
            .set(s.prefix_hit_blocks as f64 / s.prefix_query_blocks.max(1) as f64);
    }
}

#[cfg(test)]
mod tests {
    use node_common::test_util::{local_recorder, stories_engine};
    use testkit::metrics::sample;
    use testkit::span_capture::{Captured, Value};

    use super::*;

    /// stories260K with blocks of 4 and a prefill budget of 8 tokens per step.
    fn task() -> Task {
        let engine = stories_engine(&testkit::shared_model("stories260K"));
        Task::new(engine, EngineState::new().0)
    }

    /// Queues a local generation of `max_new_tokens` after an 8-token prompt.
    fn generate(t: &mut Task, id: u64, max_new_tokens: u32) -> tmpsc::UnboundedReceiver<TokenMsg> {
        let (tokens, rx) = tmpsc::unbounded_channel();
        let (reply, mut done) = oneshot::channel();
        let stopping = proto::v1::StoppingCriteria {
            max_new_tokens,
            ignore_eos: true,
            ..Default::default()
        };
        let prompt_ids: Vec<u32> = (0..8).map(|i| 300 + i).collect();
        t.handle(Command::Generate {
            req: node_common::convert::request(
                SeqId(id),
                proto::v1::GenerationSpec {
                    prompt_ids,
                    stopping: Some(stopping),
                    ..Default::default()
                },
            ),
            tokens,
            reply,
            span: decode_span(&format!("req-{id}")),
        });
        done.try_recv().expect("answered").expect("admitted");
        rx
    }

    fn field(capture: &Captured, span: &str, field: &str) -> Vec<Option<Value>> {
        capture
            .named(span)
            .into_iter()
            .map(|(_, s)| s.field(field).cloned())
            .collect()
    }

    #[test]
    fn queue_time_and_steps_count_only_scheduled_sequences() {
        let mut t = task();
        let capture = Captured::default();
        let (recorder, metrics) = local_recorder();
        let _subscriber = capture.install();
        metrics::with_local_recorder(&recorder, || {
            let _first = generate(&mut t, 1, 3);
            let _second = generate(&mut t, 2, 3);
            // Two 8-token prompts, 8 prefill tokens per step: the second waits.
            t.step();
            assert_eq!(t.spans[&SeqId(1)].steps, 1);
            assert_eq!(t.spans[&SeqId(2)].steps, 0, "not in step 1's plan");
            assert!(t.spans[&SeqId(2)].queue_wait.is_some());
            assert_eq!(
                t.batch.as_ref().map(|b| b.members.clone()),
                Some(vec![SeqId(1)])
            );
            assert_eq!(
                sample(&metrics.render(), "fission_decode_queue_time_seconds_count"),
                1.0
            );
            t.step();
            assert_eq!((t.spans[&SeqId(1)].steps, t.spans[&SeqId(2)].steps), (2, 1));
            assert!(t.spans[&SeqId(2)].queue_wait.is_none());
            assert_eq!(
                t.batch.as_ref().map(|b| b.members.clone()),
                Some(vec![SeqId(1), SeqId(2)])
            );
            assert_eq!(
                sample(&metrics.render(), "fission_decode_queue_time_seconds_count"),
                2.0
            );
        });
        assert_eq!(
            field(&capture, "decode_batch", "sequences"),
            vec![Some(Value::I64(1)), Some(Value::I64(2))]
        );
        let queue_waits = capture.named("queue_wait");
        assert_eq!(queue_waits.len(), 2);
        assert!(queue_waits.iter().all(|(_, s)| s.closed));
    }

    #[test]
    fn tokens_time_and_idle_batch_span() {
        let mut t = task();
        let capture = Captured::default();
        let (recorder, metrics) = local_recorder();
        let _subscriber = capture.install();
        metrics::with_local_recorder(&recorder, || {
            let mut tokens = generate(&mut t, 1, 4);
            while t.engine.has_work() {
                t.step();
            }
            let mut n = 0;
            while let Ok(Ok(_)) = tokens.try_recv() {
                n += 1;
            }
            assert_eq!(n, 4);
            // Idle: the batch span is still held until the loop goes to wait for a command.
            assert!(t.batch.is_some());
            t.idle();
            assert!(t.batch.is_none(), "an idle engine holds no batch span");
            t.publish_gauges();
        });
        let batches = capture.named("decode_batch");
        assert_eq!(batches.len(), 1);
        assert!(batches[0].1.closed, "the idle batch span ended");
        let text = metrics.render();
        // Four tokens, the first one's time is time to first token: three gaps.
        assert_eq!(
            sample(&text, "fission_decode_time_per_output_token_seconds_count"),
            3.0,
            "{text}"
        );
        assert!(
            text.contains("# TYPE fission_decode_prefix_cache_hit_blocks_total counter"),
            "{text}"
        );
        assert_eq!(
            field(&capture, "decode", "finish_reason"),
            vec![Some(Value::Str("length".into()))]
        );
    }

    #[test]
    fn a_cancelled_sequence_records_what_it_did() {
        let mut t = task();
        let capture = Captured::default();
        let _subscriber = capture.install();
        let _tokens = generate(&mut t, 1, 10);
        t.step();
        t.step();
        t.handle(Command::Cancel { seq_id: SeqId(1) });
        let (_, decode) = capture.named("decode").remove(0);
        assert_eq!(
            decode.field("request_id"),
            Some(&Value::Str("req-1".into()))
        );
        assert_eq!(decode.field("tokens"), Some(&Value::I64(2)));
        assert_eq!(decode.field("steps"), Some(&Value::I64(2)));
        assert_eq!(
            decode.field("finish_reason"),
            Some(&Value::Str("cancelled".into()))
        );
        assert!(decode.closed);
    }

    #[test]
    fn a_failed_import_fails_activation_stream_and_span() {
        let mut t = task();
        let capture = Captured::default();
        let _subscriber = capture.install();
        let stopping = proto::v1::StoppingCriteria {
            max_new_tokens: 4,
            ..Default::default()
        };
        let req = node_common::convert::request(
            SeqId(5),
            proto::v1::GenerationSpec {
                prompt_ids: vec![300; 8],
                stopping: Some(stopping),
                ..Default::default()
            },
        );
        let blocks = t.engine.reserve(req).expect("reserved");
        // A payload of the wrong size cannot be imported.
        t.import(
            TransferId(5),
            SeqId(5),
            0,
            &blocks,
            &Bytes::from_static(b"short"),
        );
        let (tokens, mut tokens_rx) = tmpsc::unbounded_channel();
        let span = decode_span("req-5");
        let first = SampledToken {
            token_id: 310,
            logprob: 0.0,
            top_logprobs: Vec::new(),
        };
        let err = t
            .activate(SeqId(5), first, &tokens, &span)
            .expect_err("activation fails");
        assert_eq!(err.code(), ErrorCode::KvTransfer);
        let ended = tokens_rx.try_recv().expect("the stream learns why");
        assert_eq!(ended.expect_err("an error").code, ErrorCode::KvTransfer);
        drop(span);
        let (_, decode) = capture.named("decode").remove(0);
        assert_eq!(
            decode.field("error_type"),
            Some(&Value::Str("kv_transfer".into()))
        );
        assert_eq!(
            decode.field("otel.status_code"),
            Some(&Value::Str("ERROR".into()))
        );
        assert_eq!(t.engine.num_reservations(), 0, "its blocks are freed");
    }
}
