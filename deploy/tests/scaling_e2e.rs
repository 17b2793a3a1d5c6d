//! Elastic clusters across real processes and a real etcd: nodes added, drained with SIGTERM,
//! killed with SIGKILL, and etcd stopped for 10 s, all under a steady load that must see no
//! failed request; a node serving another model is refused; prompts sharing a long prefix go
//! to the prefill node that holds it.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::fission::{
    metric, metric_sum, nodes_json, stories_dir, Added, Load, NodeConfig, Up, UpConfig,
};
use testkit::wait_until;

/// One cluster at a time: two at once on a 2-core CI machine would only test the scheduler.
static SERIAL: Mutex<()> = Mutex::new(());

const LEASE_TTL_S: u64 = 3;
const FISSION: &str = env!("CARGO_BIN_EXE_fission");

fn fission() -> Command {
    Command::new(FISSION)
}

/// `fission nodes list --json`, as the node ids it lists with their state.
fn nodes_list(etcd: &str) -> Vec<(String, String)> {
    nodes_json(Path::new(FISSION), etcd)
        .iter()
        .map(|n| {
            (
                n["node_id"].as_str().unwrap().to_string(),
                n["state"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn listed(etcd: &str, node_id: &str) -> bool {
    nodes_list(etcd).iter().any(|(n, _)| n == node_id)
}

/// The lease each listed node's record lives under, by node id.
fn leases(etcd: &str) -> Vec<(String, i64)> {
    nodes_json(Path::new(FISSION), etcd)
        .iter()
        .map(|n| {
            (
                n["node_id"].as_str().unwrap().to_string(),
                n["lease_id"].as_i64().expect("lease_id"),
            )
        })
        .collect()
}

/// The free KV blocks `node_id` last published, from `fission nodes list --json`.
fn free_blocks(etcd: &str, node_id: &str) -> Option<u64> {
    nodes_json(Path::new(FISSION), etcd)
        .iter()
        .find(|n| n["node_id"] == node_id)?["load"]["free_blocks"]
        .as_u64()
}

/// `fission up` on `etcd` with KV over TCP and a short lease, logging to `log`.
fn up(etcd: &str, prefill: usize, decode: usize, log: &Path) -> Up {
    let mut config = UpConfig::new(FISSION, prefill, decode);
    config.etcd = Some(etcd.to_string());
    config.kv_transport = "tcp".into();
    config
        .node_args
        .push(format!("--lease-ttl-s={LEASE_TTL_S}"));
    config.env.push(("RUST_LOG".into(), "info".into()));
    config.log = Some(log.to_path_buf());
    Up::start(&config)
}

/// A node added with `fission node start`, with the test's lease.
fn added(role: &str, node_id: &str, model: &Path, etcd: &str, log: &Path) -> NodeConfig {
    NodeConfig {
        fission: FISSION.into(),
        role: role.into(),
        node_id: node_id.into(),
        model: model.to_path_buf(),
        etcd: etcd.into(),
        args: vec!["--lease-ttl-s".into(), LEASE_TTL_S.to_string()],
        env: Vec::new(),
        log: log.to_path_buf(),
    }
}

#[test]
fn scale_drain_kill_and_etcd_outage_under_load() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = cluster::LocalEtcd::start(dir.path()).expect("etcd starts");
    let etcd_url = etcd.endpoint();
    let up = up(&etcd_url, 1, 1, &dir.path().join("up.log"));
    let load = Load::start(&up.url, 3, 16);
    wait_until("the first responses", Duration::from_secs(30), || {
        load.ok() >= 3
    });
    let tput_1p1d = load.throughput(Duration::from_secs(8));

    // Scale the decode pool up.
    let mut decode2 = Added::start(&added(
        "decode",
        "decode-added",
        &stories_dir(),
        &etcd_url,
        &dir.path().join("decode-added.log"),
    ));
    wait_until("decode-added in nodes list", Duration::from_secs(5), || {
        listed(&etcd_url, "decode-added")
    });
    let decode_listed = decode2.started.elapsed();
    // An idle new node publishes its free blocks: routers rank a node without room last.
    wait_until(
        "decode-added publishes its free blocks",
        Duration::from_secs(5),
        || free_blocks(&etcd_url, "decode-added").is_some_and(|f| f > 0),
    );
    wait_until("decode-added gets requests", Duration::from_secs(5), || {
        metric(&decode2.metrics, "fission_decode_generated_tokens_total") > 0.0
    });
    let decode_first_request = decode2.started.elapsed();
    assert!(
        decode_first_request < Duration::from_secs(5),
        "the added decode node got its first request {decode_first_request:?} after it started"
    );
    let tput_1p2d = load.throughput(Duration::from_secs(8));

    // Scale the prefill pool up.
    let mut prefill2 = Added::start(&added(
        "prefill",
        "prefill-added",
        &stories_dir(),
        &etcd_url,
        &dir.path().join("prefill-added.log"),
    ));
    wait_until(
        "prefill-added in nodes list",
        Duration::from_secs(5),
        || listed(&etcd_url, "prefill-added"),
    );
    let prefill_listed = prefill2.started.elapsed();
    wait_until(
        "prefill-added gets requests",
        Duration::from_secs(5),
        || metric(&prefill2.metrics, "fission_prefill_prompts_total") > 0.0,
    );
    let prefill_first_request = prefill2.started.elapsed();
    assert!(
        prefill_first_request < Duration::from_secs(5),
        "the added prefill node got its first request {prefill_first_request:?} after it started"
    );
    load.assert_no_failures("while scaling up");

    // Drain a decode node with SIGTERM: it finishes its work and exits 0.
    let before = load.ok();
    decode2.signal(libc::SIGTERM);
    let status = decode2.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "a drained node exits 0, got {status}");
    assert!(!listed(&etcd_url, "decode-added"));
    wait_until("requests after the drain", Duration::from_secs(30), || {
        load.ok() >= before + 5
    });
    load.assert_no_failures("across the drain");

    // SIGKILL a prefill node: it leaves within the lease TTL + 2 s.
    prefill2.signal(libc::SIGKILL);
    let killed = Instant::now();
    prefill2.wait_exit(Duration::from_secs(5));
    wait_until(
        "the killed node leaves the pool",
        Duration::from_secs(LEASE_TTL_S + 2),
        || {
            !listed(&etcd_url, "prefill-added")
                && !up.gateway_nodes().iter().any(|n| n == "prefill-added")
        },
    );
    let removal = killed.elapsed();
    let before = load.ok();
    wait_until("requests after the kill", Duration::from_secs(30), || {
        load.ok() >= before + 5
    });
    load.assert_no_failures("across the kill");

    // etcd down for 10 s: serving goes on; nodes are registered again within 5 s of its return.
    let before = load.ok();
    let leases_before = leases(&etcd_url);
    etcd.stop();
    std::thread::sleep(Duration::from_secs(10)); // the outage itself, not a wait for a condition
    let during_outage = load.ok() - before;
    let back = Instant::now();
    etcd.restart().expect("etcd restarts");
    // etcd keeps leases across a restart, so the old records are still listed for a while:
    // a node counts as registered again when its record is under a new lease.
    wait_until(
        "every node registered again",
        Duration::from_secs(5),
        || {
            let nodes = nodes_json(Path::new(FISSION), &etcd_url);
            ["prefill-0", "decode-0"].iter().all(|id| {
                let old = leases_before.iter().find(|(n, _)| n == id).map(|l| l.1);
                nodes.iter().any(|n| {
                    n["node_id"] == *id && n["state"] == "serving" && n["lease_id"].as_i64() != old
                })
            })
        },
    );
    let reregistered = back.elapsed();
    assert!(during_outage > 0, "requests completed while etcd was down");
    let before = load.ok();
    wait_until(
        "requests after etcd's return",
        Duration::from_secs(30),
        || load.ok() >= before + 5,
    );
    load.assert_no_failures("across the etcd outage");
    let total = load.ok();
    load.stop();
    drop(up);

    println!(
        "scaling figures (lease TTL {LEASE_TTL_S} s, stories260K, 3 closed-loop clients, 16 new tokens):\n\
         decode node: listed after {:.2} s, first routed request after {:.2} s from process start\n\
         prefill node: listed after {:.2} s, first routed request after {:.2} s from process start\n\
         SIGKILLed prefill node removed after {:.2} s\n\
         etcd outage: {during_outage} requests served during the 10 s outage; all nodes registered {:.2} s after etcd was started again\n\
         throughput: 1P+1D {tput_1p1d:.1} req/s, 1P+2D {tput_1p2d:.1} req/s (ratio {:.2}x)\n\
         {total} requests, 0 failed",
        decode_listed.as_secs_f64(),
        decode_first_request.as_secs_f64(),
        prefill_listed.as_secs_f64(),
        prefill_first_request.as_secs_f64(),
        removal.as_secs_f64(),
        reregistered.as_secs_f64(),
        tput_1p2d / tput_1p1d,
    );
}

#[test]
fn other_model_is_refused_and_shared_prefixes_stick_to_their_node() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let etcd = cluster::LocalEtcd::start(dir.path()).expect("etcd starts");
    let etcd_url = etcd.endpoint();
    let log = dir.path().join("up.log");
    let up = up(&etcd_url, 2, 1, &log);

    // A decode node serving other weights (same shape family, other config) registers but is
    // never routed to, and the gateway says why.
    let other = dir.path().join("other-model");
    let st = fission()
        .args(["make-random-model", "--shape", "tiny", "--out"])
        .arg(&other)
        .arg("--tokenizer-from")
        .arg(stories_dir())
        .status()
        .unwrap();
    assert!(st.success());
    let _stranger = Added::start(&added(
        "decode",
        "decode-stranger",
        &other,
        &etcd_url,
        &dir.path().join("stranger.log"),
    ));
    wait_until("the stranger registers", Duration::from_secs(20), || {
        listed(&etcd_url, "decode-stranger")
    });
    wait_until(
        "the gateway logs the refusal",
        Duration::from_secs(5),
        || {
            std::fs::read_to_string(&log).unwrap().lines().any(|l| {
                l.contains("node refused")
                    && l.contains("decode-stranger")
                    && l.contains("fingerprint")
            })
        },
    );
    // Same weights, another block size: its KV could not be read by the others.
    let mut odd = added(
        "decode",
        "decode-odd-blocks",
        &stories_dir(),
        &etcd_url,
        &dir.path().join("odd.log"),
    );
    odd.args.extend(["--block-size".into(), "32".into()]);
    let _odd = Added::start(&odd);
    wait_until(
        "the gateway logs the layout refusal",
        Duration::from_secs(20),
        || {
            std::fs::read_to_string(&log).unwrap().lines().any(|l| {
                l.contains("node refused")
                    && l.contains("decode-odd-blocks")
                    && l.contains("KV layout")
            })
        },
    );
    let pools = up.gateway_nodes();
    assert!(
        !pools
            .iter()
            .any(|n| n == "decode-stranger" || n == "decode-odd-blocks"),
        "refused nodes are not in the gateway's pools: {pools:?}"
    );

    // A long shared prefix (well over one 16-token block), then variations of its ending.
    let prefix = "Once upon a time there was a little girl named Lily who loved to play in the park with her friends every day. ".repeat(4);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = reqwest::Client::new();
    let send = |suffix: String| {
        let (client, url, prefix) = (client.clone(), up.url.clone(), prefix.clone());
        async move {
            let r = client
                .post(format!("{url}/generate"))
                .json(&json!({"inputs": format!("{prefix}{suffix}"), "parameters": {"max_new_tokens": 4}}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{}", r.text().await.unwrap());
        }
    };
    rt.block_on(send("First.".into()));
    let prompts = |n: &str| up.metric(n, "fission_prefill_prompts_total");
    let holder = if prompts("prefill-0") > 0.0 {
        "prefill-0"
    } else {
        "prefill-1"
    };
    let other_node = if holder == "prefill-0" {
        "prefill-1"
    } else {
        "prefill-0"
    };
    // The gateway learns the holder's blocks from its cache events.
    wait_until(
        "the gateway indexes the prefix",
        Duration::from_secs(5),
        || {
            up.info()["backend"]["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n["node_id"] == holder && n["cached_blocks"].as_u64().unwrap_or(0) >= 4)
        },
    );
    let hits_before = up.metric(holder, "fission_prefill_prefix_cache_hit_blocks_total");
    let other_before = prompts(other_node);
    for i in 0..6 {
        rt.block_on(send(format!("Variation {i}.")));
    }
    let hits_after = up.metric(holder, "fission_prefill_prefix_cache_hit_blocks_total");
    assert_eq!(
        prompts(other_node),
        other_before,
        "no shared-prefix request went to the node without the prefix"
    );
    assert!(
        hits_after >= hits_before + 6.0 * 4.0,
        "the holder reused the prefix: hit blocks {hits_before} -> {hits_after}"
    );
    println!(
        "cache-aware routing: 6/6 shared-prefix requests went to {holder}; its prefix-cache hit blocks rose {hits_before} -> {hits_after}"
    );

    // `fission nodes drain`: the holder leaves (exit 0, as `fission up` reports), and the
    // shared-prefix requests go on, on the other node.
    let out = fission()
        .args(["nodes", "drain", holder, "--etcd", &etcd_url])
        .args(up.admin_credentials())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fission nodes drain: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("the drained node exits 0", Duration::from_secs(30), || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains(&format!("{holder} exited (exit status: 0)"))
    });
    assert!(!listed(&etcd_url, holder));
    let served_before = prompts(other_node);
    rt.block_on(send("After the drain.".into()));
    assert_eq!(
        prompts(other_node),
        served_before + 1.0,
        "the remaining prefill node took the request"
    );
}

#[test]
fn a_prefill_node_killed_before_its_push_ends_costs_no_request() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let etcd = cluster::LocalEtcd::start(dir.path()).expect("etcd starts");
    let etcd_url = etcd.endpoint();
    let up = up(&etcd_url, 0, 1, &dir.path().join("up.log"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let generate = |url: String| {
        let body = json!({"inputs": "Once upon a time, in a small town,", "parameters": {"max_new_tokens": 24}});
        async move {
            let r = reqwest::Client::new()
                .post(format!("{url}/generate"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status();
            let text = r.text().await.unwrap();
            assert!(status.is_success(), "{status}: {text}");
            serde_json::from_str::<Value>(&text).unwrap()["generated_text"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    // No prefill node yet: the decode node prefills, which gives the expected text.
    let expected = rt.block_on(generate(up.url.clone()));

    // A prefill node that answers at once but holds its KV push back for 5 s (a test
    // failpoint), so that the kill below lands between its answer and the push's end.
    let mut slow = added(
        "prefill",
        "prefill-slow-push",
        &stories_dir(),
        &etcd_url,
        &dir.path().join("prefill.log"),
    );
    slow.env
        .push(("FISSION_FAILPOINT_PUSH_DELAY_MS".into(), "5000".into()));
    let mut prefill = Added::start(&slow);
    wait_until(
        "the gateway routes to the prefill node",
        Duration::from_secs(10),
        || up.is_ready("prefill-slow-push"),
    );
    let url = up.url.clone();
    let request = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(generate(url))
    });
    // The gateway has the first token (the first request counted one already): the prefill
    // node has answered, and its push is being held back.
    wait_until("the prefill node answers", Duration::from_secs(10), || {
        metric(
            &format!("{}/metrics", up.url),
            "fission_gateway_time_to_first_token_seconds_count",
        ) >= 2.0
    });
    assert_eq!(
        metric(&prefill.metrics, "fission_prefill_prompts_total"),
        1.0,
        "the request went to the prefill node"
    );
    prefill.signal(libc::SIGKILL);
    let killed = Instant::now();
    prefill.wait_exit(Duration::from_secs(5));
    let text = request.join().expect("the request completes");
    let after_kill = killed.elapsed();
    assert_eq!(
        text, expected,
        "the resumed request gives the uninterrupted text"
    );
    // The decode node's reservation lease is what the request would wait otherwise.
    assert!(
        after_kill < Duration::from_secs(5),
        "the request ended {after_kill:?} after the kill"
    );
    // Which side notices first depends on timing: the gateway losing the Prefill stream
    // retries the prefill; the decode node losing the KV push ends the Generate stream, and
    // the gateway migrates the request. Either way it is counted.
    let gateway_metrics = format!("{}/metrics", up.url);
    let retried = metric_sum(&gateway_metrics, "fission_gateway_prefill_retries_total");
    let migrated = metric_sum(&gateway_metrics, "fission_gateway_migrations_total");
    assert!(
        retried + migrated >= 1.0,
        "the gateway counted no retry and no migration"
    );
    println!("prefill node killed mid-push: the request completed {after_kill:?} after the kill, with the uninterrupted text");
    drop(up);
}
