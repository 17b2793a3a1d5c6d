//! The engine thread of a prefill node. After each layer of a step in which a prompt
//! completes, it exports that layer's blocks and hands the bytes to the request's push task,
//! so the transfer of layer i overlaps the compute of layer i+1.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use engine::engine::{Engine, LayerDone, Request, ScheduledSeq, StepObserver, TokenEvent};
use engine::error::EngineError;
use engine::ids::SeqId;
use telemetry::OpenTelemetrySpanExt;
use tokio::sync::{mpsc as tmpsc, oneshot};
use tracing::Span;

use node_common::engine_state::EngineState;
use node_common::engine_thread::{self, Commands, EngineTask};
use node_common::NodeError;

/// One layer of one prompt, ready to send.
pub struct LayerPayload {
    pub layer: usize,
    /// Index of the first of the destination's blocks `bytes` covers: 0 for a full-attention
    /// layer, the window's first block for a sliding-window layer (issue 32).
    pub first_block: usize,
    pub bytes: Bytes,
    /// When this layer's compute finished.
    pub computed_at: Instant,
}

pub struct PrefillOutcome {
    pub first: TokenEvent,
    /// From the RPC's arrival to the first token: this node's time to first token.
    pub elapsed: Duration,
    /// From the first step that computed part of the prompt to the first token.
    pub compute: Duration,
}

/// When a prompt arrived and the spans it is traced under.
pub struct Arrival {
    /// When the RPC arrived: queue time and time to first token start here.
    pub at: Instant,
    /// The request's `prefill` span: chunks are recorded on it.
    pub span: Span,
    /// Opened at arrival; ends when a step first computes part of the prompt.
    pub queue_wait: Span,
}

// One Prefill per request moves through the channel once; boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    Prefill {
        req: Request,
        layers: Option<tmpsc::UnboundedSender<LayerPayload>>,
        push_from: usize,
        reply: oneshot::Sender<Result<PrefillOutcome, EngineError>>,
        arrival: Arrival,
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
    /// `push_after_prefill` holds each prompt's layers until its first token (a benchmark's
    /// baseline; see `PrefillConfig::push_after_prefill`).
    pub fn spawn(engine: Engine, state: EngineState, push_after_prefill: bool) -> Self {
        let task = PrefillTask::new(engine, state, push_after_prefill);
        EngineHandle {
            commands: engine_thread::spawn("prefill-engine", task),
        }
    }

    /// Computes `req`'s prompt; when `layers` is given, each finished layer's KV goes there,
    /// over the prompt's blocks from `push_from` on (the decode node holds the ones before in
    /// its prefix cache).
    pub async fn prefill(
        &self,
        req: Request,
        layers: Option<tmpsc::UnboundedSender<LayerPayload>>,
        push_from: usize,
        arrival: Arrival,
    ) -> Result<PrefillOutcome, NodeError> {
        Ok(self
            .commands
            .call(|reply| Command::Prefill {
                req,
                layers,
                push_from,
                reply,
                arrival,
            })
            .await??)
    }

    pub fn cancel(&self, seq_id: SeqId) {
        let _ = self.commands.send(Command::Cancel { seq_id });
    }
}

struct Pending {
    layers: Option<tmpsc::UnboundedSender<LayerPayload>>,
    /// The first prompt block pushed: the decode node links the ones before from its prefix
    /// cache.
    push_from: usize,
    reply: oneshot::Sender<Result<PrefillOutcome, EngineError>>,
    arrived: Instant,
    /// Set by the first step that computes part of this prompt.
    computing_since: Option<Instant>,
    prompt_tokens: u64,
    span: Span,
    /// Open from arrival until the first step that computes part of this prompt.
    queue_wait: Option<Span>,
    /// Steps that computed part of this prompt (its chunks).
    chunks: i64,
    /// Layers computed and not yet sent, with `push_after_prefill`: sent at the first token.
    held: Option<Vec<LayerPayload>>,
}

/// The prefill node's engine thread: prompts in, first tokens and layers out.
struct PrefillTask {
    engine: Engine,
    pending: HashMap<SeqId, Pending>,
    state: EngineState,
    push_after_prefill: bool,
}

impl EngineTask for PrefillTask {
    type Command = Command;

    fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Prefill {
                req,
                layers,
                push_from,
                reply,
                arrival,
            } => {
                let seq_id = req.seq_id;
                let prompt_tokens = req.prompt_ids.len() as u64;
                match self.engine.add_prefill_request(req) {
                    Ok(()) => {
                        self.pending.insert(
                            seq_id,
                            Pending {
                                layers,
                                push_from,
                                reply,
                                arrived: arrival.at,
                                computing_since: None,
                                prompt_tokens,
                                queue_wait: Some(arrival.queue_wait),
                                span: arrival.span,
                                chunks: 0,
                                held: self.push_after_prefill.then(Vec::new),
                            },
                        );
                    }
                    Err(e) => {
                        arrival.span.record("chunks", 0i64);
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Cancel { seq_id } => {
                if self.engine.cancel(seq_id) {
                    metrics::counter!("fission_prefill_cancelled_total").increment(1);
                }
                if let Some(p) = self.pending.remove(&seq_id) {
                    p.span.record("chunks", p.chunks);
                }
            }
        }
    }

    fn step(&mut self) {
        step(&mut self.engine, &mut self.pending);
    }

    fn publish(&mut self) {
        publish_gauges(&self.engine);
        // Tokens of prompts admitted and not yet answered: what a router weighs a node by.
        let queued: u64 = self.pending.values().map(|p| p.prompt_tokens).sum();
        metrics::gauge!("fission_prefill_queued_prefill_tokens").set(queued as f64);
        self.state.publish(&mut self.engine, queued);
    }
}

impl PrefillTask {
    fn new(mut engine: Engine, state: EngineState, push_after_prefill: bool) -> Self {
        engine.enable_cache_events();
        PrefillTask {
            engine,
            pending: HashMap::new(),
            state,
            push_after_prefill,
        }
    }
}

fn publish_gauges(engine: &Engine) {
    let s = engine.stats();
    metrics::gauge!("fission_prefill_kv_blocks_used").set(s.num_blocks_used as f64);
    // The blocks above are the full-attention group's; this counts every layer group's.
    metrics::gauge!("fission_prefill_kv_bytes_in_use").set(engine.kv_bytes_in_use() as f64);
    metrics::gauge!("fission_prefill_kv_blocks_capacity").set(s.num_blocks_total as f64);
    metrics::gauge!("fission_prefill_queued_sequences").set((s.num_waiting + s.num_running) as f64);
    // Lifetime counts, as counters: rate(hit) / rate(queried) is the recent hit rate.
    metrics::counter!("fission_prefill_prefix_cache_hit_blocks_total")
        .absolute(s.prefix_hit_blocks);
    metrics::counter!("fission_prefill_prefix_cache_queried_blocks_total")
        .absolute(s.prefix_query_blocks);
    metrics::gauge!("fission_prefill_prefix_cache_hit_ratio")
        .set(s.prefix_hit_blocks as f64 / s.prefix_query_blocks.max(1) as f64);
    metrics::gauge!("fission_prefill_kv_usage_ratio")
        .set(s.num_blocks_used as f64 / s.num_blocks_total.max(1) as f64);
}

/// Follows one step for the prompts in `pending`: only those the scheduler put in the step
/// end their queue wait and count a chunk (a tight token budget leaves others waiting).
struct StepTracker<'a> {
    pending: &'a mut HashMap<SeqId, Pending>,
    batch: &'a Span,
    started: Instant,
}

impl StepObserver for StepTracker<'_> {
    fn scheduled(&mut self, seqs: &[ScheduledSeq]) {
        self.batch.record("sequences", seqs.len() as i64);
        if seqs.is_empty() {
            return;
        }
        metrics::histogram!("fission_prefill_batch_size").record(seqs.len() as f64);
        let queue_time = metrics::histogram!("fission_prefill_queue_time_seconds");
        for s in seqs {
            let Some(p) = self.pending.get_mut(&s.seq_id) else {
                continue;
            };
            telemetry::add_link(self.batch, &p.span.context());
            if p.queue_wait.take().is_some() {
                queue_time.record(
                    self.started
                        .saturating_duration_since(p.arrived)
                        .as_secs_f64(),
                );
                p.computing_since = Some(self.started);
            }
            p.chunks += 1;
        }
    }

    fn layer_done(&mut self, done: LayerDone<'_>) -> engine::error::Result<()> {
        let now = Instant::now();
        for (index, (seq_id, _)) in done.completing.iter().enumerate() {
            let Some(p) = self.pending.get_mut(seq_id) else {
                continue;
            };
            let Some(tx) = &p.layers else {
                continue;
            };
            // A sliding-window layer exports only the blocks its window reads at the prompt's
            // end: what the decode node keeps.
            let (first_block, blocks) = done.pushed_blocks(index)?;
            // Without the blocks the decode node holds already (its prefix cache); the first
            // block counts among the destination's, which start there.
            let skip = p.push_from.saturating_sub(first_block).min(blocks.len());
            let (first_block, blocks) = (
                (first_block + skip).saturating_sub(p.push_from),
                &blocks[skip..],
            );
            let mut buf = BytesMut::zeroed(done.cache.export_len(blocks.len()));
            done.cache.export_blocks(done.layer, blocks, &mut buf)?;
            let payload = LayerPayload {
                layer: done.layer,
                first_block,
                bytes: buf.freeze(),
                computed_at: now,
            };
            match &mut p.held {
                Some(held) => held.push(payload),
                // A closed channel means the push was abandoned; the prompt still completes.
                None => {
                    let _ = tx.send(payload);
                }
            }
        }
        Ok(())
    }
}

fn step(engine: &mut Engine, pending: &mut HashMap<SeqId, Pending>) {
    let started = Instant::now();
    // One span per engine step, linked to every request it computes (a root: a batch belongs
    // to no single trace).
    let batch = tracing::info_span!(
        parent: None,
        "prefill_batch",
        sequences = tracing::field::Empty
    );
    let _in_batch = batch.enter();
    let result = engine.step_with_observer(&mut StepTracker {
        pending,
        batch: &batch,
        started,
    });
    metrics::histogram!("fission_prefill_step_seconds").record(started.elapsed().as_secs_f64());
    match result {
        Ok(events) => {
            for ev in events {
                if let Some(p) = pending.remove(&ev.seq_id) {
                    metrics::counter!("fission_prefill_prompts_total").increment(1);
                    if let (Some(held), Some(tx)) = (p.held, &p.layers) {
                        for payload in held {
                            let _ = tx.send(payload);
                        }
                    }
                    p.span.record("chunks", p.chunks);
                    let _ = p.reply.send(Ok(PrefillOutcome {
                        first: ev,
                        elapsed: p.arrived.elapsed(),
                        compute: p.computing_since.unwrap_or(started).elapsed(),
                    }));
                }
            }
            // A prompt whose first token the grammar could not admit fails, with no token.
            for (seq_id, e) in engine.take_failed() {
                if let Some(p) = pending.remove(&seq_id) {
                    p.span.record("chunks", p.chunks);
                    let _ = p.reply.send(Err(e));
                }
            }
        }
        Err(e) => {
            // Every prompt of the step fails; each is counted where its RPC answers.
            tracing::error!(error = %e, "prefill step failed");
            let ids: Vec<SeqId> = pending.keys().copied().collect();
            for seq_id in ids {
                engine.cancel(seq_id);
                if let Some(p) = pending.remove(&seq_id) {
                    p.span.record("chunks", p.chunks);
                    let _ = p.reply.send(Err(EngineError::InvalidConfig {
                        reason: format!("prefill step failed: {e}"),
                    }));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use node_common::test_util::{local_recorder, stories_engine};
    use testkit::metrics::sample;
    use testkit::span_capture::{Captured, Value};

    use super::*;

    fn task() -> PrefillTask {
        let engine = stories_engine(&testkit::shared_model("stories260K"));
        PrefillTask::new(engine, EngineState::new().0, false)
    }

    type Reply = oneshot::Receiver<Result<PrefillOutcome, EngineError>>;

    fn admit(t: &mut PrefillTask, id: u64, prompt: std::ops::Range<u32>) -> Reply {
        admit_at(t, id, prompt, Instant::now())
    }

    fn admit_at(
        t: &mut PrefillTask,
        id: u64,
        prompt: std::ops::Range<u32>,
        arrived: Instant,
    ) -> Reply {
        let (reply, rx) = oneshot::channel();
        let span = tracing::info_span!("prefill", chunks = tracing::field::Empty);
        let queue_wait = tracing::info_span!(parent: &span, "queue_wait");
        let prompt_ids: Vec<u32> = prompt.collect();
        let stopping = proto::v1::StoppingCriteria {
            max_new_tokens: 4,
            ..Default::default()
        };
        t.handle(Command::Prefill {
            req: node_common::convert::request(
                SeqId(id),
                proto::v1::GenerationSpec {
                    prompt_ids,
                    stopping: Some(stopping),
                    ..Default::default()
                },
            ),
            layers: None,
            push_from: 0,
            reply,
            arrival: Arrival {
                at: arrived,
                span,
                queue_wait,
            },
        });
        rx
    }

    #[test]
    fn queue_time_and_chunks_follow_the_scheduler_not_the_pending_set() {
        let mut t = task();
        let capture = Captured::default();
        let (recorder, metrics) = local_recorder();
        let _subscriber = capture.install();
        metrics::with_local_recorder(&recorder, || {
            // 12 + 8 prompt tokens, 8 per step: the second prompt waits for step 2.
            let mut first = admit(&mut t, 1, 100..112);
            let mut second = admit(&mut t, 2, 200..208);

            t.step();
            assert_eq!(t.pending[&SeqId(1)].chunks, 1);
            assert!(t.pending[&SeqId(1)].queue_wait.is_none());
            assert_eq!(t.pending[&SeqId(2)].chunks, 0, "not in step 1's plan");
            assert!(t.pending[&SeqId(2)].queue_wait.is_some());
            let text = metrics.render();
            assert_eq!(
                sample(&text, "fission_prefill_queue_time_seconds_count"),
                1.0
            );

            // Step 2: prompt 1's last 4 tokens and prompt 2's first 4.
            t.step();
            assert!(first.try_recv().expect("prompt 1 answered").is_ok());
            assert_eq!(t.pending[&SeqId(2)].chunks, 1);
            assert!(t.pending[&SeqId(2)].queue_wait.is_none());
            t.step();
            let outcome = second
                .try_recv()
                .expect("prompt 2 answered")
                .expect("prompt 2 computed");
            assert!(outcome.compute <= outcome.elapsed);
            assert!(t.pending.is_empty());

            let text = metrics.render();
            assert_eq!(
                sample(&text, "fission_prefill_queue_time_seconds_count"),
                2.0,
                "{text}"
            );
            assert_eq!(sample(&text, "fission_prefill_batch_size_count"), 3.0);
            assert_eq!(sample(&text, "fission_prefill_batch_size_sum"), 4.0);
        });
        let chunks: Vec<Option<Value>> = capture
            .named("prefill")
            .into_iter()
            .map(|(_, s)| s.field("chunks").cloned())
            .collect();
        assert_eq!(chunks, vec![Some(Value::I64(2)), Some(Value::I64(2))]);
        let batches: Vec<Option<Value>> = capture
            .named("prefill_batch")
            .into_iter()
            .map(|(_, s)| s.field("sequences").cloned())
            .collect();
        assert_eq!(
            batches,
            vec![
                Some(Value::I64(1)),
                Some(Value::I64(2)),
                Some(Value::I64(1))
            ]
        );
    }

    #[test]
    fn queue_time_and_time_to_first_token_start_at_the_rpc_arrival() {
        let mut t = task();
        let _subscriber = Captured::default().install();
        let (recorder, metrics) = local_recorder();
        let waited = Duration::from_millis(300);
        // The RPC arrived a while before the engine thread got the command.
        let arrived = Instant::now() - waited;
        let mut rx = admit_at(&mut t, 1, 100..104, arrived);
        metrics::with_local_recorder(&recorder, || t.step());
        let outcome = rx.try_recv().expect("answered").expect("computed");
        assert!(outcome.elapsed >= waited, "{:?}", outcome.elapsed);
        assert!(outcome.compute < waited, "{:?}", outcome.compute);
        let queued = sample(&metrics.render(), "fission_prefill_queue_time_seconds_sum");
        assert!(queued >= waited.as_secs_f64(), "{queued}");
    }

    #[test]
    fn prefix_cache_figures_are_counters() {
        let mut t = task();
        // Every test that runs traced code holds a subscriber of its own: a thread with none
        // can register a callsite as never-enabled under another test's feet.
        let _subscriber = Captured::default().install();
        let (recorder, metrics) = local_recorder();
        metrics::with_local_recorder(&recorder, || {
            for id in [1, 2] {
                // The same 9-token prompt twice: the second finds its first 2 blocks cached.
                let mut rx = admit(&mut t, id, 100..109);
                while t.engine.has_work() {
                    t.step();
                }
                assert!(rx.try_recv().expect("answered").is_ok());
                publish_gauges(&t.engine);
            }
        });
        let text = metrics.render();
        assert!(
            text.contains("# TYPE fission_prefill_prefix_cache_hit_blocks_total counter"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "fission_prefill_prefix_cache_hit_blocks_total"),
            2.0
        );
        assert_eq!(
            sample(&text, "fission_prefill_prefix_cache_queried_blocks_total"),
            4.0
        );
        assert!(!text.contains("fission_prefill_prefix_cache_hit_blocks "));
    }
}
