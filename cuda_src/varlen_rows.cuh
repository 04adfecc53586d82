// The rows of a packed batch past each sequence's used length (seqused_q, seqused_k: seq_span.cuh),
// which the attention kernels leave unwritten: set to 0 in an output of rows of row_words 16-byte
// words (out, dq, dk, dv), and to -inf in the lse ((nheads, total) floats; null: none). For outputs
// whose memory starts undefined (arrays cuflash allocates; XLA's buffers), in place of a fill of the
// whole array: only the unused rows are written. One warp a row; a used row returns at once.
#pragma once
#include "common.cuh"

namespace cuflash {

constexpr int CLEAR_ROWS_PER_CTA = 8;

// A row is unused where its index in its sequence's span reaches min(seqused[b], max_len), seq_span's
// clamps of the length the attention kernels take (its clamp to the span holds here by construction).
__global__ void __launch_bounds__(32 * CLEAR_ROWS_PER_CTA)
    clear_unused_rows_kernel(uint4* __restrict__ rows, int row_words, float* __restrict__ lse, int nheads, int total,
                             const int* __restrict__ cu_seqlens, const int* __restrict__ seqused, int num_seqs,
                             int max_len) {
    const int row = blockIdx.x * CLEAR_ROWS_PER_CTA + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= total) return;
    int lo = 0, hi = num_seqs;  // the last sequence whose span starts at or before the row
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(cu_seqlens + mid) <= row)
            lo = mid;
        else
            hi = mid;
    }
    if (row - __ldg(cu_seqlens + lo) < min(__ldg(seqused + lo), max_len)) return;
    uint4* dst = rows + (long long)row * row_words;
    for (int w = lane; w < row_words; w += 32) dst[w] = make_uint4(0u, 0u, 0u, 0u);
    if (lse != nullptr)
        for (int h = lane; h < nheads; h += 32) lse[(long long)h * total + row] = neg_inf();
}

}  // namespace cuflash
