//! Which engine sequence each KV transfer fills. Transfer ids are this node's to hand out and
//! are not sequence ids: the KV sink, Done and Cancel all find the sequence here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use engine::ids::SeqId;
use kv_types::TransferId;

/// Shared by the service and the KV sink. An entry lives from Reserve until the sequence's
/// token stream ends or the reservation is abandoned.
#[derive(Clone, Default)]
pub(crate) struct Transfers {
    seqs: Arc<Mutex<HashMap<TransferId, SeqId>>>,
    next: Arc<AtomicU64>,
}

impl Transfers {
    /// A fresh transfer id for `seq_id`.
    pub(crate) fn open(&self, seq_id: SeqId) -> TransferId {
        let id = TransferId(self.next.fetch_add(1, Ordering::Relaxed) + 1);
        self.lock().insert(id, seq_id);
        id
    }

    pub(crate) fn seq(&self, id: TransferId) -> Option<SeqId> {
        self.lock().get(&id).copied()
    }

    pub(crate) fn close(&self, id: TransferId) -> Option<SeqId> {
        self.lock().remove(&id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TransferId, SeqId>> {
        // Nothing panics while holding it; if something did, the map is still whole.
        self.seqs.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fresh_and_map_to_their_sequence_until_closed() {
        let t = Transfers::default();
        let a = t.open(SeqId(7));
        let b = t.open(SeqId(7));
        assert_ne!(a, b);
        assert_eq!(t.seq(a), Some(SeqId(7)));
        assert_eq!(t.close(a), Some(SeqId(7)));
        assert_eq!(t.seq(a), None);
        assert_eq!(t.seq(b), Some(SeqId(7)));
    }
}
