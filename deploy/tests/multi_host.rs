//! The cluster off loopback: etcd, the gateway, 2 prefill and 2 decode nodes, each on its own
//! "host" (a network namespace with its own address on a private subnet, `testkit::netns`),
//! over mutual TLS with certificates issued by `fission certs` for those addresses. The
//! cluster serves the reference ids across the hosts; then one decode host's link is cut
//! mid-stream, and its streams continue elsewhere as from a hung node, with the same text; the
//! link comes back and that node itself serves again (its own counter moves), with every KV
//! gauge back to 0.
//!
//! Needs root (`ip netns`). Skipped with a message where namespaces cannot be made, and
//! required with `FISSION_REQUIRE_TEST_TOOLS=1` (as `./deploy/test.sh` sets).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::netns_cluster::Processes::{DecodeNodes, Gateway};
use testkit::netns_cluster::{NetnsCluster, NetnsClusterBuilder, Tls};
use testkit::references::{generate_ids, references};
use testkit::streams::{self, Record};
use testkit::wait_until;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const STALL: Duration = Duration::from_millis(1000);
const STREAMS: usize = 4;
const STREAM_TOKENS: usize = 300;

/// etcd, the gateway, 2 prefill and 2 decode nodes, each on its own host, with `tls`.
fn start(tls: Tls) -> Option<NetnsCluster> {
    NetnsClusterBuilder::new(FISSION)
        .nodes(2, 2)
        .tls(tls)
        // Slow enough steps for a link to go down mid-stream.
        .env(DecodeNodes, "FISSION_DEBUG_STEP_DELAY_MS", "15")
        // Spread the requests so that every host serves some.
        .arg(Gateway, "--routing=round-robin")
        .arg(Gateway, format!("--max-stall-ms={}", STALL.as_millis()))
        .start_or_skip()
}

fn stream_body(client: usize) -> Value {
    json!({"inputs": format!("Stream {client}: the little dog ran"),
           "parameters": {"max_new_tokens": STREAM_TOKENS, "ignore_eos": true}})
}

fn all_ok(records: &[Record], what: &str) {
    let failed = records.iter().filter(|r| !r.ok()).count();
    assert_eq!(failed, 0, "{what}:\n{}", streams::summary(records));
}

/// The reference ids, twice, through every prefill and decode host (round-robin spreads them).
fn serves_the_reference_on_every_host(c: &NetnsCluster) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let http = reqwest::Client::new();
    for round in 0..2 {
        for r in references() {
            let ids = rt.block_on(generate_ids(&http, &c.url, &r.prompt, 32));
            assert_eq!(ids, r.expected(ids.len()), "round {round}: {}", r.prompt);
            assert!(ids.len() >= 16, "round {round}: {}: {ids:?}", r.prompt);
        }
    }
    for node in ["prefill-0", "prefill-1"] {
        assert!(
            c.metric(node, "fission_prefill_prompts_total") >= 1.0,
            "{node} prefilled nothing: {}",
            testkit::fission::http_get(&c.metrics_url(node))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("prompts"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    for node in ["decode-0", "decode-1"] {
        let served = c.metric_sum(node, "fission_decode_generated_tokens_total");
        assert!(served >= 1.0, "{node} decoded nothing");
    }
    // Across hosts the KV goes over the network, never shared memory (issue 34).
    for node in ["prefill-0", "prefill-1"] {
        assert!(
            c.kv_pushes(node, "quic") >= 1.0,
            "{node} pushed nothing over QUIC"
        );
        assert_eq!(
            c.kv_pushes(node, "shm"),
            0.0,
            "{node} pushed through shm across hosts"
        );
    }
}

#[test]
fn a_pool_sharing_one_certificate_name_serves_across_hosts() {
    let Some(c) = start(Tls::SharedName("fission-node".into())) else {
        return;
    };
    serves_the_reference_on_every_host(&c);
    c.assert_kv_released();
}

#[test]
fn a_cluster_across_hosts_serves_the_reference_and_survives_a_cut_link() {
    // The lab goes away (its namespaces and whatever runs in them) when this thread's
    // cluster drops, also on a failed assertion.
    let Some(c) = start(Tls::PerHost) else {
        return;
    };
    serves_the_reference_on_every_host(&c);

    // Each stream's tokens, uninterrupted (stories260K may end a story before
    // STREAM_TOKENS: it stops on BOS as well as EOS).
    let references: Vec<Record> = (0..STREAMS)
        .map(|i| {
            let r = streams::run(&c.url, 1, 1, Duration::from_secs(60), move |_, _| {
                stream_body(i)
            });
            all_ok(&r, "reference stream");
            r[0].clone()
        })
        .collect();

    // Pull decode-0's cable while it streams.
    let url = c.url.clone();
    let load = std::thread::spawn(move || {
        streams::run(&url, STREAMS, 1, Duration::from_secs(90), |client, _| {
            stream_body(client)
        })
    });
    wait_until("decode-0 generating", Duration::from_secs(60), || {
        c.metric("decode-0", "fission_decode_running_sequences") >= 1.0
    });
    c.lab().cut("decode-0");
    let cut = Instant::now();
    wait_until(
        "decode-0 suspect at the gateway",
        STALL + Duration::from_secs(3),
        || !c.ready_nodes().iter().any(|n| n == "decode-0"),
    );
    let mut records = load.join().unwrap();
    records.sort_by_key(|r| r.client);
    all_ok(&records, "across the cut link");
    let summary = streams::summary(&records);
    for (r, want) in records.iter().zip(&references) {
        assert_eq!(
            r.token_ids, want.token_ids,
            "no token twice, none missing, none other:\n{summary}"
        );
        assert_eq!(
            r.text, want.text,
            "the moved stream reads as an uninterrupted one"
        );
        if r.started <= cut && r.end() > cut {
            assert!(
                r.max_gap <= STALL + Duration::from_secs(3),
                "a stream waited {:?} between tokens",
                r.max_gap
            );
        }
    }
    assert!(c.gateway_metric_sum("fission_gateway_migrations_total") >= 1.0);
    println!(
        "decode-0's link cut mid-stream: {} streams completed, the last {:?} after the cut",
        records.len(),
        records.iter().map(Record::end).max().unwrap() - cut
    );

    // The cable back: decode-0 is routable again and gives back what it held.
    c.lab().restore("decode-0");
    wait_until("decode-0 ready again", Duration::from_secs(30), || {
        c.ready_nodes().iter().any(|n| n == "decode-0")
    });
    c.assert_kv_released();
    // Read once decode-0 holds nothing: the streams it had when the link went are over, so
    // only new work moves this counter.
    let generated = "fission_decode_generated_tokens_total";
    let before = c.metric_sum("decode-0", generated);
    let after = streams::run(
        &c.url,
        4,
        1,
        Duration::from_secs(60),
        |client, _| json!({"inputs": format!("After {client}"), "parameters": {"max_new_tokens": 8}}),
    );
    all_ok(&after, "after the link came back");
    // Not only the cluster: decode-0 itself serves again (round-robin gives it some of the 4).
    let served = c.metric_sum("decode-0", generated) - before;
    assert!(
        served >= 1.0,
        "decode-0 generated no token after its link came back (before: {before})"
    );
    println!("decode-0 generated {served} tokens after its link came back");
}
