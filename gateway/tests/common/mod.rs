//! A gateway on a real socket over the fake backend, and an SSE reader for its streams.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gateway::fake::{FakeBackend, FakeScript};
use gateway::{Backend, GatewayConfig, GatewayError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const MODEL_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/models/stories260K"
);

/// How long a test waits on a condition before failing.
pub const WAIT: Duration = Duration::from_secs(10);

pub const CHATML: &str =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

pub fn tokenizer_path() -> PathBuf {
    PathBuf::from(MODEL_DIR).join("tokenizer.json")
}

pub fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(tokenizer_path()).expect("the stories260K tokenizer loads")
}

/// Small limits so that tests reach them with short prompts.
pub fn config() -> GatewayConfig {
    let mut config = GatewayConfig::new("stories260K", tokenizer_path());
    config.max_input_tokens = 64;
    config.max_total_tokens = 128;
    config.max_new_tokens_default = 8;
    config.max_concurrent_requests = 4;
    config.request_timeout_ms = 10_000;
    config.eos_token_ids = vec![2];
    config
}

/// A `tokenizer_config.json` with a ChatML template, in a temporary directory.
pub fn chat_tokenizer_config() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("tokenizer_config.json");
    let body = serde_json::json!({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "chat_template": CHATML,
    });
    std::fs::write(&path, body.to_string()).expect("writing tokenizer_config.json");
    (dir, path)
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub fake: Arc<FakeBackend>,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Result<(), GatewayError>>,
    pub client: reqwest::Client,
}

impl TestServer {
    pub async fn start(config: GatewayConfig, script: FakeScript) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding 127.0.0.1:0");
        let addr = listener.local_addr().expect("a bound address");
        let fake = Arc::new(FakeBackend::new(script));
        let backend: Arc<dyn Backend> = fake.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(gateway::run(config, listener, backend, shutdown.clone()));
        Self {
            addr,
            fake,
            shutdown,
            task,
            client: reqwest::Client::new(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("the gateway answers")
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .send()
            .await
            .expect("the gateway answers")
    }

    /// Posts and opens the SSE stream, checking the status and content type.
    pub async fn stream(&self, path: &str, body: serde_json::Value) -> SseReader {
        let response = self.post(path, body).await;
        assert_eq!(
            response.status(),
            200,
            "stream refused: {:?}",
            response.text().await
        );
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        SseReader::new(response)
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let result = tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the gateway stops in time")
            .expect("the gateway task does not panic");
        result.expect("the gateway stops cleanly");
    }
}

/// Reads `data:` payloads of SSE events, skipping comments (keep-alives).
pub struct SseReader {
    body: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buffer: String,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> Self {
        Self {
            body: response.bytes_stream().boxed(),
            buffer: String::new(),
        }
    }

    /// The next event's data, or `None` when the stream ended.
    pub async fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|line| line.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            let chunk = tokio::time::timeout(WAIT, self.body.next())
                .await
                .expect("the stream makes progress")?
                .expect("the stream body reads");
            self.buffer
                .push_str(std::str::from_utf8(&chunk).expect("SSE is UTF-8"));
        }
    }

    /// The next event's data as JSON.
    pub async fn next_json(&mut self) -> Option<serde_json::Value> {
        let data = self.next_data().await?;
        Some(serde_json::from_str(&data).unwrap_or_else(|e| panic!("event {data:?}: {e}")))
    }

    /// Every remaining event's data.
    pub async fn collect(mut self) -> Vec<String> {
        let mut events = Vec::new();
        while let Some(data) = self.next_data().await {
            events.push(data);
        }
        events
    }
}

/// Checks an error body in the shape of the path's API, and returns its message. TGI's routes:
/// exactly `{"error": <non-empty string>, "error_type": expected}` with `status`. OpenAI's
/// (`/v1/`): `{"error": {"message", "type": expected, "param", "code"}}`, where a TGI 422 is a
/// 400.
pub async fn assert_error(response: reqwest::Response, status: u16, error_type: &str) -> String {
    let openai = response.url().path().starts_with("/v1/");
    let status = if openai && status == 422 { 400 } else { status };
    assert_eq!(response.status(), status);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(content_type, "application/json");
    let body: serde_json::Value = response.json().await.expect("a JSON error body");
    let message = if openai {
        assert_eq!(body["error"]["type"], error_type, "{body}");
        let error = body["error"].as_object().expect("an error object");
        assert_eq!(error.len(), 4, "{body}");
        body["error"]["message"]
            .as_str()
            .expect("a message")
            .to_string()
    } else {
        assert_eq!(body["error_type"], error_type, "{body}");
        let object = body.as_object().expect("an object");
        assert_eq!(object.len(), 2, "{body}");
        body["error"].as_str().expect("a string error").to_string()
    };
    assert!(!message.is_empty());
    message
}
