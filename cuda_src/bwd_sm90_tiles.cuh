// What the Hopper backward kernels share (bwd_sm90.cuh, bwd_sm90_wide.cuh): the producer's copies,
// the dK/dV kernels' work tiles, and a step's elementwise work where its scores lie with queries as rows.
#pragma once
#include "common.cuh"
#include "dropout.cuh"
#include "score_mods.cuh"
#include "sm90_tiles.cuh"

namespace cuflash {

// Two tiles of ROWS rows and D columns at the same coordinates (K and V of a key block, Q and dO of
// a query block) into shared memory: a bulk tensor copy per 64-column panel (tensor dims: head dim,
// seq, head, batch; rows past the tensor arrive as zeros), both completing on `bar`.
template <int D, int ROWS>
__device__ __forceinline__ void copy_tile_pair(u32 dst_a, const TmaDesc& map_a, u32 dst_b, const TmaDesc& map_b,
                                               int row, int head, int batch, u32 bar) {
    for (int p = 0; p < D / 64; ++p) {
        tma_load_4d(dst_a + p * ROWS * 128, map_a, p * 64, row, head, batch, bar);
        tma_load_4d(dst_b + p * ROWS * 128, map_b, p * 64, row, head, batch, bar);
    }
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

// A step whose S = Q K^T and dP = dO V^T lie with queries as rows (bwd_sm90_dq_kernel,
// bwd_sm90_wide_kernel): a warp's 16 x 8 NT tile in wgmma's accumulator layout (wgmma.cuh), this
// lane's rows `row` and row + 8, columns col + 8 j and col + 8 j + 1; lse2_r and delta_r its two
// rows' lse * log2(e) (+inf past nq: P = 0) and Delta.
//
// P = 2^(score c - lse2[row]) (score_mods.cuh) in place of the scores; where `masked` (a block that
// the causal mask or window, or the end of the keys, crosses) the keys a row does not see get P = 0.
template <int NT, class Mods>
__device__ __forceinline__ void probs_by_rows(float (&acc_s)[NT * 4], const Mods& mods, int row, int col,
                                              const float (&lse2_r)[2], float scale_log2, bool masked) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float dist = mods.distance(row, col) + (float)(8 * (e >> 1) - 8 * j - (e & 1));
            const float u = mods.transform(acc_s[j * 4 + e]);
            acc_s[j * 4 + e] = exp2_approx(fmaf(mods.bias(u, dist), scale_log2, -lse2_r[e >> 1]));
        }
    if (masked) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!mods.visible(row + 8 * (e >> 1), col + 8 * j + (e & 1))) acc_s[j * 4 + e] = 0.f;
    }
}

// dS = P o (dP - Delta[row]) (o (1 - tanh^2) under softcap) in place of dP; with dropout dP o M / (1 - p)
// in place of dP (dropped_dp_minus), kept: the tile's keep bits (dropout_bits).
template <int NT, class Mods>
__device__ __forceinline__ void dscores_by_rows(float (&acc_dp)[NT * 4], const float (&acc_s)[NT * 4],
                                                const Mods& mods, int row, int col, const float (&lse2_r)[2],
                                                const float (&delta_r)[2], const KeepBits<NT>& kept,
                                                float dropout_scale) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float dp = Mods::DROPOUT ? dropped_dp_minus(acc_dp[j * 4 + e], kept.test(4 * j + e), dropout_scale,
                                                              delta_r[e >> 1])
                                           : acc_dp[j * 4 + e] - delta_r[e >> 1];
            acc_dp[j * 4 + e] = acc_s[j * 4 + e] * dp;
            if constexpr (Mods::SOFTCAP) {
                const float dist = mods.distance(row, col) + (float)(8 * (e >> 1) - 8 * j - (e & 1));
                acc_dp[j * 4 + e] *= mods.score_grad_from_prob(acc_s[j * 4 + e], lse2_r[e >> 1], dist);
            }
        }
}

}  // namespace cuflash
