//! KV pressure on one decode node: 200 concurrent streams on a node of 128 blocks, where the
//! gateway places 128 at once. A node that admitted each request by its prompt alone ran out
//! of blocks as the sequences grew and preempted them in a storm (594 preemptions for 200
//! requests, streams standing still over a second); one that admits a request only when its
//! pool holds every admitted request at its longest queues the rest instead. Preemptions must
//! stay at most 10% of the requests, no stream may stand still between two tokens longer than
//! twice the TPOT p99 of the run, and the node's KV gauges return to 0.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::fission::{Up, UpConfig};

const REQUESTS: usize = 200;
const MAX_NEW_TOKENS: usize = 48;

fn fission() -> PathBuf {
    std::env::var_os("FISSION_KV_PRESSURE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fission")))
}

/// One stream: when each token came, or why it failed.
async fn stream(http: reqwest::Client, url: String, i: usize) -> Result<Vec<Instant>, String> {
    // OpenAI's route, for vLLM's `ignore_eos`: every stream grows to its full length.
    let body = json!({
        "model": "stories260K",
        "prompt": format!("Once upon a time, story {i}"),
        "max_tokens": MAX_NEW_TOKENS,
        "ignore_eos": true,
        "stream": true,
        "temperature": 0.8,
        "seed": i,
    });
    let mut resp = http
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!(
            "{}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        ));
    }
    let (mut buf, mut times) = (String::new(), Vec::new());
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data:")) {
                if data.trim() == "[DONE]" {
                    return Ok(times);
                }
                let Ok(v) = serde_json::from_str::<Value>(data.trim()) else {
                    continue;
                };
                if let Some(e) = v.get("error") {
                    return Err(e.to_string());
                }
                if v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                {
                    times.push(Instant::now());
                }
            }
        }
    }
    Err("the stream ended without a final event".into())
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

// Ignored: on stories260K here it does not reproduce the storm, before or after the node's
// admission change (0 preemptions either way: about 28 requests are on the node at once, not
// 128), and its stand-still check fails on both by a hair (212 ms against 2 x 105 ms: one
// missed step). Kept as the measurement, with `--ignored`, until it reproduces the storm.
#[test]
#[ignore = "does not reproduce the preemption storm yet; a measurement"]
fn a_node_short_of_blocks_queues_requests_rather_than_preempting_them() {
    let mut config = UpConfig::new(fission(), 1, 1);
    config.node_args = vec!["--num-kv-blocks=128".into()];
    // stories260K decodes a batch in about a millisecond: requests would end before 128 of
    // them are on the node. A step of 100 ms lets them pile up as on a real model.
    config.env = vec![("FISSION_DEBUG_STEP_DELAY_MS".into(), "100".into())];
    let up = Up::start(&config);
    let url = up.url.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let results: Vec<Result<Vec<Instant>, String>> = rt.block_on(async move {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        let tasks: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let (http, url) = (http.clone(), url.clone());
                tokio::spawn(tokio::time::timeout(
                    Duration::from_secs(240),
                    stream(http, url, i),
                ))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(match t.await.unwrap() {
                Ok(r) => r,
                Err(_) => Err("no end within 240 s".into()),
            });
        }
        out
    });
    let elapsed = started.elapsed();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    // Per stream: its time per output token, and its longest stand-still between tokens.
    let mut tpots = Vec::new();
    let mut max_gap = Duration::ZERO;
    for times in results.iter().flatten() {
        let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
        if gaps.is_empty() {
            continue;
        }
        tpots.push(gaps.iter().sum::<Duration>() / gaps.len() as u32);
        max_gap = max_gap.max(gaps.into_iter().max().unwrap());
    }
    let tpot_p99 = p99(tpots);
    let decode = up.metrics_url("decode-0").to_string();
    let preemptions = testkit::fission::metric(&decode, "fission_decode_preemptions_total");
    let capacity = testkit::fission::metric(&decode, "fission_decode_kv_blocks_capacity");
    let tokens: usize = results.iter().flatten().map(Vec::len).sum();
    println!(
        "kv pressure: {REQUESTS} requests in {elapsed:.2?}: {preemptions} preemptions ({:.2} per request), longest stand-still {max_gap:.2?}, TPOT p99 {tpot_p99:.2?}; {tokens} tokens, {capacity} blocks",
        preemptions / REQUESTS as f64
    );
    testkit::wait_until(
        "the decode node's KV gauges back to 0",
        Duration::from_secs(30),
        || {
            [
                "fission_decode_kv_blocks_used",
                "fission_decode_kv_blocks_reserved",
            ]
            .iter()
            .all(|m| testkit::fission::metric(&decode, m) == 0.0)
        },
    );
    assert!(
        preemptions <= REQUESTS as f64 / 10.0,
        "{preemptions} preemptions for {REQUESTS} requests"
    );
    assert!(
        max_gap <= tpot_p99 * 2,
        "a stream stood still {max_gap:.2?}, over 2 x TPOT p99 {tpot_p99:.2?}"
    );
}
