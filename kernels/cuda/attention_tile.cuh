// The attention core shared by the paged decode kernels and the flash-style prefill kernel.
//
// One thread block (4 warps) takes one *tile*: a run of query rows of one sequence times a run
// of the query heads that share one kv head (GQA), for one key range. Keys stream through
// shared memory 32 at a time, so each K/V row is read from the cache once per tile however
// many query heads of its group the tile holds, and softmax is the online (flash) form:
// a running max `m`, running sum `l` and an unnormalized accumulator per query vector.
//
// Inside a warp, lane j scores key j of the staged tile against one query vector (no
// shuffles per key), then each lane accumulates P·V over its own dims `d = c * 32 + lane`.
// Scores are kept in base 2: q is pre-multiplied by `scale * log2(e)` and exp2f is used, as the
// CPU kernel does (kernels/src/tile.rs).
//
// Split-K: with `SPLIT`, block z takes keys [z * partition_keys, (z + 1) * partition_keys)
// and writes its unnormalized state (o, m, l) to a scratch buffer; `attention_reduce` merges the
// parts as kernels/src/split.rs does on the CPU:
//   out = sum_p o_p 2^(m_p - M) / sum_p l_p 2^(m_p - M),  M = max_p m_p.
#pragma once

#include "common.cuh"

namespace fission {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
// Keys staged per step: one per lane.
constexpr int TILE_KEYS = 32;
// Ints per entry of the tile table the host builds (see kernels/src/cuda/plan.rs).
constexpr int TILE_INTS = 6;

// Mirrors `AttnParams` in kernels/src/cuda/plan.rs field by field (#[repr(C)]).
struct AttnParams {
    unsigned long long k_cache;        // const T*, one layer
    unsigned long long v_cache;        // const T*
    unsigned long long q;              // const T*, [num_tokens, num_heads, head_dim]
    unsigned long long out;            // T*, same shape as q
    unsigned long long tiles;          // const int*, [num_tiles][TILE_INTS]
    unsigned long long block_tables;   // const uint32_t*, every sequence's table, concatenated
    unsigned long long partial_out;    // float*, split-K only: [tiles][kv_heads][parts][cap][hd]
    unsigned long long partial_ml;     // float*, split-K only: [tiles][kv_heads][parts][cap][2]
    int num_heads;
    int num_kv_heads;
    int head_dim;
    int block_size;
    int group;            // num_heads / num_kv_heads
    int heads_per_tile;   // query heads of one group in one tile (the tile's vectors are rows x heads)
    int partition_keys;   // split-K part length, a multiple of TILE_KEYS
    int num_partitions;   // gridDim.z
    float scale_log2;     // softmax scale * log2(e)
    int cap;              // query vectors per tile: WARPS * QPW of the launched kernel
    int window;           // sliding window: row at pos sees keys pos + 1 - window..=pos; 0: none
    float softcap;        // attention-logit soft-cap: s -> cap * tanh(s / cap); 0: none
};

// Tile table entry: first query row (in q/out), rows in the tile, absolute position of the first
// row, first query head within the group, offset of the sequence's block table, unused.
struct TileInfo {
    int q_row, n_rows, pos0, head_begin, table_offset;
};

__device__ __forceinline__ TileInfo load_tile(const AttnParams& p, int tile) {
    const int* t = reinterpret_cast<const int*>(p.tiles) + (size_t)tile * TILE_INTS;
    return TileInfo{t[0], t[1], t[2], t[3], t[4]};
}

// Shared-memory floats one block needs: staged queries, K (rows padded to an odd stride so
// that lanes reading different keys hit different banks) and V.
__host__ __device__ __forceinline__ int k_stride(int head_dim) { return head_dim | 1; }

// Vector v of a tile is query row v / heads_per_tile, head v % heads_per_tile within the run.
template <typename T, int VEC, int QPW, bool SPLIT>
__device__ void attend_tile(const AttnParams& p) {
    constexpr int CAP = WARPS * QPW;
    extern __shared__ float smem[];
    const int hd = p.head_dim;
    const int ks = k_stride(hd);
    float* qs = smem;                         // [CAP][hd]
    float* kt = qs + CAP * hd;                // [TILE_KEYS][ks]
    float* vt = kt + TILE_KEYS * ks;          // [TILE_KEYS][hd]

    const int tile = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const TileInfo ti = load_tile(p, tile);
    const int key_end = ti.pos0 + ti.n_rows;  // keys 0..key_end are visible to the last row
    int key_from = 0, key_to = key_end;
    if (SPLIT) {
        key_from = part * p.partition_keys;
        if (key_from >= key_end) return;  // the grid is sized for the longest tile
        key_to = min(key_end, key_from + p.partition_keys);
    }
    const int H = p.heads_per_tile;
    const T* q = reinterpret_cast<const T*>(p.q);
    const T* kc = reinterpret_cast<const T*>(p.k_cache);
    const T* vc = reinterpret_cast<const T*>(p.v_cache);
    const uint32_t* table = reinterpret_cast<const uint32_t*>(p.block_tables) + ti.table_offset;

    for (int i = threadIdx.x; i < CAP * hd; i += THREADS) {
        const int v = i / hd, d = i % hd, r = v / H, hh = ti.head_begin + v % H;
        float x = 0.f;
        if (r < ti.n_rows && hh < p.group) {
            const size_t at = ((size_t)(ti.q_row + r) * p.num_heads + kvh * p.group + hh) * hd + d;
            x = to_f32(q[at]) * p.scale_log2;
        }
        qs[i] = x;
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float m[QPW], l[QPW], acc[QPW][VEC];
    int pos[QPW];
    bool valid[QPW];
#pragma unroll
    for (int i = 0; i < QPW; ++i) {
        const int v = warp * QPW + i, r = v / H;
        valid[i] = r < ti.n_rows && ti.head_begin + v % H < p.group;
        pos[i] = ti.pos0 + r;
        m[i] = -INFINITY;
        l[i] = 0.f;
#pragma unroll
        for (int c = 0; c < VEC; ++c) acc[i][c] = 0.f;
    }

    const size_t row_elems = (size_t)p.num_kv_heads * hd;
    for (int k0 = key_from; k0 < key_to; k0 += TILE_KEYS) {
        const int n = min(TILE_KEYS, key_to - k0);
        __syncthreads();  // the previous step's K/V (and, first time, nothing) is consumed
        for (int i = threadIdx.x; i < TILE_KEYS * hd; i += THREADS) {
            const int j = i / hd, d = i % hd;
            float kx = 0.f, vx = 0.f;
            if (j < n) {
                const int key = k0 + j;
                const size_t slot = (size_t)table[key / p.block_size] * p.block_size + key % p.block_size;
                const size_t at = slot * row_elems + (size_t)kvh * hd + d;
                kx = to_f32(kc[at]);
                vx = to_f32(vc[at]);
            }
            kt[j * ks + d] = kx;
            vt[j * hd + d] = vx;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < QPW; ++i) {
            // The first key this row sees (its window's start; 0 without a window).
            const int lo = p.window > 0 ? pos[i] + 1 - p.window : 0;
            // Every condition is the same on every lane, so the warp stays converged. A tile
            // wholly before the window is skipped, so it costs no FMAs.
            if (!valid[i] || k0 > pos[i] || k0 + n - 1 < lo) continue;
            const float* qv = qs + (warp * QPW + i) * hd;
            const float* kr = kt + lane * ks;
            float s = 0.f;
            for (int d = 0; d < hd; ++d) s = fmaf(qv[d], kr[d], s);
            if (p.softcap > 0.f) {
                // s is scale * q.k in base 2; the cap applies to the natural-base score.
                const float nat = s * 0.69314718f;
                s = p.softcap * tanhf(nat / p.softcap) * 1.44269504f;
            }
            if (lane >= n || k0 + lane > pos[i] || k0 + lane < lo) s = -INFINITY;
            // Some key of max(k0, lo)..=min(k0 + n - 1, pos) is visible (k0 <= pos, lo <= pos
            // and k0 + n - 1 >= lo), so the tile max is finite.
            const float m_new = fmaxf(m[i], warp_max(s));
            const float pr = exp2f(s - m_new);
            const float corr = exp2f(m[i] - m_new);
            l[i] = l[i] * corr + warp_sum(pr);
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < VEC; ++c) acc[i][c] *= corr;
            for (int j = 0; j < n; ++j) {
                const float pj = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
                for (int c = 0; c < VEC; ++c) {
                    const int d = c * 32 + lane;
                    if (d < hd) acc[i][c] = fmaf(pj, vt[j * hd + d], acc[i][c]);
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < QPW; ++i) {
        if (!valid[i]) continue;
        const int v = warp * QPW + i;
        if (SPLIT) {
            const size_t pv = (((size_t)tile * p.num_kv_heads + kvh) * p.num_partitions + part) * CAP + v;
            float* po = reinterpret_cast<float*>(p.partial_out) + pv * hd;
#pragma unroll
            for (int c = 0; c < VEC; ++c) {
                const int d = c * 32 + lane;
                if (d < hd) po[d] = acc[i][c];
            }
            if (lane == 0) {
                float* ml = reinterpret_cast<float*>(p.partial_ml) + pv * 2;
                ml[0] = m[i];  // -inf when every key of this part lies after the row or before its window
                ml[1] = l[i];
            }
        } else {
            T* out = reinterpret_cast<T*>(p.out);
            const int r = v / H, h = kvh * p.group + ti.head_begin + v % H;
            const size_t at = ((size_t)(ti.q_row + r) * p.num_heads + h) * hd;
            const float inv = 1.f / l[i];
#pragma unroll
            for (int c = 0; c < VEC; ++c) {
                const int d = c * 32 + lane;
                if (d < hd) out[at + d] = from_f32<T>(acc[i][c] * inv);
            }
        }
    }
}

// Merges the split-K parts of every tile; grid (tiles, kv_heads), THREADS threads.
template <typename T>
__device__ void attention_reduce(const AttnParams& p) {
    const int tile = blockIdx.x, kvh = blockIdx.y, hd = p.head_dim, H = p.heads_per_tile;
    const TileInfo ti = load_tile(p, tile);
    const int key_end = ti.pos0 + ti.n_rows;
    const int parts = (key_end + p.partition_keys - 1) / p.partition_keys;
    const float* po = reinterpret_cast<const float*>(p.partial_out);
    const float* ml = reinterpret_cast<const float*>(p.partial_ml);
    T* out = reinterpret_cast<T*>(p.out);
    for (int i = threadIdx.x; i < p.cap * hd; i += THREADS) {
        const int v = i / hd, d = i % hd, r = v / H, hh = ti.head_begin + v % H;
        if (r >= ti.n_rows || hh >= p.group) continue;
        const size_t base = ((size_t)tile * p.num_kv_heads + kvh) * p.num_partitions * p.cap + v;
        float mx = -INFINITY;
        for (int z = 0; z < parts; ++z) mx = fmaxf(mx, ml[(base + (size_t)z * p.cap) * 2]);
        float num = 0.f, den = 0.f;
        for (int z = 0; z < parts; ++z) {
            const size_t pv = base + (size_t)z * p.cap;
            const float w = exp2f(ml[pv * 2] - mx);  // 0 for a part with no visible key
            den += ml[pv * 2 + 1] * w;
            num += po[pv * hd + d] * w;
        }
        const size_t at = ((size_t)(ti.q_row + r) * p.num_heads + kvh * p.group + hh) * hd + d;
        out[at] = from_f32<T>(num / den);
    }
}

}  // namespace fission

// Entry points for one dtype and head-dim bucket (head_dim <= 32 * VEC).
#define FISSION_ATTN_KERNEL(NAME, T, VEC, QPW, SPLIT)                                           \
    extern "C" __global__ void __launch_bounds__(fission::THREADS) NAME(fission::AttnParams p) { \
        fission::attend_tile<T, VEC, QPW, SPLIT>(p);                                            \
    }
