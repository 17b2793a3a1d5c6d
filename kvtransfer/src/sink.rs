//! Where accepted payloads go.
//!
//! The decode node implements [`KvSink`] by importing the payload into its paged cache. This
//! module has two implementations for tests and benchmarks: [`MemorySink`], a paged cache in
//! plain memory, and [`DiscardSink`], which counts bytes and drops them.

use kv_types::TransferId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;

use crate::error::KvTransferError;
use kv_types::KvLayout;

/// Receives a layer that passed every check. `payload` is `[K of block_ids, V of block_ids]`.
///
/// Called on the receiving task once per layer, never twice for the same layer of one
/// registration. It should copy and return (a memcpy into the cache); slow work belongs on
/// another thread. An error is answered to the sender as `sink_failed` and leaves the layer
/// pending, so it can be sent again.
pub trait KvSink: Send + Sync + 'static {
    fn write_layer(
        &self,
        xfer_id: TransferId,
        layer: u32,
        block_ids: &[u32],
        payload: Bytes,
    ) -> Result<(), KvTransferError>;
}

impl<S: KvSink + ?Sized> KvSink for Arc<S> {
    fn write_layer(
        &self,
        xfer_id: TransferId,
        layer: u32,
        block_ids: &[u32],
        payload: Bytes,
    ) -> Result<(), KvTransferError> {
        (**self).write_layer(xfer_id, layer, block_ids, payload)
    }
}

/// A paged KV cache in memory: per layer, K and V of `num_blocks` blocks.
pub struct MemorySink {
    layout: KvLayout,
    num_blocks: usize,
    /// Per layer: K blocks then V blocks, each `num_blocks * block_bytes`.
    layers: Vec<Mutex<Vec<u8>>>,
    written: Mutex<HashMap<(TransferId, u32), u64>>,
}

impl MemorySink {
    pub fn new(num_layers: u32, num_blocks: usize, layout: KvLayout) -> Self {
        let layer_bytes = 2 * num_blocks * layout.block_bytes() as usize;
        Self {
            layout,
            num_blocks,
            layers: (0..num_layers)
                .map(|_| Mutex::new(vec![0u8; layer_bytes]))
                .collect(),
            written: Mutex::new(HashMap::new()),
        }
    }

    /// Gathers `block_ids` of `layer` back into the export format.
    pub fn read_layer(&self, layer: u32, block_ids: &[u32]) -> Option<Vec<u8>> {
        let bb = self.layout.block_bytes() as usize;
        let cache = self
            .layers
            .get(layer as usize)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let v_base = self.num_blocks * bb;
        let mut out = Vec::with_capacity(2 * block_ids.len() * bb);
        for base in [0, v_base] {
            for &b in block_ids {
                let at = base + b as usize * bb;
                out.extend_from_slice(cache.get(at..at + bb)?);
            }
        }
        Some(out)
    }

    /// Payload bytes written for `(xfer_id, layer)`, if it was written.
    pub fn layer_bytes(&self, xfer_id: TransferId, layer: u32) -> Option<u64> {
        self.written
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(xfer_id, layer))
            .copied()
    }

    /// How many `(xfer_id, layer)` writes happened.
    pub fn layers_written(&self) -> usize {
        self.written
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl KvSink for MemorySink {
    fn write_layer(
        &self,
        xfer_id: TransferId,
        layer: u32,
        block_ids: &[u32],
        payload: Bytes,
    ) -> Result<(), KvTransferError> {
        let fail = |reason: String| KvTransferError::Sink {
            xfer_id,
            layer,
            reason,
        };
        let bb = self.layout.block_bytes() as usize;
        let n = block_ids.len();
        if payload.len() != 2 * n * bb {
            return Err(fail(format!(
                "payload is {} bytes, {n} blocks need {}",
                payload.len(),
                2 * n * bb
            )));
        }
        if let Some(&bad) = block_ids.iter().find(|&&b| b as usize >= self.num_blocks) {
            return Err(fail(format!(
                "block id {bad} out of range: the cache has {} blocks",
                self.num_blocks
            )));
        }
        let slot = self.layers.get(layer as usize).ok_or_else(|| {
            fail(format!(
                "layer out of range: the cache has {} layers",
                self.layers.len()
            ))
        })?;
        {
            let mut cache = slot.lock().unwrap_or_else(PoisonError::into_inner);
            let v_base = self.num_blocks * bb;
            for (i, chunk) in payload.chunks_exact(bb).enumerate() {
                let (base, b) = if i < n {
                    (0, block_ids[i])
                } else {
                    (v_base, block_ids[i - n])
                };
                let at = base + b as usize * bb;
                cache[at..at + bb].copy_from_slice(chunk);
            }
        }
        self.written
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((xfer_id, layer), payload.len() as u64);
        Ok(())
    }
}

/// Counts what it is given and drops it.
#[derive(Debug, Default)]
pub struct DiscardSink {
    bytes: AtomicU64,
    layers: AtomicU64,
}

impl DiscardSink {
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    pub fn layers(&self) -> u64 {
        self.layers.load(Ordering::Relaxed)
    }
}

impl KvSink for DiscardSink {
    fn write_layer(
        &self,
        _xfer_id: TransferId,
        _layer: u32,
        _block_ids: &[u32],
        payload: Bytes,
    ) -> Result<(), KvTransferError> {
        self.bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        self.layers.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_types::KvDtype;

    #[test]
    fn memory_sink_scatters_and_gathers() {
        let layout = KvLayout {
            dtype: KvDtype::F16,
            num_layers: 2,
            block_size: 1,
            num_kv_heads: 1,
            head_dim: 2,
            windows: Default::default(),
        };
        let sink = MemorySink::new(1, 5, layout);
        let payload: Vec<u8> = (0..16).collect();
        sink.write_layer(TransferId(1), 0, &[4, 0], payload.clone().into())
            .unwrap();
        assert_eq!(sink.read_layer(0, &[4, 0]).unwrap(), payload);
        // K of block 4 is the first 4 bytes; V of block 0 the last 4.
        assert_eq!(
            sink.read_layer(0, &[4]).unwrap(),
            [0, 1, 2, 3, 8, 9, 10, 11]
        );
        let err = sink
            .write_layer(TransferId(1), 0, &[5, 0], payload.into())
            .unwrap_err();
        assert!(matches!(
            err,
            KvTransferError::Sink {
                xfer_id: TransferId(1),
                layer: 0,
                ..
            }
        ));
    }
}
