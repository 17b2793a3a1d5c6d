//! One prompt's life on a prefill node, behind the events of its `Prefill` call: the engine
//! computes it (queued first, perhaps), each finished layer goes to the push task, the first
//! token is reported as soon as it is sampled, and the call ends once the push is done.
//!
//! While it works, the task renews the decode node's reservation (the lease then measures this
//! node's liveness, not its queue) and heartbeats the gateway whenever it has said nothing for
//! a heartbeat interval. When the decode node answers a Renew with a stale epoch, the gateway
//! has moved the request elsewhere: the prompt is dropped. When the gateway drops the call,
//! the prompt is cancelled.

use std::time::Duration;

use kv_types::TransferId;
use node_common::convert;
use node_common::failure::Failure;
use node_common::membership::WorkGuard;
use proto::v1::{self, prefill_event};
use proto::ErrorCode;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span};

use crate::actor::{Arrival, EngineHandle, LayerPayload, PrefillOutcome};
use crate::push::{run_push_task, DecodeClients, PushJob};

pub(crate) type Events = mpsc::Sender<Result<v1::PrefillEvent, tonic::Status>>;

/// The reservation this prompt's KV goes to, and how to keep it.
pub(crate) struct Destination {
    pub job: PushJob,
    pub lease: Duration,
    /// The first prompt block to push: the decode node holds the ones before in its prefix
    /// cache (`Reserved.cached_tokens`).
    pub push_from: usize,
}

/// What one prompt's task needs.
pub(crate) struct Prompt {
    pub handle: EngineHandle,
    pub clients: DecodeClients,
    pub request: engine::engine::Request,
    pub arrival: Arrival,
    pub dest: Option<Destination>,
    pub heartbeat: Duration,
    pub events: Events,
    /// Fired when the gateway drops the call.
    pub cancelled: CancellationToken,
    pub work: WorkGuard,
}

fn event(e: prefill_event::Event) -> v1::PrefillEvent {
    v1::PrefillEvent { event: Some(e) }
}

/// Where the prompt stands, for heartbeats.
#[derive(Clone, Copy)]
enum Phase {
    Computing,
    Pushing,
}

impl Prompt {
    pub(crate) async fn run(self) {
        let span = self.arrival.span.clone();
        let seq_id = self.request.seq_id;
        let handle = self.handle.clone();
        let events = self.events.clone();
        let result = self.drive().instrument(span.clone()).await;
        if let Err(failure) = result {
            handle.cancel(seq_id);
            let status = crate::metrics::ERRORS.report(failure, &span);
            let _ = events.send(Err(status)).await;
        }
    }

    async fn drive(self) -> Result<(), Failure> {
        let Prompt {
            handle,
            clients,
            request,
            arrival,
            dest,
            heartbeat,
            events,
            cancelled,
            work: _work,
        } = self;
        let seq_id = request.seq_id;
        let num_tokens = request.prompt_ids.len();
        let span = arrival.span.clone();
        // The push runs on its own task, fed layer by layer; it reports its end on `pushed`.
        let mut push = None;
        let mut layers_tx = None;
        let push_from = dest.as_ref().map_or(0, |d| d.push_from);
        if let Some(d) = dest {
            let (ltx, lrx) = mpsc::unbounded_channel::<LayerPayload>();
            let (first_tx, first_rx) = oneshot::channel();
            let (done_tx, pushed) = oneshot::channel();
            let renewal = Renewal {
                clients: clients.clone(),
                endpoint: d.job.decode_endpoint.clone(),
                xfer_id: d.job.xfer_id,
                epoch: d.job.dest.epoch,
                every: (d.lease / 4).max(Duration::from_millis(50)),
            };
            let kv_span = kv_transfer_span(&d.job, num_tokens);
            tokio::spawn(
                async move {
                    // run_push_task counts its own failures and marks its span.
                    let _ = done_tx.send(run_push_task(d.job, lrx, first_rx).await);
                }
                .instrument(kv_span),
            );
            layers_tx = Some(ltx);
            push = Some((first_tx, pushed, renewal));
        }
        let renewal = push.as_ref().map(|(_, _, r)| r);
        let mut keeper = Keeper::new(heartbeat, Phase::Computing);
        let compute = handle.prefill(request, layers_tx, push_from, arrival);
        tokio::pin!(compute);
        let outcome = loop {
            tokio::select! {
                biased;
                () = cancelled.cancelled() => {
                    // The gateway gave up on this attempt: stop computing it.
                    handle.cancel(seq_id);
                    return Ok(());
                }
                outcome = &mut compute => break outcome?,
                kept = keeper.tick(&events, renewal) => kept?,
            }
        };
        report_computed(&span, &outcome, num_tokens);
        let token = convert::token(&outcome.first);
        let first = event(prefill_event::Event::First(v1::FirstToken {
            token: Some(token.clone()),
        }));
        if events.send(Ok(first)).await.is_err() {
            return Ok(());
        }
        let Some((first_tx, mut pushed, renewal)) = push else {
            return Ok(());
        };
        // The push sends Done with the first token once every layer is acknowledged.
        let _ = first_tx.send(token);
        keeper.phase = Phase::Pushing;
        // Once the push may have sent Done, a Renew can find the reservation already activated
        // (and gone): from then on the push's own outcome says whether the KV landed, so a
        // failed renewal only stops the renewals.
        let mut renewing = Some(&renewal);
        loop {
            tokio::select! {
                biased;
                () = cancelled.cancelled() => return Ok(()),
                result = &mut pushed => {
                    return match result {
                        Ok(Ok(_)) => {
                            let _ = events.send(Ok(event(prefill_event::Event::Pushed(true)))).await;
                            Ok(())
                        }
                        Ok(Err(e)) => Err(Failure::new(e.code(), e.to_string())),
                        Err(_) => Err(Failure::new(ErrorCode::Internal, "the push task ended")),
                    };
                }
                kept = keeper.tick(&events, renewing) => {
                    if let Err(f) = kept {
                        tracing::debug!(error = ?f, "renewal refused while pushing; the push decides");
                        renewing = None;
                    }
                }
            }
        }
    }
}

/// Heartbeats to the gateway and renewals of the reservation, on their schedules.
struct Keeper {
    heartbeat: Duration,
    phase: Phase,
    next_beat: Instant,
    next_renew: Instant,
}

impl Keeper {
    fn new(heartbeat: Duration, phase: Phase) -> Self {
        let now = Instant::now();
        Keeper {
            heartbeat,
            phase,
            next_beat: now + heartbeat,
            next_renew: now,
        }
    }

    /// Waits for the next heartbeat or renewal and does it; renewal failures end the prompt.
    async fn tick(&mut self, events: &Events, renewal: Option<&Renewal>) -> Result<(), Failure> {
        let renew_due = renewal.map(|_| self.next_renew);
        let next = renew_due.map_or(self.next_beat, |r| r.min(self.next_beat));
        tokio::time::sleep_until(next).await;
        let now = Instant::now();
        if let Some(r) = renewal.filter(|_| now >= self.next_renew) {
            r.renew().await?;
            self.next_renew = Instant::now() + r.every;
        }
        if now >= self.next_beat {
            send_heartbeat(events, self.phase).await;
            self.next_beat = Instant::now() + self.heartbeat;
        }
        Ok(())
    }
}

async fn send_heartbeat(events: &Events, phase: Phase) {
    let phase = match phase {
        Phase::Computing => v1::Phase::Prefilling,
        Phase::Pushing => v1::Phase::Running,
    };
    let beat = event(prefill_event::Event::Heartbeat(v1::Heartbeat {
        phase: phase as i32,
    }));
    let _ = events.send(Ok(beat)).await;
}

/// Keeps the decode node's reservation alive while this node works on it.
struct Renewal {
    clients: DecodeClients,
    endpoint: String,
    xfer_id: TransferId,
    epoch: u64,
    every: Duration,
}

impl Renewal {
    /// One Renew. A stale epoch or a reservation that is gone means the gateway has moved the
    /// request on: the prompt ends. A decode node that cannot be reached is left to its
    /// lease, and to the gateway.
    async fn renew(&self) -> Result<(), Failure> {
        let Ok(mut client) = self.clients.get(&self.endpoint).await else {
            return Ok(());
        };
        let renew = client.renew(v1::RenewRequest {
            xfer_id: self.xfer_id.0,
            epoch: self.epoch,
        });
        // A hung decode node answers nothing: the heartbeats to the gateway go on.
        let Ok(renewed) = tokio::time::timeout(self.every, renew).await else {
            return Ok(());
        };
        match renewed {
            Ok(_) => Ok(()),
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::NotFound | tonic::Code::InvalidArgument
                ) =>
            {
                Err(Failure::new(
                    ErrorCode::Cancelled,
                    format!("the reservation moved on: {}", s.message()),
                ))
            }
            Err(_) => Ok(()),
        }
    }
}

fn kv_transfer_span(job: &PushJob, num_tokens: usize) -> Span {
    tracing::info_span!(
        "kv_transfer",
        request_id = job.request_id.as_str(),
        xfer_id = job.xfer_id.0 as i64,
        kv_endpoint = %job.dest.kv_endpoint,
        layers = i64::from(job.layout.num_layers),
        prompt_tokens = num_tokens as i64,
        // shm for a decode node on this host, else the network transport (push.rs).
        transport = tracing::field::Empty,
        bytes = tracing::field::Empty,
        tail_ms = tracing::field::Empty,
        error_type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

fn report_computed(span: &Span, outcome: &PrefillOutcome, num_tokens: usize) {
    // From the RPC's arrival: queueing on the engine thread is part of this node's TTFT.
    metrics::histogram!("fission_prefill_time_to_first_token_seconds")
        .record(outcome.elapsed.as_secs_f64());
    span.record("compute_ms", outcome.compute.as_secs_f64() * 1e3);
    metrics::counter!("fission_prefill_tokens_total").increment(num_tokens as u64);
}
