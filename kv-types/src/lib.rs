//! The KV vocabulary: what a KV block is made of, shared by the kernels that read it, the
//! engine that fills it, the transport that moves it, the wire that describes it and the
//! registry that pairs nodes by it.
//!
//! - [`KvDtype`]: the cache's element type.
//! - [`KvLayout`]: a model's cache geometry (layers, block size, KV heads, head size, dtype):
//!   two nodes can exchange blocks exactly when their layouts are equal.
//! - [`TransferId`]: one KV transfer into one decode node's reservation.
//! - [`KvBackend`]: which data plane (QUIC, TCP, shared memory) carries blocks between two nodes.
//!
//! It is a leaf: it depends on nothing of Fission's, and it must not learn about models,
//! sockets or the wire. Conversions to and from gRPC messages live in `proto`, frame
//! encoding in `kvtransfer`.

mod backend;
mod dtype;
mod ids;
mod layout;

pub use backend::{KvBackend, UnknownBackend};
pub use dtype::{KvDtype, UnknownDtype};
pub use ids::TransferId;
pub use layout::{InvalidLayout, KvLayout, LayerWindows, MAX_DIM, MAX_NUM_LAYERS};
