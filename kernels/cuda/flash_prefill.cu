// Flash-style prefill attention over a packed (varlen) batch of prompt chunks, reading K/V
// from the paged cache.
//
// The chunk's own K/V rows are written to the cache first (reshape_and_cache), so a chunk that
// continues a cached prefix attends to the prefix and to itself through the same block table:
// chunked prefill and prefix caching need no second path. Each block holds 32 query vectors
// (rows x heads of one GQA group), so each staged K/V tile is reused 32 times; the causal mask
// and the online softmax are those of attention_tile.cuh. This runs on CUDA cores in f32: the
// tensor-core route (candle-flash-attn) needs CUTLASS, see README.md.
#include "attention_tile.cuh"

#define FISSION_PREFILL(DT, T)                                        \
    FISSION_ATTN_KERNEL(flash_prefill_##DT##_hd32, T, 1, 8, false)    \
    FISSION_ATTN_KERNEL(flash_prefill_##DT##_hd64, T, 2, 8, false)    \
    FISSION_ATTN_KERNEL(flash_prefill_##DT##_hd128, T, 4, 8, false)   \
    FISSION_ATTN_KERNEL(flash_prefill_##DT##_hd256, T, 8, 8, false)

FISSION_PREFILL(f32, float)
FISSION_PREFILL(bf16, __nv_bfloat16)
FISSION_PREFILL(f16, __half)
