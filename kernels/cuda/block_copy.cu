// Whole-block copies of one layer: gather into / scatter from a contiguous staging buffer, and
// copy-on-write copies inside the cache.
//
// The staging layout is the KV-transfer wire layout of kernels/src/copy.rs:
// [K of block_ids[0..n], V of block_ids[0..n]], each block `block_words` words long. One launch
// moves all the blocks of a layer, so a transfer needs no per-block launch or memcpy. Words are
// 16 bytes (uint4) when every block is 16-byte aligned, else 2 bytes; either way raw bits move,
// so the copies are bit-exact. Ids marked 0xffffffff are skipped: the host uses that to keep
// only the last copy of a repeated id in a scatter, as the CPU kernel does.
#include <stdint.h>

constexpr uint32_t SKIP = 0xffffffffu;

// grid (n, 2): blockIdx.y picks K (0) or V (1).
template <typename W>
__device__ void gather_blocks(const W* __restrict__ k_cache, const W* __restrict__ v_cache,
                              const uint32_t* __restrict__ ids, int n, W* __restrict__ dst,
                              size_t block_words) {
    const uint32_t id = ids[blockIdx.x];
    if (id == SKIP) return;
    const W* src = (blockIdx.y == 0 ? k_cache : v_cache) + (size_t)id * block_words;
    W* to = dst + ((size_t)blockIdx.y * n + blockIdx.x) * block_words;
    for (size_t i = threadIdx.x; i < block_words; i += blockDim.x) to[i] = src[i];
}

template <typename W>
__device__ void scatter_blocks(W* __restrict__ k_cache, W* __restrict__ v_cache,
                               const uint32_t* __restrict__ ids, int n, const W* __restrict__ src,
                               size_t block_words) {
    const uint32_t id = ids[blockIdx.x];
    if (id == SKIP) return;
    W* to = (blockIdx.y == 0 ? k_cache : v_cache) + (size_t)id * block_words;
    const W* from = src + ((size_t)blockIdx.y * n + blockIdx.x) * block_words;
    for (size_t i = threadIdx.x; i < block_words; i += blockDim.x) to[i] = from[i];
}

// pairs: [n][2] (src, dst). The host launches only pairs that do not touch each other's blocks
// together, so the in-order semantics of the CPU kernel hold.
template <typename W>
__device__ void copy_blocks(W* k_cache, W* v_cache, const uint32_t* __restrict__ pairs,
                            size_t block_words) {
    W* cache = blockIdx.y == 0 ? k_cache : v_cache;
    const W* from = cache + (size_t)pairs[2 * blockIdx.x] * block_words;
    W* to = cache + (size_t)pairs[2 * blockIdx.x + 1] * block_words;
    for (size_t i = threadIdx.x; i < block_words; i += blockDim.x) to[i] = from[i];
}

#define FISSION_BLOCK_COPY(SUFFIX, W)                                                           \
    extern "C" __global__ void gather_blocks_##SUFFIX(const W* k_cache, const W* v_cache,      \
                                                      const uint32_t* ids, int n, W* dst,      \
                                                      size_t block_words) {                    \
        gather_blocks<W>(k_cache, v_cache, ids, n, dst, block_words);                          \
    }                                                                                           \
    extern "C" __global__ void scatter_blocks_##SUFFIX(W* k_cache, W* v_cache,                 \
                                                       const uint32_t* ids, int n,             \
                                                       const W* src, size_t block_words) {     \
        scatter_blocks<W>(k_cache, v_cache, ids, n, src, block_words);                         \
    }                                                                                           \
    extern "C" __global__ void copy_blocks_##SUFFIX(W* k_cache, W* v_cache,                    \
                                                    const uint32_t* pairs, size_t block_words) { \
        copy_blocks<W>(k_cache, v_cache, pairs, block_words);                                  \
    }

FISSION_BLOCK_COPY(v16, uint4)
FISSION_BLOCK_COPY(b16, uint16_t)
