//! One simulated node: the engine's real [`Scheduler`] (its block allocator, chunked prefill,
//! preemption and prefix cache) with a step in progress on the virtual clock, plus what the
//! gateway knows of it. It does what the engine's step loop does with a batch, minus the
//! model: `schedule()` the batch, spend the cost model's time on it, `commit()` it.

use engine::ids::{BlockId, SeqId};
use engine::kv::allocator::BlockAllocator;
use engine::scheduler::{Batch, NewSequence, Scheduler};
use routing_policy::Candidate;

use crate::cluster::SimCluster;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeRole {
    Prefill,
    /// Decodes; prefills locally too when the gateway asks (colocated).
    Decode,
}

/// The batch a node is computing, and when it started.
#[derive(Debug)]
pub(crate) struct Step {
    pub(crate) batch: Batch,
    pub(crate) start_s: f64,
}

pub(crate) struct SimNode {
    pub(crate) node_id: String,
    pub(crate) role: NodeRole,
    pub(crate) sched: Scheduler,
    pub(crate) step: Option<Step>,
    /// Requests the gateway sent here and has not seen finish (its `in_flight`).
    pub(crate) in_flight: u64,
    /// Prefill nodes: prompt tokens admitted and not yet answered, as they publish it.
    pub(crate) queued_prefill_tokens: u64,
    /// Decode nodes: blocks held for pushes not yet arrived, and the most they may hold.
    pub(crate) reserved_blocks: usize,
    max_reserved_blocks: usize,
    /// Prefill nodes: when the KV link finishes the transfers already queued on it.
    pub(crate) link_free_s: f64,
}

impl SimNode {
    pub(crate) fn new(cluster: &SimCluster, role: NodeRole, index: usize) -> Self {
        let blocks = cluster.kv_blocks();
        let block_size = cluster.cost.node.block_size;
        let cfg = cluster.node.scheduler_config(blocks, block_size);
        let prefix = match role {
            NodeRole::Prefill => "prefill",
            NodeRole::Decode => "decode",
        };
        SimNode {
            // Zero-padded, so the policies' tie-break by id follows the index.
            node_id: format!("{prefix}-{index:04}"),
            role,
            sched: Scheduler::new(cfg, BlockAllocator::new(blocks, block_size)),
            step: None,
            in_flight: 0,
            queued_prefill_tokens: 0,
            reserved_blocks: 0,
            max_reserved_blocks: (blocks as f64 * cluster.node.reservation_fraction) as usize,
            link_free_s: 0.0,
        }
    }

    /// The figures the gateway's routing policy ranks this node by. They are exact and
    /// current; the real gateway's come from load published up to 500 ms ago, plus its own
    /// in-flight counts.
    pub(crate) fn candidate(&self, prompt_hashes: &[u64]) -> Candidate {
        let a = self.sched.allocator();
        Candidate {
            node_id: self.node_id.clone(),
            free_blocks: a.num_free() as u64,
            total_blocks: a.num_total() as u64,
            running_sequences: self.sched.num_running() as u64,
            queued_prefill_tokens: self.queued_prefill_tokens,
            in_flight: self.in_flight,
            cached_prefix_blocks: a.count_cached_prefix(prompt_hashes),
        }
    }

    /// Sets blocks aside for a prompt a prefill node will push, as `Engine::reserve` does:
    /// `None` when the reservation share or the free blocks are exhausted.
    pub(crate) fn reserve(&mut self, prompt_tokens: usize) -> Option<Vec<BlockId>> {
        let n = prompt_tokens.div_ceil(self.sched.allocator().block_size());
        let free = self.sched.allocator().num_free();
        if self.reserved_blocks + n > self.max_reserved_blocks || n > free {
            return None;
        }
        let blocks = self.sched.allocator_mut().allocate_n(n).ok()?;
        self.reserved_blocks += n;
        Some(blocks)
    }

    /// The pushed KV arrived: the sequence joins the running batch with its first token, as
    /// `Engine::activate` does; or, with nothing left to decode, its blocks are freed.
    pub(crate) fn activate(
        &mut self,
        seq: NewSequence,
        blocks: Vec<BlockId>,
        first_token: u32,
    ) -> bool {
        self.reserved_blocks -= blocks.len();
        if seq.max_new_tokens < 2 {
            self.free(blocks);
            return false;
        }
        match self.sched.add_prefilled(seq, blocks.clone(), first_token) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "a prefilled sequence was refused");
                self.free(blocks);
                false
            }
        }
    }

    fn free(&mut self, blocks: Vec<BlockId>) {
        for b in blocks {
            self.sched
                .allocator_mut()
                .free(b)
                .expect("reserved blocks are held once");
        }
    }

    /// Plans the next step if the node is idle and has work; the batch, or `None`.
    pub(crate) fn start_step(&mut self, now_s: f64) -> Option<&Batch> {
        if self.step.is_some() || !self.sched.has_work() {
            return None;
        }
        let batch = self.sched.schedule();
        if batch.is_empty() {
            return None;
        }
        self.step = Some(Step {
            batch,
            start_s: now_s,
        });
        self.step.as_ref().map(|s| &s.batch)
    }

    /// Commits the step in progress, every sampling item getting token `token_id`; returns
    /// the step and the sequences that got a token.
    pub(crate) fn finish_step(&mut self, token_id: u32) -> (Step, Vec<SeqId>) {
        let step = self.step.take().expect("a step is in progress");
        let sampled: Vec<(SeqId, u32)> = step
            .batch
            .items
            .iter()
            .filter(|i| i.sample)
            .map(|i| (i.seq_id, token_id))
            .collect();
        self.sched.commit(&step.batch, &sampled);
        let ids = sampled.into_iter().map(|(id, _)| id).collect();
        (step, ids)
    }
}
