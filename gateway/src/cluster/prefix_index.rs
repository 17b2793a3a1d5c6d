//! Which KV block hashes each node holds, so routing can send a prompt to the node that
//! already caches its prefix.
//!
//! Nodes publish their prefix cache as a full snapshot followed by numbered batches of
//! [`CacheEvent`]s. A snapshot at sequence `n` holds every change up to and including batch
//! `n`, so the next batch applied is `n + 1`. A missing batch makes the node's set wrong in a
//! way no later batch can repair, so [`PrefixIndex::apply_events`] reports it as a
//! [`SequenceGap`] and the caller asks that node for a new snapshot.
//!
//! The hashes are the chained block hashes of the engine's `kv::prefix` module: a hash stands
//! for the whole prefix up to the end of its block, which is why [`PrefixIndex::overlap_blocks`]
//! only counts the leading run.
//!
//! This is a plain struct: the caller wraps it in a `Mutex`. Every operation is O(events) or
//! O(prompt blocks), short enough to hold a lock for.

use std::collections::{HashMap, HashSet};

/// One change to a node's set of cached block hashes, in the order the node made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheEvent {
    Stored(u64),
    Removed(u64),
}

/// A batch of events that does not follow the last one applied for its node: the node's set
/// is stale until a snapshot replaces it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cache events of node {node_id} out of sequence: expected {}, got {got}",
    expected.map_or_else(|| "a snapshot first".to_string(), |seq| seq.to_string())
)]
pub struct SequenceGap {
    pub node_id: String,
    /// The sequence number the batch should have had; `None` when the node has no snapshot.
    pub expected: Option<u64>,
    pub got: u64,
}

#[derive(Debug, Default)]
struct NodeCache {
    /// Sequence number of the last snapshot or batch applied.
    last_seq: u64,
    hashes: HashSet<u64>,
}

/// Per node, the set of cached block hashes and the last applied sequence number.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    nodes: HashMap<String, NodeCache>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces everything known about `node_id` with `hashes`, the node's full set after its
    /// batch `seq`.
    ///
    /// A snapshot always wins, even with a lower `seq` than the last batch: a restarted node
    /// numbers from scratch, and the caller only asks for snapshots when it needs them.
    pub fn apply_snapshot(
        &mut self,
        node_id: &str,
        seq: u64,
        hashes: impl IntoIterator<Item = u64>,
    ) {
        let hashes = hashes.into_iter().collect();
        self.nodes.insert(
            node_id.to_string(),
            NodeCache {
                last_seq: seq,
                hashes,
            },
        );
    }

    /// Applies batch `seq` of `node_id`'s events in order.
    ///
    /// A batch at or below the last applied sequence is a duplicate (a retransmission, or one
    /// the latest snapshot already holds) and is ignored. A batch for a node without a
    /// snapshot, or one that skips a number, changes nothing and returns [`SequenceGap`]; the
    /// node keeps its last known set meanwhile, since a slightly stale set still mostly
    /// points at the right node while an empty one would point nowhere.
    pub fn apply_events(
        &mut self,
        node_id: &str,
        seq: u64,
        events: &[CacheEvent],
    ) -> Result<(), SequenceGap> {
        let gap = |expected| SequenceGap {
            node_id: node_id.to_string(),
            expected,
            got: seq,
        };
        let Some(node) = self.nodes.get_mut(node_id) else {
            return Err(gap(None));
        };
        if seq <= node.last_seq {
            return Ok(());
        }
        let expected = node.last_seq + 1;
        if seq != expected {
            return Err(gap(Some(expected)));
        }
        for event in events {
            // Set semantics make a repeated store or a removal of an unknown hash harmless.
            match *event {
                CacheEvent::Stored(hash) => node.hashes.insert(hash),
                CacheEvent::Removed(hash) => node.hashes.remove(&hash),
            };
        }
        node.last_seq = seq;
        Ok(())
    }

    /// Forgets `node_id`, for a node that left the cluster.
    pub fn remove_node(&mut self, node_id: &str) {
        self.nodes.remove(node_id);
    }

    /// How many block hashes `node_id` is known to hold.
    pub fn num_blocks(&self, node_id: &str) -> usize {
        self.nodes.get(node_id).map_or(0, |node| node.hashes.len())
    }

    /// The last sequence number applied for `node_id`; `None` before its first snapshot.
    pub fn last_seq(&self, node_id: &str) -> Option<u64> {
        self.nodes.get(node_id).map(|node| node.last_seq)
    }

    /// How many leading `prompt_block_hashes` `node_id` holds: the prompt blocks it would not
    /// have to compute. 0 for an unknown node.
    ///
    /// Only the leading run counts because a chained hash stands for its whole prefix: a
    /// later block held without an earlier one cannot be reused.
    pub fn overlap_blocks(&self, node_id: &str, prompt_block_hashes: &[u64]) -> usize {
        self.nodes.get(node_id).map_or(0, |node| {
            prompt_block_hashes
                .iter()
                .take_while(|hash| node.hashes.contains(hash))
                .count()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::CacheEvent::{Removed, Stored};
    use super::*;

    #[test]
    fn overlap_counts_the_leading_run_only() {
        let mut index = PrefixIndex::new();
        index.apply_snapshot("a", 0, [1, 2, 4]);
        assert_eq!(index.overlap_blocks("a", &[1, 2, 3, 4]), 2);
        assert_eq!(index.overlap_blocks("a", &[3, 1, 2]), 0);
        assert_eq!(index.overlap_blocks("a", &[]), 0);
        assert_eq!(index.overlap_blocks("unknown", &[1, 2]), 0);
    }

    #[test]
    fn events_apply_in_order_including_store_remove_store() {
        let mut index = PrefixIndex::new();
        index.apply_snapshot("a", 5, []);
        index
            .apply_events("a", 6, &[Stored(1), Removed(1), Stored(1), Stored(2)])
            .unwrap();
        assert_eq!(index.overlap_blocks("a", &[1, 2]), 2);
        index.apply_events("a", 7, &[Removed(2)]).unwrap();
        assert_eq!(index.overlap_blocks("a", &[1, 2]), 1);
        assert_eq!(index.last_seq("a"), Some(7));
    }

    #[test]
    fn duplicates_are_ignored() {
        let mut index = PrefixIndex::new();
        index.apply_snapshot("a", 3, [1]);
        // Batch 3 is already in the snapshot; replaying its removal must not undo it.
        index.apply_events("a", 3, &[Removed(1)]).unwrap();
        index.apply_events("a", 1, &[Removed(1)]).unwrap();
        assert_eq!(index.overlap_blocks("a", &[1]), 1);
        assert_eq!(index.last_seq("a"), Some(3));
    }

    #[test]
    fn a_gap_changes_nothing_until_a_snapshot_resyncs() {
        let mut index = PrefixIndex::new();
        index.apply_snapshot("a", 0, [1]);
        index.apply_events("a", 1, &[Stored(2)]).unwrap();
        // Batch 2 was lost.
        let err = index.apply_events("a", 3, &[Stored(3)]).unwrap_err();
        assert_eq!(
            err,
            SequenceGap {
                node_id: "a".into(),
                expected: Some(2),
                got: 3
            }
        );
        assert_eq!(
            err.to_string(),
            "cache events of node a out of sequence: expected 2, got 3"
        );
        assert_eq!(
            index.overlap_blocks("a", &[1, 2, 3]),
            2,
            "last known set is kept"
        );
        assert!(
            index.apply_events("a", 4, &[]).is_err(),
            "still out of sequence"
        );
        // The node's dump after batch 4 holds what batches 2..=4 did.
        index.apply_snapshot("a", 4, [1, 3, 5]);
        // A late copy of batch 4 is already in the snapshot.
        index.apply_events("a", 4, &[Removed(1)]).unwrap();
        index.apply_events("a", 5, &[Stored(6)]).unwrap();
        assert_eq!(index.overlap_blocks("a", &[1, 3, 5, 6]), 4);
        assert_eq!(index.overlap_blocks("a", &[1, 2]), 1, "2 is gone");
        assert_eq!(index.last_seq("a"), Some(5));
    }

    #[test]
    fn a_batch_retransmitted_after_a_gap_still_applies() {
        let mut index = PrefixIndex::new();
        index.apply_snapshot("a", 0, []);
        assert!(index.apply_events("a", 2, &[Stored(2)]).is_err());
        index.apply_events("a", 1, &[Stored(1)]).unwrap();
        index.apply_events("a", 2, &[Stored(2)]).unwrap();
        assert_eq!(index.overlap_blocks("a", &[1, 2]), 2);
    }

    #[test]
    fn events_before_a_snapshot_are_a_gap() {
        let mut index = PrefixIndex::new();
        let err = index.apply_events("a", 1, &[Stored(1)]).unwrap_err();
        assert_eq!(err.expected, None);
        assert!(err.to_string().contains("expected a snapshot first"));
        assert_eq!(index.last_seq("a"), None);
        assert_eq!(index.overlap_blocks("a", &[1]), 0);
    }

    #[test]
    fn a_restarted_node_resyncs_from_a_lower_sequence() {
        let mut index = PrefixIndex::new();
        index.apply_snapshot("a", 40, [1, 2]);
        index.apply_snapshot("a", 0, [7]);
        index.apply_events("a", 1, &[Stored(8)]).unwrap();
        assert_eq!(index.overlap_blocks("a", &[7, 8]), 2);
        assert_eq!(index.overlap_blocks("a", &[1]), 0);
    }

    #[test]
    fn removed_nodes_are_forgotten() {
        let mut index = PrefixIndex::new();
        index.apply_snapshot("a", 0, [1]);
        index.remove_node("a");
        assert_eq!(index.overlap_blocks("a", &[1]), 0);
        assert!(index.apply_events("a", 1, &[]).is_err());
    }
}
