// The online softmax of the sm_80 forward (fwd_sm80.cuh), one key block at a
// time over a warp's 16-row tile.
#pragma once
#include "common.cuh"

namespace cuflash {

// One step over a 16-row x 8*NT_S tile of raw scores s held as mma.sync
// accumulators (two rows per lane), per row r, with c = scale * log2(e):
//   m' = max(m, rowmax(S));  alpha = 2^((m - m') c);  P = 2^(S c - m' c)
//   l' = alpha l + rowsum(P);  O' = alpha O.
// s becomes P. row_sum stays a per-lane partial (quad-reduced at the end). A
// row with no key yet has m' = -inf; its offset is taken as 0 so P = 0,
// never NaN.
template <int NT_S, int NT_O>
__device__ __forceinline__ void online_softmax_sm80(float (&s)[NT_S][4], float (&acc_o)[NT_O][4], float (&row_max)[2],
                                                    float (&row_sum)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
#pragma unroll
        for (int j = 0; j < NT_S; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        mx = quad_max(mx);
        const float offset = mx == neg_inf() ? 0.f : mx * scale_log2;
        const float alpha = exp2_approx(row_max[r] * scale_log2 - offset);
        row_max[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float p = exp2_approx(fmaf(s[j][2 * r + c], scale_log2, -offset));
                s[j][2 * r + c] = p;
                sum += p;
            }
        row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
        for (int j = 0; j < NT_O; ++j) {
            acc_o[j][2 * r] *= alpha;
            acc_o[j][2 * r + 1] *= alpha;
        }
    }
}

}  // namespace cuflash
