//! The engine thread of a prefill node. After each layer of a step in which a prompt
//! completes, it exports that layer's blocks and hands the bytes to the request's push task,
//! so the transfer of layer i overlaps the compute of layer i+1.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use engine::engine::{Engine, LayerDone, Request, TokenEvent};
use engine::error::EngineError;
use engine::ids::SeqId;
use telemetry::OpenTelemetrySpanExt;
use tokio::sync::{mpsc as tmpsc, oneshot};
use tracing::Span;

use node_common::engine_state::EngineState;
use node_common::NodeError;

/// One layer of one prompt, ready to send.
pub struct LayerPayload {
    pub layer: usize,
    pub bytes: Bytes,
    /// When this layer's compute finished.
    pub computed_at: Instant,
}

pub struct PrefillOutcome {
    pub first: TokenEvent,
    /// From admission to the first token.
    pub elapsed: Duration,
}

enum Command {
    Prefill {
        req: Request,
        layers: Option<tmpsc::UnboundedSender<LayerPayload>>,
        reply: oneshot::Sender<Result<PrefillOutcome, EngineError>>,
        /// The request's `prefill` span: queue time and chunks are recorded under it.
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
    pub fn spawn(engine: Engine, state: EngineState) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("prefill-engine".into())
            .spawn(move || run_engine_task(engine, state, rx))
            .expect("spawning the engine thread");
        EngineHandle { tx }
    }

    /// Computes `req`'s prompt; when `layers` is given, each finished layer's KV goes there.
    pub async fn prefill(
        &self,
        req: Request,
        layers: Option<tmpsc::UnboundedSender<LayerPayload>>,
    ) -> Result<PrefillOutcome, NodeError> {
        let (reply, rx) = oneshot::channel();
        let span = Span::current();
        self.tx
            .send(Command::Prefill {
                req,
                layers,
                reply,
                span,
            })
            .map_err(|_| NodeError::EngineStopped)?;
        Ok(rx.await.map_err(|_| NodeError::EngineStopped)??)
    }

    pub fn cancel(&self, seq_id: SeqId) {
        let _ = self.tx.send(Command::Cancel { seq_id });
    }
}

struct Pending {
    layers: Option<tmpsc::UnboundedSender<LayerPayload>>,
    reply: oneshot::Sender<Result<PrefillOutcome, EngineError>>,
    admitted: Instant,
    prompt_tokens: u64,
    span: Span,
    /// Open from admission until the first step that computes part of this prompt.
    queue_wait: Option<Span>,
    /// Steps that computed part of this prompt (its chunks).
    chunks: i64,
}

fn run_engine_task(mut engine: Engine, state: EngineState, rx: mpsc::Receiver<Command>) {
    engine.enable_cache_events();
    // The idle engine's figures, before the loop blocks waiting for work: routers read free
    // blocks from this, and a node that reported none would never be picked.
    state.publish(&mut engine, 0);
    let mut pending: HashMap<SeqId, Pending> = HashMap::new();
    loop {
        let first = if engine.has_work() {
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
        let mut next = first;
        while let Some(c) = next {
            match c {
                Command::Prefill {
                    req,
                    layers,
                    reply,
                    span,
                } => {
                    let seq_id = req.seq_id;
                    let prompt_tokens = req.prompt_ids.len() as u64;
                    match engine.add_prefill_request(req) {
                        Ok(()) => {
                            pending.insert(
                                seq_id,
                                Pending {
                                    layers,
                                    reply,
                                    admitted: Instant::now(),
                                    prompt_tokens,
                                    queue_wait: Some(
                                        tracing::info_span!(parent: &span, "queue_wait"),
                                    ),
                                    span,
                                    chunks: 0,
                                },
                            );
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                Command::Cancel { seq_id } => {
                    if engine.cancel(seq_id) {
                        metrics::counter!("fission_prefill_cancelled_total").increment(1);
                    }
                    pending.remove(&seq_id);
                }
            }
            next = rx.try_recv().ok();
        }
        if engine.has_work() {
            step(&mut engine, &mut pending);
        }
        let s = engine.stats();
        metrics::gauge!("fission_prefill_kv_blocks_used").set(s.num_blocks_used as f64);
        metrics::gauge!("fission_prefill_kv_blocks_capacity").set(s.num_blocks_total as f64);
        metrics::gauge!("fission_prefill_queued_sequences")
            .set((s.num_waiting + s.num_running) as f64);
        metrics::gauge!("fission_prefill_prefix_cache_hit_blocks").set(s.prefix_hit_blocks as f64);
        metrics::gauge!("fission_prefill_prefix_cache_queried_blocks")
            .set(s.prefix_query_blocks as f64);
        metrics::gauge!("fission_prefill_prefix_cache_hit_ratio")
            .set(s.prefix_hit_blocks as f64 / s.prefix_query_blocks.max(1) as f64);
        metrics::gauge!("fission_prefill_kv_usage_ratio")
            .set(s.num_blocks_used as f64 / s.num_blocks_total.max(1) as f64);
        // Tokens of prompts admitted and not yet answered: what a router weighs a node by.
        let queued: u64 = pending.values().map(|p| p.prompt_tokens).sum();
        metrics::gauge!("fission_prefill_queued_prefill_tokens").set(queued as f64);
        state.publish(&mut engine, queued);
    }
}

fn step(engine: &mut Engine, pending: &mut HashMap<SeqId, Pending>) {
    let started = Instant::now();
    // One span per engine step, linked to every request it serves (a root: a batch belongs to
    // no single trace). Every admitted prompt is in the step: chunked prefill gives each a
    // chunk per step within the token budget.
    let batch = tracing::info_span!(
        parent: None,
        "prefill_batch",
        sequences = pending.len() as i64
    );
    for p in pending.values_mut() {
        telemetry::add_link(&batch, &p.span.context());
        if p.queue_wait.take().is_some() {
            metrics::histogram!("fission_prefill_queue_time_seconds")
                .record(p.admitted.elapsed().as_secs_f64());
        }
        p.chunks += 1;
    }
    let _in_batch = batch.enter();
    let result = engine.step_with_layer_hook(&mut |done: LayerDone<'_>| {
        let now = Instant::now();
        for (seq_id, blocks) in done.completing {
            let Some(p) = pending.get(seq_id) else {
                continue;
            };
            let Some(tx) = &p.layers else {
                continue;
            };
            let mut buf = BytesMut::zeroed(done.cache.export_len(blocks.len()));
            done.cache.export_blocks(done.layer, blocks, &mut buf)?;
            // A closed channel means the push was abandoned; the prompt still completes.
            let _ = tx.send(LayerPayload {
                layer: done.layer,
                bytes: buf.freeze(),
                computed_at: now,
            });
        }
        Ok(())
    });
    metrics::histogram!("fission_prefill_step_seconds").record(started.elapsed().as_secs_f64());
    match result {
        Ok(events) => {
            for ev in events {
                if let Some(p) = pending.remove(&ev.seq_id) {
                    metrics::counter!("fission_prefill_prompts_total").increment(1);
                    p.span.record("chunks", p.chunks);
                    let _ = p.reply.send(Ok(PrefillOutcome {
                        first: ev,
                        elapsed: p.admitted.elapsed(),
                    }));
                }
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "prefill step failed");
            let ids: Vec<SeqId> = pending.keys().copied().collect();
            for seq_id in ids {
                engine.cancel(seq_id);
                if let Some(p) = pending.remove(&seq_id) {
                    let _ = p.reply.send(Err(EngineError::InvalidConfig {
                        reason: format!("prefill step failed: {e}"),
                    }));
                }
            }
        }
    }
}
