//! A single-member etcd started from PATH on free loopback ports, for `fission up` and tests:
//! a real etcd, not a fake, with a data directory that outlives restarts of the process. With
//! [`EtcdServerTls`] its clients must speak TLS and present a certificate from the given CA.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::ClusterError;

pub struct LocalEtcd {
    child: Option<Child>,
    data_dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// Plain HTTP `/health` (and `/metrics`), which needs no client certificate.
    metrics_port: u16,
    tls: Option<EtcdServerTls>,
}

/// etcd's server side of TLS: its certificate and key, and the CA every client certificate
/// must chain to (`--client-cert-auth`).
#[derive(Debug, Clone)]
pub struct EtcdServerTls {
    pub ca_cert: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn io(what: &str) -> impl Fn(std::io::Error) -> ClusterError + '_ {
    move |e| ClusterError::LocalEtcd(format!("{what}: {e}"))
}

impl LocalEtcd {
    /// Starts etcd with its data under `dir`, for plaintext clients, and waits until it answers
    /// `/health`.
    pub fn start(dir: &Path) -> Result<LocalEtcd, ClusterError> {
        Self::start_with(dir, None)
    }

    /// [`LocalEtcd::start`], serving clients over TLS only and refusing any without a
    /// certificate from `tls.ca_cert`.
    pub fn start_tls(dir: &Path, tls: EtcdServerTls) -> Result<LocalEtcd, ClusterError> {
        Self::start_with(dir, Some(tls))
    }

    fn start_with(dir: &Path, tls: Option<EtcdServerTls>) -> Result<LocalEtcd, ClusterError> {
        let port = || ports::free_port().map_err(io("picking a port"));
        let mut etcd = LocalEtcd {
            child: None,
            data_dir: dir.join("etcd-data"),
            client_port: port()?,
            peer_port: port()?,
            metrics_port: port()?,
            tls,
        };
        etcd.spawn()?;
        Ok(etcd)
    }

    /// The client URL: `https://` when it serves TLS.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// How to reach it, for the cluster named `cluster`. With TLS this trusts its CA but
    /// presents no client certificate: set [`crate::EtcdTls::client_cert`] to be let in.
    pub fn config(&self, cluster: &str) -> crate::EtcdConfig {
        let tls = self.tls.as_ref().map(|tls| crate::EtcdTls {
            ca_cert: tls.ca_cert.clone(),
            client_cert: None,
        });
        crate::EtcdConfig::new(vec![self.endpoint()], cluster).with_security(crate::EtcdSecurity {
            tls,
            credentials: None,
        })
    }

    /// etcd's own log (its stderr), appended to across restarts.
    pub fn log_path(&self) -> PathBuf {
        self.data_dir.join("etcd.log")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process has exited (or was stopped).
    pub fn has_exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// Kills the process, as a crash or an outage would; the data stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) -> Result<(), ClusterError> {
        self.stop();
        self.spawn()
    }

    fn spawn(&mut self) -> Result<(), ClusterError> {
        std::fs::create_dir_all(&self.data_dir).map_err(io("creating the data dir"))?;
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(io("opening the etcd log"))?;
        let mut cmd = Command::new("etcd");
        if let Some(tls) = &self.tls {
            cmd.arg("--client-cert-auth")
                .arg(format!("--trusted-ca-file={}", tls.ca_cert.display()))
                .arg(format!("--cert-file={}", tls.cert.display()))
                .arg(format!("--key-file={}", tls.key.display()));
        }
        // A group of its own: a terminal's Ctrl-C meant for its owner (`fission up`) must not
        // stop etcd before the nodes that revoke their leases in it on the way out.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .arg("--name=fission")
            .arg(format!("--data-dir={}", self.data_dir.join("member").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=fission={peer}"))
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{}",
                self.metrics_port
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    ClusterError::LocalEtcd(
                        "etcd is not on PATH: install it (`apt-get install -y etcd-server`) or pass --etcd URL".into(),
                    )
                } else {
                    ClusterError::LocalEtcd(format!("starting etcd: {e}"))
                }
            })?;
        self.child = Some(child);
        self.wait_healthy(Duration::from_secs(30))
    }

    fn wait_healthy(&mut self, timeout: Duration) -> Result<(), ClusterError> {
        let deadline = Instant::now() + timeout;
        let addr = format!("127.0.0.1:{}", self.metrics_port);
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(ClusterError::LocalEtcd(format!(
                        "etcd exited with {status}; see {}",
                        self.log_path().display()
                    )));
                }
            }
            if health(&addr) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(ClusterError::LocalEtcd(format!(
                    "etcd did not become healthy within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// etcd's own `/health` over plain HTTP/1.1, on its metrics port.
fn health(addr: &str) -> bool {
    let probe = || -> std::io::Result<String> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        write!(
            s,
            "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut buf = String::new();
        s.read_to_string(&mut buf)?;
        Ok(buf)
    };
    probe().is_ok_and(|r| r.contains("\"health\":\"true\""))
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.stop();
    }
}
