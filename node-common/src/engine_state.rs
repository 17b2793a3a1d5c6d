//! What an engine thread publishes after each turn of its loop: its load (for the registration
//! and for draining) and its prefix-cache events (for cache-aware routers).

use std::sync::Arc;

use engine::engine::{CacheEvent, Engine};
use tokio::sync::watch;

use crate::cache_events::CacheEventLog;
use crate::membership::WorkLoad;

/// The engine thread's publishing ends.
pub struct EngineState {
    pub load: watch::Sender<WorkLoad>,
    pub cache: Arc<CacheEventLog>,
}

/// The receiving ends, for the services.
#[derive(Clone)]
pub struct EngineStateRx {
    pub load: watch::Receiver<WorkLoad>,
    pub cache: Arc<CacheEventLog>,
}

impl EngineState {
    pub fn new() -> (EngineState, EngineStateRx) {
        let (load, load_rx) = watch::channel(WorkLoad::default());
        let cache = CacheEventLog::new();
        (
            EngineState {
                load,
                cache: Arc::clone(&cache),
            },
            EngineStateRx {
                load: load_rx,
                cache,
            },
        )
    }

    /// Publishes the engine's cache events and its load (`queued_prefill_tokens` is known to the
    /// caller only). Watchers wake only when the load actually changed.
    pub fn publish(&self, engine: &mut Engine, queued_prefill_tokens: u64) {
        self.cache
            .publish(engine.take_cache_events().into_iter().map(|e| match e {
                CacheEvent::Stored(h) => (h, true),
                CacheEvent::Removed(h) => (h, false),
            }));
        let s = engine.stats();
        let load = WorkLoad {
            free_blocks: s.num_blocks_free as u64,
            queued_prefill_tokens,
            running: s.num_running as u64,
            waiting: s.num_waiting as u64,
            reservations: engine.num_reservations() as u64,
        };
        self.load.send_if_modified(|old| {
            let changed = *old != load;
            *old = load;
            changed
        });
    }
}
