//! kvtransfer: moves a prompt's KV cache from a prefill node into blocks a decode node
//! reserved, layer by layer, while the prefill node is still computing the next layers.
//!
//! This crate knows block ids and byte layouts only. It must not depend on `engine` or on any
//! model code, and it does not speak gRPC: the reservation and the final Done message travel
//! over the nodes' control plane, not through here.
//!
//! # Flow
//!
//! 1. The decode node reserves blocks and [`TransferRegistry::register`]s a [`Reservation`]
//!    (`xfer_id`, `epoch`, `block_ids`, [`KvLayout`]); it hands the prefill node
//!    `{xfer_id, epoch, block_ids, kv_endpoint, lease_ms}`.
//! 2. The prefill node [`KvTransport::connect`]s to `kv_endpoint` (connections are cached per
//!    endpoint) and calls [`KvConnection::send_layer`] as each layer finishes; the calls run
//!    concurrently, each layer on its own stream. A layer's payload is the engine's export
//!    format `[K of block_ids, V of block_ids]`.
//! 3. The decode node's server ([`KvServer::serve`]) checks each frame (see [`frame`]) against
//!    the registry, verifies the CRC-32C, hands the payload to its [`KvSink`] and answers the
//!    sender with a [`Verdict`].
//! 4. On Done, the decode node calls [`TransferRegistry::wait_complete`] (every layer arrived,
//!    checksums valid, current epoch), then [`TransferRegistry::deregister`]. Deregistering on
//!    cancel or lease expiry is a write fence: once it returns, no write into those blocks is
//!    running or will start, and late frames are dropped and counted.
//!
//! A retry after a failed attempt re-registers the same `xfer_id` with a higher epoch; frames
//! still in flight from the old attempt are ignored as stale.
//!
//! # Backends
//!
//! - [`QuicServer`] / [`QuicTransport`]: QUIC with mutual TLS against a cluster CA
//!   (the [`identity`] crate's certificates), ALPN `fission-kv/1`, one stream per layer, tuned flow-control windows
//!   ([`QuicWindows::TUNED`]).
//! - [`TcpServer`] / [`TcpTransport`]: the same frames over TCP with a small connection pool
//!   per endpoint, for networks that block UDP.
//! - [`ShmServer`] / [`ShmTransport`]: for two nodes on one host, the same frames on a Unix
//!   socket with each payload in a memory region both map (the socket runs mutual TLS when
//!   the node has an identity; the payloads, in the user's own memory, are not encrypted).
//! - [`PickingTransport`]: shared memory for a decode node on the sender's host, the network
//!   backend otherwise, from what the reservation names ([`KvRoute`]).
//! - [`UcxServer`] / [`UcxTransport`]: each payload as a UCX tagged send into memory the
//!   receiver registered once (verbs where there is RDMA hardware, TCP or shared memory
//!   here), the frame header on a TCP control socket (no TLS; see the module).
//! - [`BackendServer`] / [`BackendTransport`]: any of them, chosen by a [`KvBackend`], so
//!   the nodes build their data plane without matching on the backend.
//!
//! # Mapping onto RDMA
//!
//! The API is shaped so an RDMA backend (RC queue pairs, one-sided writes) slots in without
//! changing the prefill or decode node logic:
//!
//! - **Register** becomes memory registration. The decode node registers the destination
//!   memory of the reserved blocks (or, better, the whole per-layer K and V cache once at
//!   start-up) as a memory region and gets an `rkey`. [`TransferRegistry::register`] keeps the
//!   same role: it records the reservation, its epoch and which layers have landed.
//! - **The reservation carries addresses instead of block ids.** For each layer and each of K
//!   and V, the reservation lists `(remote_addr, rkey)` per block (or per run of contiguous
//!   blocks), computed by the decode node from `block_ids` and the [`KvLayout`]. The prefill
//!   node needs no knowledge of the decode node's cache shape beyond that.
//! - **`send_layer` becomes RDMA WRITEs.** The sender posts one RDMA WRITE per contiguous
//!   destination run (scatter from its export buffer), all for one layer, then a final
//!   `RDMA WRITE_WITH_IMM` (or a SEND) whose 32-bit immediate encodes `(xfer slot, layer)`.
//!   RC delivers writes in order, so the completion implies the layer's bytes are in place.
//!   The receiver's completion handler plays the part of [`LayerClaim::complete`]: it checks
//!   the epoch (carried in the SEND, or in a per-reservation slot the immediate indexes) and
//!   marks the layer received. There is no payload copy and no [`KvSink`] call: the NIC wrote
//!   into the cache directly.
//! - **Concurrency** is one WRITE chain per layer, posted as layers finish, like concurrent
//!   `send_layer` calls; the queue pair's send queue depth gives the backpressure that QUIC
//!   flow control gives here.
//! - **Checksums become optional.** RC has link-level CRCs and end-to-end ICRC, so the
//!   per-layer CRC-32C can be dropped, or computed by the sender and sent in the completion
//!   message for the receiver to verify lazily.
//! - **Epochs and fencing still matter.** A stale sender can still WRITE into the region, so
//!   deregistration must invalidate the rkey (deregister the region or use a per-reservation
//!   memory window and invalidate it) before the blocks are reused; that is what
//!   [`TransferRegistry::deregister`]'s fence provides for the stream backends.
//!
//! # From device memory, and what GPUDirect RDMA would change
//!
//! The transports move host bytes. A node whose KV cache is on a device (the engine's tensor
//! path keeps one tensor a layer on the model's device, issue 35) goes through host staging,
//! inside the engine's `KvCache::export_blocks` / `import_blocks`, so the nodes do not know
//! where the cache lives: the prefill node gathers each finished layer's blocks into one
//! buffer on the device (`engine::model::device_ops::gather_blocks`, the layout of
//! `kernels::gather_blocks`, which is the wire layout) and copies it to the host buffer that
//! `send_layer` sends; the decode node's [`KvSink`] hands a received layer to the engine,
//! which uploads it and scatters it into its blocks (`device_ops::scatter_blocks`). On the
//! CPU the same code runs with CPU tensors (tested through a 1P+1D cluster). On a GPU the
//! prefill node's gather and copy run on a copy stream of their own into pinned host memory
//! (`kernels::cuda::PinnedStaging`, two buffers that alternate: `engine::kv::staging`): the
//! copy stream waits on an event recorded after the layer's reshape-and-cache, and the engine
//! hands layer N to the push once layer N + 1 is queued, so layer N crosses PCIe and is sent
//! while N + 1 computes. Each byte crosses PCIe twice (device → host on the sender, host →
//! device on the receiver) besides the wire, and is copied once more on each host (pinned
//! buffer to the send buffer; the received bytes to the upload).
//!
//! With GPUDirect RDMA the NIC reads and writes GPU memory over PCIe peer-to-peer, so:
//! - the decode node registers its device K/V cache (`nvidia-peermem`/dma-buf, `ibv_reg_mr`
//!   on the device pointer) once at start-up, and the reservation carries device addresses
//!   and the rkey as above: the NIC writes straight into the device blocks, with no host
//!   staging, no receive copy and no scatter kernel;
//! - the prefill node registers its device gather buffer (or the cache itself, posting one
//!   WRITE per contiguous block run instead of gathering), and the send needs no device →
//!   host copy; the gather, if kept, must complete (a CUDA event) before the WRITE is posted;
//! - completion means the bytes are in GPU memory but not yet visible to kernels on another
//!   stream: the receiver orders its first attention read after the completion (a flush or
//!   an event), which the stream backends get for free from their host copy;
//! - it needs the NIC and the GPU under one PCIe switch (or root complex) to be fast, and
//!   pinned device memory counts against the cache: the registration is per cache, not per
//!   transfer, so it costs nothing per request.
//!
//! # Errors
//!
//! One [`KvTransferError`]; [`KvTransferError::verdict`] maps errors to wire verdicts and
//! [`KvTransferError::error_type`] names them for the error table.

mod accept;
mod backend;
mod crc;
mod error;
pub mod frame;
mod header;
mod pick;
mod quic;
mod receive;
#[cfg(test)]
mod refusal_log;
mod registry;
mod shm;
mod shm_auth;
mod sink;
mod slots;
mod stream_io;
mod tcp;
mod transport;
mod ucx;
mod verdict;
mod version;

pub use backend::{BackendConfig, BackendConnection, BackendServer, BackendTransport};
pub use error::KvTransferError;
pub use frame::{decode_frame, FrameHeader, FrameLimits};
pub use header::LayerHeader;
pub use kv_types::{KvBackend, KvDtype, KvLayout, TransferId, MAX_DIM};
pub use pick::{KvRoute, PickingTransport};
pub use quic::{
    new_endpoint, quic_client_config, quic_server_config, QuicConfig, QuicConnection, QuicServer,
    QuicTransport, QuicWindows, ALPN, LOOPBACK_MTU, MAX_GSO_MTU,
};
pub use registry::{
    peer_fingerprint, Admission, Ignored, LayerClaim, Outcome, PeerFingerprint, PeerKey,
    RegistryConfig, RegistryStats, Reservation, TransferProgress, TransferRegistry, TransferStatus,
};
pub use shm::{ShmConfig, ShmConnection, ShmServer, ShmTransport, SHM_SCHEME};
pub use shm_auth::SHM_ALPN;
pub use sink::{DiscardSink, KvSink, MemorySink};
pub use tcp::{TcpConfig, TcpConnection, TcpServer, TcpTransport};
pub use transport::{
    send_all_layers, KvConnection, KvServer, KvTransport, RefusalObserver, TransferStat,
};
pub use ucx::{UcxConfig, UcxConnection, UcxServer, UcxTransport};
pub use verdict::Verdict;
