//! The scheduler's unit tests: chunking, budgets, preemption, prefix caching.

use super::*;

fn config(caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_prefill_tokens: 64,
        max_batch_total_tokens: 64,
        max_num_seqs: 8,
        max_prefill_chunk_tokens: 4,
        enable_prefix_caching: caching,
    }
}

/// Admission by what fits now: the preemption and recompute cases below need sequences that
/// outgrow the cache (`reserve_output_tests.rs` tests the admission that avoids them).
fn scheduler(cfg: SchedulerConfig, num_blocks: usize, block_size: usize) -> Scheduler {
    let mut s = Scheduler::try_new(cfg, BlockAllocator::new(num_blocks, block_size)).unwrap();
    s.set_reserve_output(false);
    s
}

fn new_seq(id: u64, prompt_ids: Vec<u32>, max_new_tokens: usize) -> NewSequence {
    NewSequence {
        seq_id: SeqId(id),
        prompt_ids,
        max_new_tokens,
    }
}

/// Schedules and commits one step, sampling `token_id` for every sampling item.
fn step(s: &mut Scheduler, token_id: u32) -> Batch {
    let batch = s.schedule();
    let sampled: Vec<(SeqId, u32)> = batch
        .items
        .iter()
        .filter(|item| item.sample)
        .map(|item| (item.seq_id, token_id))
        .collect();
    s.commit(&batch, &sampled);
    batch
}

fn chunks(batch: &Batch, seq_id: u64) -> Vec<u32> {
    batch
        .items
        .iter()
        .find(|item| item.seq_id == SeqId(seq_id))
        .map(|item| item.token_ids.clone())
        .unwrap_or_default()
}

#[test]
fn chunked_prefill_splits_ten_tokens_into_4_4_2() {
    let mut s = scheduler(config(false), 16, 4);
    let prompt: Vec<u32> = (100..110).collect();
    s.add(new_seq(1, prompt.clone(), 3)).unwrap();

    let lens: Vec<(usize, usize, bool)> = (0..3)
        .map(|_| {
            let batch = step(&mut s, 7);
            let item = &batch.items[0];
            assert_eq!(item.token_ids, prompt[item.start_pos..item.context_len]);
            assert!(item.block_table.len() * 4 >= item.context_len);
            (item.start_pos, item.token_ids.len(), item.sample)
        })
        .collect();
    assert_eq!(lens, vec![(0, 4, false), (4, 4, false), (8, 2, true)]);

    // Then one decode token at a time: the last known token.
    let batch = step(&mut s, 8);
    let item = &batch.items[0];
    assert_eq!((item.token_ids.clone(), item.start_pos), (vec![7], 10));
    assert!(item.sample && !item.is_prefill);
    assert_eq!(s.sequence(SeqId(1)).unwrap().output_ids, vec![7, 8]);
}

#[test]
fn decodes_come_first_and_prefill_budget_cuts_chunks() {
    let mut cfg = config(false);
    cfg.max_batch_prefill_tokens = 6;
    let mut s = scheduler(cfg, 32, 4);
    s.add(new_seq(1, vec![1; 3], 4)).unwrap();
    step(&mut s, 9);
    s.add(new_seq(2, vec![2; 10], 4)).unwrap();
    s.add(new_seq(3, vec![3; 10], 4)).unwrap();
    let batch = step(&mut s, 9);
    let ids: Vec<u64> = batch.items.iter().map(|item| item.seq_id.0).collect();
    assert_eq!(ids, vec![1, 2, 3]);
    assert_eq!(chunks(&batch, 1), vec![9]);
    assert_eq!((chunks(&batch, 2).len(), chunks(&batch, 3).len()), (4, 2));
    assert_eq!(batch.num_prefill_tokens(), 6);
    // The partially prefilled sequences continue before anything new is admitted.
    s.add(new_seq(4, vec![4; 2], 4)).unwrap();
    let batch = step(&mut s, 9);
    assert_eq!(chunks(&batch, 2).len(), 4);
    assert_eq!(chunks(&batch, 3).len(), 2);
    assert!(chunks(&batch, 4).is_empty());
}

#[test]
fn total_tokens_and_num_seqs_are_respected() {
    let mut cfg = config(false);
    cfg.max_batch_total_tokens = 12;
    cfg.max_num_seqs = 2;
    let mut s = scheduler(cfg, 32, 4);
    for id in 0..3 {
        s.add(new_seq(id, vec![5; 4], 4)).unwrap();
    }
    for _ in 0..20 {
        let batch = step(&mut s, 1);
        assert!(batch.items.len() <= 2);
        assert!(batch.num_context_tokens() <= 12);
        for seq_id in (0..3).map(SeqId) {
            if s.sequence(seq_id).is_some_and(Sequence::is_done) {
                s.finish(seq_id).unwrap();
            }
        }
    }
    assert!(!s.has_work());
    assert_eq!(s.allocator().num_free(), 32);
}

#[test]
fn preempted_sequence_resumes_with_identical_history() {
    // 4 blocks of 2 tokens: two 3-token prompts fit, but not both as they grow.
    let mut s = scheduler(config(false), 4, 2);
    s.add(new_seq(1, vec![10, 11, 12], 5)).unwrap();
    s.add(new_seq(2, vec![20, 21, 22], 5)).unwrap();
    let mut fed: HashMap<u64, Vec<(usize, Vec<u32>)>> = HashMap::new();
    let mut preempted = Vec::new();
    let mut next_token = 0;
    while s.has_work() {
        next_token += 1;
        let batch = step(&mut s, next_token);
        preempted.extend(batch.preempted.iter().map(|id| id.0));
        for item in &batch.items {
            fed.entry(item.seq_id.0)
                .or_default()
                .push((item.start_pos, item.token_ids.clone()));
        }
        for id in [1, 2] {
            if s.sequence(SeqId(id)).is_some_and(Sequence::is_done) {
                let seq = s.sequence(SeqId(id)).unwrap();
                let all: Vec<u32> = seq.all_tokens().collect();
                // Whatever was fed at a position, before or after preemption, is the
                // token the history holds there.
                for (start_pos, tokens) in &fed[&id] {
                    assert_eq!(tokens[..], all[*start_pos..start_pos + tokens.len()]);
                }
                s.finish(SeqId(id)).unwrap();
            }
        }
    }
    // The younger sequence was preempted, recomputed from position 0, and went on.
    assert!(preempted.contains(&2) && !preempted.contains(&1));
    assert!(
        fed[&2]
            .iter()
            .filter(|(start_pos, _)| *start_pos == 0)
            .count()
            >= 2
    );
    assert_eq!(s.allocator().num_used(), 0);
}

#[test]
fn recompute_keeps_outputs_and_continues_sampling() {
    let mut s = scheduler(config(false), 4, 2);
    s.add(new_seq(1, vec![1, 2, 3], 5)).unwrap();
    s.add(new_seq(2, vec![4, 5, 6], 5)).unwrap();
    let mut outputs_at_preemption = None;
    for token_id in 50.. {
        let batch = step(&mut s, token_id);
        if batch.preempted.contains(&SeqId(2)) {
            let seq = s.sequence(SeqId(2)).unwrap();
            assert_eq!((seq.num_computed_tokens, seq.num_preemptions), (0, 1));
            assert!(seq.block_table.is_empty());
            outputs_at_preemption = Some(seq.output_ids.clone());
            break;
        }
    }
    let outputs = outputs_at_preemption.expect("sequence 2 was preempted");
    assert_eq!(s.num_waiting(), 1);
    s.finish(SeqId(1)).unwrap();
    // Recompute: prompt ++ outputs, in chunks, then sampling resumes at the end.
    let mut recomputed = Vec::new();
    loop {
        let batch = step(&mut s, 99);
        let item = &batch.items[0];
        recomputed.extend(item.token_ids.clone());
        if item.sample {
            break;
        }
    }
    let expected: Vec<u32> = [4, 5, 6].into_iter().chain(outputs.clone()).collect();
    assert_eq!(recomputed, expected);
    let seq = s.sequence(SeqId(2)).unwrap();
    assert_eq!(seq.output_ids[..outputs.len()], outputs[..]);
    assert_eq!(seq.output_ids.last(), Some(&99));
}

#[test]
fn admission_never_preempts() {
    let mut s = scheduler(config(false), 4, 2);
    s.add(new_seq(1, vec![1; 4], 4)).unwrap();
    step(&mut s, 0);
    step(&mut s, 0);
    // Three blocks held; a 4-token prompt needs two and must wait.
    s.add(new_seq(2, vec![2; 4], 2)).unwrap();
    let batch = step(&mut s, 0);
    assert!(batch.preempted.is_empty());
    assert_eq!(chunks(&batch, 1).len(), 1);
    assert!(chunks(&batch, 2).is_empty());
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn prefix_cache_reuses_full_blocks_but_computes_the_last_token() {
    let mut s = scheduler(config(true), 16, 4);
    let prompt: Vec<u32> = (0..9).collect();
    s.add(new_seq(1, prompt.clone(), 1)).unwrap();
    while !s.sequence(SeqId(1)).unwrap().is_done() {
        step(&mut s, 42);
    }
    let first_table = s.sequence(SeqId(1)).unwrap().block_table.clone();
    s.finish(SeqId(1)).unwrap();
    assert_eq!(s.allocator().num_cached(), 2);

    s.add(new_seq(2, prompt.clone(), 1)).unwrap();
    let batch = s.schedule();
    let item = &batch.items[0];
    assert_eq!((item.start_pos, item.token_ids.clone()), (8, vec![8]));
    assert_eq!(item.block_table[..2], first_table[..2]);
    assert_eq!(s.allocator().prefix_stats(), (2, 4));

    // A prompt of exactly two blocks reuses only the first, so one token remains.
    s.add(new_seq(3, prompt[..8].to_vec(), 1)).unwrap();
    let batch = s.schedule();
    let item = batch
        .items
        .iter()
        .find(|item| item.seq_id == SeqId(3))
        .unwrap();
    assert_eq!(item.start_pos, 4);
    assert_eq!(s.allocator().ref_count(first_table[0]), 2);
}

#[test]
fn a_sequence_computing_its_whole_prompt_skips_the_prefix_cache() {
    let mut s = scheduler(config(true), 16, 4);
    let prompt: Vec<u32> = (0..9).collect();
    s.add(new_seq(1, prompt.clone(), 1)).unwrap();
    while !s.sequence(SeqId(1)).unwrap().is_done() {
        step(&mut s, 42);
    }
    s.finish(SeqId(1)).unwrap();
    assert_eq!(s.allocator().num_cached(), 2);

    s.add(new_seq(2, prompt.clone(), 1)).unwrap();
    assert!(s.compute_whole_prompt(SeqId(2)));
    let batch = s.schedule();
    // From the first token (the cached run above started at 8), in this config's chunks.
    assert_eq!(batch.items[0].start_pos, 0);
    assert_eq!(batch.items[0].token_ids, prompt[..4]);
    assert_eq!(
        s.allocator().prefix_stats().0,
        0,
        "no block taken from the cache"
    );
    // Once admitted, the choice is made.
    assert!(!s.compute_whole_prompt(SeqId(2)));
}

#[test]
fn generated_tokens_fill_and_register_blocks() {
    let mut s = scheduler(config(true), 16, 2);
    s.add(new_seq(1, vec![1, 2, 3], 4)).unwrap();
    while !s.sequence(SeqId(1)).unwrap().is_done() {
        step(&mut s, 5);
    }
    // Tokens 1 2 3 5 5 5 (+ the last 5, never fed): three full blocks computed.
    let hashes = crate::kv::prefix::block_hashes(&[1, 2, 3, 5, 5, 5], 2);
    assert_eq!(s.allocator().count_cached_prefix(&hashes), 3);
}

#[test]
fn cancel_in_any_state_frees_blocks_and_commit_ignores_it() {
    let mut s = scheduler(config(true), 8, 2);
    s.add(new_seq(1, vec![1; 6], 3)).unwrap();
    s.add(new_seq(2, vec![2; 3], 3)).unwrap();
    let batch = s.schedule();
    assert_eq!(s.num_running(), 2);
    s.finish(SeqId(1)).unwrap();
    s.commit(&batch, &[(SeqId(2), 7)]);
    assert!(s.sequence(SeqId(1)).is_none());
    assert_eq!(s.allocator().num_used(), 2);
    s.add(new_seq(3, vec![3; 3], 3)).unwrap();
    s.finish(SeqId(3)).unwrap();
    s.finish(SeqId(2)).unwrap();
    assert!(matches!(
        s.finish(SeqId(2)),
        Err(EngineError::UnknownSequence(SeqId(2)))
    ));
    assert_eq!((s.num_waiting(), s.num_running()), (0, 0));
    assert_eq!(s.allocator().num_free(), 8);
    assert!(!s.has_work());
}

#[test]
fn add_validates_its_input() {
    let mut s = scheduler(config(false), 4, 4);
    s.add(new_seq(1, vec![1], 1)).unwrap();
    assert!(matches!(
        s.add(new_seq(1, vec![1], 1)),
        Err(EngineError::DuplicateSequence { seq_id: SeqId(1) })
    ));
    assert!(matches!(
        s.add(new_seq(2, vec![], 1)),
        Err(EngineError::InvalidParameter {
            field: "prompt_ids",
            ..
        })
    ));
    assert!(matches!(
        s.add(new_seq(2, vec![1], 0)),
        Err(EngineError::InvalidParameter {
            field: "max_new_tokens",
            ..
        })
    ));
    assert!(matches!(
        s.add(new_seq(2, vec![1; 10], 7)),
        Err(EngineError::PromptTooLong {
            num_tokens: 17,
            limit: 16
        })
    ));
    s.add(new_seq(2, vec![1; 10], 6)).unwrap();
}

#[test]
fn zero_budgets_are_rejected_or_raised() {
    let mut cfg = config(false);
    cfg.max_num_seqs = 0;
    assert!(matches!(
        Scheduler::try_new(cfg.clone(), BlockAllocator::new(4, 4)),
        Err(EngineError::InvalidParameter {
            field: "max_num_seqs",
            ..
        })
    ));
    let s = Scheduler::new(cfg, BlockAllocator::new(4, 4));
    assert_eq!(s.config().max_num_seqs, 1);
}

#[test]
fn stats_report_blocks_and_prefix_hits() {
    let mut s = scheduler(config(true), 8, 2);
    s.add(new_seq(1, vec![1; 4], 2)).unwrap();
    step(&mut s, 3);
    let stats = s.stats();
    assert_eq!(stats.num_running, 1);
    assert_eq!(stats.num_blocks_used + stats.num_blocks_free, 8);
    assert_eq!(stats.num_blocks_used, 2);
}
