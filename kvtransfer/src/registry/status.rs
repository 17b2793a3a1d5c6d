//! What the registry reports: a transfer's status and progress, its lifetime counters, and the
//! verdict on each frame it is asked about.

use kv_types::TransferId;

use super::LayerClaim;
use crate::verdict::Verdict;

/// Where one transfer stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferStatus {
    /// Never registered here, or deregistered so long ago that it was forgotten.
    Unknown,
    /// Deregistered; late frames for it are dropped.
    Closed {
        epoch: u64,
    },
    Receiving(TransferProgress),
    /// Every layer arrived, passed its checksum and was written, at the current epoch.
    Complete(TransferProgress),
}

impl TransferStatus {
    pub fn is_complete(&self) -> bool {
        matches!(self, Self::Complete(_))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferProgress {
    pub xfer_id: TransferId,
    pub epoch: u64,
    pub num_layers: u32,
    pub layers_received: u32,
    pub payload_bytes: u64,
    /// The verified CRC-32C of each layer that has arrived.
    pub layer_crc32c: Vec<Option<u32>>,
    /// Frames with an older epoch that were ignored for this transfer.
    pub stale_frames: u64,
}

impl TransferProgress {
    pub fn is_complete(&self) -> bool {
        self.layers_received == self.num_layers
    }
}

/// Counters over the registry's lifetime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryStats {
    pub frames_accepted: u64,
    pub frames_ignored_stale_epoch: u64,
    pub frames_ignored_closed: u64,
    pub frames_rejected: u64,
    pub payload_bytes_accepted: u64,
    pub active_transfers: usize,
}

/// Why a frame was dropped without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ignored {
    StaleEpoch { current_epoch: u64 },
    Closed,
}

impl Ignored {
    pub fn verdict(self) -> Verdict {
        match self {
            Self::StaleEpoch { .. } => Verdict::StaleEpoch,
            Self::Closed => Verdict::TransferClosed,
        }
    }
}

/// The result of checking a frame header against the registry.
#[derive(Debug)]
pub enum Admission {
    /// The layer is now marked in flight; complete the claim with the payload.
    Accept(LayerClaim),
    Ignore(Ignored),
}

/// How an admitted frame ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    /// The transfer was deregistered or re-registered while the payload was on its way.
    Ignored(Ignored),
}

impl Outcome {
    pub fn verdict(self) -> Verdict {
        match self {
            Self::Accepted => Verdict::Accepted,
            Self::Ignored(i) => i.verdict(),
        }
    }
}
