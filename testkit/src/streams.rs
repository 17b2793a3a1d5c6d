//! Bounded streaming load for the fault suite: clients that each send a fixed number of
//! `/generate_stream` requests and record, per request, when it started, its first token, its
//! end, its outcome and its largest gap between tokens.

use std::time::{Duration, Instant};

use serde_json::Value;

/// How a streamed request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A final event with the generated text.
    Done,
    /// An SSE error event: its `error_type` and message.
    ErrorEvent(String, String),
    /// An HTTP error before the stream: status and body.
    Refused(u16, String),
    /// The connection failed, or the stream ended without a final event.
    Broken(String),
}

/// One request's record.
#[derive(Debug, Clone)]
pub struct Record {
    pub client: usize,
    pub started: Instant,
    pub first_token: Option<Duration>,
    pub ended: Duration,
    pub outcome: Outcome,
    /// The largest time between two tokens (or from the start to the first).
    pub max_gap: Duration,
    pub token_ids: Vec<u64>,
    /// The final event's `generated_text`.
    pub text: String,
}

impl Record {
    pub fn ok(&self) -> bool {
        self.outcome == Outcome::Done
    }

    /// When the request ended.
    pub fn end(&self) -> Instant {
        self.started + self.ended
    }
}

/// Streams one `/generate_stream` request with `body` and records it. Bounded by `timeout`.
pub async fn stream_one(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    client: usize,
    timeout: Duration,
) -> Record {
    let started = Instant::now();
    let mut record = Record {
        client,
        started,
        first_token: None,
        ended: Duration::ZERO,
        outcome: Outcome::Broken("no answer".into()),
        max_gap: Duration::ZERO,
        token_ids: Vec::new(),
        text: String::new(),
    };
    let outcome = match tokio::time::timeout(timeout, read(http, url, body, &mut record)).await {
        Ok(outcome) => outcome,
        Err(_) => Outcome::Broken(format!("no end within {timeout:?}")),
    };
    record.outcome = outcome;
    record.ended = started.elapsed();
    record
}

async fn read(http: &reqwest::Client, url: &str, body: &Value, r: &mut Record) -> Outcome {
    let resp = match http
        .post(format!("{url}/generate_stream"))
        .json(body)
        .send()
        .await
    {
        Ok(resp) => resp,
        Err(e) => return Outcome::Broken(e.to_string()),
    };
    let status = resp.status();
    if !status.is_success() {
        return Outcome::Refused(status.as_u16(), resp.text().await.unwrap_or_default());
    }
    let mut resp = resp;
    let mut buf = String::new();
    let mut last = r.started;
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => return Outcome::Broken("the stream ended without a final event".into()),
            Err(e) => return Outcome::Broken(e.to_string()),
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<Value>(data.trim()) else {
                    continue;
                };
                if let Some(error) = v.get("error") {
                    return Outcome::ErrorEvent(
                        v["error_type"].as_str().unwrap_or_default().to_string(),
                        error.as_str().unwrap_or_default().to_string(),
                    );
                }
                let now = Instant::now();
                r.max_gap = r.max_gap.max(now - last);
                last = now;
                if r.first_token.is_none() {
                    r.first_token = Some(now - r.started);
                }
                if let Some(id) = v["token"]["id"].as_u64() {
                    r.token_ids.push(id);
                }
                if let Some(text) = v["generated_text"].as_str() {
                    r.text = text.to_string();
                    return Outcome::Done;
                }
            }
        }
    }
}

/// `clients` clients, each sending `per_client` requests one after another, with bodies from
/// `body(client, i)`; every request bounded by `timeout`. Returns every record once all end.
pub fn run(
    url: &str,
    clients: usize,
    per_client: usize,
    timeout: Duration,
    body: impl Fn(usize, usize) -> Value + Send + Sync + 'static,
) -> Vec<Record> {
    run_until(url, clients, per_client, None, timeout, body)
}

/// As [`run`], but clients also stop starting requests at `until`.
pub fn run_until(
    url: &str,
    clients: usize,
    per_client: usize,
    until: Option<Instant>,
    timeout: Duration,
    body: impl Fn(usize, usize) -> Value + Send + Sync + 'static,
) -> Vec<Record> {
    let body = std::sync::Arc::new(body);
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (url, body) = (url.to_string(), std::sync::Arc::clone(&body));
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let http = reqwest::Client::new();
                    let mut records = Vec::new();
                    for i in 0..per_client {
                        if until.is_some_and(|u| Instant::now() >= u) {
                            break;
                        }
                        records.push(stream_one(&http, &url, &body(c, i), c, timeout).await);
                    }
                    records
                })
            })
        })
        .collect();
    threads
        .into_iter()
        .flat_map(|t| t.join().expect("a client panicked"))
        .collect()
}

/// A one-line summary per request, for assertion messages.
pub fn summary(records: &[Record]) -> String {
    records
        .iter()
        .map(|r| {
            format!(
                "client {} ttft {:?} end {:.2?} gap {:.2?} tokens {} {:?}",
                r.client,
                r.first_token.map(|t| format!("{t:.2?}")),
                r.ended,
                r.max_gap,
                r.token_ids.len(),
                r.outcome
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The slowest request's time from its start to its end.
pub fn slowest(records: &[Record]) -> Duration {
    records
        .iter()
        .map(|r| r.end() - r.started)
        .max()
        .unwrap_or_default()
}
