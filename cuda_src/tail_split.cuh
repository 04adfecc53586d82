// The last wave of the persistent Hopper forward, split along the keys.
//
// Without a causal mask every work tile has the same key blocks, so the last
// wave holds num_tiles mod CTAs tiles, and the CTAs without one idle for a
// whole tile's time (2048 tiles on 132 SMs: 68 tiles, the wave half empty).
// The host (cuflash/tail_split.py, cuflash/launch.py) keeps the first `full_tiles` tiles
// whole and deals the key blocks of the others, tile after tile, into `items`
// equal runs, one per ticket (stream-K). A run covers at most two tiles (items
// >= the split tiles), so it is one or two segments: key blocks [lo, hi) of
// one tile. Each segment leaves its rows' output, normalised by its own row
// sums, and their lse in a workspace slot (item + tail tile index: distinct
// for distinct segments, fewer than items + split tiles in all); the
// consumer that completes a tile half's key blocks combines its segments:
//   lse = log sum_s exp(lse_s),   O = sum_s exp(lse_s - lse) O_s.
#pragma once
#include "common.cuh"

namespace cuflash {

// Key blocks [lo, hi) of work tile `tile`; slot < 0: the whole tile, no partials.
struct Segment {
    int tile, lo, hi, slot;
    bool more;  // the item goes on in the next tile
};

// Segment `part` (0 or 1) of item `item` (>= full_tiles) over split tiles of
// `blocks` key blocks each.
__device__ __forceinline__ Segment tail_segment(int item, int part, int full_tiles, int split_tiles, int items,
                                                int blocks) {
    const int j = item - full_tiles;
    const long long units = (long long)split_tiles * blocks;
    const int begin = (int)(j * units / items), end = (int)((j + 1) * units / items);
    const int k = begin / blocks + part;  // split tile index
    const int lo = part == 0 ? begin - k * blocks : 0;
    const int hi = min(blocks, end - k * blocks);
    return Segment{full_tiles + k, lo, hi, j + k, end > (k + 1) * blocks};
}

// *p += v at GPU scope, releasing this thread's earlier writes (and, after a
// barrier, its CTA's) and acquiring those released by earlier additions.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// The item that holds key unit x of the split tiles: the last j with
// floor(j * units / items) <= x.
__device__ __forceinline__ int tail_item_of(long long x, long long units, int items) {
    return (int)(((x + 1) * items - 1) / units);
}

template <int N>
struct FloatChunk;
template <>
struct FloatChunk<2> {
    using type = float2;
};
template <>
struct FloatChunk<4> {
    using type = float4;
};

// The slots [first, last] of split tile k's segments.
__device__ __forceinline__ int2 tail_slots(int k, int split_tiles, int items, int blocks) {
    const long long units = (long long)split_tiles * blocks;
    return make_int2(tail_item_of((long long)k * blocks, units, items) + k,
                     tail_item_of((long long)(k + 1) * blocks - 1, units, items) + k);
}

// The combine of a split tile's rows [row0, row0 + 16) by one warp, once all
// its segments' partials (slots [first, last]) are written, in one pass over
// the segments with a running max m of their lse (as the online softmax):
//   l = sum_s 2^(lse_s - m),  O = sum_s 2^(lse_s - m) O_s / l,  lse = m + log l
// (in log2 units here). Lane i < 16 keeps row i's m and l; each lane sums
// D / 32 columns of all 16 rows, whose 16 loads per segment are issued
// together: a loop over rows with dependent loads took tens of microseconds,
// longer than the split saved. Reads go to L2 (ld.global.cg): other SMs
// wrote the partials.
template <int BR, int D, bool BF16_OUT>
__device__ __forceinline__ void combine_partials(const float* ws_o, const float* ws_lse, int2 slots, int row0,
                                                 u16* o_tile, long long o_sn, float* lse_rows, int rows_valid, int d,
                                                 int lane) {
    constexpr int CW = D / 32;  // columns per lane: 2 or 4
    static_assert(CW == 2 || CW == 4, "head dim 64 or 128");
    using Chunk = typename FloatChunk<CW>::type;
    const int my_row = row0 + (lane & 15);
    float m = neg_inf(), l = 0.f;
    float acc[16][CW] = {};
    for (int s = slots.x; s <= slots.y; ++s) {
        Chunk x[16];
#pragma unroll
        for (int r = 0; r < 16; ++r)
            x[r] = __ldcg(reinterpret_cast<const Chunk*>(ws_o + ((long long)s * BR + row0 + r) * D) + lane);
        const float lse_s = __ldcg(ws_lse + s * BR + my_row) * LOG2E;
        const float m_new = fmaxf(m, lse_s);
        const float keep = exp2_approx(m - m_new), add = exp2_approx(lse_s - m_new);  // keep = 0 at first
        l = fmaf(l, keep, add);
        m = m_new;
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            const float keep_r = __shfl_sync(0xffffffffu, keep, r), add_r = __shfl_sync(0xffffffffu, add, r);
            const float* xr = reinterpret_cast<const float*>(&x[r]);
#pragma unroll
            for (int e = 0; e < CW; ++e) acc[r][e] = fmaf(acc[r][e], keep_r, add_r * xr[e]);
        }
    }
    const float inv = 1.f / l;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
        const float inv_r = __shfl_sync(0xffffffffu, inv, r);
        if (row0 + r >= rows_valid) continue;
#pragma unroll
        for (int e = 0; e < CW; e += 2) {
            const int col = lane * CW + e;
            if (col < d)
                *reinterpret_cast<u32*>(o_tile + (row0 + r) * o_sn + col) =
                    pack2<BF16_OUT>(acc[r][e] * inv_r, acc[r][e + 1] * inv_r);
        }
    }
    if (lane < 16 && my_row < rows_valid) lse_rows[my_row] = (m + log2_approx(l)) * LN2;
}

}  // namespace cuflash
