//! Property tests: random interleavings of add, schedule + commit, cancel and finish over
//! small caches (so preemption happens), checking the scheduler's and the allocator's
//! invariants after every operation and that every sequence finishes in the end.

use std::collections::{BTreeMap, HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::ids::BlockId;

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt_ids: Vec<u32>,
        max_new_tokens: usize,
    },
    Step {
        seed: u32,
        cancel_mid_step: Option<usize>,
        finish_done: bool,
    },
    Cancel(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (proptest::collection::vec(0u32..3, 1..14), 1usize..6)
            .prop_map(|(prompt_ids, max_new_tokens)| Op::Add { prompt_ids, max_new_tokens }),
        5 => (any::<u32>(), proptest::option::weighted(0.1, any::<usize>()), proptest::bool::weighted(0.8))
            .prop_map(|(seed, cancel_mid_step, finish_done)| Op::Step { seed, cancel_mid_step, finish_done }),
        1 => any::<usize>().prop_map(Op::Cancel),
    ]
}

/// Budgets, block size, number of blocks, and whether admission reserves room for outputs.
fn config() -> impl Strategy<Value = (SchedulerConfig, usize, usize, bool)> {
    (
        1usize..12,
        4usize..40,
        1usize..5,
        1usize..6,
        any::<bool>(),
        1usize..5,
        2usize..12,
        any::<bool>(),
    )
        .prop_map(
            |(prefill, total, seqs, chunk, caching, block_size, num_blocks, reserve)| {
                let cfg = SchedulerConfig {
                    max_batch_prefill_tokens: prefill,
                    max_batch_total_tokens: total,
                    max_num_seqs: seqs,
                    max_prefill_chunk_tokens: chunk,
                    enable_prefix_caching: caching,
                };
                (cfg, block_size, num_blocks, reserve)
            },
        )
}

/// The test's own record of what every live sequence holds: `prompt ++ sampled tokens`.
struct Harness {
    scheduler: Scheduler,
    tokens: BTreeMap<SeqId, (usize, Vec<u32>)>,
    next_id: u64,
    coverage: Coverage,
}

/// How often the interesting paths ran, so a test can tell the strategies reach them.
#[derive(Debug, Default, Clone, Copy)]
struct Coverage {
    num_preempted: usize,
    num_mid_step_cancels: usize,
    num_chunked_items: usize,
    prefix_hit_blocks: u64,
}

impl Harness {
    fn live_ids(&self) -> Vec<SeqId> {
        self.tokens.keys().copied().collect()
    }

    fn cancel(&mut self, index: usize) {
        let ids = self.live_ids();
        if ids.is_empty() {
            return;
        }
        let seq_id = ids[index % ids.len()];
        self.scheduler.finish(seq_id).unwrap();
        self.tokens.remove(&seq_id);
    }

    fn step(&mut self, seed: u32, cancel_mid_step: Option<usize>, finish_done: bool) {
        let batch = self.scheduler.schedule();
        self.check_batch(&batch);
        self.coverage.num_preempted += batch.preempted.len();
        self.coverage.num_chunked_items += batch
            .items
            .iter()
            .filter(|item| item.is_prefill && !item.sample)
            .count();
        let sampled: Vec<(SeqId, u32)> = batch
            .items
            .iter()
            .filter(|item| item.sample)
            .map(|item| {
                (
                    item.seq_id,
                    seed.wrapping_mul(item.seq_id.0 as u32 + 7) >> 29,
                )
            })
            .collect();
        if let Some(index) = cancel_mid_step {
            self.coverage.num_mid_step_cancels += usize::from(!batch.is_empty());
            self.cancel(index);
        }
        self.scheduler.commit(&batch, &sampled);
        for (seq_id, token_id) in sampled {
            if let Some((_, tokens)) = self.tokens.get_mut(&seq_id) {
                tokens.push(token_id);
            }
        }
        if finish_done {
            for seq_id in self.live_ids() {
                if self.scheduler.sequence(seq_id).unwrap().is_done() {
                    self.scheduler.finish(seq_id).unwrap();
                    self.tokens.remove(&seq_id);
                }
            }
        }
    }

    fn check_batch(&self, batch: &Batch) {
        let cfg = self.scheduler.config();
        let alloc = self.scheduler.allocator();
        let block_size = alloc.block_size();
        assert!(batch.items.len() <= cfg.max_num_seqs);
        assert!(batch.num_context_tokens() <= cfg.max_batch_total_tokens);
        assert!(batch.num_prefill_tokens() <= cfg.max_batch_prefill_tokens);
        let mut seen = HashSet::new();
        for item in &batch.items {
            assert!(
                seen.insert(item.seq_id),
                "{} twice in one batch",
                item.seq_id
            );
            let (num_prompt, tokens) = &self.tokens[&item.seq_id];
            let n = item.token_ids.len();
            assert!(n >= 1);
            assert_eq!(item.is_prefill, n > 1 || item.start_pos < *num_prompt);
            if item.is_prefill {
                assert!(n <= cfg.max_prefill_chunk_tokens);
            }
            assert_eq!(item.context_len, item.start_pos + n);
            assert_eq!(item.token_ids, tokens[item.start_pos..item.context_len]);
            assert_eq!(item.sample, item.context_len == tokens.len());
            assert!(item.block_table.len() * block_size >= item.context_len);
            for &block_id in &item.block_table {
                assert!(
                    alloc.ref_count(block_id) > 0,
                    "{block_id} of an item is unreferenced"
                );
            }
            let seq = self.scheduler.sequence(item.seq_id).unwrap();
            assert_eq!(seq.block_table, item.block_table);
            assert_eq!(seq.status(), SequenceStatus::Running);
        }
        for seq_id in &batch.preempted {
            assert!(
                !seen.contains(seq_id),
                "preempted {seq_id} still in the batch"
            );
            let seq = self.scheduler.sequence(*seq_id).unwrap();
            assert_eq!(seq.status(), SequenceStatus::Waiting);
            assert!(seq.block_table.is_empty());
        }
    }

    fn check_state(&self) {
        let alloc = self.scheduler.allocator();
        alloc.assert_consistent();
        let mut holders: HashMap<BlockId, usize> = HashMap::new();
        for (&seq_id, (num_prompt, tokens)) in &self.tokens {
            let seq = self
                .scheduler
                .sequence(seq_id)
                .expect("a live sequence is tracked");
            assert_eq!(seq.all_tokens().collect::<Vec<_>>(), *tokens);
            assert_eq!(seq.prompt_ids.len(), *num_prompt);
            assert!(seq.output_ids.len() <= seq.max_new_tokens);
            match seq.status() {
                SequenceStatus::Waiting => {
                    assert!(seq.block_table.is_empty());
                    assert_eq!(seq.num_computed_tokens, 0);
                }
                SequenceStatus::Running => {
                    assert!(seq.num_computed_tokens < tokens.len());
                    let num_blocks = seq.block_table.len();
                    assert!(num_blocks * alloc.block_size() >= seq.num_computed_tokens);
                }
            }
            for &block_id in &seq.block_table {
                *holders.entry(block_id).or_default() += 1;
            }
        }
        // Blocks are disjoint between sequences except shared prefix blocks, whose reference
        // count is exactly their number of holders.
        for index in 0..alloc.num_total() {
            let block_id = BlockId(index as u32);
            assert_eq!(
                alloc.ref_count(block_id),
                holders.get(&block_id).copied().unwrap_or(0),
                "{block_id}"
            );
        }
        assert_eq!(
            self.scheduler.num_waiting() + self.scheduler.num_running(),
            self.tokens.len()
        );
        let num_running_not_done = self
            .tokens
            .keys()
            .filter_map(|id| self.scheduler.sequence(*id))
            .filter(|seq| seq.status() == SequenceStatus::Running && !seq.is_done())
            .count();
        assert!(num_running_not_done <= self.scheduler.config().max_num_seqs);
    }
}

fn run_ops(
    (cfg, block_size, num_blocks, reserve_output): (SchedulerConfig, usize, usize, bool),
    ops: Vec<Op>,
) -> Coverage {
    let mut scheduler =
        Scheduler::try_new(cfg, BlockAllocator::new(num_blocks, block_size)).unwrap();
    scheduler.set_reserve_output(reserve_output);
    let mut harness = Harness {
        scheduler,
        tokens: BTreeMap::new(),
        next_id: 0,
        coverage: Coverage::default(),
    };
    for op in ops {
        match op {
            Op::Add {
                prompt_ids,
                max_new_tokens,
            } => {
                let seq_id = SeqId(harness.next_id);
                harness.next_id += 1;
                let num_prompt = prompt_ids.len();
                let result = harness.scheduler.add(NewSequence {
                    seq_id,
                    prompt_ids: prompt_ids.clone(),
                    max_new_tokens,
                });
                match result {
                    Ok(()) => {
                        harness.tokens.insert(seq_id, (num_prompt, prompt_ids));
                    }
                    Err(EngineError::PromptTooLong { num_tokens, limit }) => {
                        assert!(num_tokens > limit);
                        assert_eq!(limit, harness.scheduler.max_sequence_tokens());
                    }
                    Err(err) => panic!("unexpected add error: {err}"),
                }
            }
            Op::Step {
                seed,
                cancel_mid_step,
                finish_done,
            } => harness.step(seed, cancel_mid_step, finish_done),
            Op::Cancel(index) => harness.cancel(index),
        }
        harness.check_state();
    }

    // Drain: every sequence must finish, within a generous bound on the number of steps.
    let mut num_steps = 0;
    while harness.scheduler.has_work() {
        num_steps += 1;
        assert!(
            num_steps < 5_000,
            "no progress: {:?}",
            harness.scheduler.stats()
        );
        harness.step(num_steps, None, true);
        harness.check_state();
    }
    for seq_id in harness.live_ids() {
        assert!(harness.scheduler.sequence(seq_id).unwrap().is_done());
        harness.scheduler.finish(seq_id).unwrap();
        harness.tokens.remove(&seq_id);
    }
    let alloc = harness.scheduler.allocator();
    alloc.assert_consistent();
    assert_eq!(alloc.num_used(), 0);
    assert_eq!(alloc.num_free(), alloc.num_total());
    assert_eq!(
        harness.scheduler.num_waiting() + harness.scheduler.num_running(),
        0
    );
    // Admission that holds room for every running sequence at its longest never preempts.
    if reserve_output {
        assert_eq!(harness.coverage.num_preempted, 0, "{:?}", harness.coverage);
    }
    harness.coverage.prefix_hit_blocks = alloc.prefix_stats().0;
    harness.coverage
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_interleavings_keep_invariants_and_finish(
        cfg in config(),
        ops in proptest::collection::vec(op(), 0..80),
    ) {
        run_ops(cfg, ops);
    }
}

/// The strategies above must actually reach preemption, prefix hits, chunked prefill and
/// cancellation between schedule and commit, or the property would not cover them.
#[test]
fn random_interleavings_reach_every_path() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    let mut runner = TestRunner::deterministic();
    let strategy = (config(), proptest::collection::vec(op(), 0..80));
    let mut total = Coverage::default();
    for _ in 0..200 {
        let (cfg, ops) = strategy
            .new_tree(&mut runner)
            .expect("strategies always generate")
            .current();
        let coverage = run_ops(cfg, ops);
        total.num_preempted += coverage.num_preempted;
        total.num_mid_step_cancels += coverage.num_mid_step_cancels;
        total.num_chunked_items += coverage.num_chunked_items;
        total.prefix_hit_blocks += coverage.prefix_hit_blocks;
    }
    assert!(total.num_preempted > 0, "{total:?}");
    assert!(total.num_mid_step_cancels > 0, "{total:?}");
    assert!(total.num_chunked_items > 0, "{total:?}");
    assert!(total.prefix_hit_blocks > 0, "{total:?}");
}

/// A hand-made case that must preempt.
#[test]
fn small_caches_preempt() {
    let cfg = SchedulerConfig {
        max_batch_prefill_tokens: 8,
        max_batch_total_tokens: 32,
        max_num_seqs: 4,
        max_prefill_chunk_tokens: 4,
        enable_prefix_caching: true,
    };
    let mut ops = Vec::new();
    for i in 0..4u32 {
        ops.push(Op::Add {
            prompt_ids: vec![i; 5],
            max_new_tokens: 5,
        });
    }
    for seed in 0..40 {
        ops.push(Op::Step {
            seed,
            cancel_mid_step: None,
            finish_done: true,
        });
    }
    assert!(run_ops((cfg, 2, 8, false), ops).num_preempted > 0);
}
