//! The KV transfers this node is waiting for, by id: each one's engine sequence (what the KV
//! sink writes into) and its session (where Done and Renew go). Transfer ids are this node's to
//! hand out and are not sequence ids.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use engine::ids::SeqId;
use kv_types::TransferId;
use tokio::sync::mpsc;

use crate::session::SessionEvent;

struct Entry {
    seq_id: SeqId,
    events: mpsc::Sender<SessionEvent>,
}

/// Shared by the service and the KV sink. An entry lives while its session waits for KV.
#[derive(Clone, Default)]
pub(crate) struct Transfers {
    open: Arc<Mutex<HashMap<TransferId, Entry>>>,
    next: Arc<AtomicU64>,
}

impl Transfers {
    /// A fresh transfer id for `seq_id`, whose session hears of Done and Renew on `events`.
    pub(crate) fn open(&self, seq_id: SeqId, events: mpsc::Sender<SessionEvent>) -> TransferId {
        let id = TransferId(self.next.fetch_add(1, Ordering::Relaxed) + 1);
        self.lock().insert(id, Entry { seq_id, events });
        id
    }

    pub(crate) fn seq(&self, id: TransferId) -> Option<SeqId> {
        self.lock().get(&id).map(|e| e.seq_id)
    }

    /// Where to tell the transfer's session of a Done or Renew.
    pub(crate) fn session(&self, id: TransferId) -> Option<mpsc::Sender<SessionEvent>> {
        self.lock().get(&id).map(|e| e.events.clone())
    }

    pub(crate) fn close(&self, id: TransferId) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TransferId, Entry>> {
        // Nothing panics while holding it; if something did, the map is still whole.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fresh_and_map_to_their_sequence_until_closed() {
        let t = Transfers::default();
        let (tx, _rx) = mpsc::channel(1);
        let a = t.open(SeqId(7), tx.clone());
        let b = t.open(SeqId(7), tx);
        assert_ne!(a, b);
        assert_eq!(t.seq(a), Some(SeqId(7)));
        assert!(t.session(a).is_some());
        t.close(a);
        assert_eq!(t.seq(a), None);
        assert!(t.session(a).is_none());
        assert_eq!(t.seq(b), Some(SeqId(7)));
    }
}
