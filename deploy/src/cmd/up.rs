//! `fission up`: a local cluster of separate processes (an etcd, N prefill nodes, M decode
//! nodes and a gateway), with a dev CA that gives each process a certificate for its role. Nodes register in etcd and the
//! gateway discovers them there, so `fission node start` can add more while it runs. It prints
//! the etcd URL and the gateway URL, and on Ctrl-C or SIGTERM stops every process cleanly.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use engine::loader::{ModelFiles, ModelSource};
use identity::PeerRole;

use crate::cmd::dev_certs::{tls_args, tls_flags, DevCerts};

/// `println!` that survives a closed stdout: whoever started `fission up` (a script reading up
/// to "Fission is up", `| head`) may stop reading, and the cluster must keep running.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// A model directory, or a hub repo id (`org/name[@revision]`). The default, stories260K,
    /// is embedded in the binary and needs no network.
    #[arg(long, env = "FISSION_MODEL", default_value = crate::default_model::NAME)]
    pub model: String,
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// The gateway's HTTP port.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// kv transport: quic, tcp, shm (shared memory, one host) or ucx (UCX sends into registered memory, libucx0).
    #[arg(long, default_value = "quic")]
    pub kv_transport: String,
    /// Prompts shorter than this are prefilled on the decode node.
    #[arg(long, default_value_t = 0)]
    pub max_local_prefill_tokens: usize,
    /// `mock` starts mock nodes: each step takes the time `--cost-profile` predicts, tokens are
    /// deterministic, and the scheduler, KV accounting and KV transfer stay real. Many mock
    /// nodes fit on one machine, to try routing and scaling policies at cluster size.
    #[arg(long, value_enum, default_value_t = node_common::engine_args::EngineKind::Real)]
    pub engine: node_common::engine_args::EngineKind,
    /// The mock nodes' cost profile: a built-in name (`h100-llama8b`) or a JSON file.
    #[arg(long, required_if_eq("engine", "mock"))]
    pub cost_profile: Option<String>,
    /// Where every node's model runs: cpu, or cuda[:N] (a binary built with `--features cuda`).
    #[arg(long, env = "FISSION_DEVICE", default_value = "cpu")]
    pub device: engine::device::DeviceSpec,
    /// Every node's forward pass: auto, host, or tensor (the device-generic path).
    #[arg(long = "path", env = "FISSION_PATH", default_value = "auto")]
    pub forward_path: engine::device::ForwardPath,
    /// On CUDA, the share of each GPU's memory a node may use; its KV cache gets the free
    /// part after the weights (the nodes' default when not given).
    #[arg(long, env = "FISSION_GPU_MEMORY_UTILIZATION")]
    pub gpu_memory_utilization: Option<f64>,
    /// Extra flags for every node (e.g. `--num-kv-blocks=512`), repeatable.
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    pub node_args: Vec<String>,
    /// Extra flags for the prefill nodes only (e.g. `--push-after-prefill`), repeatable.
    #[arg(long = "prefill-arg", allow_hyphen_values = true)]
    pub prefill_args: Vec<String>,
    /// Extra flags for the decode nodes only (e.g. `--lease-ms=8000`), repeatable.
    #[arg(long = "decode-arg", allow_hyphen_values = true)]
    pub decode_args: Vec<String>,
    /// Extra flags for the gateway, repeatable.
    #[arg(long = "gateway-arg", allow_hyphen_values = true)]
    pub gateway_args: Vec<String>,
    /// An API key clients must send to the gateway (`Authorization: Bearer KEY`); repeatable.
    /// FISSION_API_KEY holds one. The gateway reads them from a file, off its command line.
    #[arg(long = "api-key", env = "FISSION_API_KEY", hide_env_values = true)]
    pub api_keys: Vec<gateway::auth::ApiKey>,
    /// No TLS anywhere, for local development: plaintext gRPC that anyone who reaches a port
    /// may call, and the plaintext KV backend (`--kv-transport tcp`, which needs it).
    #[arg(long)]
    pub insecure: bool,
    /// Seconds to wait for the cluster to become healthy.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout_s: u64,
    /// Use this etcd instead of starting one from PATH (which serves TLS to the cluster CA's
    /// certificates, unless --insecure).
    #[arg(long, env = "FISSION_ETCD")]
    pub etcd: Option<String>,
    /// TLS and user for the etcd given with --etcd, passed on to every process. A password
    /// given by value reaches them in their environment, never on their command lines.
    #[command(flatten)]
    pub etcd_security: cluster::EtcdSecurityArgs,
    /// The cluster's name in etcd.
    #[arg(long, env = "FISSION_CLUSTER", default_value = "fission")]
    pub cluster: String,
    /// OTLP/gRPC collector for every process's spans (their `--otlp-endpoint`). Unset: each
    /// process reads `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`.
    // No clap `env`: that would turn the generic variable into an explicit flag for every
    // process, beating the traces-specific one (see `telemetry::TelemetryArgs`).
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
}

/// Children are killed when this is dropped, even on an error path.
struct Procs {
    children: Vec<(String, Child)>,
}

impl Procs {
    /// Stops the nodes, then the gateway (it keeps routing to nodes that are still draining),
    /// each stage with SIGTERM, up to `grace`, then SIGKILL for whoever is left. etcd, owned by
    /// the caller, goes after: draining nodes revoke their leases on the way out, which an etcd
    /// stopped first would turn into lease-loss warnings on every stop.
    fn stop(&mut self, grace: Duration) {
        let (gateway, nodes): (Vec<_>, Vec<_>) = std::mem::take(&mut self.children)
            .into_iter()
            .partition(|(name, _)| name == "gateway");
        stop_all(nodes, grace);
        stop_all(gateway, grace);
    }
}

fn stop_all(mut children: Vec<(String, Child)>, grace: Duration) {
    for (_, c) in &children {
        // SAFETY: kill(2) on a pid we spawned and have not waited on yet.
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    for (name, c) in &mut children {
        loop {
            match c.try_wait() {
                Ok(Some(status)) => {
                    eprintln!("{name} exited ({status})");
                    break;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    eprintln!("{name} did not stop in time: killing it");
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
            }
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        if !self.children.is_empty() {
            self.stop(Duration::from_secs(10));
        }
    }
}

/// A minimal HTTP/1.1 GET, enough to poll /info without an HTTP client dependency; with
/// `api_key` as a bearer token when one is given.
pub fn http_get(
    addr: &str,
    path: &str,
    api_key: Option<&gateway::auth::ApiKey>,
) -> anyhow::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let authorization = api_key
        .map(|k| format!("Authorization: Bearer {}\r\n", k.expose()))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}Connection: close\r\n\r\n"
    )?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

fn model_dir(spec: &str) -> anyhow::Result<PathBuf> {
    let spec = crate::default_model::resolve(spec)?;
    let files = ModelFiles::resolve(&ModelSource::parse(&spec)).map_err(|e| {
        anyhow::anyhow!("{e}\nOn a machine without network, serve a local model directory (fission up --model PATH) or the embedded default (leave out --model)")
    })?;
    Ok(files
        .config
        .parent()
        .context("config.json has a parent directory")?
        .to_path_buf())
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the fission binary")?;
    // Before etcd or any node starts: a CUDA request in a CPU build fails here, once.
    args.device.check_compiled()?;
    let dir = model_dir(&args.model)?;
    let work = tempfile::Builder::new().prefix("fission-up-").tempdir()?;
    match (args.kv_transport.as_str(), args.insecure) {
        (backend @ ("tcp" | "shm" | "ucx"), false) => bail!(
            "--kv-transport {backend} has no TLS: add --insecure to say plaintext is acceptable here"
        ),
        ("quic", true) => {
            bail!("the QUIC KV transport is always TLS: --insecure needs --kv-transport tcp, shm or ucx")
        }
        _ => {}
    }
    // Every process gets a certificate for its role from one dev CA: the nodes' gRPC and
    // QUIC are mutual TLS, and each node lets only the right roles call each method.
    let certs = (!args.insecure)
        .then(|| DevCerts::create(work.path()))
        .transpose()?;
    let etcd_security = args.etcd_security.security()?;
    if args.etcd.is_none() && (etcd_security.tls.is_some() || etcd_security.credentials.is_some()) {
        bail!("the --etcd-* flags are for an etcd given with --etcd: the one fission up starts uses the cluster CA");
    }
    // A process's credentials: its certificate's flags, or `--insecure`, and how it reaches
    // etcd: the etcd flags given, or, on the etcd started here, the same certificate.
    let credentials = |role: PeerRole, name: &str| -> anyhow::Result<Vec<OsString>> {
        let mut flags = match &certs {
            Some(certs) => {
                let files = certs.issue(role, name)?;
                let mut flags = tls_args(&files).to_vec();
                if args.etcd.is_none() {
                    flags.extend(etcd_client_cert(&files).to_args());
                }
                flags
            }
            None => vec!["--insecure".into()],
        };
        flags.extend(args.etcd_security.to_args());
        Ok(flags)
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [libc::SIGINT, libc::SIGTERM] {
        signal_flag(sig, Arc::clone(&stop))?;
    }
    // Started first and stopped last (on drop, after `procs`): draining nodes revoke their
    // leases on the way out.
    let mut local_etcd = None;
    let etcd = match &args.etcd {
        Some(url) => url.clone(),
        None => {
            // Clients must present a certificate from the cluster CA: the etcd holds the
            // membership every process trusts.
            let e = match &certs {
                Some(certs) => {
                    let server = certs.issue(PeerRole::Etcd, "etcd")?;
                    let tls = cluster::EtcdServerTls {
                        ca_cert: server.ca_cert,
                        cert: server.cert,
                        key: server.key,
                    };
                    cluster::LocalEtcd::start_tls(work.path(), tls)?
                }
                None => cluster::LocalEtcd::start(work.path())?,
            };
            let url = e.endpoint();
            local_etcd = Some(e);
            url
        }
    };
    say!("etcd: {etcd} (cluster {})", args.cluster);
    // Nodes added later (`fission node start`) must speak the cluster's KV transport and hold
    // a certificate for their role from its CA: issue one per role they can share, named so
    // that choosing the role in the printed command chooses the certificate too.
    let mut engine_flags: Vec<String> = match &args.cost_profile {
        Some(profile) if args.engine == node_common::engine_args::EngineKind::Mock => {
            vec![
                "--engine".into(),
                "mock".into(),
                "--cost-profile".into(),
                profile.clone(),
            ]
        }
        _ => Vec::new(),
    };
    engine_flags.extend([
        "--device".into(),
        args.device.to_string(),
        "--path".into(),
        args.forward_path.to_string(),
    ]);
    if let Some(u) = args.gpu_memory_utilization {
        engine_flags.extend(["--gpu-memory-utilization".into(), u.to_string()]);
    }
    let mut join = format!(
        "fission node start --role decode|prefill --model {} --etcd {etcd} --cluster {} --kv-transport {}",
        dir.display(),
        args.cluster,
        args.kv_transport
    );
    for flag in &engine_flags {
        join.push(' ');
        join.push_str(flag);
    }
    // The operator's commands (`fission nodes drain`) present an admin certificate.
    let mut operate = format!(
        "fission nodes list|drain --etcd {etcd} --cluster {}",
        args.cluster
    );
    match &certs {
        Some(certs) => {
            let joined = tempfile::Builder::new()
                .prefix("join-")
                .tempdir_in(work.path())?
                .keep();
            for role in [PeerRole::Decode, PeerRole::Prefill] {
                let cert = certs.ca().issue(role, role.as_str())?;
                identity::write_pem_files(&joined, certs.ca(), &cert)?;
            }
            join.push_str(&format!(
                " --tls-ca {0}/ca.pem --tls-cert {0}/decode|prefill.pem --tls-key {0}/decode|prefill.key",
                joined.display()
            ));
            if args.etcd.is_none() {
                join.push_str(&format!(
                    " --etcd-ca {0}/ca.pem --etcd-cert {0}/decode|prefill.pem --etcd-key {0}/decode|prefill.key",
                    joined.display()
                ));
            }
            let admin = certs.issue(PeerRole::Admin, "admin")?;
            operate.push(' ');
            operate.push_str(&tls_flags(&admin));
            if args.etcd.is_none() {
                operate.push_str(&shown(&etcd_client_cert(&admin).to_args()));
            }
        }
        None => {
            join.push_str(" --insecure");
            operate.push_str(" --insecure");
        }
    }
    // No password here, ever: a password given by value is to be set as FISSION_ETCD_PASSWORD.
    let etcd_flags = shown(&args.etcd_security.to_args());
    join.push_str(&etcd_flags);
    operate.push_str(&etcd_flags);
    say!("add a node: {join}");
    say!("operate: {operate}");
    let mut procs = Procs {
        children: Vec::new(),
    };
    for (role, n) in [("decode", args.decode), ("prefill", args.prefill)] {
        for i in 0..n {
            let name = format!("{role}-{i}");
            let grpc = format!("127.0.0.1:{}", ports::free_port()?);
            let metrics = format!("127.0.0.1:{}", ports::free_port()?);
            let peer_role = if role == "decode" {
                PeerRole::Decode
            } else {
                PeerRole::Prefill
            };
            let mut cmd = Command::new(&exe);
            cmd.args([
                "node",
                role,
                "--node-id",
                &name,
                "--grpc-addr",
                &grpc,
                "--metrics-addr",
                &metrics,
            ])
            .arg("--model")
            .arg(&dir)
            .args(["--kv-transport", &args.kv_transport])
            .args(credentials(peer_role, &name)?)
            .args(["--etcd", &etcd, "--cluster", &args.cluster])
            .envs(args.etcd_security.password_env())
            .args(&engine_flags)
            .args(&args.node_args);
            if role == "decode" {
                cmd.args(["--kv-addr", "127.0.0.1:0"])
                    .args(&args.decode_args);
            } else {
                cmd.args(&args.prefill_args);
            }
            otel_child(
                &mut cmd,
                &format!("fission-{role}"),
                args.otlp_endpoint.as_deref(),
            );
            say!("{name} grpc={grpc} metrics=http://{metrics}/metrics");
            procs.children.push((name, spawn(cmd)?));
        }
    }
    let http = format!("127.0.0.1:{}", args.port);
    let mut cmd = Command::new(&exe);
    cmd.args(["gateway", "--addr", &http])
        .args(credentials(PeerRole::Gateway, "gateway")?)
        .arg("--model-dir")
        .arg(&dir)
        .args(["--etcd", &etcd, "--cluster", &args.cluster])
        .envs(args.etcd_security.password_env())
        .arg(format!(
            "--max-local-prefill-tokens={}",
            args.max_local_prefill_tokens
        ))
        .args(&args.gateway_args);
    if !args.api_keys.is_empty() {
        let keys = write_key_file(work.path(), &args.api_keys)?;
        cmd.arg("--api-key-file")
            .arg(keys)
            .env_remove("FISSION_API_KEY");
    }
    otel_child(&mut cmd, "fission-gateway", args.otlp_endpoint.as_deref());
    procs.children.push(("gateway".into(), spawn(cmd)?));
    wait_ready(
        &http,
        args.api_keys.first(),
        args.prefill + args.decode,
        &mut procs,
        &stop,
        Duration::from_secs(args.ready_timeout_s),
    )?;
    say!("Fission is up: http://{http}");
    if !args.api_keys.is_empty() {
        say!(
            "API keys required ({}); with FISSION_API_KEY set to one: curl -H \"Authorization: Bearer $FISSION_API_KEY\" http://{http}/v1/models",
            args.api_keys.len()
        );
    }
    let _ = std::io::stdout().flush();
    let mut etcd_retry_at = Instant::now();
    let mut etcd_backoff = Duration::from_secs(1);
    while !stop.load(Ordering::SeqCst) {
        // Nodes may come and go (drained, killed, added with `fission node start`): the
        // cluster goes on. Without its gateway it cannot.
        if let Some((name, status)) = reap(&mut procs) {
            if name == "gateway" {
                procs.stop(Duration::from_secs(10));
                bail!("the gateway exited ({status}); the cluster was stopped");
            }
            eprintln!("{name} exited ({status}); the cluster goes on without it");
        }
        if let Some(e) = local_etcd.as_mut() {
            // Nodes keep serving and the gateway keeps its last membership through an etcd
            // outage; bring it back on the same ports and data, and everyone re-registers.
            if e.has_exited() && Instant::now() >= etcd_retry_at {
                eprintln!("etcd exited; restarting it");
                match e.restart() {
                    Ok(()) => {
                        eprintln!("etcd is back at {etcd}");
                        etcd_backoff = Duration::from_secs(1);
                    }
                    Err(error) => {
                        eprintln!(
                            "etcd did not restart ({error}); trying again in {etcd_backoff:?}"
                        );
                        etcd_retry_at = Instant::now() + etcd_backoff;
                        etcd_backoff = (etcd_backoff * 2).min(Duration::from_secs(30));
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("stopping the cluster");
    procs.stop(Duration::from_secs(30));
    drop(local_etcd);
    Ok(())
}

/// The etcd flags that present `files`' certificate to the etcd `fission up` started.
fn etcd_client_cert(files: &identity::TlsFiles) -> cluster::EtcdSecurityArgs {
    cluster::EtcdSecurityArgs::client_cert(
        files.ca_cert.clone(),
        files.cert.clone(),
        files.key.clone(),
    )
}

/// Flags as text to print, each after a space.
fn shown(flags: &[OsString]) -> String {
    flags
        .iter()
        .map(|f| format!(" {}", f.to_string_lossy()))
        .collect()
}

/// Removes and returns one child that has exited, with its exit status.
fn reap(procs: &mut Procs) -> Option<(String, std::process::ExitStatus)> {
    let i = procs
        .children
        .iter_mut()
        .position(|(_, c)| matches!(c.try_wait(), Ok(Some(_))))?;
    let (name, mut c) = procs.children.remove(i);
    let status = c.wait().ok()?;
    Some((name, status))
}

/// Each child reports as its own service: a user's `OTEL_SERVICE_NAME`, inherited as is, would
/// file the gateway's and both pools' spans under one name.
fn otel_child(cmd: &mut Command, service_name: &str, otlp_endpoint: Option<&str>) {
    cmd.env("OTEL_SERVICE_NAME", service_name);
    if let Some(endpoint) = otlp_endpoint {
        cmd.arg("--otlp-endpoint").arg(endpoint);
    }
}

/// Each child gets a process group of its own: a terminal's Ctrl-C signals the foreground
/// group, and would otherwise stop the gateway and etcd together with the nodes it is meant
/// to drain first. `fission up` alone takes the signal and stops them in order.
fn spawn(mut cmd: Command) -> anyhow::Result<Child> {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))
}

fn exited(procs: &mut Procs) -> Option<String> {
    for (name, c) in procs.children.iter_mut() {
        if let Ok(Some(_)) = c.try_wait() {
            return Some(name.clone());
        }
    }
    None
}

/// Writes the gateway's API keys, one a line, readable by this user only.
fn write_key_file(dir: &Path, keys: &[gateway::auth::ApiKey]) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("api-keys");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    for key in keys {
        writeln!(file, "{}", key.expose())?;
    }
    Ok(path)
}

/// Waits until the gateway routes to all `nodes` (its `/info`, asked with `api_key`, lists
/// them ready).
fn wait_ready(
    http: &str,
    api_key: Option<&gateway::auth::ApiKey>,
    nodes: usize,
    procs: &mut Procs,
    stop: &AtomicBool,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, body)) = http_get(http, "/info", api_key) {
            if body.matches("\"ready\":true").count() >= nodes {
                return Ok(());
            }
        }
        if let Some(name) = exited(procs) {
            bail!("{name} exited during start-up");
        }
        if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
            bail!(
                "the cluster did not become healthy within {} s",
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sets `flag` when `sig` arrives (a plain atomic store is async-signal-safe).
fn signal_flag(sig: libc::c_int, flag: Arc<AtomicBool>) -> anyhow::Result<()> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    let _ = FLAG.set(flag);
    extern "C" fn on_signal(_: libc::c_int) {
        if let Some(f) = FLAG.get() {
            f.store(true, Ordering::SeqCst);
        }
    }
    // SAFETY: installs a handler that only performs an atomic store.
    let prev = unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    if prev == libc::SIG_ERR {
        bail!("installing the handler for signal {sig}");
    }
    Ok(())
}
