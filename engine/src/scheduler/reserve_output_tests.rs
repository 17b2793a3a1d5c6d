//! Admission with [`Scheduler::set_reserve_output`]: a waiting sequence, new or preempted,
//! is admitted only while every running sequence and it fit at their longest, so sequences
//! that grow never preempt each other (the storm of issue 31 item 3, on the engine's own
//! admission: colocated prompts and recomputes).

use super::*;

fn reserving(reserve_output: bool) -> Scheduler {
    let cfg = SchedulerConfig {
        max_batch_prefill_tokens: 64,
        max_batch_total_tokens: 64,
        max_num_seqs: 8,
        max_prefill_chunk_tokens: 64,
        enable_prefix_caching: false,
    };
    // 8 blocks of 4 tokens.
    let mut s = Scheduler::try_new(cfg, BlockAllocator::new(8, 4)).expect("valid budgets");
    s.set_reserve_output(reserve_output);
    s
}

fn new_seq(id: u64, prompt_len: usize, max_new_tokens: usize) -> NewSequence {
    NewSequence {
        seq_id: SeqId(id),
        prompt_ids: vec![id as u32; prompt_len],
        max_new_tokens,
    }
}

/// Runs every sequence to its end; the preemptions on the way and the most sequences that
/// ran at once.
fn run(s: &mut Scheduler, ids: &[u64]) -> (usize, usize) {
    let (mut preempted, mut most_running) = (0, 0);
    for _ in 0..1_000 {
        if !s.has_work() {
            break;
        }
        let batch = s.schedule();
        preempted += batch.preempted.len();
        most_running = most_running.max(s.num_running());
        let sampled: Vec<(SeqId, u32)> = batch
            .items
            .iter()
            .filter(|item| item.sample)
            .map(|item| (item.seq_id, 1))
            .collect();
        s.commit(&batch, &sampled);
        for &id in ids {
            if s.sequence(SeqId(id)).is_some_and(Sequence::is_done) {
                s.finish(SeqId(id)).expect("tracked");
            }
        }
    }
    assert!(!s.has_work(), "every sequence ends");
    assert_eq!(s.allocator().num_used(), 0);
    (preempted, most_running)
}

/// Four prompts of one block that grow to four blocks each: all four fit now (4 of 8
/// blocks), two fit at their longest (16 tokens = 4 blocks each).
#[test]
fn admission_holds_room_for_growth_and_nothing_is_preempted() {
    let ids = [1, 2, 3, 4];
    let mut s = reserving(true);
    for &id in &ids {
        s.add(new_seq(id, 4, 12)).expect("adds");
    }
    let batch = s.schedule();
    assert_eq!(batch.items.len(), 2, "two fit at their longest");
    assert_eq!(s.num_waiting(), 2);
    let (preempted, most_running) = run(&mut s, &ids);
    assert_eq!((preempted, most_running), (0, 2));

    // By the prompt alone all four are admitted, and their growth preempts.
    let mut s = reserving(false);
    for &id in &ids {
        s.add(new_seq(id, 4, 12)).expect("adds");
    }
    let (preempted, most_running) = run(&mut s, &ids);
    assert!(
        preempted > 0 && most_running == 4,
        "{preempted} {most_running}"
    );
}

/// A preempted sequence's recompute waits for room at its longest too: it is not readmitted
/// into blocks that the running sequences' growth will take back.
#[test]
fn a_recompute_waits_until_it_fits_at_its_longest() {
    let mut s = reserving(true);
    // Three prefilled sequences (a decode node's, admitted elsewhere) that outgrow 8 blocks:
    // the youngest is preempted. When the first ends, its recompute fits in the free blocks
    // but not beside the second at its longest (the whole cache), whose growth would
    // preempt it again.
    for (id, max_new_tokens) in [(1, 8), (2, 28), (3, 12)] {
        let blocks = s.allocator_mut().allocate_n(1).expect("free");
        s.add_prefilled(new_seq(id, 4, max_new_tokens), blocks, 1)
            .expect("adds");
    }
    let mut preempted = Vec::new();
    let mut recomputed_beside = None;
    for _ in 0..200 {
        if !s.has_work() {
            break;
        }
        let batch = s.schedule();
        preempted.extend(batch.preempted.iter().copied());
        for item in batch.items.iter().filter(|i| i.start_pos == 0) {
            // A recompute starts at position 0: who runs beside it then?
            recomputed_beside.get_or_insert_with(|| (item.seq_id, running_at_longest(&s)));
        }
        let sampled: Vec<(SeqId, u32)> = batch
            .items
            .iter()
            .filter(|item| item.sample)
            .map(|item| (item.seq_id, 1))
            .collect();
        s.commit(&batch, &sampled);
        for id in [1, 2, 3] {
            if s.sequence(SeqId(id)).is_some_and(Sequence::is_done) {
                s.finish(SeqId(id)).expect("tracked");
            }
        }
    }
    assert!(!s.has_work());
    assert!(
        !preempted.is_empty(),
        "three prefilled sequences outgrow 8 blocks"
    );
    let (seq_id, committed) = recomputed_beside.expect("a preempted one recomputes");
    assert!(preempted.contains(&seq_id));
    // Every sequence running with the recompute, it included, fits at its longest; so it
    // was preempted once, not again and again.
    assert!(committed <= 8, "{committed} blocks committed");
    assert_eq!(preempted, vec![seq_id]);
}

/// Blocks the running sequences hold at their longest (blocks of 4 tokens).
fn running_at_longest(s: &Scheduler) -> usize {
    [1, 2, 3]
        .into_iter()
        .filter_map(|id| s.sequence(SeqId(id)))
        .filter(|seq| seq.status() == SequenceStatus::Running)
        .map(|seq| (seq.prompt_ids.len() + seq.max_new_tokens).div_ceil(4))
        .sum()
}
