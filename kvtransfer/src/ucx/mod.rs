//! UCX backend: each layer is one tagged send into memory the decode node registered once,
//! over whatever UCX finds (InfiniBand or RoCE verbs where the hardware is, its TCP and
//! shared-memory transports here).
//!
//! The decode node listens on a TCP control socket (`host:port`, advertised like TCP's). For
//! each connection, once the peer is admitted (below), it leases a region of registered
//! memory (`ucp_mem_map`, done once per region: regions are kept and reused by later
//! connections), cut into two slots ([`crate::slots`]), and sends the sender its UCX worker
//! address, the largest payload (a slot), a tag of the connection's own and the packed remote
//! key. For each frame the receiver posts a receive for that tag into the slot the sink does
//! not hold (`ucp_tag_recv_nbx`); the sender sends the payload with the tag
//! (`ucp_tag_send_nbx`, an empty message for an empty payload), then the usual frame header
//! on the control socket (checksum, epoch, trace context). Only once the message has landed
//! does the receiver read the header; it checks the payload's CRC-32C on the slot, as every
//! backend checks it, hands the sink the slot itself and answers with the verdict. Like TCP
//! and shm, a connection carries one frame at a time and each endpoint gets a small pool of
//! them.
//!
//! A large payload goes by UCX's rendezvous protocol, straight into the posted slot: over
//! RDMA a zero-copy read or write, over UCX's TCP transport its own put, which the receiving
//! worker `recv`s into the slot. That needs endpoints without UCX's peer-failure mode, whose
//! TCP transport has no such lane (rendezvous fragments then arrive as active messages and
//! are copied, 3.6x slower in `ucx_perftest`); an error handler and indirect request ids
//! still fail what was in flight to a peer that dies ([`progress`], and
//! `tests/ucx_peer_death.rs`, which SIGKILLs either side mid-transfer). The one-sided
//! `ucp_put_nbx` is not used: with no remote key on UCX's TCP transport, UCP emulated it with
//! active messages (benchmarks/history/2026-11-29-ucx-speed.md).
//!
//! UCX itself is loaded at run time ([`ffi`]): no build needs it, and a node without
//! `libucx0` fails when it builds this backend. One UCP context and worker per server or
//! transport run on a thread of their own ([`worker`] is the handle, [`progress`] the thread).
//!
//! # Trust
//!
//! UCX carries no TLS and no authentication: a peer that holds the worker address and the
//! remote key can write the region, and the receiver cannot tell who wrote it. So the
//! receiver admits a peer on the control socket before it tells it anything:
//! - a peer on this host must run as this node's user, read from the kernel's socket table
//!   (`/proc/net/tcp`, the TCP analogue of shm's `SO_PEERCRED`, see [`peer`]);
//! - a peer on another host (or network namespace) is accepted only when
//!   [`UcxConfig::remote_peers`] says so, and nodes run UCX only under `--insecure`.
//!
//! As with TCP and shm, a reservation's binding to the gateway's chosen prefill node is not
//! checked (there is no certificate): run it where the nodes' network is trusted. UCX's TCP
//! transport goes further: its put writes wherever the peer's request names, with no key to
//! check (`ucx_info -d`: "remote key: 0 bytes"), so any process that reaches the worker's
//! TCP port can write the receiver's memory. That is why UCX across hosts needs
//! `--insecure`, and why peers on one host use the shm backend. The epoch rule and the
//! checksums hold as on every backend, since a payload reaches the cache only through a
//! checked frame; what an admitted peer could still change after the check is its own
//! frame's blocks ([`crate::slots`]).
//!
//! # GPUDirect
//!
//! Here the registered memory is host memory and the sink copies each layer from its slot
//! into its cache. With CUDA, `ucp_mem_map` takes device memory (UCX's `cuda` and `gdr_copy`
//! transports, `nvidia-peermem` or dma-buf for the NIC): registering the decode node's
//! device K/V cache once at start-up and carrying, per reservation, the device address of
//! each block run instead of one region would let the NIC write straight into the blocks,
//! with no host staging, no receive copy and no scatter kernel, and a sender that registers
//! its device gather buffer would need no device-to-host copy either. The receiver must
//! then order its first attention read after the flush (a CUDA event), and the epoch fence
//! needs the remote key invalidated before blocks are reused (a per-reservation
//! registration, or UCX's `ucp_mem_unmap` of it), since the payload no longer passes
//! through a checked copy. See the crate's "What GPUDirect RDMA would change".

mod command;
pub(crate) mod ffi;
mod peer;
mod progress;
mod server;
mod transport;
mod worker;

use crate::frame::FrameLimits;

pub use server::UcxServer;
pub use transport::{UcxConnection, UcxTransport};

#[derive(Clone, Debug)]
pub struct UcxConfig {
    /// Client: most connections per endpoint, so most layers in flight to one node.
    pub connections_per_endpoint: usize,
    pub connect_timeout_ms: u64,
    /// How long one layer's send may take before the connection is dropped (client), and
    /// how long a server waits for a payload whose header has come (server).
    pub put_timeout_ms: u64,
    /// Client: the local address control connections leave from, or the system's choice.
    pub bind_ip: Option<std::net::IpAddr>,
    /// Server: connections served at once.
    pub max_connections: usize,
    /// Server: whether peers outside this host are admitted. Such a peer cannot be
    /// authenticated; nodes run UCX only under `--insecure`, which is what allows it.
    pub remote_peers: bool,
    /// UCX transports (`UCX_TLS`, e.g. `tcp`, `sm`, `rc`); when unset, the environment's
    /// `UCX_TLS`, else every transport but shared memory (`^sm`: peers on one host use the
    /// shm backend).
    pub transports: Option<String>,
    /// The largest payload a frame may carry is also each slot's size, and a connection's
    /// region holds two slots: a region is anonymous memory, so only the pages the largest
    /// layers touched take memory. Over verbs the registration pins it, so lower this to the
    /// largest layer there.
    pub limits: FrameLimits,
}

impl Default for UcxConfig {
    fn default() -> Self {
        Self {
            connections_per_endpoint: 8,
            connect_timeout_ms: 5_000,
            put_timeout_ms: 30_000,
            bind_ip: None,
            max_connections: 1024,
            remote_peers: true,
            transports: None,
            limits: FrameLimits::default(),
        }
    }
}
