//! Registration and discovery against a real etcd.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use cluster::{
    ClusterChange, DiscoveryConfig, EtcdDiscovery, LocalEtcd, NodeLoad, Registration,
    RegistrationConfig, Role,
};
use common::{next_change, record, start_etcd, wait_members};

const WAIT: Duration = Duration::from_secs(5);

fn reg_config(etcd: &LocalEtcd, ttl_s: i64) -> RegistrationConfig {
    let mut config = RegistrationConfig::new(etcd.config("test"));
    config.lease_ttl_s = ttl_s;
    config.load_publish_interval_ms = 100;
    // These tests time re-registration after an outage of seconds, not the backoff's cap.
    config.retry_max_ms = 1_000;
    config
}

async fn discovery(etcd: &LocalEtcd, expected_fingerprint: Option<&str>) -> EtcdDiscovery {
    let mut config = DiscoveryConfig::new(etcd.config("test"));
    config.expected_fingerprint = expected_fingerprint.map(str::to_string);
    EtcdDiscovery::start(config)
        .await
        .expect("discovery starts")
}

#[tokio::test]
async fn two_nodes_register_update_and_revoke() -> anyhow::Result<()> {
    let etcd = start_etcd()?;
    let disco = discovery(&etcd, None).await;
    let mut changes = disco.subscribe();
    let mut members = disco.members();

    let prefill = record("p1", Role::Prefill, "fp");
    let decode = record("d1", Role::Decode, "fp");
    let p = Registration::start(reg_config(&etcd, 5), prefill.clone()).await?;
    let d = Registration::start(reg_config(&etcd, 5), decode.clone()).await?;

    // 1. both arrive as Add, and round-trip exactly.
    let mut added = Vec::new();
    for _ in 0..2 {
        match next_change(&mut changes, WAIT, |c| matches!(c, ClusterChange::Add(_))).await? {
            ClusterChange::Add(r) => added.push(r),
            other => anyhow::bail!("unexpected {other:?}"),
        }
    }
    added.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    assert_eq!(added, vec![decode.clone(), prefill.clone()]);
    let snapshot = wait_members(&mut members, WAIT, |m| m.len() == 2).await?;
    assert!(snapshot.contains(&prefill) && snapshot.contains(&decode));

    // Load goes to its own key and does not touch membership.
    p.publish_load(NodeLoad {
        free_blocks: 7,
        queued_prefill_tokens: 3,
        running_sequences: 1,
    });
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    testkit::wait_until_async("the load published", WAIT, || {
        let mut client = client.clone();
        async move {
            let resp = client.get("/fission/test/load/prefill/p1", None).await;
            resp.ok()
                .and_then(|r| r.kvs().first().map(|kv| kv.value().to_vec()))
                .and_then(|v| serde_json::from_slice::<NodeLoad>(&v).ok())
                .is_some_and(|load| load.free_blocks == 7)
        }
    })
    .await;

    // 2. draining shows up as an Update.
    d.set_draining(true).await?;
    let change = next_change(&mut changes, WAIT, |c| {
        matches!(c, ClusterChange::Update(_))
    })
    .await?;
    let ClusterChange::Update(updated) = change else {
        unreachable!()
    };
    assert_eq!(updated.node_id, "d1");
    assert!(updated.draining);

    // 3. a revoke removes promptly, along with the load key. Without a drain before it, etcd
    // cannot tell it from an expired lease: the node is lost, for the follower to check.
    let started = Instant::now();
    p.revoke().await?;
    let change = next_change(&mut changes, WAIT, |c| {
        matches!(c, ClusterChange::Lost { .. })
    })
    .await?;
    assert_eq!(
        change,
        ClusterChange::Lost {
            role: Role::Prefill,
            node_id: "p1".into()
        }
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let load = client.get("/fission/test/load/prefill/p1", None).await?;
    assert!(load.kvs().is_empty());
    let snapshot = wait_members(&mut members, WAIT, |m| m.len() == 1).await?;
    assert_eq!(snapshot[0].node_id, "d1");

    // 4. a drained node's revoke is a removal.
    d.revoke().await?;
    let change = next_change(&mut changes, WAIT, |c| {
        matches!(c, ClusterChange::Remove { .. })
    })
    .await?;
    assert_eq!(
        change,
        ClusterChange::Remove {
            role: Role::Decode,
            node_id: "d1".into()
        }
    );
    Ok(())
}

#[tokio::test]
async fn dead_node_expires_within_ttl() -> anyhow::Result<()> {
    let etcd = start_etcd()?;
    let disco = discovery(&etcd, None).await;
    let mut members = disco.members();
    let ttl_s = 3;
    let reg =
        Registration::start(reg_config(&etcd, ttl_s), record("d9", Role::Decode, "fp")).await?;
    wait_members(&mut members, WAIT, |m| m.len() == 1).await?;

    // 4. the "process" dies: keep-alive stops, no revoke.
    let died = Instant::now();
    drop(reg);
    let limit = Duration::from_secs(ttl_s as u64 + 2);
    wait_members(&mut members, limit, |m| m.is_empty()).await?;
    assert!(died.elapsed() <= limit);
    Ok(())
}

#[tokio::test]
async fn survives_etcd_outage_and_reregisters() -> anyhow::Result<()> {
    let mut etcd = start_etcd()?;
    let disco = discovery(&etcd, None).await;
    let mut members = disco.members();
    let reg = Registration::start(reg_config(&etcd, 2), record("d1", Role::Decode, "fp")).await?;
    wait_members(&mut members, WAIT, |m| m.len() == 1).await?;
    let mut lease_rx = reg.lease_watch();
    let first_lease = tokio::time::timeout(WAIT, lease_rx.wait_for(|l| l.is_some()))
        .await??
        .expect("registered");

    // 5. etcd dies: membership is kept through the outage.
    etcd.stop();
    tokio::time::timeout(WAIT, lease_rx.wait_for(|l| l.is_none())).await??;
    tokio::time::sleep(Duration::from_secs(3)).await; // the outage itself, longer than the ttl
    assert_eq!(
        members.borrow().len(),
        1,
        "membership must survive an etcd outage"
    );

    // etcd comes back on the same ports and data dir.
    etcd.restart()?;
    let back = Instant::now();
    let lease = tokio::time::timeout(WAIT, lease_rx.wait_for(|l| l.is_some()))
        .await??
        .expect("some");
    assert_ne!(lease, first_lease, "a new lease after the outage");
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    let resp = client.get("/fission/test/nodes/decode/d1", None).await?;
    assert_eq!(resp.kvs().first().map(|kv| kv.lease()), Some(lease));
    assert!(back.elapsed() < WAIT, "{:?}", back.elapsed());

    // Discovery is watching again: a change made now reaches it.
    reg.set_draining(true).await?;
    wait_members(&mut members, WAIT, |m| m.len() == 1 && m[0].draining).await?;
    Ok(())
}

#[tokio::test]
async fn admission_excludes_other_models_and_layouts() -> anyhow::Result<()> {
    let etcd = start_etcd()?;
    let disco = discovery(&etcd, Some("good")).await;
    let refused = disco.refused();
    let mut members = disco.members();
    let bad =
        Registration::start(reg_config(&etcd, 5), record("bad", Role::Decode, "other")).await?;
    let mut odd_layout = record("odd", Role::Decode, "good");
    odd_layout.kv_layout.head_dim = 128;
    let odd = Registration::start(reg_config(&etcd, 5), odd_layout).await?;
    // Registration returns before its put lands: wait until the refused two are in etcd, so
    // that the good ones are registered after them.
    for reg in [&bad, &odd] {
        tokio::time::timeout(WAIT, reg.lease_watch().wait_for(|l| l.is_some())).await??;
    }
    // Alone with the cluster's model, the odd node defines the layout for now.
    wait_members(&mut members, WAIT, |m| {
        m.len() == 1 && m[0].node_id == "odd"
    })
    .await?;
    let mut changes = disco.subscribe();
    let good =
        Registration::start(reg_config(&etcd, 5), record("good", Role::Decode, "good")).await?;
    let good2 =
        Registration::start(reg_config(&etcd, 5), record("good2", Role::Decode, "good")).await?;

    // 6. two nodes with the common layout outnumber the odd one, which leaves; the node with
    // another model is never a member.
    let snapshot = wait_members(&mut members, WAIT, |m| {
        m.iter().map(|r| r.node_id.as_str()).collect::<Vec<_>>() == ["good", "good2"]
    })
    .await?;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    let all = client
        .get(
            "/fission/test/nodes/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await?;
    assert_eq!(all.kvs().len(), 4, "all four are in etcd");
    assert_eq!(snapshot.len(), 2);
    let reasons: Vec<(String, String)> = refused
        .borrow()
        .iter()
        .map(|r| (r.record.node_id.clone(), r.reason.clone()))
        .collect();
    assert!(
        reasons
            .iter()
            .any(|(id, why)| id == "bad" && why.contains("fingerprint")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|(id, why)| id == "odd" && why.contains("KV layout")),
        "{reasons:?}"
    );
    // The subscriber saw the odd node as a member first, then its removal.
    let mut seen = Vec::new();
    while let Ok(change) = changes.try_recv() {
        seen.push(change);
    }
    assert!(
        matches!(seen.first(), Some(ClusterChange::Add(r)) if r.node_id == "odd"),
        "{seen:?}"
    );
    assert!(
        seen.contains(&ClusterChange::Remove {
            role: Role::Decode,
            node_id: "odd".into()
        }),
        "{seen:?}"
    );
    assert!(!seen
        .iter()
        .any(|c| matches!(c, ClusterChange::Add(r) if r.node_id == "bad")));
    drop((good, good2));
    Ok(())
}
