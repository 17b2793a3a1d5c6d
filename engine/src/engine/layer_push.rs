//! The order in which a step hands its finished layers to the prefill node's push.
//!
//! A host cache hands each layer over as soon as it is computed: the push reads the cache.
//! A device cache stages it first ([`KvCache::stage_layer`]: on a GPU a gather into pinned
//! host memory queued on a copy stream) and hands over the layer before it, so the previous
//! layer is sent while this one's copy and the next one's compute run:
//!
//! ```text
//! layer N computed   -> stage N (buffer N % 2), hand over N - 1 (its copy is waited on)
//! layer N+1 computed -> stage N+1 (the other buffer), hand over N
//! forward done       -> hand over the last layer, forget the staging
//! ```
//!
//! A layer is staged as the blocks every completing prompt pushes of it
//! ([`LayerDone::pushed_blocks`]); the push may export fewer (what the decode node lacks),
//! which the staging serves too. The same order runs on the CPU, where staging is a host copy.

use super::disagg::{Completing, LayerDone};
use super::observer::StepObserver;
use crate::error::Result;
use crate::ids::BlockId;
use crate::kv::cache::KvCache;

/// One step's hand-over of finished layers to an observer.
pub(super) struct LayerPipeline<'c> {
    completing: &'c Completing,
    /// The cache is on a device: layers are staged and handed over one layer late.
    staged: bool,
    /// The layer staged and not yet handed over.
    pending: Option<usize>,
}

impl<'c> LayerPipeline<'c> {
    /// Starts a step's hand-over (the engine has dropped any earlier step's staging).
    pub(super) fn new(completing: &'c Completing, cache: &KvCache) -> Self {
        LayerPipeline {
            completing,
            staged: cache.is_on_device(),
            pending: None,
        }
    }

    fn done<'a>(&'a self, layer: usize, cache: &'a mut KvCache) -> LayerDone<'a> {
        LayerDone {
            layer,
            cache,
            completing: &self.completing.tables,
            windows: &self.completing.windows,
        }
    }

    /// `layer` is in the cache.
    pub(super) fn layer_done(
        &mut self,
        layer: usize,
        cache: &mut KvCache,
        observer: &mut dyn StepObserver,
    ) -> Result<()> {
        if !self.staged {
            return observer.layer_done(self.done(layer, cache));
        }
        let ids = self.pushed_blocks(layer, cache);
        cache.stage_layer(layer, &ids)?;
        match self.pending.replace(layer) {
            Some(previous) => observer.layer_done(self.done(previous, cache)),
            None => Ok(()),
        }
    }

    /// The forward pass is over: hands over the last staged layer and forgets the staging.
    pub(super) fn finish(self, cache: &mut KvCache, observer: &mut dyn StepObserver) -> Result<()> {
        let result = match self.pending {
            Some(layer) => observer.layer_done(self.done(layer, cache)),
            None => Ok(()),
        };
        cache.clear_staged();
        result
    }

    /// Every block of `layer` a completing prompt pushes. A prompt whose window is not held
    /// is left out: its export gathers directly, and the push reports the error.
    fn pushed_blocks(&self, layer: usize, cache: &mut KvCache) -> Vec<BlockId> {
        let done = self.done(layer, cache);
        (0..done.completing.len())
            .filter_map(|i| done.pushed_blocks(i).ok())
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect()
    }
}
