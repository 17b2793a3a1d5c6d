// reshape-and-cache: writes new K/V token rows into their cache slots.
//
// k and v are [num_tokens, num_kv_heads, head_dim]; token t goes to slot slots[t]. The copy
// moves raw bits (2- or 4-byte words), never converting, so it is bit-exact for every dtype.
// The CPU kernel lets the last token win when a slot repeats; blocks run in no fixed order, so
// the host marks every earlier duplicate with a negative slot and this kernel skips it.
#include <stdint.h>

template <typename W>
__device__ void reshape_and_cache(W* __restrict__ k_cache, W* __restrict__ v_cache,
                                  const W* __restrict__ k, const W* __restrict__ v,
                                  const long long* __restrict__ slots, int num_tokens,
                                  int row_elems) {
    for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        const long long slot = slots[t];
        if (slot < 0) continue;
        const size_t src = (size_t)t * row_elems, dst = (size_t)slot * row_elems;
        for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
            k_cache[dst + i] = k[src + i];
            v_cache[dst + i] = v[src + i];
        }
    }
}

#define FISSION_RESHAPE(NAME, W)                                                               \
    extern "C" __global__ void NAME(W* k_cache, W* v_cache, const W* k, const W* v,           \
                                    const long long* slots, int num_tokens, int row_elems) {   \
        reshape_and_cache<W>(k_cache, v_cache, k, v, slots, num_tokens, row_elems);            \
    }

FISSION_RESHAPE(reshape_and_cache_b16, uint16_t)
FISSION_RESHAPE(reshape_and_cache_b32, uint32_t)
