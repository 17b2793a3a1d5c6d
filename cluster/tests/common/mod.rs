//! A real etcd for tests: free loopback ports, a temp data dir, killed on drop.

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use cluster::{EtcdConfig, KvLayout, NodeRecord, Role};

pub struct EtcdServer {
    child: Option<Child>,
    data_dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    pub async fn start() -> anyhow::Result<EtcdServer> {
        let mut server = EtcdServer {
            child: None,
            data_dir: tempfile::tempdir()?,
            client_port: free_port()?,
            peer_port: free_port()?,
        };
        server.spawn().await?;
        Ok(server)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn config(&self, cluster: &str) -> EtcdConfig {
        EtcdConfig::new(vec![self.endpoint()], cluster)
    }

    /// SIGKILLs the server, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same ports and data dir.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data_dir.path().join("etcd.log"))?;
        let child = match Command::new("etcd")
            .arg("--name=test")
            .arg(format!(
                "--data-dir={}",
                self.data_dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=test={peer_url}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
        {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "\n\n*** etcd is not on PATH: these tests need a real etcd. \
                 Install it with `apt-get install etcd-server` (CI installs it). ***\n\n"
            ),
            Err(e) => return Err(e).context("spawning etcd"),
        };
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(15)).await
    }

    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("etcd exited early with {status}");
                }
            }
            let endpoint = self.endpoint();
            let ready = async {
                let mut client = etcd_client::Client::connect([endpoint], None).await?;
                client.get("/ready-probe", None).await?;
                Ok::<_, etcd_client::Error>(())
            };
            if let Ok(Ok(())) = tokio::time::timeout(Duration::from_millis(500), ready).await {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("etcd did not answer within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn record(node_id: &str, role: Role, fingerprint: &str) -> NodeRecord {
    NodeRecord {
        node_id: node_id.into(),
        role,
        version: "0.1.0".into(),
        grpc_endpoint: "127.0.0.1:50051".into(),
        kv_endpoint: "127.0.0.1:50052".into(),
        model_id: "tiny-llama".into(),
        model_fingerprint: fingerprint.into(),
        block_size: 16,
        kv_layout: KvLayout {
            dtype: "f16".into(),
            num_layers: 4,
            num_kv_heads: 2,
            head_dim: 64,
        },
        total_kv_blocks: 1024,
        kv_transport: "tcp".into(),
        draining: false,
    }
}

/// Waits for the first change matching `pred`, skipping others.
pub async fn next_change<F>(
    rx: &mut tokio::sync::broadcast::Receiver<cluster::ClusterChange>,
    timeout: Duration,
    pred: F,
) -> anyhow::Result<cluster::ClusterChange>
where
    F: Fn(&cluster::ClusterChange) -> bool,
{
    tokio::time::timeout(timeout, async {
        loop {
            let change = rx.recv().await?;
            if pred(&change) {
                return Ok(change);
            }
        }
    })
    .await
    .context("timed out waiting for a cluster change")?
}

/// Waits until the membership satisfies `pred`.
pub async fn wait_members<F>(
    rx: &mut tokio::sync::watch::Receiver<cluster::Members>,
    timeout: Duration,
    pred: F,
) -> anyhow::Result<cluster::Members>
where
    F: FnMut(&cluster::Members) -> bool,
{
    let members = tokio::time::timeout(timeout, rx.wait_for(pred))
        .await
        .context("timed out waiting for the membership")??;
    Ok(members.clone())
}
