//! Chained content hashes of full KV blocks: the keys of the prefix cache.
//!
//! Block `i` of a sequence hashes to `h_i = hash_block(h_{i-1}, tokens of block i)`, with
//! `h_{-1} = PREFIX_HASH_SEED`. A hash therefore stands for the whole prefix up to the end of
//! its block: two sequences have the same `h_i` exactly when their first
//! `(i + 1) * block_size` tokens are equal (up to 64-bit collisions). Only full blocks are
//! hashed; a trailing partial block has no hash because its content still changes.
//!
//! Nodes publish these hashes to the router, so the function is part of the wire contract. It
//! uses no per-process keys, no `std::hash::Hasher` (whose output may change between Rust
//! releases) and only integer arithmetic, so it gives the same value on every machine, process
//! and run. Changing it in any way means bumping [`PREFIX_HASH_VERSION`].
//!
//! The mixing is a multiply-xorshift per token (each step is a bijection of the state for a
//! fixed token, so distinct parents never collide on the same block) followed by the
//! `fmix64` finaliser of MurmurHash3 for avalanche.

/// Version of the hash function below; routers must only compare hashes of equal versions.
pub const PREFIX_HASH_VERSION: u32 = 1;

/// The parent hash of the first block of every sequence (hex digits of pi).
pub const PREFIX_HASH_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// Odd multiplier applied after every token (from wyhash).
const TOKEN_MULTIPLIER: u64 = 0xa076_1d64_78bd_642f;
/// Multiplier that folds the block length into the state (from wyhash).
const LENGTH_MULTIPLIER: u64 = 0xe703_7ed1_a0b4_28db;

/// Hashes of every full block of `token_ids`, chained from [`PREFIX_HASH_SEED`].
///
/// Returns `token_ids.len() / block_size` hashes; the trailing partial block is ignored. A
/// `block_size` of 0 yields no hashes.
pub fn block_hashes(token_ids: &[u32], block_size: usize) -> Vec<u64> {
    let mut hashes = Vec::new();
    extend_block_hashes(&mut hashes, token_ids, block_size);
    hashes
}

/// Appends the hashes of the full blocks of `token_ids` that `hashes` does not hold yet.
///
/// `hashes` must be the chained hashes of the first `hashes.len()` blocks of `token_ids` (as
/// returned by an earlier call on a prefix of the same tokens). This lets a growing sequence
/// hash each block once.
pub fn extend_block_hashes(hashes: &mut Vec<u64>, token_ids: &[u32], block_size: usize) {
    if block_size == 0 {
        return;
    }
    let mut parent = hashes.last().copied().unwrap_or(PREFIX_HASH_SEED);
    for block in token_ids.chunks_exact(block_size).skip(hashes.len()) {
        parent = hash_block(parent, block);
        hashes.push(parent);
    }
}

/// Hash of one block of `tokens` whose preceding prefix hashes to `parent`.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut state = parent ^ (tokens.len() as u64).wrapping_mul(LENGTH_MULTIPLIER);
    for &token in tokens {
        state = (state ^ u64::from(token)).wrapping_mul(TOKEN_MULTIPLIER);
        state ^= state >> 32;
    }
    fmix64(state)
}

/// The 64-bit finaliser of MurmurHash3: a bijection with full avalanche.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn one_hash_per_full_block() {
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(block_hashes(&tokens, 4).len(), 2);
        assert_eq!(block_hashes(&tokens, 5).len(), 2);
        assert_eq!(block_hashes(&tokens, 11).len(), 0);
        assert!(block_hashes(&tokens, 0).is_empty());
        assert!(block_hashes(&[], 4).is_empty());
    }

    #[test]
    fn hashes_are_chained() {
        let tokens: Vec<u32> = (0..8).collect();
        let hashes = block_hashes(&tokens, 4);
        let first = hash_block(PREFIX_HASH_SEED, &tokens[..4]);
        assert_eq!(hashes, vec![first, hash_block(first, &tokens[4..])]);
        // Same second block after a different first block: different hash.
        let other: Vec<u32> = vec![9, 9, 9, 9, 4, 5, 6, 7];
        assert_ne!(block_hashes(&other, 4)[1], hashes[1]);
    }

    /// Also produced by an independent Python implementation of the same arithmetic.
    const GOLDEN: [u64; 2] = [0x20c5_a588_1478_67c9, 0x2c8d_5682_d7b4_17e9];

    #[test]
    fn hash_is_pinned_across_processes() {
        // Routers compare hashes published by different nodes and builds; this value must
        // never change without bumping PREFIX_HASH_VERSION.
        let hashes = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(hashes, GOLDEN.to_vec());
        assert_eq!(PREFIX_HASH_VERSION, 1);
    }

    #[test]
    fn order_and_length_matter() {
        assert_ne!(
            hash_block(PREFIX_HASH_SEED, &[1, 2]),
            hash_block(PREFIX_HASH_SEED, &[2, 1])
        );
        assert_ne!(
            hash_block(PREFIX_HASH_SEED, &[0]),
            hash_block(PREFIX_HASH_SEED, &[0, 0])
        );
        assert_ne!(
            hash_block(PREFIX_HASH_SEED, &[]),
            hash_block(PREFIX_HASH_SEED, &[0])
        );
    }

    #[test]
    fn no_collisions_among_small_blocks() {
        let mut seen = HashSet::new();
        for a in 0..64u32 {
            for b in 0..64u32 {
                for c in 0..16u32 {
                    assert!(seen.insert(hash_block(PREFIX_HASH_SEED, &[a, b, c])));
                }
            }
        }
    }

    proptest! {
        #[test]
        fn equal_hash_iff_equal_prefix(
            a in proptest::collection::vec(0u32..4, 0..24),
            b in proptest::collection::vec(0u32..4, 0..24),
            block_size in 1usize..5,
        ) {
            let ha = block_hashes(&a, block_size);
            let hb = block_hashes(&b, block_size);
            for i in 0..ha.len().min(hb.len()) {
                let end = (i + 1) * block_size;
                prop_assert_eq!(ha[i] == hb[i], a[..end] == b[..end]);
            }
        }

        #[test]
        fn extend_matches_from_scratch(
            tokens in proptest::collection::vec(any::<u32>(), 0..40),
            split in 0usize..40,
            block_size in 1usize..6,
        ) {
            let split = split.min(tokens.len());
            let mut hashes = block_hashes(&tokens[..split], block_size);
            extend_block_hashes(&mut hashes, &tokens, block_size);
            prop_assert_eq!(hashes, block_hashes(&tokens, block_size));
        }
    }
}
