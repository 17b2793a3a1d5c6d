//! A frame the registry admitted: the claim on its layer, completed with the payload (written
//! to the sink behind the registration's fence) or dropped (the layer is pending again).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use kv_types::TransferId;

use super::{bump, LayerState, Outcome, TransferRegistry};
use crate::error::KvTransferError;
use crate::frame::FrameHeader;
use crate::sink::KvSink;

/// One admitted layer. Dropping it without [`LayerClaim::complete`] (a refused payload, a
/// broken stream) marks the layer pending again, so a retry can send it.
#[derive(Debug)]
pub struct LayerClaim {
    pub(super) registry: TransferRegistry,
    pub(super) xfer_id: TransferId,
    pub(super) layer: u32,
    pub(super) generation: u64,
    pub(super) block_ids: Arc<[u32]>,
    pub(super) done: bool,
}

impl LayerClaim {
    pub fn xfer_id(&self) -> TransferId {
        self.xfer_id
    }

    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// Verifies the payload's checksum, hands it to the sink and marks the layer received.
    pub fn complete<S: KvSink + ?Sized>(
        self,
        sink: &S,
        frame: &FrameHeader,
        payload: Bytes,
    ) -> Result<Outcome, KvTransferError> {
        let crc = crate::crc::crc32c_append(0, &payload);
        self.complete_with_crc32c(sink, frame, payload, crc)
    }

    /// [`LayerClaim::complete`] for a payload whose CRC-32C the caller computed while
    /// receiving it.
    pub(crate) fn complete_with_crc32c<S: KvSink + ?Sized>(
        mut self,
        sink: &S,
        frame: &FrameHeader,
        payload: Bytes,
        payload_crc32c: u32,
    ) -> Result<Outcome, KvTransferError> {
        let registry = self.registry.clone();
        let checked = if payload.len() as u64 == frame.payload_len {
            frame.check_crc32c(payload_crc32c)
        } else {
            frame.verify_payload(&payload)
        };
        if let Err(e) = checked {
            registry.reject_after_admit();
            return Err(e);
        }
        let payload_bytes = payload.len() as u64;
        let guard = {
            let mut st = registry.lock();
            // While the entry is in the map no fence writer is waiting, so this succeeds.
            match st
                .entry(self.xfer_id, self.generation)
                .and_then(|e| e.fence.clone().try_read_owned().ok())
            {
                Some(guard) => guard,
                None => {
                    self.done = true;
                    let why = registry.ignored_after_admit(&mut st, self.xfer_id);
                    return Ok(Outcome::Ignored(why));
                }
            }
        };
        if let Err(e) = sink.write_layer(self.xfer_id, self.layer, &self.block_ids, payload) {
            registry.reject_after_admit();
            return Err(e);
        }
        let mut st = registry.lock();
        self.done = true;
        let outcome = match st.entry(self.xfer_id, self.generation) {
            Some(e) => {
                e.layers[self.layer as usize] = LayerState::Received {
                    crc32c: frame.payload_crc32c,
                };
                e.layers_received += 1;
                e.payload_bytes += payload_bytes;
                e.progress_tx.send_replace(e.layers_received);
                let c = &registry.shared.counters;
                bump(&c.accepted);
                c.payload_bytes.fetch_add(payload_bytes, Ordering::Relaxed);
                Outcome::Accepted
            }
            // Deregistered during the write; the fence kept its blocks alive until now.
            None => Outcome::Ignored(registry.ignored_after_admit(&mut st, self.xfer_id)),
        };
        drop(st);
        drop(guard);
        Ok(outcome)
    }
}

impl Drop for LayerClaim {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.registry.lock();
        if let Some(e) = st.entry(self.xfer_id, self.generation) {
            if let Some(slot) = e.layers.get_mut(self.layer as usize) {
                if *slot == LayerState::InFlight {
                    *slot = LayerState::Pending;
                }
            }
        }
    }
}
