// What the Hopper backward kernels share (bwd_sm90.cuh, bwd_sm90_wide.cuh): the dK/dV kernels' work
// tiles and the order in which their dQ sums lie in dq_accum.
#pragma once
#include "common.cuh"

namespace cuflash {

// Head-dim columns of each consumer's share of a query block's dQ (64 rows): the whole row where
// a block has 128 query rows (consumer c takes rows 64c..), else half of it (columns c * D / 2..).
constexpr int bwd_sm90_dq_cols(int bm, int d) { return bm == 128 ? d : d / 2; }

// A query block's dQ (BM x D floats) lies in its dq_accum block in the order
// in which the consumers' accumulators are stored: consumer c, warp w, 8-column
// tile j, lane, element e (see wgmma.cuh for which row and column each
// holds). The float4 at position i of a block holds elements e = 0..3 of one
// lane: (row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1).
template <int BM, int D>
__device__ __forceinline__ int2 dq_fragment_row_col(int i) {
    constexpr int DQ_N = bwd_sm90_dq_cols(BM, D);
    constexpr int CONSUMER_VECS = 64 * DQ_N / 4;  // float4s of one consumer's share
    const int c = i / CONSUMER_VECS, lane = i % 32, wj = i % CONSUMER_VECS / 32;  // wj: w * (DQ_N / 8) + j
    const int row = (BM == 128 ? 64 * c : 0) + 16 * (wj / (DQ_N / 8)) + lane / 4;
    const int col = (BM == 128 ? 0 : c * DQ_N) + 8 * (wj % (DQ_N / 8)) + 2 * (lane % 4);
    return make_int2(row, col);
}

// A dK/dV kernel's work tile t -> (key block, kv head, batch): key blocks
// innermost, so that the CTAs running together share a head's Q and dO in L2
// (under a causal mask a head's longest block first).
struct KvTile {
    int n_block, hk, b;
};

__device__ __forceinline__ KvTile kv_tile_at(int t, int n_blocks, int kv_heads) {
    const int hb = t / n_blocks;
    return KvTile{t - hb * n_blocks, hb % kv_heads, hb / kv_heads};
}

}  // namespace cuflash
