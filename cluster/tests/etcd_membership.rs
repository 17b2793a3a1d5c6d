//! Registration and discovery against a real etcd.

mod common;

use std::time::{Duration, Instant};

use cluster::{
    ClusterChange, DiscoveryConfig, EtcdDiscovery, MembershipFilter, NodeLoad, Registration,
    RegistrationConfig, Role,
};
use common::{next_change, record, wait_members, EtcdServer};

const WAIT: Duration = Duration::from_secs(5);

fn reg_config(etcd: &EtcdServer, ttl_s: i64) -> RegistrationConfig {
    let mut config = RegistrationConfig::new(etcd.config("test"));
    config.lease_ttl_s = ttl_s;
    config.load_publish_interval_ms = 100;
    config
}

async fn discovery(etcd: &EtcdServer, filter: MembershipFilter) -> EtcdDiscovery {
    let mut config = DiscoveryConfig::new(etcd.config("test"));
    config.filter = filter;
    EtcdDiscovery::start(config)
        .await
        .expect("discovery starts")
}

#[tokio::test]
async fn two_nodes_register_update_and_revoke() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let disco = discovery(&etcd, MembershipFilter::default()).await;
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
    let deadline = Instant::now() + WAIT;
    loop {
        let resp = client.get("/fission/test/load/prefill/p1", None).await?;
        if let Some(kv) = resp.kvs().first() {
            let load: NodeLoad = serde_json::from_slice(kv.value())?;
            assert_eq!(load.free_blocks, 7);
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "load never published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

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

    // 3. revoke removes promptly, along with the load key.
    let started = Instant::now();
    p.revoke().await?;
    let change = next_change(&mut changes, WAIT, |c| {
        matches!(c, ClusterChange::Remove { .. })
    })
    .await?;
    assert_eq!(
        change,
        ClusterChange::Remove {
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
    Ok(())
}

#[tokio::test]
async fn dead_node_expires_within_ttl() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let disco = discovery(&etcd, MembershipFilter::default()).await;
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
    let mut etcd = EtcdServer::start().await?;
    let disco = discovery(&etcd, MembershipFilter::default()).await;
    let mut members = disco.members();
    let reg = Registration::start(reg_config(&etcd, 2), record("d1", Role::Decode, "fp")).await?;
    wait_members(&mut members, WAIT, |m| m.len() == 1).await?;
    let mut lease_rx = reg.lease_watch();
    let first_lease = tokio::time::timeout(WAIT, lease_rx.wait_for(|l| l.is_some()))
        .await??
        .expect("registered");

    // 5. etcd dies: membership is kept through the outage.
    etcd.kill();
    tokio::time::timeout(WAIT, lease_rx.wait_for(|l| l.is_none())).await??;
    tokio::time::sleep(Duration::from_secs(3)).await; // the outage itself, longer than the ttl
    assert_eq!(
        members.borrow().len(),
        1,
        "membership must survive an etcd outage"
    );

    // etcd comes back on the same ports and data dir.
    etcd.restart().await?;
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
async fn filter_excludes_other_fingerprints() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let filter = MembershipFilter {
        expected_fingerprint: Some("good".into()),
        expected_layout: Some(record("x", Role::Decode, "good").kv_layout),
    };
    let disco = discovery(&etcd, filter).await;
    let mut members = disco.members();
    let mut changes = disco.subscribe();
    let bad =
        Registration::start(reg_config(&etcd, 5), record("bad", Role::Decode, "other")).await?;
    let mut odd_layout = record("odd", Role::Decode, "good");
    odd_layout.kv_layout.head_dim = 128;
    let odd = Registration::start(reg_config(&etcd, 5), odd_layout).await?;
    // Registration returns before its put lands: wait until the refused two are in etcd, so
    // that the good one is registered after them.
    for reg in [&bad, &odd] {
        tokio::time::timeout(WAIT, reg.lease_watch().wait_for(|l| l.is_some())).await??;
    }
    let good =
        Registration::start(reg_config(&etcd, 5), record("good", Role::Decode, "good")).await?;

    // 6. only the matching node is a member. Wait for the good one, then make sure the others
    // (registered before it) never showed up.
    let snapshot = wait_members(&mut members, WAIT, |m| !m.is_empty()).await?;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    let all = client
        .get(
            "/fission/test/nodes/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await?;
    assert_eq!(all.kvs().len(), 3, "all three are in etcd");
    assert_eq!(snapshot.len(), 1);
    assert_eq!(snapshot[0].node_id, "good");
    while let Ok(change) = changes.try_recv() {
        assert_eq!(
            change,
            ClusterChange::Add(record("good", Role::Decode, "good"))
        );
    }
    drop(good);
    Ok(())
}
