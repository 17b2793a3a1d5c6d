//! What the etcd tests share: a real etcd ([`cluster::LocalEtcd`], the one launcher `fission
//! up` uses too) in a temp dir, records, and waits on the change stream and the snapshot.

#![allow(dead_code)]

use std::time::Duration;

use anyhow::Context;
use cluster::{LocalEtcd, NodeRecord, Role};
use kv_types::{KvDtype, KvLayout};

/// A real etcd on free loopback ports, killed on drop, with its data in a temp dir.
pub struct TestEtcd {
    pub etcd: LocalEtcd,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for TestEtcd {
    type Target = LocalEtcd;
    fn deref(&self) -> &LocalEtcd {
        &self.etcd
    }
}

impl std::ops::DerefMut for TestEtcd {
    fn deref_mut(&mut self) -> &mut LocalEtcd {
        &mut self.etcd
    }
}

pub fn start_etcd() -> anyhow::Result<TestEtcd> {
    let dir = tempfile::tempdir()?;
    let etcd = LocalEtcd::start(dir.path()).context("etcd starts")?;
    Ok(TestEtcd { etcd, _dir: dir })
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
        kv_layout: KvLayout {
            dtype: KvDtype::F16,
            num_layers: 4,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 64,
            windows: Default::default(),
        },
        total_kv_blocks: 1024,
        kv_transport: "tcp".into(),
        host_id: String::new(),
        architecture: String::new(),
        weight_dtype: String::new(),
        draining: false,
    }
}

/// Waits for the first change matching `pred`, skipping others.
pub async fn next_change<F>(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<cluster::ClusterChange>,
    timeout: Duration,
    pred: F,
) -> anyhow::Result<cluster::ClusterChange>
where
    F: Fn(&cluster::ClusterChange) -> bool,
{
    tokio::time::timeout(timeout, async {
        loop {
            let change = rx.recv().await.context("the change stream ended")?;
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
