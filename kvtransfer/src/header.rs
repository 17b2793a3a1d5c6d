//! What a KV frame says about the layer it carries.
//!
//! The layer payload for a transfer of `n` blocks is `[K of block_ids[0..n], V of
//! block_ids[0..n]]`, contiguous, so it is `2 * n * block_bytes` bytes (see [`KvLayout`]).

use std::sync::Arc;

use kv_types::{KvLayout, TransferId};

use crate::error::KvTransferError;

/// What the sender says about one layer: everything in a frame header except the payload's
/// length and checksum, which are computed from the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerHeader {
    pub xfer_id: TransferId,
    pub epoch: u64,
    pub layer: u32,
    /// The sender's cache geometry; `layout.num_layers` is the transfer's layer count.
    pub layout: KvLayout,
    /// Destination blocks on the decode node, shared by all layers of a transfer.
    pub block_ids: Arc<[u32]>,
    /// W3C `traceparent` of the sending span, so the receive span can join the trace.
    pub traceparent: Option<String>,
}

impl LayerHeader {
    /// The expected payload length for this header, checked against the frame limits.
    pub fn expected_payload_bytes(&self) -> Result<u64, KvTransferError> {
        self.layout
            .layer_payload_bytes(self.block_ids.len())
            .ok_or_else(|| KvTransferError::InvalidHeader {
                xfer_id: self.xfer_id,
                layer: self.layer,
                field: "block_ids",
                reason: format!("{} blocks overflow the payload size", self.block_ids.len()),
            })
    }
}
