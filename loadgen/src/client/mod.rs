//! One streamed request, timed from the client, against any of the three APIs. Each API's
//! body and event meanings live in its own file; framing (`sse`) and timing are shared.

pub mod openai;
pub mod sse;
pub mod tgi;

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::Value;

use crate::config::{Api, Target};
use crate::error::LoadError;
use crate::record::{ErrorKind, RequestRecord};
use crate::workload::RequestSpec;
use sse::{SseDecoder, SseEvent};

/// What one event means for the measurement.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EventMeaning {
    /// Tokens the event carries: 0 for role-only deltas, usage chunks and `[DONE]`.
    pub tokens: usize,
    /// The event ends the generation (`[DONE]`, a `finish_reason`, TGI's `generated_text`).
    pub finished: bool,
    /// The server's error type, when the event is an error.
    pub error: Option<String>,
    pub completion_tokens: Option<usize>,
    pub prompt_tokens: Option<usize>,
}

impl EventMeaning {
    fn error(error_type: String) -> Self {
        Self {
            error: Some(error_type),
            ..Self::default()
        }
    }
}

/// The error type of an error body, in the shapes servers use: Fission's and TGI's
/// `{"error": "...", "error_type": "overloaded"}`, OpenAI's `{"error": {"type", "code"}}`,
/// vLLM's older `{"object": "error", "type": ...}`. Cut to a short label-safe word.
fn error_type(v: &Value) -> String {
    let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
    let nested = v.get("error").filter(|e| e.is_object());
    let raw = s(v.get("error_type"))
        .or_else(|| nested.and_then(|e| s(e.get("code")).or_else(|| s(e.get("type")))))
        .or_else(|| s(v.get("type")))
        .unwrap_or_else(|| "error".to_string());
    let clean: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(40)
        .collect();
    if clean.is_empty() {
        "error".into()
    } else {
        clean
    }
}

/// The timing of one stream, event by event.
#[derive(Debug, Default)]
pub struct StreamTally {
    ttft_s: Option<f64>,
    last_token_s: Option<f64>,
    itl_s: Vec<f64>,
    counted_tokens: usize,
    reported_tokens: Option<usize>,
    prompt_tokens: Option<usize>,
    finished: bool,
    error: Option<ErrorKind>,
}

impl StreamTally {
    /// Takes in one event seen `at_s` after the request was sent. Returns false once the
    /// stream has failed: nothing after an error event is measured.
    pub fn observe(&mut self, m: EventMeaning, at_s: f64) -> bool {
        if let Some(error_type) = m.error {
            self.error = Some(ErrorKind::SseError { error_type });
            return false;
        }
        if m.tokens > 0 {
            if let Some(last) = self.last_token_s {
                self.itl_s.push(at_s - last);
            }
            self.ttft_s.get_or_insert(at_s);
            self.last_token_s = Some(at_s);
            self.counted_tokens += m.tokens;
        }
        self.reported_tokens = m.completion_tokens.or(self.reported_tokens);
        self.prompt_tokens = m.prompt_tokens.or(self.prompt_tokens);
        self.finished |= m.finished;
        true
    }

    /// The server's count when it gave one (it knows about tokens with no text, and about
    /// several tokens in one event), else the events counted.
    pub fn output_tokens(&self) -> usize {
        self.reported_tokens.unwrap_or(self.counted_tokens)
    }

    /// The failure, if the stream failed or ended without its end marker.
    pub fn error(&self) -> Option<ErrorKind> {
        match &self.error {
            Some(e) => Some(e.clone()),
            None if !self.finished => Some(ErrorKind::Incomplete),
            None => None,
        }
    }

    /// Feeds a stream's events, as decoded, through `api`'s meanings.
    pub fn observe_event(&mut self, api: Api, event: &SseEvent, at_s: f64) -> bool {
        let meaning = match api {
            Api::OpenaiCompletions => openai::interpret(event, false),
            Api::OpenaiChat => openai::interpret(event, true),
            Api::Tgi => tgi::interpret(event),
        };
        match meaning {
            Ok(m) => self.observe(m, at_s),
            Err(_) => {
                self.error = Some(ErrorKind::Malformed);
                false
            }
        }
    }
}

/// Sends requests to one target. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    target: Target,
    endpoint: String,
    request_timeout: Duration,
}

impl Client {
    pub fn new(target: Target, request_timeout: Duration) -> Result<Self, LoadError> {
        // No proxy and no redirects: traffic goes to the given address and nowhere else.
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(request_timeout.min(Duration::from_secs(10)))
            .tcp_nodelay(true)
            .build()
            .map_err(LoadError::Client)?;
        Ok(Self {
            http,
            endpoint: target.endpoint(),
            target,
            request_timeout,
        })
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The first model id of `GET /v1/models`, for OpenAI servers that want `model` (vLLM);
    /// `None` when the server has no such route. One request, to the target only.
    pub async fn discover_model(&self) -> Option<String> {
        let url = format!("{}/v1/models", self.target.base_url.trim_end_matches('/'));
        let mut req = self.http.get(url).timeout(Duration::from_secs(10));
        if let Some(key) = &self.target.api_key {
            req = req.bearer_auth(key);
        }
        let v: Value = req.send().await.ok()?.json().await.ok()?;
        v["data"][0]["id"].as_str().map(str::to_string)
    }

    /// Sends `spec` and times it. Never fails: a failure is recorded in the result.
    pub async fn send(&self, spec: &RequestSpec, level_start: Instant) -> RequestRecord {
        let start = Instant::now();
        let mut tally = StreamTally::default();
        let streamed =
            tokio::time::timeout(self.request_timeout, self.stream(spec, start, &mut tally)).await;
        let e2e_s = start.elapsed().as_secs_f64();
        let error = match streamed {
            Err(_) => Some(ErrorKind::Timeout),
            Ok(Err(kind)) => Some(kind),
            Ok(Ok(())) => tally.error(),
        };
        RequestRecord {
            index: spec.index,
            sent_at_s: start.saturating_duration_since(level_start).as_secs_f64(),
            input_len: spec.input_len,
            prompt_tokens: tally.prompt_tokens,
            output_len: spec.output_len,
            output_tokens: tally.output_tokens(),
            ttft_s: tally.ttft_s,
            e2e_s,
            itl_s: std::mem::take(&mut tally.itl_s),
            error,
        }
    }

    async fn stream(
        &self,
        spec: &RequestSpec,
        start: Instant,
        tally: &mut StreamTally,
    ) -> Result<(), ErrorKind> {
        let api = self.target.api;
        let model = self.target.model.as_deref();
        let body = match api {
            Api::OpenaiCompletions => openai::body(spec, model, false),
            Api::OpenaiChat => openai::body(spec, model, true),
            Api::Tgi => tgi::body(spec),
        };
        let mut req = self.http.post(&self.endpoint).json(&body);
        if let Some(key) = &self.target.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(classify)?;
        if !resp.status().is_success() {
            return Err(ErrorKind::Http {
                status: resp.status().as_u16(),
            });
        }
        let mut bytes = resp.bytes_stream();
        let mut decoder = SseDecoder::new();
        while let Some(chunk) = bytes.next().await {
            let chunk = chunk.map_err(classify)?;
            let at_s = start.elapsed().as_secs_f64();
            for event in decoder.push(&chunk) {
                if !tally.observe_event(api, &event, at_s) {
                    return Ok(());
                }
            }
        }
        if let Some(event) = decoder.finish() {
            tally.observe_event(api, &event, start.elapsed().as_secs_f64());
        }
        Ok(())
    }
}

fn classify(e: reqwest::Error) -> ErrorKind {
    if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.is_connect() {
        ErrorKind::Connect
    } else {
        ErrorKind::Transport
    }
}

#[cfg(test)]
mod tests;
