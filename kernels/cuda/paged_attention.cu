// Paged attention for decode: one query row per sequence, keys read through the block tables.
//
// v1 runs one block per (sequence, kv head, run of query heads) over the whole context.
// v2 (split-K) also cuts the context into partitions, so a small batch with long contexts still
// fills the GPU, and `paged_attention_reduce_*` merges the partitions. The host picks QPW (query
// vectors per warp) so that a block holds a whole GQA group where it can: every K/V row is
// then read once for all the group's query heads. The core is in attention_tile.cuh.
#include "attention_tile.cuh"

#define FISSION_DECODE(DT, T, HD, VEC)                                                 \
    FISSION_ATTN_KERNEL(paged_attention_v1_##DT##_hd##HD##_q1, T, VEC, 1, false)       \
    FISSION_ATTN_KERNEL(paged_attention_v1_##DT##_hd##HD##_q2, T, VEC, 2, false)       \
    FISSION_ATTN_KERNEL(paged_attention_v1_##DT##_hd##HD##_q4, T, VEC, 4, false)       \
    FISSION_ATTN_KERNEL(paged_attention_v2_##DT##_hd##HD##_q1, T, VEC, 1, true)        \
    FISSION_ATTN_KERNEL(paged_attention_v2_##DT##_hd##HD##_q2, T, VEC, 2, true)        \
    FISSION_ATTN_KERNEL(paged_attention_v2_##DT##_hd##HD##_q4, T, VEC, 4, true)

#define FISSION_DECODE_DTYPE(DT, T)    \
    FISSION_DECODE(DT, T, 32, 1)       \
    FISSION_DECODE(DT, T, 64, 2)       \
    FISSION_DECODE(DT, T, 128, 4)      \
    FISSION_DECODE(DT, T, 256, 8)      \
    extern "C" __global__ void __launch_bounds__(fission::THREADS)                     \
        paged_attention_reduce_##DT(fission::AttnParams p) {                           \
        fission::attention_reduce<T>(p);                                                \
    }

FISSION_DECODE_DTYPE(f32, float)
FISSION_DECODE_DTYPE(bf16, __nv_bfloat16)
FISSION_DECODE_DTYPE(f16, __half)
