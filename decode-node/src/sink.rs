//! Where received KV layers go: queued to the engine thread, which owns the cache.

use bytes::Bytes;
use engine::ids::BlockId;
use kv_types::TransferId;
use kvtransfer::{KvSink, KvTransferError};

use crate::actor::EngineHandle;
use crate::transfers::Transfers;

pub struct EngineSink {
    pub(crate) handle: EngineHandle,
    pub(crate) transfers: Transfers,
}

impl KvSink for EngineSink {
    fn write_layer(
        &self,
        xfer_id: TransferId,
        layer: u32,
        block_ids: &[u32],
        payload: Bytes,
    ) -> Result<(), KvTransferError> {
        let sink_error = |reason: String| KvTransferError::Sink {
            xfer_id,
            layer,
            reason,
        };
        // The registry admitted the frame, so the transfer was open a moment ago; gone now
        // means it was just abandoned, and the engine would drop the layer anyway.
        let seq_id = self
            .transfers
            .seq(xfer_id)
            .ok_or_else(|| sink_error("the transfer was closed".into()))?;
        let blocks = block_ids.iter().map(|&b| BlockId(b)).collect();
        self.handle
            .import(xfer_id, seq_id, layer as usize, blocks, payload)
            .map_err(|e| sink_error(e.to_string()))
    }
}
