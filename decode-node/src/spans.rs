//! The spans of a decode node's sequences and batches: a sequence's `decode` span and its
//! `queue_wait`, the `decode_batch` span of the sequences stepped together, and the step
//! observer that keeps them (and queue time) up to date. The engine thread owns them all.

use std::collections::HashMap;
use std::time::Instant;

use engine::engine::{ScheduledSeq, StepObserver};
use engine::ids::SeqId;
use telemetry::OpenTelemetrySpanExt;
use tracing::span::EnteredSpan;
use tracing::Span;

/// The `decode` span of a sequence, a child of the caller's span: tokens and steps are recorded
/// on it, with no span per token.
pub(crate) fn decode_span(request_id: &str) -> Span {
    tracing::info_span!(
        "decode",
        request_id,
        tokens = tracing::field::Empty,
        steps = tracing::field::Empty,
        finish_reason = tracing::field::Empty,
        error_type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// A running sequence's spans.
pub(crate) struct SeqSpans {
    pub(crate) span: Span,
    /// Open from admission until the first step that includes the sequence.
    pub(crate) queue_wait: Option<Span>,
    pub(crate) steps: i64,
    pub(crate) tokens: i64,
    pub(crate) admitted: Instant,
    /// When its last token was known: the gap to the next is its time per output token.
    pub(crate) last_token_at: Option<Instant>,
}

impl SeqSpans {
    pub(crate) fn new(span: Span, last_token_at: Option<Instant>) -> Self {
        let queue_wait = Some(tracing::info_span!(parent: &span, "queue_wait"));
        SeqSpans {
            span,
            queue_wait,
            steps: 0,
            tokens: 0,
            admitted: Instant::now(),
            last_token_at,
        }
    }

    /// Records what the sequence did; `finish` is the finish reason, or why it ended.
    pub(crate) fn end(self, finish: &str) {
        self.span.record("tokens", self.tokens);
        self.span.record("steps", self.steps);
        self.span.record("finish_reason", finish);
    }
}

/// The span of the current batch composition.
pub(crate) struct BatchSpan {
    pub(crate) span: Span,
    pub(crate) members: Vec<SeqId>,
    pub(crate) steps: i64,
}

/// Follows one step: the batch span is that of the sequences the scheduler put in the step
/// (waiting ones are not in it), and only those end their queue wait and count a step.
pub(crate) struct StepTracker<'a> {
    pub(crate) spans: &'a mut HashMap<SeqId, SeqSpans>,
    pub(crate) batch: &'a mut Option<BatchSpan>,
    /// The batch span, entered from scheduling until the step's tokens are handed out.
    pub(crate) entered: Option<EnteredSpan>,
    pub(crate) started: Instant,
}

impl StepObserver for StepTracker<'_> {
    fn scheduled(&mut self, seqs: &[ScheduledSeq]) {
        let mut members: Vec<SeqId> = seqs
            .iter()
            .map(|s| s.seq_id)
            .filter(|id| self.spans.contains_key(id))
            .collect();
        members.sort_unstable();
        if members.is_empty() {
            *self.batch = None;
            return;
        }
        // One span per batch composition, linked to the sequences in it (a root: a batch
        // belongs to no single trace). A new one starts when a sequence joins or leaves; a
        // span per step would cost more than a small model's step.
        if self.batch.as_ref().is_none_or(|b| b.members != members) {
            let span = tracing::info_span!(
                parent: None,
                "decode_batch",
                sequences = members.len() as i64,
                steps = tracing::field::Empty
            );
            for id in &members {
                telemetry::add_link(&span, &self.spans[id].span.context());
            }
            // The previous batch span ends here.
            *self.batch = Some(BatchSpan {
                span,
                members,
                steps: 0,
            });
        }
        let queue_time = metrics::histogram!("fission_decode_queue_time_seconds");
        for s in seqs {
            let Some(spans) = self.spans.get_mut(&s.seq_id) else {
                continue;
            };
            if spans.queue_wait.take().is_some() {
                queue_time.record(
                    self.started
                        .saturating_duration_since(spans.admitted)
                        .as_secs_f64(),
                );
            }
            spans.steps += 1;
        }
        if let Some(b) = self.batch.as_mut() {
            b.steps += 1;
            b.span.record("steps", b.steps);
            self.entered = Some(b.span.clone().entered());
        }
    }
}
