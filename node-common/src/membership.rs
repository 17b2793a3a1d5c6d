//! A node's life in the cluster: registration in etcd once it can serve, load publishing, and
//! the drain that ends it (SIGTERM or the Drain RPC): marked draining so routers stop sending
//! work, then in-flight work finishes, then the lease is revoked and the node exits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use cluster::{
    EtcdConfig, EtcdSecurityArgs, NodeLoad, NodeRecord, Registration, RegistrationConfig, Role,
};
use kv_types::KvLayout;
use proto::ErrorCode;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use crate::error::NodeError;
use crate::etcd_status::EtcdStatus;
use crate::failure::Failure;

#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// etcd endpoints, comma separated. Without them the node does not register (a static
    /// cluster, where the gateway is given node addresses).
    #[arg(long, env = "FISSION_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Names the key space in etcd, so clusters can share one etcd.
    #[arg(long, env = "FISSION_CLUSTER", default_value = "fission")]
    pub cluster: String,
    /// The registration lease's time to live: how long a dead node stays listed.
    #[arg(long, env = "FISSION_LEASE_TTL_S", default_value_t = 5)]
    pub lease_ttl_s: i64,
    /// The longest a drain waits for in-flight work before the node exits anyway.
    #[arg(long, env = "FISSION_DRAIN_TIMEOUT_S", default_value_t = 300)]
    pub drain_timeout_s: u64,
    /// Host put in the endpoints this node advertises.
    #[arg(long, env = "FISSION_ADVERTISE_HOST", default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// TLS and user for etcd.
    #[command(flatten)]
    pub etcd_security: EtcdSecurityArgs,
}

impl ClusterArgs {
    /// How to reach etcd; `None` without `--etcd`. Fails on etcd security flags that do not
    /// go together, or a password file that cannot be read.
    pub fn etcd_config(&self) -> Result<Option<EtcdConfig>, NodeError> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let security = self
            .etcd_security
            .security()
            .map_err(|e| NodeError::Config(e.to_string()))?;
        Ok(Some(
            EtcdConfig::new(self.etcd.clone(), self.cluster.clone()).with_security(security),
        ))
    }
}

/// A node's work as its engine thread sees it, published after every step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkLoad {
    pub free_blocks: u64,
    pub queued_prefill_tokens: u64,
    pub running: u64,
    pub waiting: u64,
    /// Decode nodes: reservations whose KV has not arrived yet.
    pub reservations: u64,
}

impl WorkLoad {
    pub fn is_idle(&self) -> bool {
        self.running == 0 && self.waiting == 0 && self.reservations == 0
    }
}

/// Counts work that lives outside the engine (token streams, KV pushes) and must end before a
/// draining node may exit.
#[derive(Clone, Default)]
pub struct WorkTracker(Arc<TrackerInner>);

#[derive(Default)]
struct TrackerInner {
    active: AtomicUsize,
    changed: Notify,
}

pub struct WorkGuard(Arc<TrackerInner>);

impl WorkTracker {
    pub fn begin(&self) -> WorkGuard {
        self.0.active.fetch_add(1, Ordering::SeqCst);
        WorkGuard(Arc::clone(&self.0))
    }

    pub fn active(&self) -> usize {
        self.0.active.load(Ordering::SeqCst)
    }
}

impl Drop for WorkGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// A node id unlikely to collide: the role, the host's process id and the start time.
pub fn random_node_id(role: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{role}-{:x}{:06x}", std::process::id(), nanos & 0xff_ffff)
}

/// New work (`what`: prompts, reservations, requests) is refused once the drain has started;
/// the gateway takes Unavailable as "try another node". Work already here carries on.
pub fn refuse_if_draining(
    drain: &tokio_util::sync::CancellationToken,
    info: &proto::v1::NodeInfo,
    what: &str,
) -> Result<(), Failure> {
    if drain.is_cancelled() {
        return Err(Failure::new(
            ErrorCode::Unavailable,
            format!(
                "{} node {} is draining and takes no new {what}",
                info.role, info.node_id
            ),
        ));
    }
    Ok(())
}

/// The record a node registers, built from what it reports in `Info`.
pub fn node_record(
    info: &proto::v1::NodeInfo,
    layout: KvLayout,
    role: Role,
    grpc_endpoint: String,
    kv_endpoint: String,
    kv_transport: kv_types::KvBackend,
) -> NodeRecord {
    NodeRecord {
        node_id: info.node_id.clone(),
        role,
        version: env!("CARGO_PKG_VERSION").to_string(),
        grpc_endpoint,
        kv_endpoint,
        model_id: info.model_id.clone(),
        model_fingerprint: info.model_fingerprint.clone(),
        kv_layout: layout,
        total_kv_blocks: u64::from(info.total_kv_blocks),
        kv_transport: kv_transport.as_str().to_string(),
        host_id: host_id(),
        architecture: info.architecture.clone(),
        weight_dtype: info.weight_dtype.clone(),
        draining: false,
    }
}

/// This host's identity, `MACHINE_ID/BOOT_ID`: nodes that share it run on one kernel and one
/// machine, so the shared-memory KV transport can reach one from the other. The boot id tells
/// apart clones of one image, which share a machine id. Empty parts where a file is missing.
/// `FISSION_HOST_ID`, when set, replaces it: for nodes that share a kernel but not `/dev/shm`
/// (containers of one image), or that stand for hosts of their own (network namespaces).
pub fn host_id() -> String {
    if let Some(id) = std::env::var("FISSION_HOST_ID")
        .ok()
        .filter(|s| !s.is_empty())
    {
        return id;
    }
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    };
    format!(
        "{}/{}",
        read("/etc/machine-id"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// A node's membership: registered (with etcd) or standalone (without).
pub struct Membership {
    node_id: String,
    registration: Option<Registration>,
    load_task: Option<JoinHandle<()>>,
    drain_timeout: Duration,
}

impl Membership {
    /// Registers `record` and publishes `load` from now on. Call it once the node serves: a
    /// registered node is routed to at once. Returns while etcd is down too; the registration
    /// task keeps trying.
    pub async fn join(
        args: &ClusterArgs,
        record: NodeRecord,
        mut load: watch::Receiver<WorkLoad>,
        etcd_status: EtcdStatus,
    ) -> Result<Membership, NodeError> {
        let node_id = record.node_id.clone();
        let drain_timeout = Duration::from_secs(args.drain_timeout_s);
        let Some(etcd) = args.etcd_config()? else {
            return Ok(Membership {
                node_id,
                registration: None,
                load_task: None,
                drain_timeout,
            });
        };
        let mut config = RegistrationConfig::new(etcd);
        config.lease_ttl_s = args.lease_ttl_s;
        let registration = Registration::start(config, record)
            .await
            .map_err(|e| NodeError::Config(format!("etcd registration: {e}")))?;
        tokio::spawn(etcd_status.follow(registration.clone()));
        let reg = registration.clone();
        let load_task = tokio::spawn(async move {
            loop {
                let w = *load.borrow_and_update();
                reg.publish_load(NodeLoad {
                    free_blocks: w.free_blocks,
                    queued_prefill_tokens: w.queued_prefill_tokens,
                    running_sequences: w.running + w.waiting,
                });
                if load.changed().await.is_err() {
                    return;
                }
            }
        });
        tracing::info!(%node_id, "registering in etcd");
        Ok(Membership {
            node_id,
            registration: Some(registration),
            load_task: Some(load_task),
            drain_timeout,
        })
    }

    /// Drains: marks the node draining, waits until the engine is idle and no tracked work is
    /// left (or the drain timeout passes), then leaves the cluster.
    pub async fn drain(self, mut load: watch::Receiver<WorkLoad>, tracker: &WorkTracker) {
        let started = tokio::time::Instant::now();
        if let Some(reg) = &self.registration {
            if let Err(error) = reg.set_draining(true).await {
                // The flag is kept and written once etcd answers again.
                tracing::warn!(node_id = %self.node_id, %error, "could not mark the node draining yet");
            }
            // No wait for routers to see the flag: new work that still arrives is refused as
            // Unavailable (see `refuse_if_draining`), which a gateway answers by trying the
            // next node, and work accepted before the flag is tracked and finished below.
        }
        tracing::info!(node_id = %self.node_id, in_flight = tracker.active(), "draining");
        let idle = async {
            loop {
                let notified = tracker.0.changed.notified();
                if load.borrow_and_update().is_idle() && tracker.active() == 0 {
                    return;
                }
                tokio::select! {
                    _ = notified => {}
                    changed = load.changed() => if changed.is_err() { return },
                }
            }
        };
        if tokio::time::timeout(self.drain_timeout, idle)
            .await
            .is_err()
        {
            tracing::warn!(node_id = %self.node_id, in_flight = tracker.active(), "drain timed out with work left");
        }
        if let Some(task) = &self.load_task {
            task.abort();
        }
        if let Some(reg) = &self.registration {
            if let Err(error) = reg.revoke().await {
                tracing::warn!(node_id = %self.node_id, %error, "lease revoke failed; it expires by itself");
            }
        }
        tracing::info!(node_id = %self.node_id, drain_ms = started.elapsed().as_millis() as u64, "drained");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draining_node_refuses_new_work_by_role_and_id() {
        let drain = tokio_util::sync::CancellationToken::new();
        let info = proto::v1::NodeInfo {
            node_id: "decode-1".into(),
            role: "decode".into(),
            ..Default::default()
        };
        assert!(refuse_if_draining(&drain, &info, "reservations").is_ok());
        drain.cancel();
        let refused = refuse_if_draining(&drain, &info, "reservations").expect_err("draining");
        assert_eq!(refused.code, ErrorCode::Unavailable);
        assert_eq!(
            refused.message,
            "decode node decode-1 is draining and takes no new reservations"
        );
    }

    #[tokio::test]
    async fn drain_waits_for_tracked_work_and_the_engine() {
        let args = ClusterArgs {
            etcd: vec![],
            cluster: "c".into(),
            lease_ttl_s: 5,
            drain_timeout_s: 30,
            advertise_host: "127.0.0.1".into(),
            etcd_security: EtcdSecurityArgs::default(),
        };
        let (load_tx, load_rx) = watch::channel(WorkLoad {
            running: 1,
            ..Default::default()
        });
        let tracker = WorkTracker::default();
        let guard = tracker.begin();
        let record = node_record(
            &proto::v1::NodeInfo::default(),
            kv_types::KvLayout::SMOLLM2_135M_F32,
            Role::Decode,
            String::new(),
            String::new(),
            kv_types::KvBackend::Tcp,
        );
        let m = Membership::join(
            &args,
            record,
            load_rx.clone(),
            EtcdStatus::new("decode", false),
        )
        .await
        .unwrap();
        let t = tracker.clone();
        let drained = tokio::spawn(async move { m.drain(load_rx, &t).await });
        tokio::task::yield_now().await;
        assert!(!drained.is_finished());
        drop(guard);
        tokio::task::yield_now().await;
        assert!(!drained.is_finished(), "the engine still runs a sequence");
        load_tx.send_replace(WorkLoad::default());
        tokio::time::timeout(Duration::from_secs(5), drained)
            .await
            .expect("drain ends once idle")
            .unwrap();
    }
}
