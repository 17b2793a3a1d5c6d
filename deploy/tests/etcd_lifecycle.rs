//! How processes treat etcd at the edges of its life: `fission up` stopped from a terminal
//! stops its nodes, then its gateway, then etcd, so the nodes leave the cluster cleanly; a node
//! whose etcd is gone backs off, says so in `/health` and `/metrics`, and registers once etcd
//! is back.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use testkit::fission::{http_get, metric, stories_dir, Added, NodeConfig, Up, UpConfig};
use testkit::wait_until;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

/// What a node or `fission up` logs when etcd went before the nodes were done with it.
const LEASE_WARNINGS: [&str; 4] = [
    "lease lost",
    "etcd registration failed",
    "lease revoke failed",
    "could not mark the node draining",
];

#[test]
fn ctrl_c_stops_the_nodes_then_the_gateway_then_etcd_without_lease_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("up.log");
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.log = Some(log.clone());
    config.process_group = true;
    config.env = vec![("RUST_LOG".into(), "info".into())];
    let mut up = Up::start(&config);
    let served = testkit::streams::run(&up.url, 2, 2, Duration::from_secs(60), |c, i| {
        serde_json::json!({
            "inputs": format!("Client {c} request {i}: once upon a time"),
            "parameters": {"max_new_tokens": 8},
        })
    });
    assert!(served.iter().all(|r| r.ok()), "{served:?}");

    // A terminal's Ctrl-C: SIGINT to the whole foreground group.
    up.signal_group(libc::SIGINT);
    let status = up.wait_exit(Duration::from_secs(90));
    let text = strip_ansi(&std::fs::read_to_string(&log).unwrap());
    assert!(status.success(), "fission up exited {status}:\n{text}");

    let stopping = text
        .find("stopping the cluster")
        .unwrap_or_else(|| panic!("no stop began:\n{text}"));
    let after = &text[stopping..];
    for warning in LEASE_WARNINGS {
        assert!(
            !after.contains(warning),
            "{warning:?} while stopping: etcd went before the nodes\n{after}"
        );
    }
    let revoked = after
        .lines()
        .filter(|l| l.contains("lease revoked") && l.contains("ok=true"))
        .count();
    assert_eq!(
        revoked, 2,
        "both nodes revoke their leases in etcd:\n{after}"
    );
    let last_node = after
        .rfind("node stopped")
        .unwrap_or_else(|| panic!("no node stopped:\n{after}"));
    let gateway = after
        .find("gateway stopped")
        .unwrap_or_else(|| panic!("the gateway did not stop:\n{after}"));
    assert!(
        last_node < gateway,
        "the gateway stops after the last node:\n{after}"
    );
}

/// The log without its colour codes (`ok=true` is written `ok\x1b[0m\x1b[2m=\x1b[0mtrue`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC '[' parameters, ended by a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn a_node_whose_etcd_is_gone_backs_off_says_so_and_registers_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    // An etcd with known ports, stopped: the node starts against an address where nothing
    // answers, and the same etcd comes back there later.
    let mut etcd = cluster::LocalEtcd::start(dir.path()).unwrap();
    let endpoint = etcd.endpoint();
    etcd.stop();
    let node = Added::start(&NodeConfig {
        fission: FISSION.into(),
        role: "decode".into(),
        node_id: "decode-lonely".into(),
        model: stories_dir(),
        etcd: endpoint,
        args: Vec::new(),
        env: Vec::new(),
        log: dir.path().join("node.log"),
    });
    let metrics = node.metrics.clone();
    let health_url = metrics.replace("/metrics", "/health");
    let health = || http_get(&health_url).unwrap_or_default();
    let failures = || metric(&metrics, "fission_decode_etcd_registration_failures_total");

    wait_until("the node serves /health", Duration::from_secs(60), || {
        health().contains(r#""etcd":"unregistered""#)
    });
    assert_eq!(metric(&metrics, "fission_decode_etcd_registered"), 0.0);
    // The attempts back off: from the first failure to the seventh the waits double from
    // 0.1 s (0.1 + 0.2 + ... + 3.2 = 6.3 s). A node that retried every second at most would
    // get there in under 4 s.
    wait_until("a first failed attempt", Duration::from_secs(30), || {
        failures() >= 1.0
    });
    let first = Instant::now();
    wait_until("a seventh failed attempt", Duration::from_secs(60), || {
        failures() >= 7.0
    });
    let spread = first.elapsed();
    assert!(
        spread >= Duration::from_millis(5_500),
        "7 attempts within {spread:?}: no backoff"
    );

    etcd.restart().unwrap();
    // The longest wait is 10 s and a fifth.
    wait_until(
        "the node registers once etcd is back",
        Duration::from_secs(30),
        || health().contains(r#""etcd":"registered""#),
    );
    assert_eq!(metric(&metrics, "fission_decode_etcd_registered"), 1.0);
    drop(node);
}
