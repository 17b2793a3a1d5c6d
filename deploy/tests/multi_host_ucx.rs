//! The KV transports that carry no TLS, across hosts (issue 34): a 1P+1D cluster on two
//! network namespaces (`testkit::netns`, each a host with its own address) pushes its KV as
//! UCX puts over UCX's TCP transport and serves the reference ids, every push counted under
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

use serde_json::Value;
use testkit::fission::{http_get, metric, stories_dir, KillOnDrop};
use testkit::kv_gauges;
use testkit::netns::{lab_or_skip, spawn_logged, Lab};
use testkit::references::{generate_ids, references};
use testkit::wait::try_wait_until;
use testkit::wait_until;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const HOSTS: &[&str] = &["etcd", "gateway", "prefill", "decode", "client"];
const GRPC_PORT: u16 = 50051;
const METRICS_PORT: u16 = 9100;
const KV_PORT: u16 = 7000;
const HTTP_PORT: u16 = 8080;

/// One cluster at a time: two at once on a 2-core CI machine would only test the scheduler.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// etcd, a gateway, one prefill and one decode node, each on its own host, all with
/// `--kv-transport <kv>` and `--insecure` (no certificates: these transports have no TLS).
struct Cluster {
    lab: Lab,
    url: String,
    dir: tempfile::TempDir,
    // Held for their Drop, which kills them; the lab's Drop removes what is left.
    _procs: Vec<KillOnDrop>,
}

impl Cluster {
    /// Starts the cluster and waits for `ready` nodes at the gateway.
    fn start(lab: Lab, kv: &str, ready: usize) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let (etcd, etcd_url) = lab.start_etcd("etcd", dir.path());
        let mut procs = vec![etcd];
        for role in ["prefill", "decode"] {
            let ip = lab.host(role).ip;
            let mut cmd = lab.command(role, FISSION);
            cmd.args(["node", role, "--model"])
                .arg(stories_dir())
                .args(["--node-id", role, "--num-kv-blocks", "256"])
                .args([
                    "--etcd",
                    &etcd_url,
                    "--cluster",
                    "lab",
                    "--lease-ttl-s",
                    "3",
                ])
                .args(["--kv-transport", kv, "--insecure"])
                // Namespaces share the kernel, /dev/shm and the machine id: each stands for a
                // host of its own only by the id it advertises.
                .env("FISSION_HOST_ID", role)
                // UCX over its TCP transport, the network between hosts here.
                .env("UCX_TLS", "tcp")
                .arg(format!("--grpc-addr={ip}:{GRPC_PORT}"))
                .arg(format!("--metrics-addr={ip}:{METRICS_PORT}"))
                .arg(format!("--advertise-host={ip}"));
            if role == "decode" {
                cmd.arg(format!("--kv-addr={ip}:{KV_PORT}"));
            }
            procs.push(spawn_logged(cmd, &dir.path().join(format!("{role}.log"))));
        }
        let gw_ip = lab.host("gateway").ip;
        let mut gateway = lab.command("gateway", FISSION);
        gateway
            .args(["gateway", "--model-dir"])
            .arg(stories_dir())
            .arg(format!("--addr={gw_ip}:{HTTP_PORT}"))
            .args(["--etcd", &etcd_url, "--cluster", "lab", "--insecure"])
            .env_remove("FISSION_API_KEY");
        procs.push(spawn_logged(gateway, &dir.path().join("gateway.log")));

        // From here this thread, and the clients it starts, are on the client host.
        lab.enter("client").unwrap();
        let c = Cluster {
            url: format!("http://{gw_ip}:{HTTP_PORT}"),
            lab,
            dir,
            _procs: procs,
        };
        if let Err(e) = try_wait_until(
            &format!("{ready} nodes ready at the gateway"),
            Duration::from_secs(90),
            || c.ready_nodes() == ready,
        ) {
            panic!(
                "{e}\nprefill:\n{}\ndecode:\n{}\ngateway:\n{}",
                c.log("prefill"),
                c.log("decode"),
                c.log("gateway")
            );
        }
        c
    }

    fn ready_nodes(&self) -> usize {
        http_get(&format!("{}/info", self.url))
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| {
                v["backend"]["nodes"]
                    .as_array()
                    .map(|a| a.iter().filter(|n| n["ready"] == true).count())
            })
            .unwrap_or(0)
    }

    fn metrics(&self, node: &str) -> String {
        format!("http://{}:{METRICS_PORT}/metrics", self.lab.host(node).ip)
    }

    fn pushes(&self, transport: &str) -> f64 {
        metric(
            &self.metrics("prefill"),
            &format!("fission_prefill_kv_pushes_total{{transport=\"{transport}\"}}"),
        )
    }

    fn log(&self, node: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{node}.log"))).unwrap_or_default()
    }

    /// Every KV gauge of both nodes back to 0, and each of them exported.
    fn assert_kv_released(&self) {
        for node in ["prefill", "decode"] {
            let m = self.metrics(node);
            wait_until(
                &format!("every KV gauge of {node} back to 0"),
                Duration::from_secs(20),
                || kv_gauges::held(node, &m) == 0.0,
            );
            assert_eq!(kv_gauges::missing(node, &m), Vec::<&str>::new(), "{node}");
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn ucx_over_tcp_across_hosts_serves_the_reference() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(lab) = lab_or_skip(HOSTS) else {
        return;
    };
    let c = Cluster::start(lab, "ucx", 2);
    let refs = references();
    let http = reqwest::Client::new();
    for r in &refs {
        let ids = runtime().block_on(generate_ids(&http, &c.url, &r.prompt, 32));
        assert!(ids.len() >= 16, "{}: {ids:?}", r.prompt);
        assert_eq!(ids, r.expected(ids.len()), "{}", r.prompt);
    }
    let n = refs.len() as f64;
    assert!(
        c.pushes("ucx") >= n,
        "{} ucx pushes for {n} prompts; prefill log:\n{}",
        c.pushes("ucx"),
        c.log("prefill")
    );
    assert_eq!(c.pushes("shm"), 0.0, "pushed through shm across hosts");
    // The decode node admitted a peer from another host: only --insecure allows that.
    assert!(
        c.log("decode").contains("kv ucx connection ready"),
        "{}",
        c.log("decode")
    );
    c.assert_kv_released();
}

#[test]
fn shm_across_hosts_is_refused() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(lab) = lab_or_skip(HOSTS) else {
        return;
    };
    // The gateway admits the first node and refuses the other, whose shared memory the
    // first could not reach: the cluster never pairs them.
    let c = Cluster::start(lab, "shm", 1);
    let rule = "KV transport \"shm\" reaches only one host";
    wait_until(
        "the gateway refuses the node on the other host",
        Duration::from_secs(30),
        || c.log("gateway").contains(rule),
    );
    assert_eq!(c.ready_nodes(), 1, "{}", c.log("gateway"));
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
    assert_eq!(c.pushes("shm"), 0.0, "pushed through shm across hosts");
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
