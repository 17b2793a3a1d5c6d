//! Real Fission clusters for end-to-end tests: `fission up` and `fission node start` as child
//! processes (the test passes the binary, `env!("CARGO_BIN_EXE_fission")`), their metrics and
//! `/info` read over HTTP, real signals, and a closed-loop load. Every process is stopped when
//! its handle drops, and every wait is on a condition.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::wait::{try_wait_until, wait_until};

/// stories260K in the shared models directory: the model every cluster test serves.
pub fn stories_dir() -> PathBuf {
    crate::shared_model("stories260K")
}

/// A port for a child process to bind ([`ports::free_port`]).
pub fn free_port() -> u16 {
    ports::free_port().expect("a free port")
}

/// GET `url` on a runtime of its own thread (tests poll from sync code); `None` on any error.
pub fn http_get(url: &str) -> Option<String> {
    http_get_with_key(url, None)
}

/// [`http_get`] with `api_key` as a bearer token when one is given.
pub fn http_get_with_key(url: &str, api_key: Option<&str>) -> Option<String> {
    let url = url.to_string();
    let api_key = api_key.map(str::to_string);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        rt.block_on(async {
            let mut request = reqwest::Client::new().get(&url);
            if let Some(key) = api_key {
                request = request.bearer_auth(key);
            }
            request.send().await.ok()?.text().await.ok()
        })
    })
    .join()
    .ok()
    .flatten()
}

/// The value of the first sample named exactly `name` in a Prometheus exposition at
/// `metrics_url`; 0 when absent or unreachable.
pub fn metric(metrics_url: &str, name: &str) -> f64 {
    http_get(metrics_url)
        .unwrap_or_default()
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// The sum of every sample of the metric `name` (all label sets).
pub fn metric_sum(metrics_url: &str, name: &str) -> f64 {
    http_get(metrics_url)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

/// Sends `sig` to `child`.
pub fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on a child we spawned and have not reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
}

/// Waits for `child` to exit, for at most `timeout`.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> ExitStatus {
    let mut status = None;
    wait_until("the process to exit", timeout, || {
        status = child.try_wait().expect("try_wait");
        status.is_some()
    });
    status.expect("exited")
}

/// A child process SIGKILLed (and reaped) when dropped, so a failed test leaves none behind.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// SIGTERM, then SIGKILL if it has not exited within `grace`.
fn stop(child: &mut Child, grace: Duration) {
    signal(child, libc::SIGTERM);
    let exited = try_wait_until("the process to stop", grace, || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if exited.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// How to start `fission up`.
#[derive(Clone, Debug)]
pub struct UpConfig {
    pub fission: PathBuf,
    pub model: PathBuf,
    pub prefill: usize,
    pub decode: usize,
    /// An etcd to use instead of the one `fission up` starts.
    pub etcd: Option<String>,
    /// `quic` (the default) or `tcp`.
    pub kv_transport: String,
    /// Flags for every node (`--num-kv-blocks=512` by default).
    pub node_args: Vec<String>,
    /// Any other flags of `fission up`.
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// An API key the gateway requires (given to `fission up` in `FISSION_API_KEY`); the
    /// handle's own requests ([`Up::info`]) send it.
    pub api_key: Option<String>,
    /// Where the cluster's stderr goes; inherited when unset.
    pub log: Option<PathBuf>,
    pub ready_timeout: Duration,
    /// Starts `fission up` in a process group of its own, so that a test can signal the group
    /// as a terminal's Ctrl-C does ([`Up::signal_group`]) without signalling itself.
    pub process_group: bool,
}

impl UpConfig {
    pub fn new(fission: impl Into<PathBuf>, prefill: usize, decode: usize) -> Self {
        UpConfig {
            fission: fission.into(),
            model: stories_dir(),
            prefill,
            decode,
            etcd: None,
            kv_transport: "quic".into(),
            node_args: vec!["--num-kv-blocks=512".into()],
            args: Vec::new(),
            env: Vec::new(),
            api_key: None,
            log: None,
            ready_timeout: Duration::from_secs(120),
            process_group: false,
        }
    }
}

/// A running `fission up`; SIGTERM on drop, and the drop waits for it to exit.
pub struct Up {
    child: Child,
    pub url: String,
    /// Node name (`prefill-0`, `decode-0`, ...) and its metrics URL, as `fission up` printed.
    pub metrics: Vec<(String, String)>,
    /// Node name and its gRPC `host:port`, as `fission up` printed.
    pub grpc: Vec<(String, String)>,
    /// The `fission node start ...` command `fission up` printed for adding a node.
    pub join: String,
    /// The etcd URL it printed.
    pub etcd: String,
    /// The `fission nodes list|drain ...` command it printed, with the admin certificate.
    pub operate: String,
    /// [`UpConfig::api_key`].
    pub api_key: Option<String>,
}

impl Up {
    /// Starts the cluster and waits until the gateway lists every node as ready.
    pub fn start(config: &UpConfig) -> Up {
        let port = free_port();
        let mut cmd = Command::new(&config.fission);
        cmd.args(["up", "--model"])
            .arg(&config.model)
            .args(["--prefill", &config.prefill.to_string()])
            .args(["--decode", &config.decode.to_string()])
            .args(["--port", &port.to_string()])
            .args(["--kv-transport", &config.kv_transport])
            // The KV backends without TLS (tcp, shm) are allowed only where a user says so.
            .args((config.kv_transport != "quic").then_some("--insecure"))
            .args([
                "--ready-timeout-s",
                &config.ready_timeout.as_secs().to_string(),
            ])
            .args(config.node_args.iter().map(|a| format!("--node-arg={a}")))
            .args(&config.args)
            // A key in the test runner's environment would lock out every other test.
            .env_remove("FISSION_API_KEY")
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .envs(config.api_key.as_ref().map(|k| ("FISSION_API_KEY", k)))
            .stdout(Stdio::piped());
        if let Some(etcd) = &config.etcd {
            cmd.args(["--etcd", etcd]);
        }
        if config.process_group {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        match &config.log {
            Some(log) => cmd.stderr(std::fs::File::create(log).expect("log file")),
            None => cmd.stderr(Stdio::inherit()),
        };
        let mut child = cmd.spawn().expect("fission up starts");
        let out = child.stdout.take().expect("stdout");
        let (mut metrics, mut url, mut join, mut etcd) = (Vec::new(), None, String::new(), None);
        let mut operate = String::new();
        let mut grpc = Vec::new();
        let mut lines = BufReader::new(out).lines();
        for line in lines.by_ref() {
            let line = line.expect("a line");
            if let Some(rest) = line.strip_prefix("Fission is up: ") {
                url = Some(rest.trim().to_string());
                break;
            }
            if let Some(rest) = line.strip_prefix("add a node: ") {
                join = rest.to_string();
            } else if let Some(rest) = line.strip_prefix("operate: ") {
                operate = rest.to_string();
            } else if let Some(rest) = line.strip_prefix("etcd: ") {
                etcd = rest.split_whitespace().next().map(str::to_string);
            } else if let Some((name, m)) = line.split_once(" grpc=") {
                let addr = m.split_whitespace().next().unwrap_or_default();
                grpc.push((name.to_string(), addr.to_string()));
                let m = m.split("metrics=").nth(1).expect("a metrics url");
                metrics.push((name.to_string(), m.to_string()));
            }
        }
        // Keep reading: `fission up` prints more after it is up, and a closed pipe must not be
        // what a test measures.
        std::thread::spawn(move || lines.for_each(drop));
        let log = || {
            config
                .log
                .as_ref()
                .and_then(|l| std::fs::read_to_string(l).ok())
                .unwrap_or_default()
        };
        let up = Up {
            child,
            url: url.unwrap_or_else(|| panic!("fission up did not come up:\n{}", log())),
            metrics,
            grpc,
            join,
            etcd: etcd.unwrap_or_default(),
            operate,
            api_key: config.api_key.clone(),
        };
        // `fission up` reports healthy once a decode node answers; the tests need every node
        // routable.
        let nodes = config.prefill + config.decode;
        wait_until(
            "every node ready at the gateway",
            config.ready_timeout,
            || {
                let info = up.info();
                let ready = info["backend"]["nodes"]
                    .as_array()
                    .map_or(0, |a| a.iter().filter(|n| n["ready"] == true).count());
                ready >= nodes
            },
        );
        up
    }

    /// Sends `sig` to `fission up`'s process group, as a terminal does on Ctrl-C (needs
    /// [`UpConfig::process_group`]).
    pub fn signal_group(&self, sig: libc::c_int) {
        // SAFETY: killpg(2) on the group of a child we spawned as its leader.
        unsafe {
            libc::killpg(self.child.id() as libc::pid_t, sig);
        }
    }

    /// Waits for `fission up` to exit, for at most `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        wait_exit(&mut self.child, timeout)
    }

    /// The credentials a node of `role` added to this cluster needs (its `--tls-*` and
    /// `--etcd-*` flags and `--insecure`), taken from the join command `fission up` printed.
    pub fn credentials(&self, role: &str) -> Vec<String> {
        credential_flags(&self.join.replace("decode|prefill", role))
    }

    /// The credentials of the operator's commands (`fission nodes drain`).
    pub fn admin_credentials(&self) -> Vec<String> {
        credential_flags(&self.operate)
    }

    pub fn metrics_url(&self, node: &str) -> &str {
        &self
            .metrics
            .iter()
            .find(|(n, _)| n == node)
            .unwrap_or_else(|| panic!("no node {node} in {:?}", self.metrics))
            .1
    }

    pub fn metric(&self, node: &str, name: &str) -> f64 {
        metric(self.metrics_url(node), name)
    }

    /// The gateway's `/info`.
    pub fn info(&self) -> Value {
        let info = http_get_with_key(&format!("{}/info", self.url), self.api_key.as_deref());
        serde_json::from_str(&info.unwrap_or_default()).unwrap_or_default()
    }

    /// The node ids in the gateway's pools.
    pub fn gateway_nodes(&self) -> Vec<String> {
        self.info()["backend"]["nodes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|n| n["node_id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether the gateway lists `node_id` as ready.
    pub fn is_ready(&self, node_id: &str) -> bool {
        ready_node_ids(&self.info()).iter().any(|n| n == node_id)
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(30));
    }
}

/// The `--tls-*`, `--etcd-*` (with their values) and `--insecure` flags of a command line.
fn credential_flags(command: &str) -> Vec<String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = words[i];
        if w == "--insecure" {
            out.push(w.to_string());
        } else if (w.starts_with("--tls-") || (w.starts_with("--etcd-") && w != "--etcd"))
            && i + 1 < words.len()
        {
            out.push(w.to_string());
            out.push(words[i + 1].to_string());
            i += 1;
        }
        i += 1;
    }
    out
}

/// `fission nodes list --json --etcd ETCD`: every registered node (empty when it fails).
/// The node ids a gateway's `/info` lists as ready.
pub fn ready_node_ids(info: &Value) -> Vec<String> {
    info["backend"]["nodes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|n| n["ready"] == true)
                .filter_map(|n| n["node_id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

pub fn nodes_json(fission: &Path, etcd: &str) -> Vec<Value> {
    let Ok(out) = Command::new(fission)
        .args(["nodes", "list", "--json", "--etcd", etcd])
        .output()
    else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    let v: Value = serde_json::from_slice(&out.stdout).expect("nodes list prints JSON");
    v["nodes"].as_array().cloned().unwrap_or_default()
}

/// A node added with `fission node start`; SIGKILLed on drop.
pub struct Added {
    pub child: Child,
    pub metrics: String,
    pub started: Instant,
}

/// How to start one node with `fission node start`.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub fission: PathBuf,
    pub role: String,
    pub node_id: String,
    pub model: PathBuf,
    pub etcd: String,
    /// Flags after the defaults (`--num-kv-blocks 512 --kv-transport tcp --insecure`), which
    /// they beat. A node of a mutual-TLS cluster needs its credentials here
    /// ([`Up::credentials`]); `--insecure` then only allows the plaintext KV backend.
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub log: PathBuf,
}

impl Added {
    pub fn start(config: &NodeConfig) -> Added {
        let started = Instant::now();
        let mut child = Command::new(&config.fission)
            .args(["node", "start", "--role", &config.role, "--model"])
            .arg(&config.model)
            .args(["--etcd", &config.etcd, "--node-id", &config.node_id])
            .args(
                [["--num-kv-blocks", "512"], ["--kv-transport", "tcp"]]
                    .iter()
                    .filter(|[flag, _]| !config.args.iter().any(|a| a == flag))
                    .flatten(),
            )
            .args(
                (!config
                    .args
                    .iter()
                    .any(|a| a == "--insecure" || a == "--kv-transport"))
                .then_some("--insecure"),
            )
            .args(&config.args)
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&config.log).expect("log file"))
            .spawn()
            .expect("fission node start runs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the announcement");
        let metrics = line
            .split("metrics=")
            .nth(1)
            .unwrap_or_else(|| panic!("node announces its metrics URL, got {line:?}"))
            .trim()
            .to_string();
        Added {
            child,
            metrics,
            started,
        }
    }

    pub fn signal(&self, sig: libc::c_int) {
        signal(&self.child, sig);
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        wait_exit(&mut self.child, timeout)
    }
}

impl Drop for Added {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Closed-loop load: `workers` clients each sending one `/generate` after another until
/// stopped, each with a distinct prompt (no shared prefix, so load decides routing).
pub struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    pub fn start(url: &str, workers: usize, max_new_tokens: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..workers)
            .map(|w| {
                let (url, stop, ok, failures) = (
                    url.to_string(),
                    Arc::clone(&stop),
                    Arc::clone(&ok),
                    Arc::clone(&failures),
                );
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    rt.block_on(async move {
                        let client = reqwest::Client::new();
                        let mut i = 0u64;
                        while !stop.load(Ordering::SeqCst) {
                            i += 1;
                            let prompt = format!("Worker {w} request {i}: once upon a time");
                            let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}});
                            let resp = client
                                .post(format!("{url}/generate"))
                                .json(&body)
                                .send()
                                .await;
                            let failure = match resp {
                                Ok(r) if r.status().is_success() => {
                                    ok.fetch_add(1, Ordering::SeqCst);
                                    continue;
                                }
                                Ok(r) => format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
                                Err(e) => e.to_string(),
                            };
                            failures.lock().expect("no panic holding it").push(failure);
                        }
                    });
                })
            })
            .collect();
        Load {
            stop,
            ok,
            failures,
            threads,
        }
    }

    /// Requests completed so far.
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::SeqCst)
    }

    pub fn assert_no_failures(&self, when: &str) {
        let f = self.failures.lock().expect("no panic holding it");
        assert!(
            f.is_empty(),
            "{} failed requests {when}: {:?}",
            f.len(),
            &f[..f.len().min(5)]
        );
    }

    /// Waits until `n` more requests than now have completed.
    pub fn wait_for_more(&self, what: &str, n: u64, timeout: Duration) {
        let before = self.ok();
        wait_until(what, timeout, || self.ok() >= before + n);
    }

    /// Completed requests per second over the next `window` (a measurement, so it sleeps).
    pub fn throughput(&self, window: Duration) -> f64 {
        let before = self.ok();
        std::thread::sleep(window);
        (self.ok() - before) as f64 / window.as_secs_f64()
    }

    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().expect("a load worker panicked");
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
