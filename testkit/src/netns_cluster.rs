//! The one way the cluster tests off loopback describe their cluster: etcd, the gateway and
//! every node each on a "host" of its own (a network namespace, [`crate::netns::Lab`]), each
//! started as its own process that listens on and advertises its host's address, as on
//! separate machines; and a `client` host that the test thread moves onto. The loopback
//! counterpart, over `fission up`, is [`crate::cluster_builder::ClusterBuilder`].
//!
//! Needs root (`ip netns`): [`NetnsClusterBuilder::start_or_skip`] skips with a message where
//! namespaces cannot be made, as [`crate::netns::lab_or_skip`] does.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde_json::Value;

use crate::fission::{http_get, metric, metric_sum, stories_dir, KillOnDrop};
use crate::kv_gauges;
use crate::netns::{lab_or_skip, spawn_logged, Lab};
use crate::wait::{try_wait_until, wait_until};

/// Where each process listens on its own host.
pub const GRPC_PORT: u16 = 50051;
pub const METRICS_PORT: u16 = 9100;
pub const KV_PORT: u16 = 7000;
pub const HTTP_PORT: u16 = 8080;
/// Every node's `--num-kv-blocks`.
const NUM_KV_BLOCKS: &str = "256";
/// A short lease, so that a node that is gone leaves the pool soon.
const LEASE_TTL_S: &str = "3";
const CLUSTER: &str = "lab";
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// One cluster at a time in a test binary: two at once on a 2-core CI machine would only test
/// the scheduler.
static SERIAL: Mutex<()> = Mutex::new(());

/// How the processes' certificates name them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tls {
    /// Each process its own certificate for its own address (`fission certs issue --san IP`):
    /// peers check the address they dial.
    PerHost,
    /// One certificate per role, all naming this DNS name, which every client checks instead
    /// of the address (`--tls-server-name`): a pool behind one Secret.
    SharedName(String),
    /// No certificates, `--insecure` everywhere: the KV transports without TLS need it.
    Insecure,
}

/// Which processes a flag or an environment variable is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Processes {
    /// Every node, prefill and decode.
    Nodes,
    DecodeNodes,
    Gateway,
}

/// Builds a cluster across hosts: 1 prefill and 1 decode node serving stories260K, KV over
/// QUIC, a certificate per host, until an option says otherwise. Nodes are `prefill-0`,
/// `prefill-1`, ..., `decode-0`, ..., each the name of its host and its `--node-id`.
#[derive(Clone, Debug)]
pub struct NetnsClusterBuilder {
    fission: PathBuf,
    prefill: usize,
    decode: usize,
    kv_transport: String,
    tls: Tls,
    args: Vec<(Processes, String)>,
    env: Vec<(Processes, String, String)>,
    ready: Option<usize>,
}

impl NetnsClusterBuilder {
    /// `fission` is the binary under test (`env!("CARGO_BIN_EXE_fission")`, or another
    /// build's); it also issues the certificates.
    pub fn new(fission: impl Into<PathBuf>) -> Self {
        NetnsClusterBuilder {
            fission: fission.into(),
            prefill: 1,
            decode: 1,
            kv_transport: "quic".into(),
            tls: Tls::PerHost,
            args: Vec::new(),
            env: Vec::new(),
            ready: None,
        }
    }

    /// `prefill` 0 is colocated mode: the decode nodes prefill their own prompts.
    pub fn nodes(mut self, prefill: usize, decode: usize) -> Self {
        self.prefill = prefill;
        self.decode = decode;
        self
    }

    /// Every node's `--kv-transport`: `quic` (the default), `tcp`, `shm` or `ucx`.
    pub fn transport(mut self, transport: &str) -> Self {
        self.kv_transport = transport.into();
        self
    }

    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = tls;
        self
    }

    /// A flag for `to`, after the ones the builder sets.
    pub fn arg(mut self, to: Processes, arg: impl Into<String>) -> Self {
        self.args.push((to, arg.into()));
        self
    }

    /// An environment variable for `to`.
    pub fn env(mut self, to: Processes, key: &str, value: &str) -> Self {
        self.env.push((to, key.into(), value.into()));
        self
    }

    fn args_for(&self, to: Processes) -> impl Iterator<Item = &str> {
        self.args
            .iter()
            .filter(move |(p, _)| *p == to)
            .map(|(_, a)| a.as_str())
    }

    fn env_for(&self, to: Processes) -> impl Iterator<Item = (&str, &str)> {
        self.env
            .iter()
            .filter(move |(p, _, _)| *p == to)
            .map(|(_, k, v)| (k.as_str(), v.as_str()))
    }

    /// How many nodes the gateway must list as ready before [`Self::start_or_skip`] returns
    /// (every node by default), for a cluster where it must refuse some.
    pub fn ready(mut self, nodes: usize) -> Self {
        self.ready = Some(nodes);
        self
    }

    fn node_names(&self) -> Vec<String> {
        let prefill = (0..self.prefill).map(|i| format!("prefill-{i}"));
        prefill
            .chain((0..self.decode).map(|i| format!("decode-{i}")))
            .collect()
    }

    /// Starts the cluster, moves the calling thread (and the HTTP clients it makes from now on)
    /// onto the `client` host, and returns once the gateway lists the nodes as ready; panics
    /// with the processes' logs if it does not within 90 s. `None`, after a `SKIPPED` line,
    /// where namespaces cannot be made here. Waits for any other cluster of this test binary
    /// to be dropped first.
    pub fn start_or_skip(&self) -> Option<NetnsCluster> {
        let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
        let nodes = self.node_names();
        let hosts: Vec<&str> = ["etcd", "gateway", "client"]
            .into_iter()
            .chain(nodes.iter().map(String::as_str))
            .collect();
        let lab = lab_or_skip(&hosts)?;
        let dir = ScratchDir::new();
        let tls = TlsFiles::issue(&self.fission, &lab, &dir.0.join("tls"), &self.tls, &nodes);
        let (etcd, etcd_url) = lab.start_etcd("etcd", &dir.0);
        let mut procs = vec![etcd];
        for node in &nodes {
            let role = role(node);
            let ip = lab.host(node).ip;
            let mut cmd = lab.command(node, &self.fission);
            cmd.args(["node", role, "--model"])
                .arg(stories_dir())
                .args(["--node-id", node, "--num-kv-blocks", NUM_KV_BLOCKS])
                .args(["--etcd", &etcd_url, "--cluster", CLUSTER])
                .args(["--lease-ttl-s", LEASE_TTL_S])
                .args(["--kv-transport", &self.kv_transport])
                .arg(format!("--grpc-addr={ip}:{GRPC_PORT}"))
                .arg(format!("--metrics-addr={ip}:{METRICS_PORT}"))
                .arg(format!("--advertise-host={ip}"))
                .args(tls.flags(node))
                .args(self.args_for(Processes::Nodes))
                // Namespaces share the kernel, /dev/shm and the machine id: each stands for a
                // host of its own only by the id it advertises, so that no two nodes pick
                // shared memory between them.
                .env("FISSION_HOST_ID", node)
                .envs(self.env_for(Processes::Nodes));
            if role == "decode" {
                cmd.arg(format!("--kv-addr={ip}:{KV_PORT}"))
                    .args(self.args_for(Processes::DecodeNodes))
                    .envs(self.env_for(Processes::DecodeNodes));
            }
            procs.push(spawn_logged(cmd, &dir.log(node)));
        }
        let gw_ip = lab.host("gateway").ip;
        let mut gateway = lab.command("gateway", &self.fission);
        gateway
            .args(["gateway", "--model-dir"])
            .arg(stories_dir())
            .arg(format!("--addr={gw_ip}:{HTTP_PORT}"))
            .args(["--etcd", &etcd_url, "--cluster", CLUSTER])
            .args(tls.flags("gateway"))
            .args(self.args_for(Processes::Gateway))
            .envs(self.env_for(Processes::Gateway))
            // A key in the test runner's environment would lock the test out.
            .env_remove("FISSION_API_KEY");
        procs.push(spawn_logged(gateway, &dir.log("gateway")));

        lab.enter("client")
            .unwrap_or_else(|e| panic!("onto the client host: {e}"));
        let cluster = NetnsCluster {
            url: format!("http://{gw_ip}:{HTTP_PORT}"),
            nodes,
            _procs: procs,
            lab,
            dir,
            _serial: serial,
        };
        let ready = self.ready.unwrap_or(cluster.nodes.len());
        if let Err(e) = try_wait_until(
            &format!("{ready} nodes ready at the gateway"),
            READY_TIMEOUT,
            || cluster.ready_nodes().len() == ready,
        ) {
            panic!("{e}\n{}", cluster.log_tails());
        }
        Some(cluster)
    }
}

/// `prefill` or `decode`, from a node name.
fn role(node: &str) -> &str {
    node.split('-')
        .next()
        .expect("split yields one piece at least")
}

/// The certificates of a cluster, as each process's flags.
struct TlsFiles {
    dir: PathBuf,
    tls: Tls,
}

impl TlsFiles {
    /// `fission certs init` in `dir`, then the certificates `tls` asks for: one per host of
    /// the gateway and of each of `nodes`, or one per role.
    fn issue(fission: &Path, lab: &Lab, dir: &Path, tls: &Tls, nodes: &[String]) -> TlsFiles {
        let files = TlsFiles {
            dir: dir.to_path_buf(),
            tls: tls.clone(),
        };
        if *tls == Tls::Insecure {
            return files;
        }
        let run = |args: &[&str]| {
            let out = Command::new(fission)
                .args(args)
                .output()
                .unwrap_or_else(|e| panic!("{}: {e}", fission.display()));
            assert!(out.status.success(), "fission {args:?}: {out:?}");
        };
        let out = dir.to_str().expect("a temporary directory's path is UTF-8");
        run(&["certs", "init", "--out", out]);
        let (ca, key) = (format!("{out}/ca.pem"), format!("{out}/ca.key"));
        let mut issued = Vec::new();
        for host in std::iter::once("gateway").chain(nodes.iter().map(String::as_str)) {
            let name = files.cert_name(host);
            let san = match tls {
                Tls::SharedName(shared) => shared.clone(),
                _ => lab.host(host).ip.to_string(),
            };
            if issued.contains(&name) {
                continue;
            }
            run(&[
                "certs",
                "issue",
                "--ca-cert",
                &ca,
                "--ca-key",
                &key,
                "--role",
                role(host),
                "--name",
                &name,
                "--san",
                &san,
                "--out",
                out,
            ]);
            issued.push(name);
        }
        files
    }

    /// The certificate `host` presents: its own, or its role's.
    fn cert_name(&self, host: &str) -> String {
        match self.tls {
            Tls::SharedName(_) => role(host).to_string(),
            _ => host.to_string(),
        }
    }

    /// `--tls-ca A --tls-cert B --tls-key C` (and `--tls-server-name`) for `host`, or
    /// `--insecure`.
    fn flags(&self, host: &str) -> Vec<String> {
        if self.tls == Tls::Insecure {
            return vec!["--insecure".into()];
        }
        let (d, name) = (self.dir.display(), self.cert_name(host));
        let mut flags = vec![
            "--tls-ca".into(),
            format!("{d}/ca.pem"),
            "--tls-cert".into(),
            format!("{d}/{name}.pem"),
            "--tls-key".into(),
            format!("{d}/{name}.key"),
        ];
        if let Tls::SharedName(shared) = &self.tls {
            flags.extend(["--tls-server-name".into(), shared.clone()]);
        }
        flags
    }
}

/// A directory of its own for a cluster's etcd data, certificates and logs, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> ScratchDir {
        // Unique per cluster: a process may start several one after another.
        static CLUSTERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("fission-netns-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        ScratchDir(path)
    }

    /// `<dir>/<name>.log`.
    fn log(&self, name: &str) -> PathBuf {
        self.0.join(format!("{name}.log"))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running cluster across hosts. Dropping it kills its processes and removes the hosts.
pub struct NetnsCluster {
    /// The gateway's HTTP base URL, reached from the `client` host.
    pub url: String,
    nodes: Vec<String>,
    // Dropped in this order: the processes, then the hosts (and anything left on them), then
    // the files, then the lock that lets the next cluster start.
    _procs: Vec<KillOnDrop>,
    lab: Lab,
    dir: ScratchDir,
    _serial: MutexGuard<'static, ()>,
}

impl NetnsCluster {
    /// The hosts, to cut and restore a node's link ([`Lab::cut`]).
    pub fn lab(&self) -> &Lab {
        &self.lab
    }

    /// Every node's name, prefill nodes first.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The node ids the gateway lists as ready (empty when it does not answer).
    pub fn ready_nodes(&self) -> Vec<String> {
        http_get(&format!("{}/info", self.url))
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .map(|v| crate::fission::ready_node_ids(&v))
            .unwrap_or_default()
    }

    pub fn metrics_url(&self, node: &str) -> String {
        format!("http://{}:{METRICS_PORT}/metrics", self.lab.host(node).ip)
    }

    /// The first sample named exactly `name` of `node` ([`metric`]).
    pub fn metric(&self, node: &str, name: &str) -> f64 {
        metric(&self.metrics_url(node), name)
    }

    /// Every sample of the metric `name` of `node`, summed over its labels ([`metric_sum`]).
    pub fn metric_sum(&self, node: &str, name: &str) -> f64 {
        metric_sum(&self.metrics_url(node), name)
    }

    /// The gateway's metric `name`, summed over its labels.
    pub fn gateway_metric_sum(&self, name: &str) -> f64 {
        metric_sum(&format!("{}/metrics", self.url), name)
    }

    /// KV pushes `node` (a prefill node) made over `transport`, by its
    /// `fission_prefill_kv_pushes_total{transport=...}` counter.
    pub fn kv_pushes(&self, node: &str, transport: &str) -> f64 {
        self.metric(
            node,
            &format!("fission_prefill_kv_pushes_total{{transport=\"{transport}\"}}"),
        )
    }

    /// What `process` (a node, `gateway` or `etcd`) has written to its stderr so far.
    pub fn log(&self, process: &str) -> String {
        std::fs::read_to_string(self.dir.log(process)).unwrap_or_default()
    }

    /// The last lines of every process's log, for a failure message.
    pub fn log_tails(&self) -> String {
        const LINES: usize = 40;
        let mut out = String::new();
        for process in self.nodes.iter().map(String::as_str).chain(["gateway"]) {
            let log = self.log(process);
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(LINES)..].join("\n");
            out.push_str(&format!("--- {process} (last {LINES} lines):\n{tail}\n"));
        }
        out
    }

    /// Waits up to 20 s for every KV gauge of every node to read 0 ([`kv_gauges`]), then
    /// checks each is exported at all (an absent one would read 0).
    pub fn assert_kv_released(&self) {
        for node in &self.nodes {
            let m = self.metrics_url(node);
            wait_until(
                &format!("every KV gauge of {node} back to 0"),
                Duration::from_secs(20),
                || kv_gauges::held(node, &m) == 0.0,
            );
            assert_eq!(
                kv_gauges::missing(node, &m),
                Vec::<&str>::new(),
                "{node} exports them"
            );
        }
    }
}
