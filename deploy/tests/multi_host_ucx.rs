//! The KV transports that carry no TLS, across hosts (issue 34): a 1P+1D cluster on two
//! network namespaces (`testkit::netns`, each a host with its own address) pushes its KV as
//! UCX sends over UCX's TCP transport and serves the reference ids, every push counted under
//! `transport="ucx"` and none through shared memory, with every KV gauge back to 0; asking
//! for shared memory between the two hosts is refused by the gateway, which admits only one
//! of the two nodes and says why (the prefill node would refuse too: `PickingTransport`'s
//! test); and UCX without `--insecure` (the flag that allows a KV plane without TLS) does not
//! start.
//!
//! Needs root (`ip netns`) and libucx0. Skipped with a message where namespaces cannot be
//! made, and required with `FISSION_REQUIRE_TEST_TOOLS=1` (as `./deploy/test.sh` sets).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::fission::stories_dir;
use testkit::netns_cluster::{NetnsCluster, NetnsClusterBuilder, Processes, Tls};
use testkit::references::{generate_ids, references};
use testkit::wait_until;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

/// etcd, a gateway, one prefill and one decode node, each on its own host, all with
/// `--kv-transport <kv>` and `--insecure` (no certificates: these transports have no TLS);
/// returns once `ready` nodes are ready at the gateway.
fn start(kv: &str, ready: usize) -> Option<NetnsCluster> {
    NetnsClusterBuilder::new(FISSION)
        .transport(kv)
        .tls(Tls::Insecure)
        // UCX over its TCP transport, the network between hosts here.
        .env(Processes::Nodes, "UCX_TLS", "tcp")
        .ready(ready)
        .start_or_skip()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn ucx_over_tcp_across_hosts_serves_the_reference() {
    let Some(c) = start("ucx", 2) else {
        return;
    };
    let refs = references();
    let http = reqwest::Client::new();
    for r in &refs {
        let ids = runtime().block_on(generate_ids(&http, &c.url, &r.prompt, 32));
        assert!(ids.len() >= 16, "{}: {ids:?}", r.prompt);
        assert_eq!(ids, r.expected(ids.len()), "{}", r.prompt);
    }
    let n = refs.len() as f64;
    assert!(
        c.kv_pushes("prefill-0", "ucx") >= n,
        "{} ucx pushes for {n} prompts; prefill log:\n{}",
        c.kv_pushes("prefill-0", "ucx"),
        c.log("prefill-0")
    );
    assert_eq!(
        c.kv_pushes("prefill-0", "shm"),
        0.0,
        "pushed through shm across hosts"
    );
    // The decode node admitted a peer from another host: only --insecure allows that.
    assert!(
        c.log("decode-0").contains("kv ucx connection ready"),
        "{}",
        c.log("decode-0")
    );
    c.assert_kv_released();
}

#[test]
fn shm_across_hosts_is_refused() {
    // The gateway admits the first node and refuses the other, whose shared memory the
    // first could not reach: the cluster never pairs them.
    let Some(c) = start("shm", 1) else {
        return;
    };
    let rule = "KV transport \"shm\" reaches only one host";
    wait_until(
        "the gateway refuses the node on the other host",
        Duration::from_secs(30),
        || c.log("gateway").contains(rule),
    );
    assert_eq!(c.ready_nodes().len(), 1, "{}", c.log("gateway"));
    // Whichever node joined first serves alone, or nothing does: either way no layer
    // crosses in shared memory.
    let url = format!("{}/generate", c.url);
    let _ = runtime().block_on(async {
        reqwest::Client::new()
            .post(url)
            .timeout(Duration::from_secs(60))
            .json(&serde_json::json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}))
            .send()
            .await
    });
    assert_eq!(
        c.kv_pushes("prefill-0", "shm"),
        0.0,
        "pushed through shm across hosts"
    );
    c.assert_kv_released();
}

#[test]
fn ucx_without_insecure_does_not_start() {
    // No namespace needed: the node refuses its flags before it binds anything. With a
    // certificate, gRPC runs mutual TLS; the KV plane would not, and only --insecure allows it.
    let dir = tempfile::tempdir().unwrap();
    let certs = testkit::certs::TestCerts::new(dir.path());
    let node = Command::new(FISSION)
        .args(["node", "decode", "--model"])
        .arg(stories_dir())
        .args(["--kv-transport", "ucx", "--etcd", "http://127.0.0.1:1"])
        .args(certs.flags(identity::PeerRole::Decode, "decode"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&node.stderr);
    assert!(!node.status.success(), "started: {stderr}");
    assert!(
        stderr.contains("the UCX KV transport has no TLS: it needs --insecure"),
        "{stderr}"
    );
}
