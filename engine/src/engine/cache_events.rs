//! The engine's side of prefix-cache publishing: routers learn which block hashes a node holds
//! from a full dump ([`Engine::cached_block_hashes`]) followed by ordered deltas
//! ([`Engine::take_cache_events`]), and route prompts to nodes that already hold their prefix.
//!
//! The engine only records; numbering batches, sending them and answering resync requests
//! is the service's job, since the engine does no networking.

use super::Engine;
use crate::kv::allocator::CacheEvent;

impl Engine {
    /// Starts recording prefix-cache events. Off by default, so a node that publishes nothing
    /// buffers nothing; enabling twice keeps the pending events.
    ///
    /// Take the first dump with [`cached_block_hashes`](Self::cached_block_hashes) right after
    /// enabling: that dump plus every later [`take_cache_events`](Self::take_cache_events)
    /// batch, applied in order, is exactly the node's set of cached hashes.
    pub fn enable_cache_events(&mut self) {
        self.scheduler.allocator_mut().enable_events();
    }

    /// The events recorded since the last call, oldest first; empty while recording is off.
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.scheduler.allocator_mut().take_events()
    }

    /// Every block hash this node holds (in use or cached), in no particular order: the full
    /// dump a router resyncs from after missing a batch of events.
    ///
    /// To resync consistently, call [`take_cache_events`](Self::take_cache_events) first and
    /// discard or publish that batch under an earlier sequence number: the dump already
    /// includes those changes.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.scheduler.allocator().cached_hashes().collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::engine::{EngineConfig, Request};
    use crate::ids::SeqId;
    use crate::loader::ModelSource;
    use crate::model::LoadedModel;
    use crate::sampling::SamplingParams;
    use crate::stopping::StoppingCriteria;

    fn stories_engine(num_kv_blocks: usize) -> Engine {
        let dir = testkit::shared_model("stories260K");
        let model = LoadedModel::load(&ModelSource::Local(dir), None, &candle_core::Device::Cpu)
            .expect("stories260K loads");
        let cfg = EngineConfig {
            block_size: 4,
            num_kv_blocks: Some(num_kv_blocks),
            ..Default::default()
        };
        Engine::new(model, cfg).expect("engine starts")
    }

    fn request(id: u64, prompt_ids: Vec<u32>) -> Request {
        Request {
            num_generated: 0,
            seq_id: SeqId(id),
            prompt_ids,
            sampling: SamplingParams::greedy(),
            stopping: StoppingCriteria {
                max_new_tokens: 4,
                stop_token_ids: Vec::new(),
                stop_strings: Vec::new(),
                ignore_eos: true,
            },
            grammar: None,
            prompt_logprobs: false,
        }
    }

    /// Prompts that share prefixes (hits) and differ (misses), in a cache small enough that
    /// later requests evict earlier blocks.
    fn workload() -> Vec<Vec<u32>> {
        let shared: Vec<u32> = (1..=12).collect();
        (0..8u32)
            .map(|i| {
                let mut prompt = if i % 2 == 0 {
                    shared.clone()
                } else {
                    Vec::new()
                };
                prompt.extend((0..10).map(|t| 20 + i * 10 + t));
                prompt
            })
            .collect()
    }

    #[test]
    fn replayed_events_equal_the_dump_through_eviction() {
        let mut engine = stories_engine(16);
        engine.enable_cache_events();
        let mut replica: HashSet<u64> = engine.cached_block_hashes().into_iter().collect();
        let mut removed = 0;
        for (id, prompt) in workload().into_iter().enumerate() {
            engine
                .generate(vec![request(id as u64, prompt)])
                .expect("generates");
            for event in engine.take_cache_events() {
                match event {
                    CacheEvent::Stored(hash) => assert!(replica.insert(hash)),
                    CacheEvent::Removed(hash) => {
                        assert!(replica.remove(&hash));
                        removed += 1;
                    }
                }
            }
            let dump: HashSet<u64> = engine.cached_block_hashes().into_iter().collect();
            assert_eq!(replica, dump);
        }
        assert!(removed > 0, "the workload must evict to test removals");
    }

    #[test]
    fn recording_is_off_by_default() {
        let mut engine = stories_engine(16);
        for (id, prompt) in workload().into_iter().enumerate() {
            engine
                .generate(vec![request(id as u64, prompt)])
                .expect("generates");
        }
        assert!(!engine.cached_block_hashes().is_empty());
        assert!(engine.take_cache_events().is_empty());
    }
}
