//! One streamed request, timed from the client.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct Sample {
    pub ttft: Duration,
    pub e2e: Duration,
    pub tokens: usize,
    pub ok: bool,
}

impl Sample {
    /// Time per output token after the first.
    pub fn tpot(&self) -> Option<Duration> {
        (self.tokens > 1).then(|| (self.e2e - self.ttft) / (self.tokens as u32 - 1))
    }
}

/// Streams one request through `/generate_stream` and times its events.
pub async fn stream_once(
    client: &reqwest::Client,
    url: &str,
    prompt: &str,
    max_new_tokens: usize,
) -> anyhow::Result<Sample> {
    let start = Instant::now();
    let resp = client
        .post(format!("{url}/generate_stream"))
        .json(&json!({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}))
        .send()
        .await?;
    if !resp.status().is_success() {
        return Ok(Sample {
            ttft: start.elapsed(),
            e2e: start.elapsed(),
            tokens: 0,
            ok: false,
        });
    }
    let mut body = resp.bytes_stream();
    let mut ttft = None;
    let mut tokens = 0;
    let mut ok = false;
    let mut buf = String::new();
    while let Some(chunk) = body.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(pos) = buf.find("\n\n") {
            let event: String = buf.drain(..pos + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let v: serde_json::Value = serde_json::from_str(data.trim())?;
                if v.get("error").is_some() {
                    ok = false;
                    continue;
                }
                tokens += 1;
                ttft.get_or_insert_with(|| start.elapsed());
                if v["details"].is_object() {
                    ok = true;
                }
            }
        }
    }
    let e2e = start.elapsed();
    Ok(Sample {
        ttft: ttft.unwrap_or(e2e),
        e2e,
        tokens,
        ok,
    })
}
