// The online softmax of the Hopper forward (fwd_sm90.cuh), one key block at a
// time over a consumer warp's 16 rows held as wgmma accumulators.
#pragma once
#include "common.cuh"

namespace cuflash {

// One step of the online softmax on a 16-row x BC tile of raw scores held as
// wgmma accumulators (two rows per thread): s becomes P = 2^(s c - m c) for
// the running max m, the running sum is updated, and alpha receives the
// factor 2^(m_old c - m c) that O must be multiplied by. m moves only when
// the tile's max exceeds it by more than rescale_log2 (in log2 units): P then
// stays below 2^rescale_log2, and most steps leave alpha = 1 and O untouched
// (the result is the same: O and the sum share the stale max, and the epilogue
// uses it). A row with no key yet (max -inf) keeps P = 0.
//
// How stale m may be depends on P's type. 16-bit P: 8 (FA4's trick); a P below
// 256 is rounded as finely as one below 1. fp8 P: 0, m moves whenever it grows,
// so that a row's largest P is exactly 1: with 3 mantissa bits, a stale max let
// the largest P be rounded by up to 6%, which gave 3-14x the error of naive fp8
// attention on rows dominated by one key (tests/test_fuzz_gpu.py cases 110, 641
// and 711 of the default seed).
template <bool FP8_P>
constexpr float rescale_log2 = FP8_P ? 0.f : 8.f;

// The row max and the row sum are computed as MAX_CHAINS and SUM_CHAINS
// interleaved chains joined by a tree (powers of two): one chain of NT
// dependent instructions made each a latency stall between the S GEMM and
// the exponentials, and after them (SASS and ncu of the fp8 kernel). The
// kernel picks the counts (fwd_sm90_kernel: MAX_CHAINS, SUM_CHAINS).
//
// ROW_BIAS: a row's scores are s + row_bias[r] (ALiBi's row part on a block on one side of the
// diagonal, fwd_sm90_mainloop.cuh's apply_score_mods); the max and sum are those of the biased
// scores, the bias entering once per row.
template <int NT, int MAX_CHAINS, int SUM_CHAINS, bool FP8_P, bool ROW_BIAS>
__device__ __forceinline__ void online_softmax_sm90(float (&s)[NT * 4], float (&row_max)[2], float (&row_sum)[2],
                                                    float (&alpha)[2], float scale_log2, const float (&row_bias)[2]) {
    static_assert(NT >= MAX_CHAINS && NT >= SUM_CHAINS, "a chain per partial max and sum");
    float mx[2];  // the max of this thread's scores of each row and the running max
    bool grows = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float part[MAX_CHAINS];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float m2 = fmaxf(s[j * 4 + 2 * r], s[j * 4 + 2 * r + 1]);
            part[j % MAX_CHAINS] = j < MAX_CHAINS ? m2 : fmaxf(part[j % MAX_CHAINS], m2);
        }
#pragma unroll
        for (int w = MAX_CHAINS / 2; w > 0; w /= 2)
#pragma unroll
            for (int k = 0; k < w; ++k) part[k] = fmaxf(part[k], part[k + w]);
        mx[r] = fmaxf(row_max[r], ROW_BIAS ? part[0] + row_bias[r] : part[0]);
        grows = grows || mx[r] * scale_log2 > row_max[r] * scale_log2 + rescale_log2<FP8_P>;
        alpha[r] = 1.f;
    }
    // A row's max moves only when the max over its quad passes the running max
    // by rescale_log2. Where no thread of the warp holds such a score (most
    // steps once a row has seen a few tiles) one vote skips the two shuffle
    // rounds of the quad max, which lie between the S GEMM and the first
    // exponential; the result is the same.
    if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m = quad_max(mx[r]);
            if (m * scale_log2 > row_max[r] * scale_log2 + rescale_log2<FP8_P>) {
                alpha[r] = exp2_approx((row_max[r] - m) * scale_log2);
                row_max[r] = m;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float offset =
            row_max[r] == neg_inf() ? 0.f : (ROW_BIAS ? row_max[r] - row_bias[r] : row_max[r]) * scale_log2;
        float sum[SUM_CHAINS];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float pair = 0.f;
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const float p = exp2_approx(fmaf(s[j * 4 + 2 * r + cc], scale_log2, -offset));
                s[j * 4 + 2 * r + cc] = p;
                pair = cc == 0 ? p : pair + p;
            }
            sum[j % SUM_CHAINS] = j < SUM_CHAINS ? pair : sum[j % SUM_CHAINS] + pair;
        }
#pragma unroll
        for (int w = SUM_CHAINS / 2; w > 0; w /= 2)
#pragma unroll
            for (int k = 0; k < w; ++k) sum[k] += sum[k + w];
        row_sum[r] = row_sum[r] * alpha[r] + sum[0];
    }
}

// O *= alpha, rows r = 0, 1 of the thread (wgmma accumulators of NT_O 8-column
// tiles), skipped by the whole warp where no row of it moved its max.
template <int NT_O>
__device__ __forceinline__ void rescale_o(float (&acc_o)[NT_O * 4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < NT_O; ++j) {
            acc_o[j * 4 + 0] *= alpha[0];
            acc_o[j * 4 + 1] *= alpha[0];
            acc_o[j * 4 + 2] *= alpha[1];
            acc_o[j * 4 + 3] *= alpha[1];
        }
    }
}

}  // namespace cuflash
