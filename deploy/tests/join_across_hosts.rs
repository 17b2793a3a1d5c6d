//! A node on another host joins a `fission up` cluster with the command `fission up` printed
//! (issue 31, item 2). `fission up` runs on one "host" (a network namespace, everything on its
//! loopback, mutual TLS, QUIC KV); a decode node joins from a second host at its own address.
//! `fission up`'s prefill node, listening on 127.0.0.1, must push KV to the joining node's
//! address: a sending socket bound to 127.0.0.1 cannot (connect fails with EINVAL), and every
//! request then fell back to prefilling on the decode node.
//!
//! The nodes share one certificate name (`localhost`, which `fission up`'s certificates and
//! the printed join certificate both carry), checked with `--tls-server-name`, as SECURITY.md
//! says to do where node addresses are not known in advance. The joining host reaches
//! `fission up`'s etcd, which listens on loopback only, through a forwarder between the two
//! namespaces ([`Lab::forward_loopback`]). No packet leaves the namespaces.
//!
//! Needs root (`ip netns`). Skipped with a message where namespaces cannot be made, and
//! required with `FISSION_REQUIRE_TEST_TOOLS=1` (as `./deploy/test.sh` sets).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::fission::{metric, metric_sum, KillOnDrop, Up, UpConfig};
use testkit::netns::Lab;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const SHARED_NAME: &str = "localhost";
const REQUESTS: usize = 8;

#[test]
fn a_decode_node_on_another_host_takes_kv_from_fission_ups_prefill_node() {
    let lab = match Lab::new(&["up", "joiner"]) {
        Ok(lab) => lab,
        Err(why) if !testkit::phoenix::tools_required() => {
            eprintln!("SKIPPED: network namespaces cannot be made here ({why}); run as root with iproute2");
            return;
        }
        Err(why) => panic!("network namespaces are required (FISSION_REQUIRE_TEST_TOOLS=1): {why}"),
    };
    let dir = tempfile::tempdir().unwrap();
    // This thread, the HTTP clients it makes and `fission up` with all it starts run on the
    // "up" host.
    lab.enter("up").unwrap();
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.args = vec![
        format!("--gateway-arg=--tls-server-name={SHARED_NAME}"),
        format!("--prefill-arg=--tls-server-name={SHARED_NAME}"),
        // Every request goes through a prefill node (none is prefilled on the decode node
        // for being short), spread over both decode nodes.
        "--max-local-prefill-tokens=0".into(),
        "--gateway-arg=--routing=round-robin".into(),
    ];
    config.log = Some(dir.path().join("up.log"));
    let up = Up::start(&config);

    // The printed join command, on the other host, at that host's address.
    let etcd_port: u16 = up
        .etcd
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or_else(|| panic!("etcd URL {:?}", up.etcd));
    lab.forward_loopback("joiner", "up", etcd_port).unwrap();
    let ip = lab.host("joiner").ip;
    let metrics_url = format!("http://{ip}:9100/metrics");
    let join = up.join.replace("decode|prefill", "decode");
    let words: Vec<&str> = join.split_whitespace().collect();
    assert_eq!(words.first(), Some(&"fission"), "join command: {join}");
    let mut cmd = lab.command("joiner", FISSION);
    cmd.args(&words[1..])
        .args(["--node-id", "decode-x"])
        .arg(format!("--grpc-addr={ip}:7100"))
        .arg(format!("--metrics-addr={ip}:9100"))
        .arg(format!("--kv-addr={ip}:7000"))
        .arg(format!("--advertise-host={ip}"))
        .arg(format!("--tls-server-name={SHARED_NAME}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("decode-x.log")).unwrap());
    let _joiner = KillOnDrop(cmd.spawn().unwrap());
    let log = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap_or_default();
    testkit::wait::try_wait_until(
        "decode-x ready at the gateway",
        Duration::from_secs(60),
        || up.is_ready("decode-x"),
    )
    .unwrap_or_else(|e| panic!("{e}\ndecode-x:\n{}", log("decode-x.log")));

    let got = |name: &str| metric_sum(&metrics_url, name);
    let gateway = format!("{}/metrics", up.url);
    let summary = || {
        format!(
            "decode-x: kv transfers completed {}, local prefills {}, tokens {}; gateway prefill \
             retries {}\ndecode-x log:\n{}\nfission up log (tail):\n{}",
            got("fission_decode_kv_transfers_completed_total"),
            got("fission_decode_local_prefill_total"),
            got("fission_decode_generated_tokens_total"),
            metric_sum(&gateway, "fission_gateway_prefill_retries_total"),
            log("decode-x.log"),
            log("up.log")
                .lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .join("\n")
        )
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // A request that cannot be served fails the test, rather than hanging it.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    for i in 0..REQUESTS {
        let resp: Result<Value, reqwest::Error> = rt.block_on(async {
            http.post(format!("{}/generate", up.url))
                .json(
                    &json!({"inputs": format!("Request {i}: the little dog ran to the park"),
                              "parameters": {"max_new_tokens": 8}}),
                )
                .send()
                .await?
                .json()
                .await
        });
        let resp = resp.unwrap_or_else(|e| panic!("request {i}: {e}\n{}", summary()));
        assert!(resp["generated_text"].is_string(), "request {i}: {resp}");
    }

    // Round-robin gave the joining node half of the requests; each one's KV came from
    // fission up's prefill node over QUIC, with no retry and no fallback.
    assert!(
        got("fission_decode_generated_tokens_total") >= 1.0,
        "{}",
        summary()
    );
    assert!(
        got("fission_decode_kv_transfers_completed_total") >= 1.0,
        "{}",
        summary()
    );
    assert_eq!(
        got("fission_decode_local_prefill_total"),
        0.0,
        "{}",
        summary()
    );
    assert_eq!(
        metric_sum(&gateway, "fission_gateway_prefill_retries_total"),
        0.0,
        "{}",
        summary()
    );
    println!(
        "decode-x on {ip}: {} KV transfers from fission up's prefill node, {} tokens",
        got("fission_decode_kv_transfers_completed_total"),
        metric(&metrics_url, "fission_decode_generated_tokens_total")
    );
}
