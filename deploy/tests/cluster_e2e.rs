//! The disaggregated path across real processes: `fission up` with 1 prefill and 1 decode
//! node on loopback, KV over QUIC, driven through the public HTTP API with a real client.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use testkit::cluster_builder::ClusterBuilder;
use testkit::fission::{http_get, KillOnDrop, Up};
use testkit::references::{assert_concurrent_references, generate_ids, references};
use testkit::wait_until;

/// One cluster at a time: two at once on a 2-core CI machine would only test the scheduler.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

/// `fission up` with `prefill` and `decode` nodes (KV over QUIC), `env` and `args`.
fn start(prefill: usize, decode: usize, env: &[(&str, &str)], args: &[&str]) -> Up {
    let builder = ClusterBuilder::new(FISSION).nodes(prefill, decode);
    let builder = env.iter().fold(builder, |b, (k, v)| b.env(k, v));
    args.iter().fold(builder, |b, a| b.arg(*a)).start()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_cluster_serves_reference_tokens() {
    let _serial = SERIAL.lock().await;
    let cluster = start(1, 1, &[], &[]);
    let client = ::reqwest::Client::new();
    let refs = references();
    for r in &refs {
        let ids = generate_ids(&client, &cluster.url, &r.prompt, 32).await;
        assert_eq!(ids, r.expected(32), "prompt {}", r.prompt);
    }
    // 16 concurrent requests of mixed prompt and output lengths.
    assert_concurrent_references(&cluster.url, 16, |i| 8 + (i * 5) % 25).await;
    // SSE: every event is JSON; tokens arrive in order and the last event closes the stream.
    let resp = client
        .post(format!("{}/generate_stream", cluster.url))
        .json(&json!({"inputs": refs[0].prompt, "parameters": {"max_new_tokens": 12}}))
        .send()
        .await
        .expect("stream");
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.expect("body");
    let events: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| serde_json::from_str(d.trim()).expect("each event is JSON"))
        .collect();
    assert_eq!(events.len(), 12);
    let ids: Vec<u64> = events
        .iter()
        .map(|e| e["token"]["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(ids, refs[0].expected(12));
    let last = events.last().expect("last");
    assert_eq!(last["details"]["finish_reason"], "length");
    assert!(last["generated_text"].is_string());
    assert!(events[..11].iter().all(|e| e["generated_text"].is_null()));
    // The KV really crossed the network, and everything was given back.
    assert!(cluster.metric("decode-0", "fission_decode_kv_received_bytes_total") > 0.0);
    assert!(cluster.metric("prefill-0", "fission_prefill_kv_transfer_bytes_total") > 0.0);
    assert_eq!(
        cluster.metric("decode-0", "fission_decode_kv_blocks_used"),
        0.0
    );
    assert_eq!(
        cluster.metric("decode-0", "fission_decode_kv_blocks_reserved"),
        0.0
    );
    // Every component's exposition passes promtool, and its names say whose they are.
    let gateway_metrics = format!("{}/metrics", cluster.url);
    for (component, url) in [
        ("gateway", gateway_metrics.as_str()),
        ("prefill", cluster.metrics_url("prefill-0")),
        ("decode", cluster.metrics_url("decode-0")),
    ] {
        let text = http_get(url).unwrap_or_default();
        let prefix = format!("fission_{component}_");
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(
                name.starts_with(&prefix),
                "{component} exposes {name}, not named {prefix}<what>_<unit>"
            );
        }
        if let Some(report) = testkit::promtool::check(&text).expect("promtool passes") {
            println!("promtool check metrics ({component}): ok {report}");
        }
    }

    // A node added with the command `fission up` printed joins the QUIC cluster (the shared
    // dev-CA certificate), and serves once the original prefill node is drained.
    let mut argv: Vec<String> = cluster
        .join
        .split_whitespace()
        .map(|a| a.replace("decode|prefill", "prefill"))
        .collect();
    assert_eq!(
        argv.first().map(String::as_str),
        Some("fission"),
        "{}",
        cluster.join
    );
    assert!(cluster.join.contains("--tls-cert"), "{}", cluster.join);
    argv.remove(0);
    let etcd = argv[argv.iter().position(|a| a == "--etcd").expect("--etcd") + 1].clone();
    let mut joined = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_fission"))
            .args(&argv)
            .args(["--node-id", "prefill-joined", "--num-kv-blocks=512"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the printed command starts a node"),
    );
    let mut announce = String::new();
    BufReader::new(joined.0.stdout.take().expect("stdout"))
        .read_line(&mut announce)
        .expect("announce");
    let joined_metrics = announce
        .split("metrics=")
        .nth(1)
        .unwrap_or_else(|| panic!("node announces its metrics URL, got {announce:?}"))
        .trim()
        .to_string();
    wait_until(
        "the joined node to reach the gateway",
        Duration::from_secs(20),
        || {
            cluster
                .gateway_nodes()
                .iter()
                .any(|n| n == "prefill-joined")
        },
    );
    let drained = Command::new(env!("CARGO_BIN_EXE_fission"))
        .args(["nodes", "drain", "prefill-0", "--etcd", &etcd])
        .args(cluster.admin_credentials())
        .status()
        .expect("fission nodes drain");
    assert!(drained.success());
    wait_until("prefill-0 to leave", Duration::from_secs(30), || {
        !cluster.gateway_nodes().iter().any(|n| n == "prefill-0")
    });
    let ids = generate_ids(&client, &cluster.url, &refs[0].prompt, 16).await;
    assert_eq!(ids, refs[0].expected(16));
    // The push task counts its bytes once Done is answered, which may be just after the
    // request has ended.
    wait_until(
        "the joined node to count the KV it pushed over QUIC",
        Duration::from_secs(10),
        || {
            testkit::fission::metric(&joined_metrics, "fission_prefill_kv_transfer_bytes_total")
                > 0.0
        },
    );
    drop(joined);
    drop(cluster);

    // Colocated (no prefill node): the same ids.
    let colocated = start(0, 1, &[], &[]);
    for r in &refs {
        let ids = generate_ids(&client, &colocated.url, &r.prompt, 32).await;
        assert_eq!(ids, r.expected(32), "colocated prompt {}", r.prompt);
    }
    assert_eq!(
        colocated.metric("decode-0", "fission_decode_kv_received_bytes_total"),
        0.0
    );
    drop(colocated);

    // Conditional disaggregation: with a prefill node up, prompts under the threshold are
    // still prefilled on the decode node.
    let conditional = start(1, 1, &[], &["--max-local-prefill-tokens", "100"]);
    let r = &refs[1];
    let ids = generate_ids(&client, &conditional.url, &r.prompt, 32).await;
    assert_eq!(ids, r.expected(32));
    assert!(conditional.metric("decode-0", "fission_decode_local_prefill_total") >= 1.0);
    assert_eq!(
        conditional.metric("decode-0", "fission_decode_kv_received_bytes_total"),
        0.0
    );
    assert_eq!(
        conditional.metric("prefill-0", "fission_prefill_prompts_total"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_frees_blocks_on_both_nodes() {
    let _serial = SERIAL.lock().await;
    // 20 ms per decode step keeps the stream open long enough to leave mid-way.
    let cluster = start(1, 1, &[("FISSION_DEBUG_STEP_DELAY_MS", "20")], &[]);
    let client = ::reqwest::Client::new();
    let resp = client
        .post(format!("{}/generate_stream", cluster.url))
        .json(&json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 400}}))
        .send()
        .await
        .expect("stream");
    let mut body = resp.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        let chunk = body.next().await.expect("more events").expect("chunk");
        seen += String::from_utf8_lossy(&chunk).matches("data:").count();
    }
    assert!(
        cluster.metric("decode-0", "fission_decode_kv_blocks_used") > 0.0,
        "mid-stream blocks are held"
    );
    drop(body);
    cluster.wait_kv_released(Duration::from_secs(2)).await;
    assert!(
        cluster.metric("decode-0", "fission_decode_cancelled_total") >= 1.0,
        "the decode node saw the cancellation"
    );
}

/// The overlap benchmark's baseline (`--push-after-prefill`: every layer held until the prompt
/// is done) moves the same KV: the reference tokens, concurrently, and every block given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushing_after_the_prefill_serves_the_same_tokens() {
    let _serial = SERIAL.lock().await;
    let cluster = start(1, 1, &[], &["--prefill-arg=--push-after-prefill"]);
    assert_concurrent_references(&cluster.url, 6, |_| 24).await;
    assert!(cluster.metric("decode-0", "fission_decode_kv_received_bytes_total") > 0.0);
    cluster.wait_kv_released(Duration::from_secs(2)).await;
}
