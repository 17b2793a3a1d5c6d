//! Sliding-window groups in the scheduler: freed blocks, per-group admission, the prefix cache.

use std::collections::HashSet;

use super::*;
use crate::ids::BlockId;
use crate::kv::groups::{first_live_block, NO_BLOCK};

const BS: usize = 4;
const WINDOW: usize = 8;

fn config(caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_prefill_tokens: 64,
        max_batch_total_tokens: 256,
        max_num_seqs: 8,
        max_prefill_chunk_tokens: 8,
        enable_prefix_caching: caching,
    }
}

/// A full-attention pool of `full` blocks and one window group of `window_blocks`.
fn scheduler(caching: bool, full: usize, window_blocks: usize) -> Scheduler {
    Scheduler::try_new(config(caching), BlockAllocator::new(full, BS))
        .unwrap()
        .with_window_groups(vec![(WINDOW, BlockAllocator::new(window_blocks, BS))])
}

fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>, max_new_tokens: usize) {
    s.add(NewSequence {
        seq_id: SeqId(id),
        prompt_ids: prompt,
        max_new_tokens,
    })
    .unwrap();
}

/// Every item's window table reads only live blocks from its first query's window on, and no
/// live block is in two running sequences' tables unless shared through the prefix cache.
fn check_item(item: &BatchItem) {
    let table = &item.window_tables[0];
    assert_eq!(table.len(), item.block_table.len());
    let first = first_live_block(item.start_pos, WINDOW, BS);
    let last = item.context_len.div_ceil(BS);
    assert!(
        table[first..last].iter().all(|&b| b != NO_BLOCK),
        "{item:?}"
    );
}

/// Runs every sequence to its end, checking each item; returns the most window blocks held.
fn run(s: &mut Scheduler) -> usize {
    let mut most = 0;
    let mut token = 1000;
    while s.has_work() {
        let batch = s.schedule();
        for item in &batch.items {
            check_item(item);
        }
        let sampled: Vec<(SeqId, u32)> = batch
            .items
            .iter()
            .filter(|i| i.sample)
            .map(|i| (i.seq_id, token))
            .collect();
        token += 1;
        s.commit(&batch, &sampled);
        most = most.max(s.group_usage()[1].num_blocks_used);
        s.windows[0].allocator.assert_consistent();
        let done: Vec<SeqId> = s
            .seqs
            .values()
            .filter(|q| q.is_done())
            .map(|q| q.seq_id)
            .collect();
        for id in done {
            s.finish(id).unwrap();
        }
    }
    most
}

#[test]
fn blocks_before_the_window_go_back_to_the_pool() {
    let mut s = scheduler(false, 64, 64);
    add(&mut s, 1, (0..40).collect(), 6);
    let most = run(&mut s);
    // 46 tokens need 12 blocks in full; the window group never held more than its cap.
    let cap = s.window_cap(WINDOW);
    assert_eq!(cap, (WINDOW - 1 + 8).div_ceil(BS) + 1);
    assert!(most <= cap && most < 12, "held {most}, cap {cap}");
    for usage in s.group_usage() {
        assert_eq!(usage.num_blocks_used, 0, "{usage:?}");
    }
}

#[test]
fn a_sequence_mid_way_holds_only_its_window() {
    let mut s = scheduler(false, 64, 64);
    add(&mut s, 1, (0..40).collect(), 10);
    // Five chunks of 8 prefill the prompt and sample the first token.
    for _ in 0..5 {
        let batch = s.schedule();
        s.commit(&batch, &[(SeqId(1), 7)]);
    }
    let seq = s.sequence(SeqId(1)).unwrap();
    assert_eq!(seq.num_computed_tokens, 40);
    // The next query, at 40, reads keys 33..=40: blocks 8.. of 4 tokens.
    let table = &seq.window_tables[0];
    let first = first_live_block(40, WINDOW, BS);
    assert_eq!(first, 8);
    assert!(table[..first].iter().all(|&b| b == NO_BLOCK));
    assert!(table[first..].iter().all(|&b| b != NO_BLOCK));
    assert_eq!(s.group_usage()[1].num_blocks_used, table.len() - first);
    assert_eq!(s.group_usage()[0].num_blocks_used, 10);
}

#[test]
fn admission_counts_each_group_at_its_longest() {
    // The window pool fits two sequences at their window's cap (6 blocks each), not three.
    let cap = (WINDOW - 1 + 8).div_ceil(BS) + 1;
    let mut s = scheduler(false, 256, 2 * cap);
    for id in 1..=3 {
        add(&mut s, id, (0..40).map(|t| t + id as u32).collect(), 20);
    }
    let batch = s.schedule();
    // The first is admitted on an idle scheduler; the second fits beside it; the third does not.
    assert_eq!(batch.items.len(), 2, "{:?}", batch.items);
    assert_eq!(s.num_waiting(), 1);
    run(&mut s);
    assert_eq!(s.stats().num_blocks_used, 0);
}

#[test]
fn a_short_window_pool_preempts_instead_of_failing() {
    let mut s = scheduler(false, 256, 7);
    s.set_reserve_output(false);
    for id in 1..=3 {
        add(&mut s, id, (0..30).map(|t| t * 3 + id as u32).collect(), 12);
    }
    run(&mut s);
    for usage in s.group_usage() {
        assert_eq!(usage.num_blocks_used, 0, "{usage:?}");
    }
}

#[test]
fn a_prefix_hit_takes_the_window_blocks_it_reads_from_the_cache() {
    let mut s = scheduler(true, 64, 64);
    let prompt: Vec<u32> = (0..41).collect();
    add(&mut s, 1, prompt.clone(), 2);
    run(&mut s);
    // The freed window blocks kept their hashes: the second sequence reuses 10 blocks, its
    // window group the two its first computed token (at 40) reads.
    add(&mut s, 2, prompt, 2);
    let batch = s.schedule();
    let item = &batch.items[0];
    assert_eq!(item.start_pos, 40);
    let table = &item.window_tables[0];
    assert!(table[..8].iter().all(|&b| b == NO_BLOCK));
    assert!(table[8..].iter().all(|&b| b != NO_BLOCK));
    // The first sequence queried 10 blocks and hit none; the second hit all 10.
    assert_eq!(
        (s.stats().prefix_hit_blocks, s.stats().prefix_queried_blocks),
        (10, 20)
    );
}

#[test]
fn a_prefix_hit_shrinks_to_what_every_window_group_still_holds() {
    // A window pool too small to keep the first sequence's freed blocks cached for long.
    let mut s = scheduler(true, 64, 6);
    let prompt: Vec<u32> = (0..41).collect();
    add(&mut s, 1, prompt.clone(), 2);
    run(&mut s);
    // Another sequence evicts the window group's cached blocks, not the full group's.
    add(&mut s, 2, (500..524).collect(), 2);
    run(&mut s);
    let full_hits = s
        .allocator
        .count_cached_prefix(&crate::kv::prefix::block_hashes(&prompt, BS)[..10]);
    assert_eq!(full_hits, 10, "the full group still holds the prompt");
    add(&mut s, 3, prompt.clone(), 2);
    let batch = s.schedule();
    let item = &batch.items[0];
    // Whatever the hit, the window group holds every block its first query reads.
    check_item(item);
    assert!(item.start_pos < 40, "the hit shrank: {}", item.start_pos);
    run(&mut s);
    for usage in s.group_usage() {
        assert_eq!(usage.num_blocks_used, 0, "{usage:?}");
    }
}

#[test]
fn live_window_blocks_are_never_shared_by_two_running_sequences_without_a_hash() {
    let mut s = scheduler(false, 128, 40);
    for id in 1..=4 {
        add(&mut s, id, (0..(13 * id as u32)).collect(), 9);
    }
    let mut token = 1;
    while s.has_work() {
        let batch = s.schedule();
        let mut seen: HashSet<BlockId> = HashSet::new();
        for seq in s
            .seqs
            .values()
            .filter(|q| q.status == SequenceStatus::Running)
        {
            for &b in seq.window_tables[0].iter().filter(|&&b| b != NO_BLOCK) {
                assert!(seen.insert(b), "{b} held twice");
            }
        }
        for item in &batch.items {
            check_item(item);
        }
        let sampled: Vec<(SeqId, u32)> = batch
            .items
            .iter()
            .filter(|i| i.sample)
            .map(|i| (i.seq_id, token))
            .collect();
        token += 1;
        s.commit(&batch, &sampled);
        let done: Vec<SeqId> = s
            .seqs
            .values()
            .filter(|q| q.is_done())
            .map(|q| q.seq_id)
            .collect();
        for id in done {
            s.finish(id).unwrap();
        }
    }
    assert_eq!(s.group_usage()[1].num_blocks_used, 0);
}
