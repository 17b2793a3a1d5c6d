//! Paged KV block allocator: a free list, per-block reference counts and a prefix cache of
//! full blocks keyed by their chained content hash (see [`super::prefix`]).
//!
//! Every block is in exactly one of three states:
//! - free: reference count 0, no hash, on the free list;
//! - used: reference count > 0, with or without a registered hash;
//! - cached: reference count 0 with a registered hash, in the eviction LRU. Its KV content
//!   stays valid until [`BlockAllocator::allocate`] evicts it, so
//!   [`BlockAllocator::acquire_cached`] can revive it.
//!
//! A block holds a hash exactly when the hash index maps that hash to it, so one hash is held
//! by at most one block. Every operation is O(1) or O(log n) in the number of blocks.
//!
//! When [`BlockAllocator::enable_events`] is on, every change to the set of held hashes is
//! also recorded as a [`CacheEvent`], so a node can publish its prefix cache to routers as a
//! stream of deltas instead of repeated full dumps of [`BlockAllocator::cached_hashes`].

use std::collections::{BTreeMap, HashMap};

use crate::error::{EngineError, Result};
use crate::ids::BlockId;

/// One change to the set of hashes the allocator holds (used or cached blocks alike).
///
/// Events are kept in the order they happened: a hash can be stored, evicted and stored again,
/// and only replaying them in order gives the right final set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheEvent {
    /// The hash entered the index: a full block with this content can now be shared.
    Stored(u64),
    /// The hash left the index: its block was evicted and reused.
    Removed(u64),
}

/// Book-keeping for one block.
#[derive(Debug, Clone, Copy, Default)]
struct BlockMeta {
    ref_count: u32,
    /// Content hash registered for this block, if it is full and indexed.
    hash: Option<u64>,
    /// Key of this block in the eviction LRU; `Some` exactly when the block is cached.
    lru_tick: Option<u64>,
}

/// Hands out KV blocks and shares full blocks between sequences with equal prefixes.
#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    /// Never-used or released blocks without a hash; popped from the end.
    free_list: Vec<BlockId>,
    /// Content hash -> the one block holding it (used or cached).
    hash_index: HashMap<u64, BlockId>,
    /// Cached blocks by the tick at which their last reference went away: the first entry is
    /// the least recently used and is evicted first.
    evictable: BTreeMap<u64, BlockId>,
    next_tick: u64,
    num_used: usize,
    prefix_hit_blocks: u64,
    prefix_queried_blocks: u64,
    /// Changes to `hash_index` not yet taken, in order; `None` while recording is off, so an
    /// engine that publishes nothing pays one branch per change and no memory.
    events: Option<Vec<CacheEvent>>,
}

impl BlockAllocator {
    /// An allocator over blocks `0..num_blocks` of `block_size` tokens each, all free.
    ///
    /// # Panics
    /// If `block_size` is 0 or `num_blocks` does not fit in a [`BlockId`]; both are
    /// programming errors in the cache set-up.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be at least 1 token");
        let num_blocks_u32 = u32::try_from(num_blocks).expect("num_blocks must fit in a u32 id");
        Self {
            block_size,
            blocks: vec![BlockMeta::default(); num_blocks],
            // Reversed so that allocation hands out block 0 first.
            free_list: (0..num_blocks_u32).rev().map(BlockId).collect(),
            hash_index: HashMap::new(),
            evictable: BTreeMap::new(),
            next_tick: 0,
            num_used: 0,
            prefix_hit_blocks: 0,
            prefix_queried_blocks: 0,
            events: None,
        }
    }

    pub fn num_total(&self) -> usize {
        self.blocks.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that can be allocated now: free ones plus cached (evictable) ones.
    pub fn num_free(&self) -> usize {
        self.free_list.len() + self.evictable.len()
    }

    /// Blocks with a reference count above 0.
    pub fn num_used(&self) -> usize {
        self.num_used
    }

    /// Unreferenced blocks that still hold a registered hash and can be revived.
    pub fn num_cached(&self) -> usize {
        self.evictable.len()
    }

    /// Current reference count of `id`; 0 for free, cached or out-of-range blocks.
    pub fn ref_count(&self, id: BlockId) -> usize {
        self.meta(id).map_or(0, |meta| meta.ref_count as usize)
    }

    /// The block holding content `hash`, used or cached, without taking a reference.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.hash_index.get(&hash).copied()
    }

    /// Takes one block with reference count 1: from the free list first, else by evicting the
    /// least recently used cached block (whose hash is dropped).
    pub fn allocate(&mut self) -> Result<BlockId> {
        let id = if let Some(id) = self.free_list.pop() {
            id
        } else if let Some((_, id)) = self.evictable.pop_first() {
            let meta = &mut self.blocks[id.0 as usize];
            meta.lru_tick = None;
            if let Some(hash) = meta.hash.take() {
                self.hash_index.remove(&hash);
                self.record(CacheEvent::Removed(hash));
            }
            id
        } else {
            return Err(EngineError::OutOfBlocks { needed: 1, free: 0 });
        };
        let meta = &mut self.blocks[id.0 as usize];
        debug_assert_eq!(meta.ref_count, 0, "allocated {id} was still referenced");
        meta.ref_count = 1;
        self.num_used += 1;
        Ok(id)
    }

    /// Takes `n` blocks, or none at all when fewer than `n` can be allocated.
    pub fn allocate_n(&mut self, n: usize) -> Result<Vec<BlockId>> {
        let free = self.num_free();
        if n > free {
            return Err(EngineError::OutOfBlocks { needed: n, free });
        }
        let ids = (0..n)
            .map(|_| self.allocate().expect("num_free() blocks are allocatable"))
            .collect();
        Ok(ids)
    }

    /// Adds a reference to a used block (to share a cached block, use
    /// [`acquire_cached`](Self::acquire_cached)).
    pub fn incref(&mut self, id: BlockId) -> Result<()> {
        match self.meta_mut(id) {
            Some(meta) if meta.ref_count > 0 => {
                meta.ref_count += 1;
                Ok(())
            }
            _ => Err(EngineError::BlockNotAllocated { block_id: id }),
        }
    }

    /// Drops one reference. At 0 a block with a registered hash becomes cached (most recently
    /// used), any other block returns to the free list. Freeing an unreferenced block is an
    /// error and changes nothing.
    pub fn free(&mut self, id: BlockId) -> Result<()> {
        let tick = self.next_tick;
        let meta = match self.meta_mut(id) {
            Some(meta) if meta.ref_count > 0 => meta,
            _ => return Err(EngineError::BlockNotAllocated { block_id: id }),
        };
        meta.ref_count -= 1;
        if meta.ref_count > 0 {
            return Ok(());
        }
        if meta.hash.is_some() {
            meta.lru_tick = Some(tick);
            self.evictable.insert(tick, id);
            self.next_tick += 1;
        } else {
            self.free_list.push(id);
        }
        self.num_used -= 1;
        Ok(())
    }

    /// Records that the used block `id` is now full with content `hash`, so later sequences
    /// can share it. Ignored when another block already holds `hash` (that mapping is kept),
    /// when `id` already holds a hash, or when `id` is not in use.
    pub fn register_hash(&mut self, id: BlockId, hash: u64) {
        if self.hash_index.contains_key(&hash) {
            return;
        }
        match self.meta_mut(id) {
            Some(meta) if meta.ref_count > 0 && meta.hash.is_none() => {
                meta.hash = Some(hash);
                self.hash_index.insert(hash, id);
                self.record(CacheEvent::Stored(hash));
            }
            _ => {
                tracing::debug!(block_id = %id, "register_hash ignored for a block that is not in use or already hashed");
            }
        }
    }

    /// Takes a reference to the block holding `hash`, reviving it if it was cached. Counts as
    /// one queried block in [`prefix_stats`](Self::prefix_stats).
    pub fn acquire_cached(&mut self, hash: u64) -> Option<BlockId> {
        let id = self.take_cached(hash);
        self.prefix_queried_blocks += 1;
        self.prefix_hit_blocks += u64::from(id.is_some());
        id
    }

    /// Takes a reference to each block holding the leading run of `hashes` that is cached,
    /// stopping at the first miss. Counts `hashes.len()` queried blocks and the returned
    /// number of hit blocks in [`prefix_stats`](Self::prefix_stats).
    pub fn acquire_cached_prefix(&mut self, hashes: &[u64]) -> Vec<BlockId> {
        let mut ids = Vec::new();
        for &hash in hashes {
            match self.take_cached(hash) {
                Some(id) => ids.push(id),
                None => break,
            }
        }
        self.prefix_queried_blocks += hashes.len() as u64;
        self.prefix_hit_blocks += ids.len() as u64;
        ids
    }

    /// Counts `n` queried blocks that were not taken (a hit cut short by the caller) in
    /// [`prefix_stats`](Self::prefix_stats).
    pub fn count_prefix_misses(&mut self, n: usize) {
        self.prefix_queried_blocks += n as u64;
    }

    /// How many leading `hashes` are held by some block, used or cached.
    pub fn count_cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|hash| self.hash_index.contains_key(hash))
            .count()
    }

    /// Every hash held by a block, used or cached, in no particular order.
    pub fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.hash_index.keys().copied()
    }

    /// Starts recording [`CacheEvent`]s; does nothing when recording is already on (pending
    /// events are kept).
    ///
    /// A subscriber that takes [`cached_hashes`](Self::cached_hashes) right after enabling, or
    /// right after a [`take_events`](Self::take_events), and then applies every later batch of
    /// taken events in order, holds exactly the allocator's set of hashes.
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// The events recorded since the last call, oldest first; empty while recording is off.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// `(hit blocks, queried blocks)` over every prefix-cache lookup so far.
    pub fn prefix_stats(&self) -> (u64, u64) {
        (self.prefix_hit_blocks, self.prefix_queried_blocks)
    }

    fn record(&mut self, event: CacheEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    fn take_cached(&mut self, hash: u64) -> Option<BlockId> {
        let id = self.lookup(hash)?;
        let meta = &mut self.blocks[id.0 as usize];
        if let Some(tick) = meta.lru_tick.take() {
            self.evictable.remove(&tick);
            self.num_used += 1;
        }
        meta.ref_count += 1;
        Some(id)
    }

    fn meta(&self, id: BlockId) -> Option<&BlockMeta> {
        self.blocks.get(id.0 as usize)
    }

    fn meta_mut(&mut self, id: BlockId) -> Option<&mut BlockMeta> {
        self.blocks.get_mut(id.0 as usize)
    }

    /// Panics when the internal indexes disagree with the per-block states.
    #[cfg(test)]
    pub(crate) fn assert_consistent(&self) {
        use std::collections::HashSet;

        let mut on_free_list = HashSet::new();
        for &id in &self.free_list {
            assert!(on_free_list.insert(id), "{id} twice on the free list");
        }
        let mut used = 0;
        for (index, meta) in self.blocks.iter().enumerate() {
            let id = BlockId(u32::try_from(index).expect("index fits in u32"));
            let free = on_free_list.contains(&id);
            let cached = meta.lru_tick.is_some();
            match meta.ref_count {
                0 => {
                    assert!(
                        free ^ cached,
                        "{id} is unreferenced but neither free nor cached"
                    );
                    assert_eq!(cached, meta.hash.is_some(), "{id} cached iff hashed");
                }
                _ => {
                    used += 1;
                    assert!(!free && !cached, "{id} is referenced but free or cached");
                }
            }
            if let Some(tick) = meta.lru_tick {
                assert_eq!(self.evictable.get(&tick), Some(&id));
            }
            if let Some(hash) = meta.hash {
                assert_eq!(self.hash_index.get(&hash), Some(&id));
            }
        }
        assert_eq!(used, self.num_used);
        for (hash, id) in &self.hash_index {
            assert_eq!(self.blocks[id.0 as usize].hash, Some(*hash));
        }
        assert_eq!(self.num_used + self.num_free(), self.num_total());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn allocates_until_empty_then_errors() {
        let mut alloc = BlockAllocator::new(3, 16);
        let ids = alloc.allocate_n(3).unwrap();
        assert_eq!(ids, vec![BlockId(0), BlockId(1), BlockId(2)]);
        assert_eq!((alloc.num_used(), alloc.num_free()), (3, 0));
        assert!(matches!(
            alloc.allocate(),
            Err(EngineError::OutOfBlocks { needed: 1, free: 0 })
        ));
        alloc.free(ids[1]).unwrap();
        assert_eq!(alloc.allocate().unwrap(), ids[1]);
        alloc.assert_consistent();
    }

    #[test]
    fn allocate_n_is_all_or_nothing() {
        let mut alloc = BlockAllocator::new(4, 16);
        alloc.allocate_n(2).unwrap();
        assert!(matches!(
            alloc.allocate_n(3),
            Err(EngineError::OutOfBlocks { needed: 3, free: 2 })
        ));
        assert_eq!(alloc.num_free(), 2);
        alloc.assert_consistent();
    }

    #[test]
    fn double_free_is_an_error_and_changes_nothing() {
        let mut alloc = BlockAllocator::new(2, 16);
        let id = alloc.allocate().unwrap();
        alloc.free(id).unwrap();
        assert!(matches!(
            alloc.free(id),
            Err(EngineError::BlockNotAllocated { block_id }) if block_id == id
        ));
        assert!(alloc.free(BlockId(99)).is_err());
        assert!(alloc.incref(id).is_err());
        assert_eq!(alloc.num_free(), 2);
        alloc.assert_consistent();
    }

    #[test]
    fn shared_block_is_released_by_its_last_reference() {
        let mut alloc = BlockAllocator::new(2, 16);
        let id = alloc.allocate().unwrap();
        alloc.incref(id).unwrap();
        alloc.free(id).unwrap();
        assert_eq!((alloc.ref_count(id), alloc.num_used()), (1, 1));
        alloc.free(id).unwrap();
        assert_eq!((alloc.ref_count(id), alloc.num_used()), (0, 0));
    }

    #[test]
    fn hashed_block_is_cached_and_revived() {
        let mut alloc = BlockAllocator::new(2, 16);
        let id = alloc.allocate().unwrap();
        alloc.register_hash(id, 7);
        alloc.free(id).unwrap();
        assert_eq!((alloc.num_cached(), alloc.num_free()), (1, 2));
        assert_eq!(alloc.count_cached_prefix(&[7, 8]), 1);
        assert_eq!(alloc.acquire_cached(7), Some(id));
        assert_eq!((alloc.num_cached(), alloc.num_used()), (0, 1));
        assert_eq!(alloc.acquire_cached(8), None);
        assert_eq!(alloc.prefix_stats(), (1, 2));
        alloc.assert_consistent();
    }

    #[test]
    fn eviction_takes_the_least_recently_used_and_drops_its_hash() {
        let mut alloc = BlockAllocator::new(2, 16);
        let a = alloc.allocate().unwrap();
        let b = alloc.allocate().unwrap();
        alloc.register_hash(a, 1);
        alloc.register_hash(b, 2);
        alloc.free(b).unwrap();
        alloc.free(a).unwrap();
        // b was released first, so it goes first.
        assert_eq!(alloc.allocate().unwrap(), b);
        assert_eq!(alloc.lookup(2), None);
        assert_eq!(alloc.lookup(1), Some(a));
        assert_eq!(alloc.cached_hashes().collect::<Vec<_>>(), vec![1]);
        alloc.assert_consistent();
    }

    #[test]
    fn duplicate_hash_keeps_the_existing_block() {
        let mut alloc = BlockAllocator::new(2, 16);
        let a = alloc.allocate().unwrap();
        let b = alloc.allocate().unwrap();
        alloc.register_hash(a, 5);
        alloc.register_hash(b, 5);
        assert_eq!(alloc.lookup(5), Some(a));
        alloc.free(b).unwrap();
        // b holds no hash, so it is plainly free rather than cached.
        assert_eq!(alloc.num_cached(), 0);
        alloc.assert_consistent();
    }

    #[test]
    fn acquire_cached_prefix_stops_at_the_first_miss() {
        let mut alloc = BlockAllocator::new(4, 16);
        let ids = alloc.allocate_n(3).unwrap();
        for (id, hash) in ids.iter().zip([10, 11, 12]) {
            alloc.register_hash(*id, hash);
        }
        alloc.free(ids[0]).unwrap();
        let got = alloc.acquire_cached_prefix(&[10, 11, 99, 12]);
        assert_eq!(got, vec![ids[0], ids[1]]);
        assert_eq!(alloc.ref_count(ids[1]), 2);
        assert_eq!(alloc.prefix_stats(), (2, 4));
        alloc.assert_consistent();
    }

    #[test]
    fn events_are_off_by_default_and_record_nothing() {
        let mut alloc = BlockAllocator::new(1, 16);
        assert!(!alloc.events_enabled());
        let a = alloc.allocate().unwrap();
        alloc.register_hash(a, 1);
        alloc.free(a).unwrap();
        let b = alloc.allocate().unwrap();
        assert_eq!(a, b, "the cached block was evicted");
        assert!(alloc.take_events().is_empty());
        assert!(alloc.events.is_none(), "nothing is buffered while off");
    }

    #[test]
    fn events_keep_the_order_of_store_evict_store() {
        let mut alloc = BlockAllocator::new(1, 16);
        alloc.enable_events();
        let a = alloc.allocate().unwrap();
        alloc.register_hash(a, 1);
        // Neither a duplicate hash nor a second hash on the same block enters the index.
        alloc.register_hash(a, 1);
        alloc.register_hash(a, 2);
        alloc.free(a).unwrap();
        let a = alloc.allocate().unwrap();
        alloc.register_hash(a, 1);
        assert_eq!(
            alloc.take_events(),
            vec![
                CacheEvent::Stored(1),
                CacheEvent::Removed(1),
                CacheEvent::Stored(1)
            ]
        );
        assert!(alloc.take_events().is_empty(), "take drains");
        // Enabling again keeps recording without losing pending events.
        alloc.free(a).unwrap();
        alloc.allocate().unwrap();
        alloc.enable_events();
        assert_eq!(alloc.take_events(), vec![CacheEvent::Removed(1)]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Allocate,
        AllocateN(usize),
        Incref(usize),
        Free(usize),
        FreeRaw(u32),
        Register(usize, u64),
        Acquire(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Allocate),
            1 => (0usize..4).prop_map(Op::AllocateN),
            2 => any::<usize>().prop_map(Op::Incref),
            4 => any::<usize>().prop_map(Op::Free),
            1 => (0u32..10).prop_map(Op::FreeRaw),
            3 => (any::<usize>(), 0u64..6).prop_map(|(i, h)| Op::Register(i, h)),
            3 => (0u64..6).prop_map(Op::Acquire),
        ]
    }

    proptest! {
        #[test]
        fn random_ops_keep_refcounts_and_hashes_consistent(
            num_blocks in 1usize..8,
            ops in proptest::collection::vec(op(), 0..200),
        ) {
            let mut alloc = BlockAllocator::new(num_blocks, 4);
            // One entry per reference the test holds.
            let mut held: Vec<BlockId> = Vec::new();
            for op in ops {
                match op {
                    Op::Allocate => {
                        let cached_before: Vec<u64> = alloc.cached_hashes().collect();
                        match alloc.allocate() {
                            Ok(id) => {
                                prop_assert!(!held.contains(&id));
                                // A freshly allocated block holds no hash: an evicted
                                // block's hash is gone from the index.
                                prop_assert!(alloc.cached_hashes().all(|h| alloc.lookup(h) != Some(id)));
                                prop_assert!(cached_before.len() - alloc.cached_hashes().count() <= 1);
                                held.push(id);
                            }
                            Err(_) => prop_assert_eq!(alloc.num_free(), 0),
                        }
                    }
                    Op::AllocateN(n) => {
                        let free = alloc.num_free();
                        match alloc.allocate_n(n) {
                            Ok(ids) => held.extend(ids),
                            Err(_) => {
                                prop_assert!(n > free);
                                prop_assert_eq!(alloc.num_free(), free);
                            }
                        }
                    }
                    Op::Incref(i) if !held.is_empty() => {
                        let id = held[i % held.len()];
                        alloc.incref(id).unwrap();
                        held.push(id);
                    }
                    Op::Free(i) if !held.is_empty() => {
                        let id = held.swap_remove(i % held.len());
                        alloc.free(id).unwrap();
                    }
                    Op::FreeRaw(raw) => {
                        let id = BlockId(raw);
                        let result = alloc.free(id);
                        if let Some(pos) = held.iter().position(|&h| h == id) {
                            prop_assert!(result.is_ok());
                            held.swap_remove(pos);
                        } else {
                            prop_assert!(result.is_err(), "double free of {} accepted", id);
                        }
                    }
                    Op::Register(i, hash) if !held.is_empty() => {
                        alloc.register_hash(held[i % held.len()], hash);
                    }
                    Op::Acquire(hash) => {
                        let expected = alloc.lookup(hash);
                        let got = alloc.acquire_cached(hash);
                        prop_assert_eq!(got, expected);
                        held.extend(got);
                    }
                    _ => {}
                }
                alloc.assert_consistent();
                let mut counts: HashMap<BlockId, usize> = HashMap::new();
                for &id in &held {
                    *counts.entry(id).or_default() += 1;
                }
                for index in 0..num_blocks {
                    let id = BlockId(index as u32);
                    prop_assert_eq!(alloc.ref_count(id), counts.get(&id).copied().unwrap_or(0));
                }
                prop_assert_eq!(alloc.num_used(), counts.len());
                prop_assert_eq!(alloc.num_used() + alloc.num_free(), num_blocks);
                prop_assert!(alloc.num_cached() <= alloc.num_free());
            }
            for id in held.drain(..) {
                alloc.free(id).unwrap();
            }
            prop_assert_eq!(alloc.num_free(), num_blocks);
            prop_assert_eq!(alloc.num_used(), 0);
        }

        /// A subscriber that starts from a dump and applies each drained batch in order holds
        /// exactly the allocator's hashes after every batch.
        #[test]
        fn replayed_events_equal_cached_hashes(
            num_blocks in 1usize..6,
            warm_up in proptest::collection::vec(op(), 0..50),
            ops in proptest::collection::vec((op(), proptest::bool::weighted(0.3)), 0..300),
        ) {
            let mut alloc = BlockAllocator::new(num_blocks, 4);
            let mut held: Vec<BlockId> = Vec::new();
            // Recording starts mid-life, so the replica must start from the dump.
            for op in warm_up {
                apply_op(&mut alloc, &mut held, op);
            }
            alloc.enable_events();
            let mut replica: HashSet<u64> = alloc.cached_hashes().collect();
            for (op, take) in ops {
                apply_op(&mut alloc, &mut held, op);
                if take {
                    for event in alloc.take_events() {
                        match event {
                            // Every event changes the set: none is redundant.
                            CacheEvent::Stored(hash) => prop_assert!(replica.insert(hash)),
                            CacheEvent::Removed(hash) => prop_assert!(replica.remove(&hash)),
                        }
                    }
                    prop_assert_eq!(&replica, &alloc.cached_hashes().collect::<HashSet<_>>());
                }
            }
        }
    }

    /// Applies `op` the way a sequence would, ignoring ops that do not apply.
    fn apply_op(alloc: &mut BlockAllocator, held: &mut Vec<BlockId>, op: Op) {
        match op {
            Op::Allocate => held.extend(alloc.allocate().ok()),
            Op::AllocateN(n) => held.extend(alloc.allocate_n(n).unwrap_or_default()),
            Op::Incref(i) if !held.is_empty() => {
                let id = held[i % held.len()];
                alloc.incref(id).unwrap();
                held.push(id);
            }
            Op::Free(i) if !held.is_empty() => {
                let id = held.swap_remove(i % held.len());
                alloc.free(id).unwrap();
            }
            Op::FreeRaw(raw) => {
                if let Some(pos) = held.iter().position(|&h| h.0 == raw) {
                    alloc.free(held.swap_remove(pos)).unwrap();
                }
            }
            Op::Register(i, hash) if !held.is_empty() => {
                alloc.register_hash(held[i % held.len()], hash);
            }
            Op::Acquire(hash) => held.extend(alloc.acquire_cached(hash)),
            _ => {}
        }
    }
}
