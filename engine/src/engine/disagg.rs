//! The engine's side of disaggregated serving.
//!
//! Decode node: [`Engine::reserve`] sets blocks aside for a prompt a prefill node will push,
//! the transferred bytes land through [`KvCache::import_blocks`], and [`Engine::activate`]
//! joins the sequence to the running batch with the first token the prefill node sampled.
//! Prefill node: [`Engine::add_prefill_request`] runs a prompt and leaves after its first
//! token, and [`Engine::step_with_layer_hook`] hands each finished layer to the caller.

use super::{Engine, Request};
use crate::error::{EngineError, Result};
use crate::ids::{BlockId, SeqId};
use crate::kv::cache::KvCache;
use crate::sampling::SampledToken;
use crate::scheduler::{Batch, NewSequence};
use crate::stopping::FinishReason;

/// One layer's KV is in the cache for every sequence of the step.
pub struct LayerDone<'a> {
    pub layer: usize,
    pub cache: &'a mut KvCache,
    /// Sequences whose prompt completes in this step, with the blocks holding it.
    pub completing: &'a [(SeqId, Vec<BlockId>)],
}

/// Called after each layer of a step in which some prompt completes.
pub type LayerHook<'a> = dyn FnMut(LayerDone<'_>) -> Result<()> + 'a;

/// A request waiting for its KV to arrive.
pub(super) struct Reservation {
    request: Request,
    blocks: Vec<BlockId>,
}

impl Engine {
    /// Decode node: validates `req` and sets aside blocks for its prompt's KV. `OutOfBlocks`
    /// means busy: the reservation pool or the free blocks are exhausted.
    pub fn reserve(&mut self, req: Request) -> Result<Vec<BlockId>> {
        self.check_one_kv_group()?;
        self.validate(&req)?;
        if let Some(spec) = &req.grammar {
            // Fail now rather than when the KV has arrived; the constraint is built again then.
            self.compile_grammar(
                spec,
                &req.prompt_ids[req.prompt_ids.len() - req.num_generated..],
            )?;
        }
        let n = req.prompt_ids.len().div_ceil(self.block_size);
        let held: usize = self.reserved.values().map(|r| r.blocks.len()).sum();
        let free = self.scheduler.allocator().num_free();
        if held + n > self.max_reserved_blocks || n > free {
            return Err(EngineError::OutOfBlocks {
                needed: n,
                free: free.min(self.max_reserved_blocks.saturating_sub(held)),
            });
        }
        let blocks = self.scheduler.allocator_mut().allocate_n(n)?;
        self.reserved.insert(
            req.seq_id,
            Reservation {
                request: req,
                blocks: blocks.clone(),
            },
        );
        Ok(blocks)
    }

    /// Frees a reservation's blocks (lease expiry, cancellation, failed transfer).
    pub fn release_reservation(&mut self, seq_id: SeqId) -> bool {
        let Some(r) = self.reserved.remove(&seq_id) else {
            return false;
        };
        for b in r.blocks {
            if let Err(e) = self.scheduler.allocator_mut().free(b) {
                tracing::error!(%seq_id, error = %e, "freeing a reserved block");
            }
        }
        true
    }

    /// Blocks held by reservations.
    pub fn num_reserved_blocks(&self) -> usize {
        self.reserved.values().map(|r| r.blocks.len()).sum()
    }

    pub fn num_reservations(&self) -> usize {
        self.reserved.len()
    }

    /// Decode node: the KV of `seq_id`'s prompt is in its reserved blocks and the prefill node
    /// sampled `first`. Runs the first token through this node's stop and text state (its
    /// text was already sent by the prefill node) and joins the running batch. Returns the
    /// finish reason when the first token already ends the request (its blocks are freed).
    pub fn activate(&mut self, seq_id: SeqId, first: SampledToken) -> Result<Option<FinishReason>> {
        let r = self
            .reserved
            .remove(&seq_id)
            .ok_or(EngineError::UnknownSequence(seq_id))?;
        let max_new_tokens = r.request.remaining_new_tokens();
        let new_seq = NewSequence {
            seq_id,
            prompt_ids: r.request.prompt_ids.clone(),
            max_new_tokens,
        };
        if let Err(e) = self.track(r.request, false) {
            for b in r.blocks {
                self.scheduler.allocator_mut().free(b)?;
            }
            return Err(e);
        }
        let ends_now = max_new_tokens < 2;
        if !ends_now {
            if let Err(e) = self
                .scheduler
                .add_prefilled(new_seq, r.blocks.clone(), first.token_id)
            {
                self.states.remove(&seq_id);
                for b in r.blocks {
                    self.scheduler.allocator_mut().free(b)?;
                }
                return Err(e);
            }
        } else {
            // Nothing left to decode: give the blocks back before emitting.
            for b in r.blocks {
                self.scheduler.allocator_mut().free(b)?;
            }
        }
        let state = self.states.get_mut(&seq_id).expect("tracked just above");
        // The prefill node computed the prompt and reported its logprobs.
        state.prompt_logprobs = None;
        state.num_generated += 1;
        let mut finish = state
            .stopping
            .check_token(first.token_id, state.num_generated);
        let stop_token = finish == Some(FinishReason::Eos);
        if !stop_token {
            // The prefill node sampled under the same grammar; follow it past that token.
            if let Some(grammar) = &mut state.grammar {
                match grammar.accept(first.token_id) {
                    Err(e) => {
                        // Not a finish that did not happen: the request fails.
                        tracing::warn!(%seq_id, error = %e, "first token outside the grammar");
                        self.states.remove(&seq_id);
                        if !ends_now {
                            self.scheduler.finish(seq_id)?;
                        }
                        return Err(EngineError::Grammar {
                            seq_id,
                            reason: e.to_string(),
                        });
                    }
                    Ok(()) if grammar.is_complete() => finish = Some(FinishReason::Eos),
                    Ok(()) => {}
                }
            }
        }
        if !stop_token && state.text.push(first.token_id)?.stopped {
            finish = Some(FinishReason::Stop);
        }
        if ends_now && finish.is_none() {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() {
            self.states.remove(&seq_id);
            if !ends_now {
                self.scheduler.finish(seq_id)?;
            }
        }
        Ok(finish)
    }

    /// Prefill node: queues `req` to compute its prompt and sample one token. The sequence
    /// leaves the engine after that token (its blocks stay in the prefix cache).
    pub fn add_prefill_request(&mut self, req: Request) -> Result<()> {
        self.check_one_kv_group()?;
        self.validate(&req)?;
        let new_seq = NewSequence {
            seq_id: req.seq_id,
            prompt_ids: req.prompt_ids.clone(),
            max_new_tokens: 1,
        };
        self.admit(new_seq, req, true)
    }

    /// Items of `plan` whose chunk ends their prompt, with their blocks.
    pub(super) fn completing_prompts(&self, plan: &Batch) -> Vec<(SeqId, Vec<BlockId>)> {
        plan.items
            .iter()
            .filter(|i| {
                i.sample
                    && self
                        .scheduler
                        .sequence(i.seq_id)
                        .is_some_and(|s| s.output_ids.is_empty())
            })
            .map(|i| (i.seq_id, i.block_table.clone()))
            .collect()
    }
}

impl Engine {
    /// The push and the import carry one block table a sequence: an engine whose sliding
    /// layers free their blocks ([`Engine::new`]) cannot take part; [`Engine::with_full_kv`]
    /// builds one that can.
    fn check_one_kv_group(&self) -> Result<()> {
        let groups = self.cache.groups().num_groups();
        if groups > 1 {
            return Err(EngineError::InvalidConfig {
                reason: format!(
                    "this engine keeps {groups} KV layer groups (sliding windows free their \
                     blocks); a node that pushes or imports KV is built with Engine::with_full_kv"
                ),
            });
        }
        Ok(())
    }

    /// Whether `seq_id` holds a reservation that has not been activated or released.
    pub fn is_reserved(&self, seq_id: SeqId) -> bool {
        self.reserved.contains_key(&seq_id)
    }
}
