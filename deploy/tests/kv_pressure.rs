//! KV pressure on one decode node: 200 concurrent streams on a node of 128 blocks, where the
//! gateway places up to 128 at once (its `--max-concurrent-requests`). A node that admitted
//! each request by its prompt alone took them all (one block each) and ran out of blocks as
//! the sequences grew: it preempted them in a storm (issue 31: 594 preemptions for 200
//! requests, streams standing still over a second). One that admits a request only when its
//! pool holds every admitted request at its longest queues the rest in the gateway instead.
//! Preemptions must stay at most 10% of the requests, no stream may stand still between two
//! tokens longer than twice the TPOT p99 of the run, every stream runs to its end, and the
//! node's KV gauges return to 0. `FISSION_KV_PRESSURE_BIN` runs another build of `fission`
//! (one with the `failpoints` features, for the slowed step).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::fission::{Up, UpConfig};

const REQUESTS: usize = 200;
const MAX_NEW_TOKENS: usize = 32;
/// The decode node's step, slowed (a test failpoint) so that streams last as on a real model.
const STEP_MS: u64 = 100;

fn fission() -> PathBuf {
    std::env::var_os("FISSION_KV_PRESSURE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fission")))
}

/// Tokens whose chunk had no text (counting only chunks with text would read each as a
/// missed step).
static EMPTY_TOKENS: AtomicUsize = AtomicUsize::new(0);

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
                // One chunk per token, its text empty or not (a token that completes no
                // character has none yet); the usage chunk has no choice.
                if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                    times.push(Instant::now());
                    if v["choices"][0]["text"].as_str().is_none_or(str::is_empty) {
                        EMPTY_TOKENS.fetch_add(1, Ordering::Relaxed);
                    }
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

/// Samples a gauge of `metrics_url` until `stop`; the most it read.
fn peak(metrics_url: String, name: &'static str, stop: Arc<AtomicBool>) -> f64 {
    let mut most: f64 = 0.0;
    while !stop.load(Ordering::SeqCst) {
        most = most.max(testkit::fission::metric(&metrics_url, name));
        std::thread::sleep(Duration::from_millis(50));
    }
    most
}

#[test]
fn a_node_short_of_blocks_queues_requests_rather_than_preempting_them() {
    let mut config = UpConfig::new(fission(), 1, 1);
    config.node_args = vec!["--num-kv-blocks=128".into()];
    // stories260K decodes a batch in about a millisecond: requests would end before 128 of
    // them are on the node. A step of STEP_MS lets them pile up as on a real model.
    config.env = vec![("FISSION_DEBUG_STEP_DELAY_MS".into(), STEP_MS.to_string())];
    let up = Up::start(&config);
    let url = up.url.clone();
    let decode = up.metrics_url("decode-0").to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (decode, stop) = (decode.clone(), Arc::clone(&stop));
        std::thread::spawn(move || peak(decode, "fission_decode_running_sequences", stop))
    };
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
    stop.store(true, Ordering::SeqCst);
    let most_running = sampler.join().unwrap();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    // Per stream: its time per output token, and its stand-stills between tokens (with the
    // stream and the token they end at, to tell a join from a stall).
    let mut tpots = Vec::new();
    let mut stills = Vec::new();
    for (i, times) in results.iter().flatten().enumerate() {
        let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
        if gaps.is_empty() {
            continue;
        }
        tpots.push(gaps.iter().sum::<Duration>() / gaps.len() as u32);
        stills.extend(gaps.into_iter().enumerate().map(|(k, g)| (g, i, k + 1)));
    }
    // Longest first.
    stills.sort();
    stills.reverse();
    let max_gap = stills.first().map_or(Duration::ZERO, |s| s.0);
    let tpot_p99 = p99(tpots);
    let preemptions = testkit::fission::metric(&decode, "fission_decode_preemptions_total");
    let capacity = testkit::fission::metric(&decode, "fission_decode_kv_blocks_capacity");
    let tokens: usize = results.iter().flatten().map(Vec::len).sum();
    let over_1s = stills
        .iter()
        .filter(|s| s.0 > Duration::from_secs(1))
        .count();
    // The first gap is the join: the prefill node's token, then the decode node's first
    // step after the KV arrived (it waits for the step in flight to end).
    let longest = |join: bool| {
        stills
            .iter()
            .find(|s| (s.2 == 1) == join)
            .map_or(Duration::ZERO, |s| s.0)
    };
    println!(
        "kv pressure: {REQUESTS} requests in {elapsed:.2?}: {preemptions} preemptions ({:.2} per request), at most {most_running} running on the node, longest stand-still {max_gap:.2?}, TPOT p99 {tpot_p99:.2?}, {over_1s} stand-stills over 1 s; {tokens} tokens ({} without text), {capacity} blocks",
        preemptions / REQUESTS as f64,
        EMPTY_TOKENS.load(Ordering::Relaxed),
    );
    println!(
        "longest stand-stills: at the join {:.2?}, after it {:.2?}; (gap, stream, token): {:?}",
        longest(true),
        longest(false),
        &stills[..stills.len().min(8)]
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
    assert_eq!(
        tokens,
        REQUESTS * MAX_NEW_TOKENS,
        "every stream ran to its end"
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
