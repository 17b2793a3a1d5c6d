//! What every handler shares: the config, the validator, the backend, admission and metrics. A
//! cheap `Clone` handle over one `Arc`.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tracing::Instrument;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::config::GatewayConfig;
use crate::error::GatewayError;
use crate::generation::Generation;
use crate::metrics;
use crate::queue::{Queue, QueueConfig};
use crate::request::ValidRequest;
use crate::validation::{FieldNames, GenerateParameters, Limits, Prompt, Validator};

/// `model` values that mean "whatever this server serves": TGI's and Hugging Face's clients
/// send them to a server given by URL (`text_generation`'s `Client.chat` sends `tgi`,
/// `huggingface_hub`'s `InferenceClient(base_url=...).chat_completion` sends `dummy`), and TGI
/// accepts them.
pub(crate) const PLACEHOLDER_MODELS: [&str; 2] = ["tgi", "dummy"];

#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
}

struct Shared {
    config: GatewayConfig,
    validator: Arc<Validator>,
    backend: Arc<dyn Backend>,
    queue: Queue,
    metrics: PrometheusHandle,
    started_at_unix: u64,
    /// Cancelled when shutdown's drain deadline passes: every generation still running ends.
    abort: CancellationToken,
}

impl AppState {
    /// Checks `config` and loads the tokenizer and chat template it names. `metrics` renders
    /// `/metrics`: [`crate::metrics::install_recorder`]'s handle in a server, any handle in tests.
    pub fn new(
        config: GatewayConfig,
        backend: Arc<dyn Backend>,
        metrics: PrometheusHandle,
    ) -> Result<Self, GatewayError> {
        config.validate()?;
        let validator = Arc::new(Validator::load(&config)?);
        Ok(Self {
            inner: Arc::new(Shared {
                queue: Queue::new(QueueConfig {
                    max_concurrent_requests: config.max_concurrent_requests,
                    max_waiting_requests: config.max_waiting_requests,
                    max_queued_tokens: config.max_queued_tokens,
                    max_queue_wait_ms: config.max_queue_wait_ms,
                }),
                config,
                validator,
                backend,
                metrics,
                started_at_unix: unix_now(),
                abort: CancellationToken::new(),
            }),
        })
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    /// Ends every generation in flight (and any that starts later) with an `unavailable` error,
    /// which drops their backend streams and so cancels them upstream. For shutdown, once the
    /// drain deadline has passed.
    pub fn abort_in_flight(&self) {
        self.inner.abort.cancel();
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        self.inner.backend.as_ref()
    }

    pub(crate) fn validator(&self) -> &Arc<Validator> {
        &self.inner.validator
    }

    pub(crate) fn metrics(&self) -> &PrometheusHandle {
        &self.inner.metrics
    }

    pub(crate) fn queue(&self) -> &Queue {
        &self.inner.queue
    }

    pub(crate) fn started_at_unix(&self) -> u64 {
        self.inner.started_at_unix
    }

    /// The limits requests are held to now: the configured ones, lowered to the smallest
    /// context among the ready nodes. `/info`, `/v1/models` and validation all read them here.
    pub(crate) fn limits(&self) -> Limits {
        Limits::new(&self.inner.config, self.inner.backend.max_context())
    }

    /// Checks OpenAI's `model` against the names this gateway serves. An absent `model` is
    /// taken as the served one, and so are [`PLACEHOLDER_MODELS`].
    pub(crate) fn check_model(&self, model: Option<&str>) -> Result<(), GatewayError> {
        let names = self.inner.config.model_names();
        match model {
            Some(given) if !PLACEHOLDER_MODELS.contains(&given) && !names.contains(&given) => {
                Err(GatewayError::ModelNotFound {
                    given: given.to_string(),
                    served: names
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", "),
                })
            }
            _ => Ok(()),
        }
    }

    /// What OpenAI's `system_fingerprint` reports: the build and the model, which together
    /// decide what a seeded request generates.
    pub(crate) fn system_fingerprint(&self) -> String {
        format!(
            "fission-{}-{}",
            env!("CARGO_PKG_VERSION"),
            self.inner.config.model_id
        )
    }

    /// Validates, queues and starts one generation: the path every generation endpoint takes.
    /// Validation comes first: the queue is bounded by prompt tokens too, and a request that
    /// cannot be served should not wait to be told so.
    pub(crate) async fn generate(
        &self,
        endpoint: &'static str,
        prompt: Prompt,
        parameters: GenerateParameters,
        fields: FieldNames,
    ) -> Result<Generation, GatewayError> {
        let request = self
            .validate_request(endpoint, prompt, parameters, fields)
            .await?;
        self.start(request).await
    }

    /// Counts and validates one request, and records what validation learnt on the request's
    /// span.
    pub(crate) async fn validate_request(
        &self,
        endpoint: &'static str,
        prompt: Prompt,
        parameters: GenerateParameters,
        fields: FieldNames,
    ) -> Result<ValidRequest, GatewayError> {
        let received_at = Instant::now();
        ::metrics::counter!(metrics::REQUESTS_TOTAL, "endpoint" => endpoint).increment(1);
        let request = self
            .validate(prompt, parameters, fields, received_at)
            .await?;
        // The handler runs inside `http_request` (the server's middleware), which declares these
        // fields: the id only exists from here on. Any other current span ignores them.
        let http_request = tracing::Span::current();
        http_request.record("request_id", request.request_id.as_str());
        http_request.record("prompt_tokens", request.prompt_ids.len() as i64);
        http_request.record("max_new_tokens", request.stopping.max_new_tokens as i64);
        Ok(request)
    }

    /// Queues and starts a validated request.
    pub(crate) async fn start(&self, request: ValidRequest) -> Result<Generation, GatewayError> {
        Generation::start(
            &self.inner.config.model_id,
            self.inner.backend.as_ref(),
            &self.inner.queue,
            request,
            self.inner.config.request_timeout_ms,
            self.inner.abort.clone(),
        )
        .await
    }

    /// Tokenization is CPU work: it runs on the blocking pool, not on the runtime's workers.
    async fn validate(
        &self,
        prompt: Prompt,
        parameters: GenerateParameters,
        fields: FieldNames,
        received_at: Instant,
    ) -> Result<ValidRequest, GatewayError> {
        let validator = Arc::clone(&self.inner.validator);
        let limits = self.limits();
        let span = tracing::info_span!("validate", prompt_tokens = tracing::field::Empty);
        let request = tokio::task::spawn_blocking(move || {
            validator.validate(prompt, parameters, fields, limits, received_at)
        })
        .instrument(span.clone())
        .await
        .map_err(|e| GatewayError::Internal {
            message: format!("validation task: {e}"),
        })??;
        span.record("prompt_tokens", request.prompt_ids.len() as i64);
        Ok(request)
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
