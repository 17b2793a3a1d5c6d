//! The synchronous engine: admits requests, runs one continuous-batching step at a time, samples,
//! detokenizes and applies stop conditions. Services drive it from their own thread.

use std::collections::HashMap;
use std::sync::Arc;

use kernels::KvDtype;
use kv_types::KvLayout;

use crate::detokenize::{IncrementalDetokenizer, StopStringStream};
use crate::error::{EngineError, Result};
use crate::ids::SeqId;
use crate::kv::allocator::BlockAllocator;
use crate::kv::cache::KvCache;
use crate::kv::groups::KvGroups;
use crate::model::{ForwardBatch, LoadedModel};
use crate::sampling::{SampledToken, SamplingParams};
use crate::scheduler::{Batch, NewSequence, Scheduler, SchedulerConfig};
use crate::stopping::{FinishReason, StoppingCriteria};
use prompt_logprobs::RowUse;

mod cache_events;
mod config;
mod constrain;
mod disagg;
mod heap;
mod layer_push;
mod observer;
mod prompt_logprobs;
mod row_sampling;
pub use crate::kv::allocator::CacheEvent;
pub use config::EngineConfig;
pub use disagg::{CompletingWindows, LayerDone, LayerHook};
pub use observer::{ScheduledSeq, StepObserver};

/// One generation request, already tokenized and validated by the caller's limits.
#[derive(Debug, Clone)]
pub struct Request {
    pub seq_id: SeqId,
    pub prompt_ids: Vec<u32>,
    /// The last `num_generated` prompt ids are tokens the request already generated (it resumes
    /// after a failure elsewhere): they count against `max_new_tokens`, prime the text and
    /// stop-string state (so a stop string across the resume point still matches), and the
    /// next token's index is `num_generated`. 0 for a new request.
    pub num_generated: usize,
    pub sampling: SamplingParams,
    pub stopping: StoppingCriteria,
    /// What the output must match (structured output); `None` leaves it free.
    pub grammar: Option<grammar::GrammarSpec>,
    /// Report each prompt token's logprob with the first token (TGI's
    /// `decoder_input_details`). The prompt is then computed whole, without the prefix cache.
    /// Ignored when the request resumes (`num_generated > 0`): those were reported before.
    pub prompt_logprobs: bool,
}

impl Request {
    /// Greedy, generating exactly `max_new_tokens` (no stop token or string ends it early):
    /// what benchmarks time and what the committed references were generated with.
    pub fn greedy_fixed_length(seq_id: SeqId, prompt_ids: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            seq_id,
            prompt_ids,
            num_generated: 0,
            sampling: SamplingParams::greedy(),
            stopping: StoppingCriteria {
                max_new_tokens,
                stop_token_ids: Vec::new(),
                stop_strings: Vec::new(),
                ignore_eos: true,
            },
            grammar: None,
            prompt_logprobs: false,
        }
    }
}

impl Request {
    /// Tokens still to generate: `max_new_tokens` less those generated before a resume.
    pub fn remaining_new_tokens(&self) -> usize {
        self.stopping
            .max_new_tokens
            .saturating_sub(self.num_generated)
    }
}

/// One generated token of one sequence.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub seq_id: SeqId,
    pub token: SampledToken,
    /// Text this token completes (may be empty while a character or stop string is pending).
    pub text: String,
    /// Set on the sequence's last token.
    pub finish: Option<FinishReason>,
    /// Index of this token among the sequence's generated tokens.
    pub index: usize,
    /// On the first token of a request that asked for them: the logprob of prompt token
    /// `i + 1` given the tokens before it, for every `i` (one fewer than the prompt's tokens).
    pub prompt_logprobs: Vec<f32>,
}

/// Occupancy figures for metrics and routing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub num_blocks_total: usize,
    pub num_blocks_used: usize,
    pub num_blocks_free: usize,
    pub num_blocks_cached: usize,
    pub num_running: usize,
    pub num_waiting: usize,
    pub prefix_hit_blocks: u64,
    pub prefix_query_blocks: u64,
    /// Sequences preempted (blocks taken back, recomputed later) since start.
    pub preemptions: u64,
}

struct SeqState {
    sampling: SamplingParams,
    stopping: StoppingCriteria,
    text: StopStringStream,
    num_generated: usize,
    /// Prefill node: the sequence leaves the engine after its first token, whatever its
    /// stopping criteria say; the decode node generates the rest.
    prefill_only: bool,
    /// The grammar the output follows, advanced past every token generated so far.
    grammar: Option<grammar::Constraint>,
    /// Prompt logprobs by position, NaN until computed, when the request asked for them.
    prompt_logprobs: Option<Vec<f32>>,
}

pub struct Engine {
    model: LoadedModel,
    cache: KvCache,
    scheduler: Scheduler,
    states: HashMap<SeqId, SeqState>,
    block_size: usize,
    preemptions: u64,
    max_input_tokens: usize,
    max_total_tokens: usize,
    /// Decode node: requests whose blocks are reserved while a prefill node pushes their KV.
    reserved: HashMap<SeqId, disagg::Reservation>,
    /// The most blocks reservations may hold at once.
    max_reserved_blocks: usize,
    /// The step's plan as observers see it; kept so a step does not allocate it anew.
    scheduled: Vec<ScheduledSeq>,
    /// The vocabulary grammars compile against, built on the first constrained request.
    grammar_vocab: Option<Arc<grammar::Vocabulary>>,
    /// A constrained sequence's masked logits row; kept so a step does not allocate it anew.
    mask_scratch: Vec<f32>,
    /// Sequences that ended with an error instead of a token (their grammar failed): already
    /// removed, their owners learn why from [`Engine::take_failed`].
    failed: Vec<(SeqId, EngineError)>,
}

impl Engine {
    /// An engine whose sliding-window layers hold only their window's blocks
    /// ([`crate::kv::groups`]): each window's layers get their own pool, sized for
    /// `max_num_seqs` windows, and the bytes that saves go to the full-attention layers.
    pub fn new(model: LoadedModel, cfg: EngineConfig) -> Result<Self> {
        Self::build(model, cfg, true)
    }

    /// An engine in which every layer keeps every block of a sequence: full attention's
    /// memory, for comparison (its layout has no windows, so it exchanges KV only with
    /// another such engine).
    pub fn with_full_kv(model: LoadedModel, cfg: EngineConfig) -> Result<Self> {
        Self::build(model, cfg, false)
    }

    fn build(model: LoadedModel, cfg: EngineConfig, per_window: bool) -> Result<Self> {
        // A step's buffers stay in the heap for the next step instead of faulting in again.
        heap::keep_freed_heap();
        let mc = model.config().clone();
        let dtype = match cfg.kv_cache_dtype {
            Some(d) => d,
            None => kv_dtype(model.model.dtype())?,
        };
        if cfg.block_size == 0 {
            return Err(EngineError::InvalidParameter {
                field: "block_size",
                reason: "must be > 0".into(),
                given: "0".into(),
            });
        }
        let mut layout = KvLayout {
            dtype,
            num_layers: mc.num_layers as u32,
            block_size: cfg.block_size as u32,
            num_kv_heads: mc.num_kv_heads as u32,
            head_dim: mc.head_dim as u32,
            windows: Default::default(),
        };
        layout
            .validate()
            .map_err(|e| EngineError::InvalidParameter {
                field: e.field,
                reason: format!("must be in 1..={}", e.max),
                given: e.value.to_string(),
            })?;
        let groups = if mc.layer_windows.len() == mc.num_layers {
            KvGroups::new(&mc.layer_windows, per_window)
        } else {
            KvGroups::single(mc.num_layers)
        };
        // Which layers free (and push) only their window: a peer must agree (issue 32).
        layout.windows = kv_types::LayerWindows::of(&groups.layer_windows());
        let budget = cfg
            .num_kv_blocks
            .is_none()
            .then(|| (available_memory_bytes() as f64 * cfg.kv_memory_fraction) as usize);
        let mut num_blocks = match (cfg.num_kv_blocks, budget) {
            (Some(n), _) => n,
            (None, bytes) => KvCache::blocks_for_bytes(bytes.unwrap_or(0), &layout),
        };
        let chunk = cfg
            .max_prefill_chunk_tokens
            .min(cfg.max_batch_prefill_tokens);
        let window_pools: Vec<usize> = groups
            .windows()
            .iter()
            .map(|&w| {
                KvGroups::window_pool_blocks(w, chunk, cfg.block_size, cfg.max_num_seqs, num_blocks)
            })
            .collect();
        let full_layers = groups.num_layers_in(0);
        if let (Some(bytes), true) = (budget, full_layers > 0) {
            // The bytes the window pools leave go to the full-attention layers.
            let layer_block = 2 * layout.block_bytes() as usize;
            let window_bytes: usize = window_pools
                .iter()
                .enumerate()
                .map(|(g, &n)| n * groups.num_layers_in(g + 1) * layer_block)
                .sum();
            num_blocks =
                num_blocks.max(bytes.saturating_sub(window_bytes) / (full_layers * layer_block));
        }
        let max_seq_blocks = mc.max_context.div_ceil(cfg.block_size);
        if num_blocks < max_seq_blocks.min(2) {
            return Err(EngineError::InvalidParameter {
                field: "num_kv_blocks",
                reason: "must hold at least one sequence".into(),
                given: num_blocks.to_string(),
            });
        }
        let pool_blocks: Vec<usize> = std::iter::once(num_blocks)
            .chain(window_pools.iter().copied())
            .collect();
        let mut cache = match model.model.kv_device() {
            Some(device) => KvCache::with_groups_on(layout, groups.clone(), &pool_blocks, device)?,
            None => KvCache::with_groups(layout, groups.clone(), &pool_blocks),
        };
        if cfg.prefault_kv {
            cache.prefault();
        }
        let sched_cfg = SchedulerConfig {
            max_batch_prefill_tokens: cfg.max_batch_prefill_tokens,
            max_batch_total_tokens: cfg
                .max_batch_total_tokens
                .unwrap_or(num_blocks * cfg.block_size),
            max_num_seqs: cfg.max_num_seqs,
            max_prefill_chunk_tokens: cfg.max_prefill_chunk_tokens,
            enable_prefix_caching: cfg.enable_prefix_caching,
        };
        let window_allocators = groups
            .windows()
            .iter()
            .zip(&window_pools)
            .map(|(&w, &n)| (w, BlockAllocator::new(n, cfg.block_size)))
            .collect();
        let mut scheduler =
            Scheduler::try_new(sched_cfg, BlockAllocator::new(num_blocks, cfg.block_size))?
                .with_window_groups(window_allocators);
        scheduler.set_reserve_output(cfg.reserve_output);
        tracing::info!(
            num_blocks,
            ?window_pools,
            block_size = cfg.block_size,
            kv_bytes = cache.kv_bytes(),
            kv_on_device = cache.is_on_device(),
            "kv cache allocated"
        );
        Ok(Engine {
            model,
            cache,
            scheduler,
            states: HashMap::new(),
            block_size: cfg.block_size,
            preemptions: 0,
            scheduled: Vec::new(),
            max_input_tokens: cfg
                .max_input_tokens
                .unwrap_or(mc.max_context)
                .min(mc.max_context),
            max_total_tokens: cfg
                .max_total_tokens
                .unwrap_or(mc.max_context)
                .min(mc.max_context),
            reserved: HashMap::new(),
            max_reserved_blocks: (num_blocks as f64 * cfg.reservation_fraction) as usize,
            grammar_vocab: None,
            mask_scratch: Vec::new(),
            failed: Vec::new(),
        })
    }

    pub fn model(&self) -> &LoadedModel {
        &self.model
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Checks a request against the model's limits and queues it.
    pub fn add_request(&mut self, req: Request) -> Result<()> {
        self.validate(&req)?;
        let new_seq = NewSequence {
            seq_id: req.seq_id,
            prompt_ids: req.prompt_ids.clone(),
            max_new_tokens: req.remaining_new_tokens(),
        };
        self.admit(new_seq, req, false)
    }

    /// Tracks `req`'s state and queues its sequence, or neither.
    fn admit(&mut self, new_seq: NewSequence, req: Request, prefill_only: bool) -> Result<()> {
        let seq_id = req.seq_id;
        self.track(req, prefill_only)?;
        if let Err(e) = self.scheduler.add(new_seq) {
            self.states.remove(&seq_id);
            return Err(e);
        }
        if self.states[&seq_id].prompt_logprobs.is_some() {
            self.scheduler.compute_whole_prompt(seq_id);
        }
        Ok(())
    }

    fn validate(&self, req: &Request) -> Result<()> {
        if self.states.contains_key(&req.seq_id) || self.reserved.contains_key(&req.seq_id) {
            return Err(EngineError::DuplicateSequence { seq_id: req.seq_id });
        }
        if req.prompt_ids.is_empty() {
            return Err(EngineError::InvalidParameter {
                field: "inputs",
                reason: "must contain at least one token".into(),
                given: "0 tokens".into(),
            });
        }
        if req.prompt_ids.len() > self.max_input_tokens {
            return Err(EngineError::PromptTooLong {
                num_tokens: req.prompt_ids.len(),
                limit: self.max_input_tokens,
            });
        }
        let max_context = self.max_total_tokens;
        let vocab = self.model.config().vocab_size;
        if let Some(bad) = req.prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidParameter {
                field: "inputs",
                reason: format!("token ids must be < vocab size {vocab}"),
                given: bad.to_string(),
            });
        }
        if req.num_generated >= req.prompt_ids.len()
            || req.num_generated >= req.stopping.max_new_tokens
        {
            return Err(EngineError::InvalidParameter {
                field: "num_generated",
                reason: format!(
                    "must be below the prompt's {} tokens and max_new_tokens {}",
                    req.prompt_ids.len(),
                    req.stopping.max_new_tokens
                ),
                given: req.num_generated.to_string(),
            });
        }
        if req.prompt_ids.len() + req.remaining_new_tokens() > max_context {
            return Err(EngineError::PromptTooLong {
                num_tokens: req.prompt_ids.len() + req.remaining_new_tokens(),
                limit: max_context,
            });
        }
        req.sampling.validate()?;
        req.stopping.validate()
    }

    /// Starts tracking the sampling, stopping and text state of an admitted request. The
    /// tokens it already generated go through the text state as they did where they were
    /// generated; the text they release was sent from there.
    fn track(&mut self, req: Request, prefill_only: bool) -> Result<()> {
        let prompt_len = req.prompt_ids.len() - req.num_generated;
        let detok = IncrementalDetokenizer::new(
            Arc::clone(&self.model.tokenizer),
            &req.prompt_ids[..prompt_len],
            true,
        );
        let mut text = StopStringStream::new(detok, req.stopping.stop_strings.clone());
        for &token_id in &req.prompt_ids[prompt_len..] {
            text.push(token_id)?;
        }
        let prompt_logprobs = (req.prompt_logprobs && req.num_generated == 0)
            .then(|| vec![f32::NAN; req.prompt_ids.len() - 1]);
        let grammar = match &req.grammar {
            Some(spec) => Some(self.compile_grammar(spec, &req.prompt_ids[prompt_len..])?),
            None => None,
        };
        self.states.insert(
            req.seq_id,
            SeqState {
                sampling: req.sampling,
                stopping: req.stopping,
                text,
                num_generated: req.num_generated,
                prefill_only,
                grammar,
                prompt_logprobs,
            },
        );
        Ok(())
    }

    /// Cancels a sequence in any state and frees its blocks at once.
    pub fn cancel(&mut self, seq_id: SeqId) -> bool {
        if self.release_reservation(seq_id) {
            return true;
        }
        let known = self.states.remove(&seq_id).is_some();
        if known {
            if let Err(e) = self.scheduler.finish(seq_id) {
                tracing::warn!(%seq_id, error = %e, "cancel of an unscheduled sequence");
            }
        }
        known
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    pub fn stats(&self) -> EngineStats {
        let a = self.scheduler.allocator();
        let (hit, queried) = a.prefix_stats();
        EngineStats {
            num_blocks_total: a.num_total(),
            num_blocks_used: a.num_used(),
            num_blocks_free: a.num_free(),
            num_blocks_cached: a.num_cached(),
            num_running: self.scheduler.num_running(),
            num_waiting: self.scheduler.num_waiting(),
            prefix_hit_blocks: hit,
            prefix_query_blocks: queried,
            preemptions: self.preemptions,
        }
    }

    /// Blocks held and in each layer group's pool, the full-attention group first.
    pub fn kv_usage(&self) -> Vec<crate::scheduler::GroupUsage> {
        self.scheduler.group_usage()
    }

    /// Bytes of KV the sequences hold now, over every layer (blocks in use, K and V).
    pub fn kv_bytes_in_use(&self) -> usize {
        let layer_block = 2 * self.cache.layout().block_bytes() as usize;
        let groups = self.cache.groups();
        self.kv_usage()
            .iter()
            .enumerate()
            .map(|(g, u)| u.num_blocks_used * groups.num_layers_in(g) * layer_block)
            .sum()
    }

    /// Runs one forward step over the scheduled batch and returns the tokens it produced.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>> {
        self.step_with_observer(&mut observer::NoLayers)
    }

    /// Like [`step`](Self::step), calling `hook` after each layer with the sequences whose
    /// prompt completes in this step, so a prefill node can push that layer's KV while the
    /// next layer computes.
    pub fn step_with_layer_hook(&mut self, hook: &mut LayerHook<'_>) -> Result<Vec<TokenEvent>> {
        self.step_with_observer(&mut observer::LayerHookObserver(hook))
    }

    /// Like [`step`](Self::step), telling `observer` which sequences the step computes before
    /// its forward pass, and handing it each finished layer as
    /// [`step_with_layer_hook`](Self::step_with_layer_hook) does.
    pub fn step_with_observer(
        &mut self,
        observer: &mut dyn StepObserver,
    ) -> Result<Vec<TokenEvent>> {
        let plan = self.scheduler.schedule();
        self.preemptions += plan.preempted.len() as u64;
        self.scheduled.clear();
        self.scheduled
            .extend(plan.items.iter().map(|item| ScheduledSeq {
                seq_id: item.seq_id,
                num_tokens: item.token_ids.len(),
                is_prefill: item.is_prefill,
                samples: item.sample,
            }));
        observer.scheduled(&self.scheduled);
        if plan.items.is_empty() {
            return Ok(Vec::new());
        }
        let (fb, row_uses) = self.forward_batch(&plan);
        let completing = self.completing_prompts(&plan);
        // Staged layers (a step that failed mid-way keeps them) are stale once this step writes.
        self.cache.clear_staged();
        let logits = if completing.is_empty() || !observer.takes_layers() {
            self.model.model.forward(&fb, &mut self.cache)?
        } else {
            // A device cache's layers are staged and handed over one layer late (layer_push).
            let mut push = layer_push::LayerPipeline::new(&completing, &self.cache);
            let logits = self.model.model.forward_with_layer_hook(
                &fb,
                &mut self.cache,
                &mut |layer, cache| push.layer_done(layer, cache, observer),
            )?;
            push.finish(&mut self.cache, observer)?;
            logits
        };
        let vocab = self.model.config().vocab_size;
        let (states, scheduler, scratch) =
            (&mut self.states, &self.scheduler, &mut self.mask_scratch);
        let sampled = crate::model::logits_rows(&logits, |rows| {
            let mut ready = row_sampling::sample_unconstrained(
                &row_uses,
                &plan.items,
                states,
                scheduler,
                rows,
                vocab,
            );
            let mut out = Vec::with_capacity(fb.logits_rows.len());
            for (row, row_use) in row_uses.iter().enumerate() {
                let logits = &rows[row * vocab..(row + 1) * vocab];
                let item = match *row_use {
                    RowUse::Sample(index) => &plan.items[index],
                    RowUse::Prompt {
                        seq_id,
                        position,
                        target,
                    } => {
                        if let Some(values) = states
                            .get_mut(&seq_id)
                            .and_then(|s| s.prompt_logprobs.as_mut())
                        {
                            values[position] = prompt_logprobs::logprob_at(logits, target);
                        }
                        continue;
                    }
                };
                if let Some(tok) = ready[row].take() {
                    out.push((item.seq_id, tok));
                    continue;
                }
                let Some(state) = states.get_mut(&item.seq_id) else {
                    continue; // cancelled between schedule and now
                };
                let context = penalty_context(scheduler, item.seq_id, &state.sampling);
                let tok = constrain::sample_constrained(
                    logits,
                    state.grammar.as_mut(),
                    &state.stopping.stop_token_ids,
                    scratch,
                    &state.sampling,
                    &context,
                    item.context_len as u64,
                );
                out.push((item.seq_id, tok));
            }
            out
        })?;
        let ids: Vec<(SeqId, u32)> = sampled.iter().map(|(s, t)| (*s, t.token_id)).collect();
        self.scheduler.commit(&plan, &ids);
        let mut events = Vec::with_capacity(sampled.len());
        for (seq_id, token) in sampled {
            events.extend(self.emit(seq_id, token)?);
        }
        Ok(events)
    }

    /// The step's model input, and what each of its logits rows is for.
    fn forward_batch(&self, plan: &Batch) -> (ForwardBatch, Vec<RowUse>) {
        let mut fb = ForwardBatch::default();
        let mut uses = Vec::with_capacity(plan.items.len());
        for (index, item) in plan.items.iter().enumerate() {
            let wants_prompt = self
                .states
                .get(&item.seq_id)
                .is_some_and(|s| s.prompt_logprobs.is_some());
            let prompt = wants_prompt
                .then(|| self.scheduler.sequence(item.seq_id))
                .flatten()
                .map(|s| s.prompt_ids.as_slice());
            prompt_logprobs::push_item(&mut fb, &mut uses, index, item, self.block_size, prompt);
        }
        fb.share_logits_rows();
        (fb, uses)
    }

    /// The event for `token`, or none when the sequence's grammar refuses it: the sequence
    /// then ends with an error ([`Engine::take_failed`]), so that no token outside the
    /// grammar reaches a client and no finish reason is made up.
    fn emit(&mut self, seq_id: SeqId, token: SampledToken) -> Result<Option<TokenEvent>> {
        let state = self
            .states
            .get_mut(&seq_id)
            .expect("sampled sequences have state");
        state.num_generated += 1;
        let index = state.num_generated - 1;
        let mut finish = state
            .stopping
            .check_token(token.token_id, state.num_generated);
        let stop_token = finish == Some(FinishReason::Eos);
        if !stop_token {
            if let Some(grammar) = &mut state.grammar {
                // A complete match admits nothing more: the output ends as at an eos token.
                if let Err(e) = grammar.accept(token.token_id) {
                    tracing::warn!(%seq_id, error = %e, "token outside the grammar; the sequence fails");
                    self.fail(seq_id, e)?;
                    return Ok(None);
                } else if grammar.is_complete() {
                    finish = Some(FinishReason::Eos);
                }
            }
        }
        let prompt_logprobs = state.prompt_logprobs.take().unwrap_or_default();
        let mut text = String::new();
        let prefill_only = state.prefill_only;
        // The eos token itself contributes no text; a grammar's last token does.
        if !stop_token {
            let delta = state.text.push(token.token_id)?;
            text = delta.text;
            if delta.stopped {
                finish = Some(FinishReason::Stop);
            }
        }
        if finish.is_none() && prefill_only {
            // The decode node carries on; this node is done with the sequence.
            self.states.remove(&seq_id);
            self.scheduler.finish(seq_id)?;
            return Ok(Some(TokenEvent {
                seq_id,
                token,
                text,
                finish,
                index,
                prompt_logprobs,
            }));
        }
        if let Some(reason) = finish {
            if reason != FinishReason::Stop {
                text.push_str(&state.text.flush()?);
                // Held-back text may complete a stop string only at the flush.
                if state.text.stopped() {
                    finish = Some(FinishReason::Stop);
                }
            }
            self.states.remove(&seq_id);
            self.scheduler.finish(seq_id)?;
        }
        Ok(Some(TokenEvent {
            seq_id,
            token,
            text,
            finish,
            index,
            prompt_logprobs,
        }))
    }

    /// Ends `seq_id` because its grammar failed: its blocks are freed and its owner learns
    /// why from [`Engine::take_failed`].
    pub(crate) fn fail(&mut self, seq_id: SeqId, e: grammar::GrammarError) -> Result<()> {
        self.states.remove(&seq_id);
        self.scheduler.finish(seq_id)?;
        self.failed.push((
            seq_id,
            EngineError::Grammar {
                seq_id,
                reason: e.to_string(),
            },
        ));
        Ok(())
    }

    /// The sequences that ended with an error since the last call, and why. A sequence listed
    /// here gets no more events: its owner must end its stream with the error.
    pub fn take_failed(&mut self) -> Vec<(SeqId, EngineError)> {
        std::mem::take(&mut self.failed)
    }

    /// Runs the given requests to completion and returns each one's output, in request order;
    /// fails with the error of a sequence that fails (its grammar refused a token).
    pub fn generate(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>> {
        let order: Vec<SeqId> = requests.iter().map(|r| r.seq_id).collect();
        let mut done: HashMap<SeqId, Completion> = HashMap::new();
        for r in requests {
            done.insert(
                r.seq_id,
                Completion {
                    prompt_ids: r.prompt_ids.clone(),
                    ..Default::default()
                },
            );
            self.add_request(r)?;
        }
        while self.has_work() {
            for ev in self.step()? {
                let c = done
                    .get_mut(&ev.seq_id)
                    .expect("events belong to added requests");
                if ev.index == 0 {
                    c.prompt_logprobs = ev.prompt_logprobs;
                }
                c.output_ids.push(ev.token.token_id);
                c.text.push_str(&ev.text);
                c.tokens.push(ev.token);
                c.finish_reason = ev.finish;
            }
            if let Some((_, e)) = self.take_failed().into_iter().next() {
                return Err(e);
            }
        }
        Ok(order
            .into_iter()
            .map(|id| done.remove(&id).expect("every request has a completion"))
            .collect())
    }
}

/// The result of [`Engine::generate`].
#[derive(Debug, Clone, Default)]
pub struct Completion {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub tokens: Vec<SampledToken>,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    /// As [`TokenEvent::prompt_logprobs`].
    pub prompt_logprobs: Vec<f32>,
}

fn kv_dtype(d: candle_core::DType) -> Result<KvDtype> {
    match d {
        candle_core::DType::F32 => Ok(KvDtype::F32),
        candle_core::DType::BF16 => Ok(KvDtype::Bf16),
        candle_core::DType::F16 => Ok(KvDtype::F16),
        other => Err(EngineError::UnsupportedDtype {
            dtype: format!("{other:?}"),
        }),
    }
}

/// MemAvailable from /proc/meminfo, or 4 GiB where it cannot be read.
fn available_memory_bytes() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(4 << 30)
}

/// Prompt and output ids, only when a repetition penalty needs them.
fn penalty_context(scheduler: &Scheduler, seq_id: SeqId, sampling: &SamplingParams) -> Vec<u32> {
    if sampling.repetition_penalty == 1.0 {
        return Vec::new();
    }
    scheduler
        .sequence(seq_id)
        .map(|s| s.prompt_ids.iter().chain(&s.output_ids).copied().collect())
        .unwrap_or_default()
}
