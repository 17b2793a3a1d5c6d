//! One admitted request's token stream, guarded so that every stream ends properly: after the
//! token with a finish reason, or with exactly one error (a backend error, the request timeout,
//! or "stream ended early"). The guard holds the admission permit, records the latency metrics,
//! and, when dropped before the end (the client left), drops the backend stream, which cancels
//! the request upstream.

use std::time::Instant;

use futures::stream::BoxStream;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{field, Instrument, Span};

use crate::backend::Backend;
use crate::error::GatewayError;
use crate::metrics;
use crate::queue::{Queue, Slot};
use crate::request::{FinishReason, GeneratedToken, RequestId, TokenStream, ValidRequest};

/// A started generation.
pub(crate) struct Generation {
    pub request_id: RequestId,
    /// The seed, when the request samples (TGI reports none for greedy decoding).
    pub seed: Option<u64>,
    /// Tokens in order, ending after the finish or after one error.
    pub tokens: BoxStream<'static, Result<GeneratedToken, GatewayError>>,
}

/// A generation collected to its end.
pub(crate) struct Completed {
    pub tokens: Vec<GeneratedToken>,
    pub text: String,
    pub finish_reason: FinishReason,
}

impl Generation {
    /// Queues `request` for admission and hands it to the backend once it is its turn. The
    /// request timeout counts from its arrival and covers the whole generation, the queue
    /// included. Cancelling `abort` (shutdown's drain deadline) ends the generation with an
    /// `Unavailable` error.
    pub(crate) async fn start(
        model: &str,
        backend: &dyn Backend,
        queue: &Queue,
        request: ValidRequest,
        timeout_ms: u64,
        abort: CancellationToken,
    ) -> Result<Self, GatewayError> {
        let request_id = request.request_id.clone();
        let prompt_tokens = request.prompt_ids.len();
        let seed = (request.sampling.temperature > 0.0).then_some(request.sampling.seed);
        let received_at = request.received_at;
        let deadline = tokio::time::Instant::from_std(received_at)
            + std::time::Duration::from_millis(timeout_ms);
        // Counts are recorded as i64: tracing-opentelemetry exports u64 fields as strings.
        let span = tracing::info_span!(
            "generate",
            request_id = %request_id,
            model = %model,
            prompt_tokens = prompt_tokens as i64,
            max_new_tokens = request.stopping.max_new_tokens as i64,
            ttft_ms = field::Empty,
            tpot_ms = field::Empty,
            generated_tokens = field::Empty,
            finish_reason = field::Empty,
            error_type = field::Empty,
            otel.status_code = field::Empty,
        );
        ::metrics::histogram!(metrics::INPUT_TOKENS).record(prompt_tokens as f64);

        let timeout = || GatewayError::Timeout {
            request_id: request_id.clone(),
            timeout_ms,
        };
        // Called inside the span so the queue's and the backend's spans are its children.
        let admitted = queue.admit(prompt_tokens, deadline, || {
            span.in_scope(|| backend.generate(request.clone()))
        });
        let admitted = tokio::time::timeout_at(deadline, admitted.instrument(span.clone()));
        let started = tokio::select! {
            () = abort.cancelled() => Err(shutting_down()),
            started = admitted => started.map_err(|_| timeout()).and_then(|r| r),
        };
        let (inner, slot) = started.inspect_err(|error| record_failure(&span, error))?;

        let guard = Guard {
            inner: Some(inner),
            request_id: request_id.clone(),
            deadline,
            timeout_ms,
            received_at,
            first_token_at: None,
            generated: 0,
            span,
            abort,
            _slot: slot,
        };
        let tokens = futures::stream::unfold(guard, |mut guard| {
            let span = guard.span.clone();
            async move {
                let item = guard.next().await?;
                Some((item, guard))
            }
            .instrument(span)
        })
        .boxed();
        Ok(Self {
            request_id,
            seed,
            tokens,
        })
    }
}

impl Completed {
    /// Waits for every token of `tokens` (request `request_id`'s); the first error fails the
    /// whole generation.
    pub(crate) async fn collect(
        request_id: RequestId,
        mut stream: BoxStream<'static, Result<GeneratedToken, GatewayError>>,
    ) -> Result<Self, GatewayError> {
        let mut tokens = Vec::new();
        let mut text = String::new();
        while let Some(item) = stream.next().await {
            let token = item?;
            text.push_str(&token.text);
            tokens.push(token);
        }
        // The guard ends every stream with a finish reason or an error; keep the error kind
        // the guard would have given, should that ever change.
        let Some(finish_reason) = tokens.last().and_then(|t| t.finish_reason) else {
            return Err(GatewayError::StreamEndedEarly {
                request_id,
                generated_tokens: tokens.len(),
            });
        };
        Ok(Completed {
            tokens,
            text,
            finish_reason,
        })
    }

    /// The generated token ids, in order.
    pub(crate) fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.id).collect()
    }
}

/// Marks `generate` failed, with the `error_type` the errors metric and the nodes' spans use
/// (`ErrorCode::as_str`). A failure after the stream started reaches the client as an SSE event
/// after a 200, so `http_request` (closed by then) cannot show it: this span does.
fn record_failure(span: &Span, error: &GatewayError) {
    span.record("otel.status_code", "ERROR");
    span.record("error_type", error.code().as_str());
}

fn shutting_down() -> GatewayError {
    GatewayError::Unavailable {
        reason: "the gateway is shutting down".into(),
    }
}

struct Guard {
    /// `None` once the stream ended (finished or failed).
    inner: Option<TokenStream>,
    request_id: RequestId,
    deadline: tokio::time::Instant,
    timeout_ms: u64,
    received_at: Instant,
    first_token_at: Option<Instant>,
    generated: usize,
    span: Span,
    abort: CancellationToken,
    /// Released when the generation ends, which wakes the queue's head.
    _slot: Slot,
}

impl Guard {
    async fn next(&mut self) -> Option<Result<GeneratedToken, GatewayError>> {
        let inner = self.inner.as_mut()?;
        let next = tokio::select! {
            () = self.abort.cancelled() => Err(shutting_down()),
            next = tokio::time::timeout_at(self.deadline, inner.next()) => Ok(next),
        };
        let item = match next {
            Err(error) => Err(error),
            Ok(Err(_)) => Err(GatewayError::Timeout {
                request_id: self.request_id.clone(),
                timeout_ms: self.timeout_ms,
            }),
            Ok(Ok(None)) => Err(GatewayError::StreamEndedEarly {
                request_id: self.request_id.clone(),
                generated_tokens: self.generated,
            }),
            Ok(Ok(Some(item))) => item,
        };
        match &item {
            Ok(token) => self.on_token(token),
            Err(error) => {
                self.inner = None;
                record_failure(&self.span, error);
            }
        }
        Some(item)
    }

    fn on_token(&mut self, token: &GeneratedToken) {
        let now = Instant::now();
        self.generated += 1;
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
            let ttft = now - self.received_at;
            ::metrics::histogram!(metrics::TIME_TO_FIRST_TOKEN).record(ttft.as_secs_f64());
            self.span.record("ttft_ms", ttft.as_secs_f64() * 1e3);
        }
        let Some(finish_reason) = token.finish_reason else {
            return;
        };
        // The last token: the backend stream is done, and dropping it now releases it.
        self.inner = None;
        ::metrics::histogram!(metrics::REQUEST_DURATION)
            .record((now - self.received_at).as_secs_f64());
        ::metrics::histogram!(metrics::GENERATED_TOKENS).record(self.generated as f64);
        if let (Some(first), true) = (self.first_token_at, self.generated > 1) {
            let per_token = (now - first).as_secs_f64() / (self.generated - 1) as f64;
            ::metrics::histogram!(metrics::TIME_PER_OUTPUT_TOKEN).record(per_token);
            self.span.record("tpot_ms", per_token * 1e3);
        }
        self.span.record("generated_tokens", self.generated as i64);
        self.span
            .record("finish_reason", finish_reason.as_tgi_str());
        tracing::debug!(parent: &self.span, "generation finished");
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.inner.is_some() {
            // Dropping `inner` right after this cancels the request upstream.
            ::metrics::counter!(metrics::CANCELLED_TOTAL).increment(1);
            tracing::debug!(parent: &self.span, generated_tokens = self.generated, "client went away; cancelling");
        }
    }
}
