//! `fission nodes list|drain`: what an operator sees of, and does to, a running cluster.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use cluster::{EtcdConfig, NodeStatus};
use proto::v1::node_client::NodeClient;
use proto::v1::DrainRequest;

#[derive(Args, Debug, Clone)]
pub struct EtcdArgs {
    /// etcd endpoints, comma separated (`fission up` prints its URL).
    #[arg(
        long,
        env = "FISSION_ETCD",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub etcd: Vec<String>,
    #[arg(long, env = "FISSION_CLUSTER", default_value = "fission")]
    pub cluster: String,
    /// TLS and user for etcd (`fission up` prints them).
    #[command(flatten)]
    pub security: cluster::EtcdSecurityArgs,
}

impl EtcdArgs {
    fn config(&self) -> anyhow::Result<EtcdConfig> {
        Ok(EtcdConfig::new(self.etcd.clone(), self.cluster.clone())
            .with_security(self.security.security()?))
    }
}

#[derive(Subcommand)]
pub enum NodesCommand {
    /// Every registered node with its role, endpoints, load and state.
    List {
        #[command(flatten)]
        etcd: EtcdArgs,
        /// `{"nodes": [{"node_id", "role", ...}]}` instead of a table.
        #[arg(long)]
        json: bool,
        /// Accepted and unused, so that the `operate:` line `fission up` prints works for
        /// every subcommand: listing reads etcd only, never a node.
        #[command(flatten)]
        _tls: identity::TlsArgs,
    },
    /// Drain a node: it takes no new requests, finishes its work, leaves and exits.
    Drain {
        node_id: String,
        #[command(flatten)]
        etcd: EtcdArgs,
        /// An admin (or gateway) certificate: nodes let no other role drain them.
        #[command(flatten)]
        tls: identity::TlsArgs,
    },
}

pub fn run(cmd: NodesCommand) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cmd {
            NodesCommand::List { etcd, json, .. } => list(&etcd, json).await,
            NodesCommand::Drain { node_id, etcd, tls } => drain(&etcd, &tls, &node_id).await,
        }
    })
}

fn state(s: &NodeStatus) -> &'static str {
    if s.record.draining {
        "draining"
    } else {
        "serving"
    }
}

fn to_json(s: &NodeStatus) -> serde_json::Value {
    let r = &s.record;
    serde_json::json!({
        "node_id": r.node_id,
        "role": r.role.as_str(),
        "state": state(s),
        "version": r.version,
        "grpc_endpoint": r.grpc_endpoint,
        "kv_endpoint": r.kv_endpoint,
        "model_id": r.model_id,
        "model_fingerprint": r.model_fingerprint,
        "block_size": r.kv_layout.block_size,
        "kv_layout": r.kv_layout,
        "total_kv_blocks": r.total_kv_blocks,
        "kv_transport": r.kv_transport,
        "draining": r.draining,
        "lease_id": s.lease_id,
        "load": s.load,
    })
}

async fn list(etcd: &EtcdArgs, json: bool) -> anyhow::Result<()> {
    let nodes = cluster::list_nodes(&etcd.config()?)
        .await
        .with_context(|| format!("reading the cluster from {:?}", etcd.etcd))?;
    if json {
        let nodes: Vec<serde_json::Value> = nodes.iter().map(to_json).collect();
        println!("{}", serde_json::json!({ "nodes": nodes }));
        return Ok(());
    }
    println!(
        "{:<24} {:<8} {:<9} {:<22} {:<22} {:>8} {:>8} {:>8}",
        "NODE", "ROLE", "STATE", "GRPC", "KV", "FREE", "QUEUED", "RUNNING"
    );
    for s in &nodes {
        let r = &s.record;
        let (free, queued, running) = s.load.map_or(("-".into(), "-".into(), "-".into()), |l| {
            (
                l.free_blocks.to_string(),
                l.queued_prefill_tokens.to_string(),
                l.running_sequences.to_string(),
            )
        });
        println!(
            "{:<24} {:<8} {:<9} {:<22} {:<22} {:>8} {:>8} {:>8}",
            r.node_id,
            r.role.as_str(),
            state(s),
            r.grpc_endpoint,
            if r.kv_endpoint.is_empty() {
                "-"
            } else {
                &r.kv_endpoint
            },
            free,
            queued,
            running
        );
    }
    Ok(())
}

async fn drain(etcd: &EtcdArgs, tls: &identity::TlsArgs, node_id: &str) -> anyhow::Result<()> {
    let security = tls.grpc_as(&[identity::PeerRole::Admin, identity::PeerRole::Gateway])?;
    let nodes = cluster::list_nodes(&etcd.config()?).await?;
    let Some(node) = nodes.iter().find(|s| s.record.node_id == node_id) else {
        bail!(
            "no node {node_id} is registered in cluster {}",
            etcd.cluster
        );
    };
    let channel = security
        .endpoint(&node.record.grpc_endpoint)?
        .connect()
        .await
        .with_context(|| format!("connecting to {node_id} at {}", node.record.grpc_endpoint))?;
    let started = NodeClient::new(channel)
        .drain(DrainRequest {})
        .await?
        .into_inner()
        .started;
    if started {
        println!("{node_id}: draining; it exits when its work is done");
    } else {
        println!("{node_id}: already draining");
    }
    Ok(())
}
