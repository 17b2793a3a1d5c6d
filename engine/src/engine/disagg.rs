//! The engine's side of disaggregated serving.
//!
//! Decode node: [`Engine::reserve`] sets blocks aside for a prompt a prefill node will push,
//! the transferred bytes land through [`KvCache::import_blocks`], and [`Engine::activate`]
//! joins the sequence to the running batch with the first token the prefill node sampled.
//! Prefill node: [`Engine::add_prefill_request`] runs a prompt and leaves after its first
//! token, and [`Engine::step_with_layer_hook`] hands each finished layer to the caller.
//!
//! Sliding-window layers: both nodes free the blocks a window has passed
//! ([`crate::kv::groups`]). A sliding layer's push carries only the blocks its window reads at
//! the prompt's last position ([`first_pushed_block`]: the first decode query's window), which
//! are exactly the blocks the decode node reserves for it; the nodes agree on the windows
//! through their [`KvLayout`]s (`windows`).

use super::{Engine, Request};
use crate::error::{EngineError, Result};
use crate::ids::{BlockId, SeqId};
use crate::kv::cache::KvCache;
use crate::kv::groups::{first_pushed_block, NO_BLOCK};
use crate::sampling::SampledToken;
use crate::scheduler::{Batch, NewSequence};
use crate::stopping::FinishReason;
use kv_types::KvLayout;

/// One layer's KV is in the cache for every sequence of the step.
pub struct LayerDone<'a> {
    pub layer: usize,
    pub cache: &'a mut KvCache,
    /// Sequences whose prompt completes in this step, with the blocks holding it (the
    /// full-attention group's: every block of the prompt).
    pub completing: &'a [(SeqId, Vec<BlockId>)],
    /// For each of `completing`, in order: its sliding-window groups' tables.
    pub windows: &'a [CompletingWindows],
}

/// A completing prompt's length and its sliding-window groups' block tables, as long as its
/// full-attention table, with [`NO_BLOCK`] before the window of the step's first query.
#[derive(Debug, Clone, Default)]
pub struct CompletingWindows {
    pub prompt_len: usize,
    pub tables: Vec<Vec<BlockId>>,
}

/// The prompts a step completes: what [`LayerDone`] lends out.
pub(super) struct Completing {
    pub(super) tables: Vec<(SeqId, Vec<BlockId>)>,
    pub(super) windows: Vec<CompletingWindows>,
}

impl Completing {
    pub(super) fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }
}

impl<'a> LayerDone<'a> {
    /// What this layer pushes for `completing[index]`: the index of its first block in the
    /// prompt's block list, and the blocks of this node's cache holding them. A full-attention
    /// layer pushes every block; a sliding-window layer those from [`first_pushed_block`] on,
    /// which the decode node reserves for it ([`Engine::import_layer`]).
    pub fn pushed_blocks(&self, index: usize) -> Result<(usize, &'a [BlockId])> {
        let (completing, windows): (&'a [_], &'a [CompletingWindows]) =
            (self.completing, self.windows);
        let blocks = &completing[index].1;
        let group = self.cache.groups().group_of(self.layer);
        if group == 0 {
            return Ok((0, blocks));
        }
        let w = &windows[index];
        let window = self.cache.groups().windows()[group - 1];
        let block_size = self.cache.layout().block_size as usize;
        let from = first_pushed_block(w.prompt_len, window, block_size);
        match w.tables[group - 1].get(from..blocks.len()) {
            Some(ids) if !ids.is_empty() && !ids.contains(&NO_BLOCK) => Ok((from, ids)),
            _ => Err(EngineError::InvalidConfig {
                reason: format!(
                    "layer {}: the window of a {}-token prompt is not held from block {from}",
                    self.layer, w.prompt_len
                ),
            }),
        }
    }
}

/// Called after each layer of a step in which some prompt completes: at once on a host cache,
/// and once the next layer is computed and this one staged on a device cache
/// (`engine/layer_push.rs`).
pub type LayerHook<'a> = dyn FnMut(LayerDone<'_>) -> Result<()> + 'a;

/// A request waiting for its KV to arrive.
pub(super) struct Reservation {
    request: Request,
    blocks: Vec<BlockId>,
    /// Leading `blocks` linked from the prefix cache: they hold their KV already, and the push
    /// fills the rest.
    cached: usize,
    /// Per sliding-window group: the index of the first block its layers receive (the first
    /// decode query's window), and the blocks that take them.
    windows: Vec<(usize, Vec<BlockId>)>,
}

impl Engine {
    /// Decode node: validates `req` and sets aside blocks for its prompt's KV. `OutOfBlocks`
    /// means busy: the reservation pool or the free blocks are exhausted. The blocks returned
    /// are the full-attention group's; a sliding-window group takes only the blocks of the
    /// first decode query's window ([`import_layer`](Self::import_layer)).
    pub fn reserve(&mut self, req: Request) -> Result<Vec<BlockId>> {
        self.reserve_blocks(req, false).map(|(blocks, _)| blocks)
    }

    /// [`reserve`](Self::reserve), linking the leading blocks of the prompt this node holds in
    /// its prefix cache (a previous turn of the conversation) into the reservation, so that a
    /// prefill node pushes only the rest. Returns the blocks of the whole prompt and how many
    /// of them were linked: the push fills `blocks[cached..]`
    /// ([`import_layer`](Self::import_layer)). The last block is always left to push. Nothing
    /// is linked on an engine with sliding-window groups or without prefix caching.
    pub fn reserve_linking(&mut self, req: Request) -> Result<(Vec<BlockId>, usize)> {
        self.reserve_blocks(req, true)
    }

    fn reserve_blocks(&mut self, req: Request, link: bool) -> Result<(Vec<BlockId>, usize)> {
        self.validate(&req)?;
        if let Some(spec) = &req.grammar {
            // Fail now rather than when the KV has arrived; the constraint is built again then.
            self.compile_grammar(
                spec,
                &req.prompt_ids[req.prompt_ids.len() - req.num_generated..],
            )?;
        }
        let n = req.prompt_ids.len().div_ceil(self.block_size);
        let linkable = link
            && self.cache.groups().windows().is_empty()
            && self.scheduler.config().enable_prefix_caching;
        let mut hashes = match linkable {
            true => crate::kv::prefix::block_hashes(&req.prompt_ids, self.block_size),
            false => Vec::new(),
        };
        // A push always carries the last block: every layer then has a frame, and the
        // prefill node's first token follows the KV it pushed.
        hashes.truncate((req.prompt_ids.len() - 1) / self.block_size);
        let alloc = self.scheduler.allocator();
        let cached = alloc.count_cached_prefix(&hashes);
        // Reviving cached blocks takes them out of the free count too.
        let revived = hashes[..cached]
            .iter()
            .filter(|&&h| alloc.lookup(h).is_some_and(|id| alloc.ref_count(id) == 0))
            .count();
        let held: usize = self.reserved.values().map(|r| r.blocks.len()).sum();
        let free = alloc.num_free();
        if held + n > self.max_reserved_blocks || n - cached + revived > free {
            return Err(EngineError::OutOfBlocks {
                needed: n - cached + revived,
                free: free.min(self.max_reserved_blocks.saturating_sub(held)),
            });
        }
        let windows: Vec<(usize, usize)> = self
            .cache
            .groups()
            .windows()
            .iter()
            .map(|&w| first_pushed_block(req.prompt_ids.len(), w, self.block_size))
            .map(|from| (from, n - from))
            .collect();
        for (g, &(_, k)) in windows.iter().enumerate() {
            let free = self.scheduler.window_allocator_mut(g + 1).num_free();
            if k > free {
                return Err(EngineError::OutOfBlocks { needed: k, free });
            }
        }
        let alloc = self.scheduler.allocator_mut();
        let mut blocks = alloc.acquire_cached_prefix(&hashes[..cached]);
        debug_assert_eq!(blocks.len(), cached);
        alloc.count_prefix_misses(hashes.len() - cached);
        blocks.extend(alloc.allocate_n(n - cached)?);
        let windows = windows
            .into_iter()
            .enumerate()
            .map(|(g, (from, k))| {
                let pool = self.scheduler.window_allocator_mut(g + 1);
                (from, pool.allocate_n(k).expect("checked against num_free"))
            })
            .collect();
        self.reserved.insert(
            req.seq_id,
            Reservation {
                request: req,
                blocks: blocks.clone(),
                cached,
                windows,
            },
        );
        Ok((blocks, cached))
    }

    /// Decode node: one layer's pushed KV for reservation `seq_id`, as the prefill node
    /// exported it over the reservation's blocks to fill ([`KvCache::export_blocks`] layout;
    /// the blocks after its linked prefix). A sliding-window layer keeps only the blocks of
    /// the first decode query's window: its payload covers those blocks alone (what a prefill
    /// node pushes, [`LayerDone::pushed_blocks`]) or every block of the prompt, whose head is
    /// dropped. Any other length is refused.
    pub fn import_layer(&mut self, seq_id: SeqId, layer: usize, payload: &[u8]) -> Result<()> {
        let r = self
            .reserved
            .get(&seq_id)
            .ok_or(EngineError::UnknownSequence(seq_id))?;
        let group = match layer < self.cache.num_layers() {
            true => self.cache.groups().group_of(layer),
            false => 0, // import_blocks names the bad layer
        };
        if group == 0 {
            return self
                .cache
                .import_blocks(layer, &r.blocks[r.cached..], payload);
        }
        let (from, blocks) = &r.windows[group - 1];
        let layout = self.cache.layout();
        if layout.layer_payload_bytes(blocks.len()) == Some(payload.len() as u64) {
            return self.cache.import_blocks(layer, blocks, payload);
        }
        let suffix = window_suffix(payload, r.blocks.len(), *from, &layout)?;
        self.cache.import_blocks(layer, blocks, &suffix)
    }

    /// Frees every block a reservation holds, in every group.
    fn free_reserved(&mut self, blocks: Vec<BlockId>, windows: Vec<(usize, Vec<BlockId>)>) {
        for b in blocks {
            if let Err(e) = self.scheduler.allocator_mut().free(b) {
                tracing::error!(error = %e, "freeing a reserved block");
            }
        }
        for (g, (_, ids)) in windows.into_iter().enumerate() {
            for b in ids {
                if let Err(e) = self.scheduler.window_allocator_mut(g + 1).free(b) {
                    tracing::error!(error = %e, "freeing a reserved window block");
                }
            }
        }
    }

    /// Frees a reservation's blocks (lease expiry, cancellation, failed transfer).
    pub fn release_reservation(&mut self, seq_id: SeqId) -> bool {
        let Some(r) = self.reserved.remove(&seq_id) else {
            return false;
        };
        self.free_reserved(r.blocks, r.windows);
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
            self.free_reserved(r.blocks, r.windows);
            return Err(e);
        }
        let ends_now = max_new_tokens < 2;
        if !ends_now {
            let window_tables = r
                .windows
                .iter()
                .map(|(from, ids)| {
                    let mut table = vec![NO_BLOCK; *from];
                    table.extend_from_slice(ids);
                    table
                })
                .collect();
            if let Err(e) = self.scheduler.add_prefilled_windows(
                new_seq,
                r.blocks.clone(),
                window_tables,
                first.token_id,
            ) {
                self.states.remove(&seq_id);
                self.free_reserved(r.blocks, r.windows);
                return Err(e);
            }
        } else {
            // Nothing left to decode: give the blocks back before emitting.
            self.free_reserved(r.blocks, r.windows);
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
        self.validate(&req)?;
        let new_seq = NewSequence {
            seq_id: req.seq_id,
            prompt_ids: req.prompt_ids.clone(),
            max_new_tokens: 1,
        };
        self.admit(new_seq, req, true)
    }

    /// Items of `plan` whose chunk ends their prompt, with their blocks in every group.
    pub(super) fn completing_prompts(&self, plan: &Batch) -> Completing {
        let items = plan.items.iter().filter(|i| {
            i.sample
                && self
                    .scheduler
                    .sequence(i.seq_id)
                    .is_some_and(|s| s.output_ids.is_empty())
        });
        let (tables, windows) = items
            .map(|i| {
                let windows = CompletingWindows {
                    // The chunk ends the prompt.
                    prompt_len: i.context_len,
                    tables: i.window_tables.clone(),
                };
                ((i.seq_id, i.block_table.clone()), windows)
            })
            .unzip();
        Completing { tables, windows }
    }
}

impl Engine {
    /// Whether `seq_id` holds a reservation that has not been activated or released.
    pub fn is_reserved(&self, seq_id: SeqId) -> bool {
        self.reserved.contains_key(&seq_id)
    }
}

/// The part of a layer's payload over `n` blocks (`[K, V]`, each its blocks' elements then
/// their scales: [`KvCache::export_blocks`]) that covers blocks `from..n`, in the same layout.
fn window_suffix(payload: &[u8], n: usize, from: usize, layout: &KvLayout) -> Result<Vec<u8>> {
    let block = layout.block_bytes() as usize;
    let scales = layout.block_scale_bytes() as usize;
    let elems = block - scales;
    if n == 0 || from > n || payload.len() != 2 * n * block {
        return Err(EngineError::InvalidParameter {
            field: "import buffer",
            reason: format!("must be {} bytes", 2 * n * block),
            given: payload.len().to_string(),
        });
    }
    let mut out = Vec::with_capacity(2 * (n - from) * block);
    for half in payload.chunks_exact(n * block) {
        out.extend_from_slice(&half[from * elems..n * elems]);
        out.extend_from_slice(&half[n * elems + from * scales..n * elems + n * scales]);
    }
    Ok(out)
}
