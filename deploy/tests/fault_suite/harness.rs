//! The fault suite's cluster: a real etcd, a `fission gateway` and nodes started with
//! `fission node start`, each its own process on loopback, so a test can signal any of them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use identity::PeerRole;
use serde_json::{json, Value};
use testkit::certs::TestCerts;
use testkit::fission::{free_port, http_get, metric, Added, KillOnDrop, NodeConfig};
use testkit::streams::Record;
use testkit::wait_until;

/// The `fission` binary under test; `FISSION_FAULT_SUITE_BIN` runs the suite against another
/// build (an older one, to show a scenario fails there).
pub fn fission() -> PathBuf {
    std::env::var_os("FISSION_FAULT_SUITE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fission")))
}

/// etcd lease of every node: short, so a dead node leaves soon.
pub const LEASE_TTL_S: u64 = 3;

/// A random model with room for long prompts and slow enough steps to interrupt: 8 layers,
/// hidden 256, 2048 positions, on stories260K's tokenizer.
pub fn long_model(dir: &Path) -> PathBuf {
    let out = dir.join("long-model");
    let spec = json!({
        "architecture": "LlamaForCausalLM", "hidden": 256, "layers": 8, "heads": 4,
        "kv_heads": 2, "head_dim": 64, "ffn": 1024, "vocab": 512, "max_pos": 2048,
        "rope_theta": 10000.0, "attention_bias": false, "tie_word_embeddings": true,
        "dtype": "float32", "init_std": 0.02, "seed": 0
    });
    let spec_path = dir.join("long-model.json");
    std::fs::write(&spec_path, spec.to_string()).expect("spec written");
    let status = Command::new(fission())
        .args(["make-random-model", "--spec-json"])
        .arg(&spec_path)
        .arg("--out")
        .arg(&out)
        .arg("--tokenizer-from")
        .arg(testkit::fission::stories_dir())
        .stdout(Stdio::null())
        .status()
        .expect("fission make-random-model runs");
    assert!(status.success());
    out
}

/// A node to start: its role, id and flags beyond the defaults.
pub struct Spec {
    pub role: &'static str,
    pub node_id: String,
    pub args: Vec<String>,
}

pub fn node(role: &'static str, node_id: &str, args: &[&str]) -> Spec {
    Spec {
        role,
        node_id: node_id.into(),
        args: args.iter().map(|a| a.to_string()).collect(),
    }
}

pub struct Cluster {
    pub dir: PathBuf,
    pub etcd: cluster::LocalEtcd,
    pub etcd_url: String,
    pub model: PathBuf,
    pub url: String,
    pub gateway_metrics: String,
    pub gateway: KillOnDrop,
    /// Every node started, by id; a test may kill one (it stays listed).
    pub nodes: Vec<(String, Added)>,
    /// The cluster CA: the faults run over mutual-TLS gRPC, as in production.
    pub certs: TestCerts,
}

impl Cluster {
    /// etcd, then the nodes, then a gateway with `gateway_args`; returns once every node is
    /// ready at the gateway.
    pub fn start(dir: &Path, model: &Path, specs: Vec<Spec>, gateway_args: &[&str]) -> Cluster {
        let etcd = cluster::LocalEtcd::start(dir).expect("etcd starts");
        let etcd_url = etcd.endpoint();
        let mut c = Cluster {
            dir: dir.to_path_buf(),
            etcd_url: etcd_url.clone(),
            etcd,
            model: model.to_path_buf(),
            url: String::new(),
            gateway_metrics: String::new(),
            gateway: KillOnDrop(Command::new("true").spawn().expect("true runs")),
            nodes: Vec::new(),
            certs: TestCerts::new(dir),
        };
        for s in specs {
            c.add(s);
        }
        let port = free_port();
        let log = std::fs::File::create(dir.join("gateway.log")).expect("log");
        let child = Command::new(fission())
            .args(["gateway", "--addr", &format!("127.0.0.1:{port}")])
            .arg("--model-dir")
            .arg(model)
            .args(["--etcd", &etcd_url])
            .args(c.certs.flags(PeerRole::Gateway, "gateway"))
            .args(gateway_args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("fission gateway runs");
        c.gateway = KillOnDrop(child);
        c.url = format!("http://127.0.0.1:{port}");
        c.gateway_metrics = format!("{}/metrics", c.url);
        let n = c.nodes.len();
        wait_until(
            "every node ready at the gateway",
            Duration::from_secs(60),
            || c.ready_nodes().len() == n,
        );
        c
    }

    /// `prefill-0`, `decode-0` and `decode-1` on `model`: the cluster of every decode-node fault.
    pub fn one_prefill_two_decode(dir: &Path, model: &Path, gateway_args: &[&str]) -> Cluster {
        Cluster::start(
            dir,
            model,
            vec![
                node("prefill", "prefill-0", &[]),
                node("decode", "decode-0", &[]),
                node("decode", "decode-1", &[]),
            ],
            gateway_args,
        )
    }

    pub fn add(&mut self, s: Spec) {
        let mut args = vec!["--lease-ttl-s".to_string(), LEASE_TTL_S.to_string()];
        let role = if s.role == "decode" {
            PeerRole::Decode
        } else {
            PeerRole::Prefill
        };
        args.extend(self.certs.flags(role, &s.node_id));
        args.extend(s.args);
        let added = Added::start(&NodeConfig {
            fission: fission(),
            role: s.role.into(),
            node_id: s.node_id.clone(),
            model: self.model.clone(),
            etcd: self.etcd_url.clone(),
            args,
            env: Vec::new(),
            log: self.dir.join(format!("{}.log", s.node_id)),
        });
        self.nodes.push((s.node_id, added));
    }

    pub fn node(&self, id: &str) -> &Added {
        &self
            .nodes
            .iter()
            .find(|(n, _)| n == id)
            .unwrap_or_else(|| panic!("no node {id}"))
            .1
    }

    pub fn info(&self) -> Value {
        serde_json::from_str(&http_get(&format!("{}/info", self.url)).unwrap_or_default())
            .unwrap_or_default()
    }

    pub fn ready_nodes(&self) -> Vec<String> {
        testkit::fission::ready_node_ids(&self.info())
    }

    /// Whether `id`'s process still runs.
    pub fn alive(&mut self, id: &str) -> bool {
        let (_, n) = self
            .nodes
            .iter_mut()
            .find(|(n, _)| n == id)
            .unwrap_or_else(|| panic!("no node {id}"));
        n.child.try_wait().expect("try_wait").is_none()
    }

    pub fn gateway_metric(&self, name: &str) -> f64 {
        testkit::fission::metric_sum(&self.gateway_metrics, name)
    }

    /// Waits until every KV gauge of every node still alive is back to 0: nothing leaked.
    pub fn assert_kv_released(&mut self) {
        for (id, n) in &mut self.nodes {
            if n.child.try_wait().expect("try_wait").is_some() {
                continue;
            }
            for g in testkit::kv_gauges::for_node(id) {
                wait_until(
                    &format!("{id} {g} back to 0"),
                    Duration::from_secs(15),
                    || metric(&n.metrics, g) == 0.0,
                );
            }
        }
    }

    /// One short request, to show the cluster serves without a restart.
    pub fn assert_serves(&self) {
        let r = testkit::streams::run(&self.url, 1, 1, Duration::from_secs(30), |_, _| {
            body("The cluster still serves", 8)
        });
        assert!(r[0].ok(), "{:?}", r[0]);
    }
}

/// A TGI body for `prompt`, greedy, exactly `max_new_tokens` new tokens.
pub fn body(prompt: &str, max_new_tokens: usize) -> Value {
    json!({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": true}})
}

/// A prompt of about `n` tokens of stories260K's tokenizer, different per `tag`.
pub fn long_prompt(tag: &str, n: usize) -> String {
    let mut s = format!("{tag}: ");
    let words = [
        "once", "upon", "a", "time", "there", "was", "a", "little", "dog",
    ];
    // About one token per short word and one per space-joined word boundary.
    for i in 0..n {
        s.push_str(words[i % words.len()]);
        s.push(' ');
    }
    s
}

/// Requests in flight at `fault` ended within `within` of it, with tokens or an error event.
pub fn assert_ended_within(records: &[Record], fault: Instant, within: Duration) {
    for r in records {
        if r.started <= fault && r.end() > fault {
            assert!(
                r.end() - fault <= within,
                "a request in flight at the fault ended {:.2?} after it: {r:?}",
                r.end() - fault
            );
        }
    }
}

/// Every record succeeded.
pub fn assert_all_ok(records: &[Record], what: &str) {
    let failed = records.iter().filter(|r| !r.ok()).count();
    assert_eq!(
        failed,
        0,
        "{failed} of {} requests failed {what}:\n{}",
        records.len(),
        testkit::streams::summary(records)
    );
}

/// Prints the records' figures for the test log.
pub fn report(name: &str, records: &[Record]) {
    let mut ttft: Vec<f64> = records
        .iter()
        .filter_map(|r| r.first_token.map(|t| t.as_secs_f64()))
        .collect();
    ttft.sort_by(f64::total_cmp);
    let max_gap = records
        .iter()
        .map(|r| r.max_gap.as_secs_f64())
        .fold(0.0, f64::max);
    let ok = records.iter().filter(|r| r.ok()).count();
    eprintln!(
        "{name}: {ok}/{} ok, ttft median {:.2} s max {:.2} s, largest token gap {max_gap:.2} s",
        records.len(),
        ttft.get(ttft.len() / 2).copied().unwrap_or(0.0),
        ttft.last().copied().unwrap_or(0.0),
    );
}
