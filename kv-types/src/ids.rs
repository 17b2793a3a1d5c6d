//! Ids of KV transfers.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One KV transfer: the reservation a decode node made for one prompt, which a prefill node
/// fills. It is the decode node's to assign and means nothing on another node; in particular it
/// is not the engine's sequence id, which the decode node maps it to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TransferId(pub u64);

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
