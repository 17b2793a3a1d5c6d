//! What a service sees of one step while it runs: which sequences the scheduler put in it
//! (before the forward pass), and each finished layer (for the prefill node's KV push).
//!
//! The scheduler admits only what fits its budgets, so a sequence added to the engine may sit
//! out several steps; queue times, chunk counts and batch spans must follow the step's plan,
//! not the set of sequences the service has handed over.

use super::disagg::{LayerDone, LayerHook};
use crate::error::Result;
use crate::ids::SeqId;

/// One sequence of a step's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq_id: SeqId,
    /// Tokens the step computes for it: a prompt chunk, or 1 for a decode.
    pub num_tokens: usize,
    /// The tokens are (part of) the prompt, or a recompute after preemption.
    pub is_prefill: bool,
    /// The step samples a token for it.
    pub samples: bool,
}

/// Called by [`Engine::step_with_observer`](super::Engine::step_with_observer).
pub trait StepObserver {
    /// Once per step, after scheduling and before the forward pass, with the sequences the
    /// step computes (none when nothing fits).
    fn scheduled(&mut self, _seqs: &[ScheduledSeq]) {}

    /// After each layer of a step in which some prompt completes; an error fails the step.
    /// On a device cache a layer arrives once the next one is computed and its own blocks are
    /// staged for the push (`layer_push`).
    fn layer_done(&mut self, _done: LayerDone<'_>) -> Result<()> {
        Ok(())
    }

    /// Whether [`layer_done`](Self::layer_done) is wanted: without it a step stages nothing.
    fn takes_layers(&self) -> bool {
        true
    }
}

/// [`Engine::step`](super::Engine::step)'s observer: nothing to push.
pub(super) struct NoLayers;

impl StepObserver for NoLayers {
    fn takes_layers(&self) -> bool {
        false
    }
}

/// Adapts a bare layer hook.
pub(super) struct LayerHookObserver<'h, 'a>(pub &'h mut LayerHook<'a>);

impl StepObserver for LayerHookObserver<'_, '_> {
    fn layer_done(&mut self, done: LayerDone<'_>) -> Result<()> {
        (self.0)(done)
    }
}
