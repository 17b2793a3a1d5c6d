//! Nodes whose sliding windows differ are refused as any KV layout mismatch (issue 32): a
//! sliding layer's push carries only the blocks its window reads at the prompt's end, so a
//! prefill node and a decode node must cut the same blocks. Against a real etcd: the windows
//! travel in the registration record, and admission refuses the node whose windows (not its
//! geometry) differ from the cluster's.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use cluster::{DiscoveryConfig, EtcdDiscovery, Registration, RegistrationConfig, Role};
use common::{record, start_etcd, wait_members};
use kv_types::LayerWindows;

const WAIT: Duration = Duration::from_secs(5);

/// Gemma 3's pattern over the record's 4 layers: sliding, sliding, sliding, global.
fn windows(window: usize) -> LayerWindows {
    LayerWindows::of(&[Some(window), Some(window), Some(window), None])
}

#[tokio::test]
async fn a_node_whose_windows_differ_is_refused() -> anyhow::Result<()> {
    let etcd = start_etcd()?;
    let mut config = DiscoveryConfig::new(etcd.config("test"));
    config.expected_fingerprint = Some("gemma".into());
    let disco = EtcdDiscovery::start(config).await?;
    let refused = disco.refused();
    let mut members = disco.members();
    let reg = |node_id: &str, role: Role, window: Option<usize>| {
        let mut r = record(node_id, role, "gemma");
        r.kv_layout.windows = window.map_or(LayerWindows::NONE, windows);
        let mut config = RegistrationConfig::new(etcd.config("test"));
        config.lease_ttl_s = 5;
        Registration::start(config, r)
    };
    let _prefill = reg("prefill", Role::Prefill, Some(512)).await?;
    let _decode = reg("decode", Role::Decode, Some(512)).await?;
    let snapshot = wait_members(&mut members, WAIT, |m| m.len() == 2).await?;
    // The record carries the windows through etcd.
    assert!(snapshot.iter().all(|r| r.kv_layout.windows == windows(512)));

    // Same model, same geometry: only the window differs, or no layer slides.
    let _wide = reg("wide", Role::Decode, Some(1024)).await?;
    let _full = reg("full", Role::Prefill, None).await?;
    tokio::time::timeout(WAIT, refused.clone().wait_for(|r| r.len() == 2)).await??;
    let reasons: Vec<(String, String)> = refused
        .borrow()
        .iter()
        .map(|r| (r.record.node_id.clone(), r.reason.clone()))
        .collect();
    for id in ["wide", "full"] {
        assert!(
            reasons
                .iter()
                .any(|(node, why)| node == id && why.contains("KV layout")),
            "{reasons:?}"
        );
    }
    let mut ids: Vec<String> = members.borrow().iter().map(|r| r.node_id.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["decode", "prefill"]);
    Ok(())
}
