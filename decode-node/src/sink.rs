//! Where received KV layers go: queued to the engine thread, which owns the cache.

use bytes::Bytes;
use engine::ids::{BlockId, SeqId};
use kvtransfer::{KvSink, KvTransferError};

use crate::actor::EngineHandle;

pub struct EngineSink {
    pub handle: EngineHandle,
}

impl KvSink for EngineSink {
    fn write_layer(
        &self,
        xfer_id: u64,
        layer: u32,
        block_ids: &[u32],
        payload: Bytes,
    ) -> Result<(), KvTransferError> {
        // The xfer id is the sequence id (see the service's reserve).
        let blocks = block_ids.iter().map(|&b| BlockId(b)).collect();
        self.handle
            .import(SeqId(xfer_id), layer as usize, blocks, payload)
            .map_err(|e| KvTransferError::Sink {
                xfer_id,
                layer,
                reason: e.to_string(),
            })
    }
}
