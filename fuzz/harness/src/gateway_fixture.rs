//! A gateway [`app`] over the fake backend, built once per target and driven with `oneshot`
//! with the POSTs [`request`] frames, and the checks that hold for every request whatever its
//! answer: it is answered in time, it starts at most one generation, that generation passed
//! validation, and none outlives its response.

use std::path::PathBuf;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, Request, StatusCode};
use axum::Router;
use gateway::fake::{FakeBackend, FakeScript};
use gateway::{app, AppState, GatewayConfig, ValidRequest};
use http_body_util::BodyExt;
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::runtime::Runtime;
use tower::ServiceExt;

/// The body limit of the HTTP targets: libFuzzer's inputs (4 KiB by default) pass it.
pub(crate) const MAX_BODY_BYTES: usize = 1024;

/// Longer than any request to the fake backend takes; past it the gateway hung.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// One runtime for every target: libFuzzer calls a target millions of times, and a runtime per
/// call would cost more than the request. Current-thread, as the fuzzer runs one input at a time.
static RUNTIME: LazyLock<Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread tokio runtime builds")
});

/// `<shared>/models/NAME`, as `testkit::shared_model` finds it (the harness is built in the
/// instrumented fuzz build too, which should not compile testkit's dependencies).
pub(crate) fn shared_model(name: &str) -> PathBuf {
    std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")))
        .join("models")
        .join(name)
}

pub(crate) fn stories_tokenizer() -> PathBuf {
    shared_model("stories260K").join("tokenizer.json")
}

/// Small limits, so that inputs of a few hundred bytes reach every one of them.
fn base_config() -> GatewayConfig {
    let mut config = GatewayConfig::new("stories260K", stories_tokenizer());
    config.max_input_tokens = 64;
    config.max_total_tokens = 96;
    config.max_new_tokens_default = 4;
    config.max_stop_sequences = 4;
    config.max_top_n_tokens = 5;
    config.max_body_bytes = MAX_BODY_BYTES;
    config.request_timeout_ms = 5_000;
    config.eos_token_ids = vec![2];
    config
}

/// A request's answer, with what it did to the backend.
pub(crate) struct Exchange {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The request the backend was given, when the gateway started a generation.
    pub generated: Option<ValidRequest>,
    /// Sequences the request started (OpenAI's `n`, `best_of` and prompt lists start several).
    pub sequences: usize,
}

impl Exchange {
    /// The body for messages: lossy, and cut short.
    pub(crate) fn body_text(&self) -> String {
        let text = String::from_utf8_lossy(&self.body);
        text.chars().take(2_000).collect()
    }
}

pub(crate) struct TestGateway {
    app: Router,
    fake: Arc<FakeBackend>,
    pub config: GatewayConfig,
}

impl TestGateway {
    /// A gateway with [`base_config`] changed by `configure`. Panics when the model or a
    /// fixture is missing: a harness that cannot start has nothing to test.
    pub(crate) fn new(configure: impl FnOnce(&mut GatewayConfig)) -> Self {
        let mut config = base_config();
        configure(&mut config);
        let script = FakeScript {
            token_delay: Duration::ZERO,
            ..FakeScript::default()
        };
        let fake = Arc::new(FakeBackend::new(script));
        let metrics = PrometheusBuilder::new().build_recorder().handle();
        let state = AppState::new(config.clone(), fake.clone(), metrics).unwrap_or_else(|e| {
            panic!(
                "the fuzz gateway starts (tokenizer {}): {e}",
                config.tokenizer_path.display()
            )
        });
        Self {
            app: app(state),
            fake,
            config,
        }
    }

    /// Sends `request`, reads the whole answer, and checks what it did to the backend.
    pub(crate) fn send(&self, request: Request<Body>) -> Exchange {
        let before = self.fake.counts();
        let (status, headers, body) = RUNTIME.block_on(async {
            let answer = async {
                let response = self
                    .app
                    .clone()
                    .oneshot(request)
                    .await
                    .expect("the router's error type is Infallible");
                let (parts, body) = response.into_parts();
                let body = body
                    .collect()
                    .await
                    .expect("a response body streams to its end without an error")
                    .to_bytes();
                (parts.status, parts.headers, body)
            };
            tokio::time::timeout(ANSWER_TIMEOUT, answer)
                .await
                .unwrap_or_else(|_| panic!("no complete answer within {ANSWER_TIMEOUT:?}"))
        });
        let after = self.fake.counts();
        // OpenAI's `n`, `best_of` and prompt lists start several sequences of one request,
        // each validated alike: the last one stands for them.
        let started = after.started - before.started;
        assert_eq!(
            after.active, 0,
            "a generation outlived its response: {after:?}"
        );
        let generated = (started >= 1).then(|| {
            self.fake
                .last_request()
                .expect("the fake backend keeps the request it started")
        });
        if let Some(request) = &generated {
            check_valid(request, &self.config);
        }
        Exchange {
            status,
            headers,
            body,
            generated,
            sequences: started,
        }
    }
}

/// What validation promises about every request it lets through to a backend.
fn check_valid(request: &ValidRequest, config: &GatewayConfig) {
    let prompt_tokens = request.prompt_ids.len();
    let stopping = &request.stopping;
    let sampling = &request.sampling;
    assert!(prompt_tokens > 0, "an empty prompt reached the backend");
    assert!(
        prompt_tokens <= config.max_input_tokens,
        "{prompt_tokens} prompt tokens reached the backend, max_input_tokens is {}",
        config.max_input_tokens
    );
    assert!(stopping.max_new_tokens >= 1, "max_new_tokens 0 passed");
    assert!(
        prompt_tokens + stopping.max_new_tokens <= config.max_total_tokens,
        "{prompt_tokens} prompt + {} new tokens pass max_total_tokens {}",
        stopping.max_new_tokens,
        config.max_total_tokens
    );
    assert!(
        stopping.stop_strings.len() <= config.max_stop_sequences
            && stopping.stop_strings.iter().all(|s| !s.is_empty()),
        "stop strings passed unchecked: {:?}",
        stopping.stop_strings
    );
    assert_eq!(stopping.stop_token_ids, config.eos_token_ids);
    assert!(
        sampling.temperature.is_finite() && sampling.temperature >= 0.0,
        "temperature {} passed",
        sampling.temperature
    );
    assert!(
        sampling.top_p > 0.0 && sampling.top_p <= 1.0,
        "top_p {} passed",
        sampling.top_p
    );
    assert!(
        sampling.repetition_penalty.is_finite() && sampling.repetition_penalty > 0.0,
        "repetition_penalty {} passed",
        sampling.repetition_penalty
    );
    assert!(
        sampling.top_n_logprobs <= config.max_top_n_tokens,
        "{} alternatives per token passed, max_top_n_tokens is {}",
        sampling.top_n_logprobs,
        config.max_top_n_tokens
    );
}

/// A POST of `body` to `path`, framed as `mode` says.
pub(crate) fn request(path: &str, mode: u8, body: Vec<u8>) -> Request<Body> {
    let mut request = Request::post(path);
    if mode & 2 == 0 {
        request = request.header(header::CONTENT_TYPE, "application/json");
    }
    let body = if mode & 1 == 0 {
        request = request.header(header::CONTENT_LENGTH, body.len());
        Body::from(body)
    } else {
        // Two chunks, as a chunked upload arrives: the reader must join them.
        let mut first = body;
        let second = first.split_off(first.len() / 2);
        let chunks = [first, second].map(|chunk| Ok::<_, std::io::Error>(Bytes::from(chunk)));
        Body::from_stream(futures::stream::iter(chunks))
    };
    request
        .body(body)
        .expect("a POST with a static path and valid headers builds")
}
