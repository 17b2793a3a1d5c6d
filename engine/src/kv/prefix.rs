//! Chained content hashes of full KV blocks, the keys of the prefix cache. The function lives
//! in its own crate because routers compute it too: see [`prefix_hash`].

pub use prefix_hash::{
    block_hashes, extend_block_hashes, hash_block, PREFIX_HASH_SEED, PREFIX_HASH_VERSION,
};
