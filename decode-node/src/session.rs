//! One request's life on a decode node: the task behind a `Generate` stream.
//!
//! Remote prefill: the session holds a reservation (blocks and a registered transfer at the
//! request's epoch) while a prefill node pushes the KV. The lease measures the prefill node,
//! not the queue it waits in: every Renew from the node filling the reservation starts it
//! again, so a long prompt queued behind others keeps its blocks, and a dead or hung prefill
//! node loses them within one lease. A Reprefill moves the reservation to a newer epoch (the
//! gateway retries with another prefill node, or here): KV frames, Done and Renew of older
//! epochs are refused from then on. Done activates the sequence and tokens flow. The gateway
//! names the prefill node it chose for each epoch (a Bind before its Prefill call, or with the
//! Reprefill): the reservation then takes KV frames from that node's certificate only.
//!
//! Local prefill: the engine queues the prompt and tokens flow once it runs.
//!
//! Either way the session sends a heartbeat whenever it has sent nothing for a heartbeat
//! interval, so the gateway tells a slow request from a hung node; it ends after the last
//! token, with an error, or when the gateway closes its side (every block is then freed).

use std::sync::Arc;
use std::time::Duration;

use engine::engine::Request;
use engine::ids::SeqId;
use kv_types::{KvLayout, TransferId};
use kvtransfer::{PeerFingerprint, Reservation, TransferRegistry};
use node_common::convert;
use node_common::failure::Failure;
use node_common::membership::WorkGuard;
use proto::v1::{self, generate_down, generate_up};
use proto::ErrorCode;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Streaming;
use tracing::{Instrument, Span};

use crate::actor::{EngineHandle, TokenMsg};
use crate::metrics::ERRORS;
use crate::session_event::SessionEvent;
use crate::transfers::Transfers;

/// What every session of a node shares.
pub(crate) struct SessionCtx {
    pub handle: EngineHandle,
    pub registry: TransferRegistry,
    pub transfers: Transfers,
    pub layout: KvLayout,
    pub kv_endpoint: String,
    /// The shared-memory endpoint served beside `kv_endpoint` for prefill nodes on this host,
    /// and this host's id (membership's), both named in every reservation; empty when none.
    pub kv_shm_endpoint: String,
    pub host_id: String,
    /// How long a reservation lives without a Renew.
    pub lease: Duration,
    /// How long a session may send nothing before it sends a heartbeat.
    pub heartbeat: Duration,
    /// Link the prompt's prefix this node caches into each reservation, so that the prefill
    /// node pushes only the rest (`--kv-delta`).
    pub kv_delta: bool,
    /// Cancelled when the node's drain is over: sessions still open end with an error, which
    /// the gateway answers by migrating them.
    pub stop: tokio_util::sync::CancellationToken,
}

pub(crate) type Down = mpsc::Sender<Result<v1::GenerateDown, tonic::Status>>;

/// Where a session stands.
pub(crate) enum Stage {
    /// Blocks reserved for the transfer, waiting for its KV at `epoch`.
    Reserved {
        xfer_id: TransferId,
        epoch: u64,
        deadline: Instant,
        /// The blocks the push fills: those after the cached prefix.
        block_ids: Vec<u32>,
        /// Prompt tokens linked from this node's prefix cache ([`v1::Reserved::cached_tokens`]).
        cached_tokens: u32,
    },
    /// Queued or running in the engine; tokens are due.
    Generating { first_token_seen: bool },
}

/// A session about to run: its request, its stage and the channels it owns.
pub(crate) struct Session {
    pub ctx: Arc<SessionCtx>,
    pub request: Request,
    pub request_id: String,
    /// The gateway's trace context, for the sequence's `decode` span.
    pub trace: telemetry::Context,
    /// The `stream` span of the Generate call.
    pub span: Span,
    pub up: Streaming<v1::GenerateUp>,
    pub down: Down,
    /// Done and Renew for the reservation, from [`Session::reserve`] on; none with a local
    /// prefill.
    pub events: Option<mpsc::Receiver<SessionEvent>>,
    pub tokens_tx: mpsc::UnboundedSender<TokenMsg>,
    pub tokens_rx: mpsc::UnboundedReceiver<TokenMsg>,
    pub next_seq: Arc<std::sync::atomic::AtomicU64>,
    pub work: WorkGuard,
}

/// How a session ended, for its span and the blocks it held.
enum End {
    /// The last token was sent.
    Finished,
    /// The gateway closed its side, or stopped reading.
    Left,
    Failed(Failure),
}

impl Session {
    /// Reserves blocks for a remote prefill at `epoch` and registers the transfer; the first
    /// message down is the reservation.
    pub(crate) async fn reserve(&mut self, epoch: u64) -> Result<Stage, Failure> {
        let link = self.ctx.kv_delta;
        let (blocks, cached) = match self.ctx.handle.reserve(self.request.clone(), link).await {
            Ok(b) => b,
            Err(e) if e.code() == ErrorCode::Overloaded => {
                metrics::counter!("fission_decode_reserve_busy_total").increment(1);
                return Err(Failure::new(ErrorCode::Overloaded, e.to_string()));
            }
            Err(e) => return Err(e.into()),
        };
        let block_ids: Vec<u32> = blocks[cached..].iter().map(|b| b.0).collect();
        let cached_tokens = (cached * self.ctx.layout.block_size as usize) as u32;
        metrics::counter!("fission_decode_kv_linked_blocks_total").increment(cached as u64);
        let (events_tx, events_rx) = mpsc::channel(8);
        self.events = Some(events_rx);
        let xfer_id = self.ctx.transfers.open(self.request.seq_id, events_tx);
        self.register(xfer_id, epoch, block_ids.clone(), None)
            .await?;
        self.send_reserved(xfer_id, epoch, block_ids.clone(), cached_tokens)
            .await;
        let stage = Stage::Reserved {
            xfer_id,
            epoch,
            deadline: Instant::now() + self.ctx.lease,
            block_ids,
            cached_tokens,
        };
        tracing::debug!(request_id = %self.request_id, %xfer_id, epoch, cached_tokens, "reserved");
        Ok(stage)
    }

    async fn register(
        &self,
        xfer_id: TransferId,
        epoch: u64,
        block_ids: Vec<u32>,
        chosen: Option<PeerFingerprint>,
    ) -> Result<(), Failure> {
        self.ctx
            .registry
            .register_from(
                Reservation {
                    xfer_id,
                    epoch,
                    block_ids: block_ids.into(),
                    layout: self.ctx.layout,
                },
                chosen,
            )
            .await
            .map_err(|e| Failure::new(ErrorCode::Internal, e.to_string()))
    }

    async fn send_reserved(
        &self,
        xfer_id: TransferId,
        epoch: u64,
        block_ids: Vec<u32>,
        cached_tokens: u32,
    ) {
        let reserved = v1::Reserved {
            xfer_id: xfer_id.0,
            epoch,
            block_ids,
            kv_endpoint: self.ctx.kv_endpoint.clone(),
            lease_ms: self.ctx.lease.as_millis() as u32,
            layout: Some(self.ctx.layout.into()),
            cached_tokens,
            kv_shm_endpoint: self.ctx.kv_shm_endpoint.clone(),
            host_id: self.ctx.host_id.clone(),
        };
        let _ = self
            .down
            .send(Ok(down(generate_down::Msg::Reserved(reserved))))
            .await;
    }

    /// Queues the prompt in the engine to prefill here.
    pub(crate) async fn generate_here(&mut self) -> Result<Stage, Failure> {
        // Inside the stream span: the sequence's `decode` span is its child.
        self.ctx
            .handle
            .generate(
                self.request.clone(),
                self.tokens_tx.clone(),
                &self.request_id,
            )
            .instrument(self.span.clone())
            .await?;
        metrics::counter!("fission_decode_local_prefill_total").increment(1);
        // The gateway places a request on its first answer: the prompt is queued here.
        let beat = down(generate_down::Msg::Heartbeat(v1::Heartbeat {
            phase: v1::Phase::Queued as i32,
        }));
        let _ = self.down.send(Ok(beat)).await;
        Ok(Stage::Generating {
            first_token_seen: false,
        })
    }

    /// Runs the session from `stage` to its end, then frees what it holds.
    pub(crate) async fn run(mut self, mut stage: Stage) {
        let end = self.drive(&mut stage).await;
        match &stage {
            Stage::Reserved { xfer_id, .. } => {
                self.ctx.registry.deregister(*xfer_id).await;
                self.ctx.transfers.close(*xfer_id);
                self.ctx.handle.cancel(self.request.seq_id);
            }
            Stage::Generating { .. } => {
                if !matches!(end, End::Finished) {
                    self.ctx.handle.cancel(self.request.seq_id);
                }
            }
        }
        match end {
            End::Finished => {}
            End::Left => {
                // The one place a cancellation is counted: the engine thread also sees the
                // sequence go (a Cancel, or a stream nobody reads) but cannot tell why.
                metrics::counter!("fission_decode_cancelled_total").increment(1);
            }
            End::Failed(f) => {
                let status = ERRORS.report(f, &self.span);
                let _ = self.down.send(Err(status)).await;
            }
        }
        drop(self.work);
    }

    async fn drive(&mut self, stage: &mut Stage) -> End {
        let mut heartbeat = tokio::time::interval(self.ctx.heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sent = Instant::now();
        let mut tokens = 0i64;
        loop {
            let lease = match stage {
                Stage::Reserved { deadline, .. } => Some(*deadline),
                Stage::Generating { .. } => None,
            };
            tokio::select! {
                biased;
                () = self.ctx.stop.cancelled() => {
                    return End::Failed(Failure::new(
                        ErrorCode::Unavailable,
                        "the decode node stopped at its drain deadline",
                    ));
                }
                msg = self.tokens_rx.recv() => match msg {
                    Some(Ok(ev)) => {
                        tokens += 1;
                        self.span.record("tokens", tokens);
                        let last = ev.finish.is_some();
                        let token = down(generate_down::Msg::Token(convert::token(&ev)));
                        if self.down.send(Ok(token)).await.is_err() {
                            return End::Left;
                        }
                        last_sent = Instant::now();
                        *stage = Stage::Generating { first_token_seen: true };
                        if last {
                            return End::Finished;
                        }
                    }
                    Some(Err(failure)) => return End::Failed(failure),
                    None => {
                        return End::Failed(Failure::new(
                            ErrorCode::Internal,
                            "the engine dropped the sequence",
                        ))
                    }
                },
                // Closed once the transfer is activated (and absent with a local prefill); a
                // closed channel answers at once, so it is polled only while open.
                event = next_event(&mut self.events),
                    if self.events.as_ref().is_some_and(|e| !e.is_closed()) => {
                    if let Some(event) = event {
                        if let Some(end) = self.on_event(stage, event).await {
                            return end;
                        }
                    }
                }
                msg = self.up.message() => match msg {
                    Ok(Some(v1::GenerateUp { msg: Some(generate_up::Msg::Reprefill(r)) })) => {
                        if let Err(f) = self.reprefill(stage, r).await {
                            return End::Failed(f);
                        }
                        last_sent = Instant::now();
                    }
                    Ok(Some(v1::GenerateUp { msg: Some(generate_up::Msg::Bind(b)) })) => {
                        if let Err(f) = self.bind(stage, &b) {
                            return End::Failed(f);
                        }
                    }
                    Ok(Some(_)) => {
                        return End::Failed(Failure::new(
                            ErrorCode::Validation,
                            "a Generate stream takes one GenerateStart, then Reprefill and Bind only",
                        ))
                    }
                    // The gateway closed its side or is gone: the request is over.
                    Ok(None) | Err(_) => return End::Left,
                },
                () = sleep_until_opt(lease) => {
                    metrics::counter!("fission_decode_lease_expired_total").increment(1);
                    tracing::warn!(request_id = %self.request_id, "kv lease expired");
                    return End::Failed(Failure::new(
                        ErrorCode::Timeout,
                        "kv lease expired: the prefill node stopped renewing the reservation",
                    ));
                }
                _ = heartbeat.tick() => {
                    if last_sent.elapsed() >= self.ctx.heartbeat {
                        let phase = match stage {
                            Stage::Reserved { .. } => v1::Phase::Prefilling,
                            Stage::Generating { first_token_seen: false } => v1::Phase::Queued,
                            Stage::Generating { first_token_seen: true } => v1::Phase::Running,
                        };
                        let beat = down(generate_down::Msg::Heartbeat(v1::Heartbeat {
                            phase: phase as i32,
                        }));
                        if self.down.send(Ok(beat)).await.is_err() {
                            return End::Left;
                        }
                        last_sent = Instant::now();
                    }
                }
            }
        }
    }

    /// Renew and Done from the prefill node. `Some` ends the session.
    async fn on_event(&mut self, stage: &mut Stage, event: SessionEvent) -> Option<End> {
        let Stage::Reserved {
            xfer_id,
            epoch,
            deadline,
            ..
        } = stage
        else {
            let refuse = || Failure::new(ErrorCode::NotFound, "no reservation is waiting");
            match event {
                SessionEvent::Renew { reply, .. } => drop(reply.send(Err(refuse()))),
                SessionEvent::Done { reply, .. } => drop(reply.send(Err(refuse()))),
            }
            return None;
        };
        let (xfer_id, current) = (*xfer_id, *epoch);
        let stale = |given: u64| {
            Failure::new(
                ErrorCode::Validation,
                format!(
                    "xfer {xfer_id}: epoch {given} is stale, the reservation is at epoch {current}"
                ),
            )
        };
        match event {
            SessionEvent::Renew { epoch, reply } => {
                if epoch != current {
                    let _ = reply.send(Err(stale(epoch)));
                    return None;
                }
                *deadline = Instant::now() + self.ctx.lease;
                let _ = reply.send(Ok(()));
                None
            }
            SessionEvent::Done { done, reply } => {
                if done.epoch != current {
                    let _ = reply.send(Err(stale(done.epoch)));
                    return None;
                }
                match self.activate(xfer_id, &done).await {
                    Ok(finished) => {
                        let _ = reply.send(Ok(()));
                        *stage = Stage::Generating {
                            first_token_seen: false,
                        };
                        // The first token (the prefill node's, which the gateway has) ended
                        // the request: nothing more comes.
                        finished.then_some(End::Finished)
                    }
                    Err(f) => {
                        let _ = reply.send(Err(f.clone()));
                        Some(End::Failed(f))
                    }
                }
            }
        }
    }

    /// Checks that every layer arrived as the sender computed it, fences the transfer and
    /// joins the sequence to the batch. `Ok(true)` when its first token already ends it.
    async fn activate(
        &mut self,
        xfer_id: TransferId,
        d: &v1::DoneRequest,
    ) -> Result<bool, Failure> {
        let first = d
            .first_token
            .as_ref()
            .ok_or_else(|| Failure::new(ErrorCode::Validation, "done without first_token"))?;
        let progress = self
            .ctx
            .registry
            .wait_complete(xfer_id, Duration::from_secs(5))
            .await
            .map_err(|e| {
                Failure::new(
                    ErrorCode::KvTransfer,
                    format!("kv transfer incomplete: {e}"),
                )
            })?;
        let received: Vec<u32> = progress
            .layer_crc32c
            .iter()
            .map(|c| c.unwrap_or(0))
            .collect();
        if !d.checksums.is_empty() && d.checksums != received {
            return Err(Failure::new(
                ErrorCode::KvTransfer,
                format!("kv checksums differ for xfer {xfer_id}"),
            ));
        }
        // Fence: no write into these blocks runs after this returns.
        self.ctx.registry.deregister(xfer_id).await;
        self.ctx.transfers.close(xfer_id);
        metrics::counter!("fission_decode_kv_transfers_completed_total").increment(1);
        metrics::histogram!("fission_decode_kv_transfer_bytes")
            .record(progress.payload_bytes as f64);
        let finish = self
            .ctx
            .handle
            .activate(
                self.request.seq_id,
                convert::sampled(first),
                self.tokens_tx.clone(),
                self.trace.clone(),
                &self.request_id,
            )
            .await?;
        // The first token goes down this stream too, ahead of every engine token: the
        // gateway then reads one complete, ordered stream, whichever of this and the prefill
        // node's copy reaches it first.
        let token = down(generate_down::Msg::Token(first.clone()));
        let _ = self.down.send(Ok(token)).await;
        Ok(finish.is_some())
    }

    /// The gateway retries the prefill: at a newer epoch into the same blocks, or here.
    async fn reprefill(&mut self, stage: &mut Stage, r: v1::Reprefill) -> Result<(), Failure> {
        let Stage::Reserved {
            xfer_id,
            epoch,
            ref block_ids,
            cached_tokens,
            ..
        } = *stage
        else {
            // Already generating: the KV arrived after all; nothing to redo.
            return Ok(());
        };
        if r.epoch <= epoch {
            return Err(Failure::new(
                ErrorCode::Validation,
                format!(
                    "reprefill at epoch {}, the reservation is at epoch {epoch}",
                    r.epoch
                ),
            ));
        }
        metrics::counter!("fission_decode_reprefills_total").increment(1);
        if r.local_prefill {
            self.ctx.registry.deregister(xfer_id).await;
            self.ctx.transfers.close(xfer_id);
            self.ctx.handle.cancel(self.request.seq_id);
            // A fresh sequence id: the engine may not have dropped the reservation's yet.
            self.request.seq_id = SeqId(
                self.next_seq
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            );
            *stage = self.generate_here().await?;
            return Ok(());
        }
        // Same blocks, newer epoch: the registry waits out the old attempt's writes and
        // ignores its frames from now on.
        let block_ids = block_ids.clone();
        self.register(xfer_id, r.epoch, block_ids.clone(), chosen(&r.prefill)?)
            .await?;
        self.send_reserved(xfer_id, r.epoch, block_ids.clone(), cached_tokens)
            .await;
        *stage = Stage::Reserved {
            xfer_id,
            epoch: r.epoch,
            deadline: Instant::now() + self.ctx.lease,
            block_ids,
            cached_tokens,
        };
        Ok(())
    }
}

impl Session {
    /// The gateway chose the prefill node for the reservation's epoch: frames from any other
    /// peer are refused from now on. A binding the registry refuses (another peer's frames
    /// came first) leaves the chosen node's push to fail, which the gateway retries at a new
    /// epoch; a binding for an epoch that is over is moot.
    fn bind(&self, stage: &Stage, b: &v1::Bind) -> Result<(), Failure> {
        let Some(fingerprint) = chosen(&b.prefill)? else {
            return Ok(());
        };
        let Stage::Reserved { xfer_id, epoch, .. } = *stage else {
            return Ok(());
        };
        if b.epoch != epoch {
            return Ok(());
        }
        if let Err(e) = self.ctx.registry.bind(xfer_id, epoch, fingerprint) {
            tracing::warn!(request_id = %self.request_id, %xfer_id, epoch, error = %e, "kv reservation not bound to the chosen prefill node");
        }
        Ok(())
    }
}

/// The prefill node the gateway named (`NodeInfo.kv_identity`); empty names none.
fn chosen(prefill: &[u8]) -> Result<Option<PeerFingerprint>, Failure> {
    if prefill.is_empty() {
        return Ok(None);
    }
    PeerFingerprint::try_from(prefill).map(Some).map_err(|_| {
        Failure::new(
            ErrorCode::Validation,
            format!(
                "a prefill node's kv_identity is a 32-byte SHA-256, not {} bytes",
                prefill.len()
            ),
        )
    })
}

fn down(msg: generate_down::Msg) -> v1::GenerateDown {
    v1::GenerateDown { msg: Some(msg) }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// The next Done or Renew; never, without a reservation.
async fn next_event(events: &mut Option<mpsc::Receiver<SessionEvent>>) -> Option<SessionEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
