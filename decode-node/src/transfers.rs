//! The KV transfers this node is waiting for, by id: each one's engine sequence (what the KV
//! sink writes into) and its session (where Done and Renew go). Transfer ids are this node's to
//! hand out and are not sequence ids. They are random 64-bit numbers, not a count: only the
//! gateway and the prefill node it sends learn a reservation's id, so no other cluster member
//! can name the next request's reservation (issue 31).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use engine::ids::SeqId;
use kv_types::TransferId;
use tokio::sync::mpsc;

use crate::session_event::SessionEvent;

struct Entry {
    seq_id: SeqId,
    events: mpsc::Sender<SessionEvent>,
}

/// Shared by the service and the KV sink. An entry lives while its session waits for KV.
#[derive(Clone, Default)]
pub(crate) struct Transfers {
    open: Arc<Mutex<HashMap<TransferId, Entry>>>,
}

impl Transfers {
    /// A fresh transfer id for `seq_id`, whose session hears of Done and Renew on `events`.
    pub(crate) fn open(&self, seq_id: SeqId, events: mpsc::Sender<SessionEvent>) -> TransferId {
        let mut open = self.lock();
        // rand's thread generator is a CSPRNG seeded from the OS. Zero is left out (proto's
        // default, "no transfer"), and so is an id in use, however unlikely.
        let id = loop {
            let id = TransferId(rand::random::<u64>());
            if id.0 != 0 && !open.contains_key(&id) {
                break id;
            }
        };
        open.insert(id, Entry { seq_id, events });
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
        // Not a count: neither follows from the other.
        assert!(a.0.abs_diff(b.0) > 1 << 20, "{a} and {b}");
        t.close(a);
        assert_eq!(t.seq(a), None);
        assert!(t.session(a).is_none());
        assert_eq!(t.seq(b), Some(SeqId(7)));
    }
}
