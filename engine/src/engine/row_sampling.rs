//! A step's unconstrained rows sampled on every kernel thread at once.
//!
//! Sampling reads a whole vocabulary row (49,152 logits for SmolLM2) for the maximum, the
//! log-sum-exp and any top logprobs. At batch 64 those passes took 3% of a decode step on the
//! engine thread while the kernel threads waited. Rows under a grammar keep to the engine
//! thread: their matchers are advanced in order, and masking needs the engine's scratch row.

use std::collections::HashMap;
use std::sync::OnceLock;

use super::prompt_logprobs::RowUse;
use super::{penalty_context, SeqState};
use crate::ids::SeqId;
use crate::sampling::{sample, SampledToken, SamplingParams};
use crate::scheduler::{BatchItem, Scheduler};

/// Rows below which one thread samples faster than a hand-off to the pool.
const PARALLEL_ROWS: usize = 4;

/// One row's sampling inputs.
struct Job<'a> {
    row: usize,
    params: &'a SamplingParams,
    context: Vec<u32>,
    position: u64,
}

/// The sampled token of every row that samples without a grammar (`None` for the others:
/// prompt-logprob rows, constrained rows, cancelled sequences). Each row gives exactly what
/// [`sample`] gives it alone, so the output does not depend on the batch or the threads.
pub(super) fn sample_unconstrained(
    row_uses: &[RowUse],
    items: &[BatchItem],
    states: &HashMap<SeqId, SeqState>,
    scheduler: &Scheduler,
    rows: &[f32],
    vocab: usize,
) -> Vec<Option<SampledToken>> {
    let jobs: Vec<Job<'_>> = row_uses
        .iter()
        .enumerate()
        .filter_map(|(row, row_use)| {
            let RowUse::Sample(index) = *row_use else {
                return None;
            };
            let item = &items[index];
            let state = states.get(&item.seq_id)?;
            state.grammar.is_none().then(|| Job {
                row,
                params: &state.sampling,
                context: penalty_context(scheduler, item.seq_id, &state.sampling),
                position: item.context_len as u64,
            })
        })
        .collect();
    let done: Vec<OnceLock<SampledToken>> = (0..row_uses.len()).map(|_| OnceLock::new()).collect();
    let run = |job: &Job<'_>| {
        let logits = &rows[job.row * vocab..(job.row + 1) * vocab];
        let token = sample(logits, job.params, &job.context, job.position);
        // Each job has a row of its own: the cell is empty.
        let _ = done[job.row].set(token);
    };
    if jobs.len() < PARALLEL_ROWS {
        jobs.iter().for_each(run);
    } else {
        let tasks = kernels::pool_threads().min(jobs.len());
        let per = jobs.len().div_ceil(tasks);
        kernels::parallel_for(tasks, &|task| {
            jobs.iter().skip(task * per).take(per).for_each(&run);
        });
    }
    done.into_iter().map(OnceLock::into_inner).collect()
}
