// The parts of the consumers' key loop of the Hopper forward (the loop itself
// is written out in fwd_sm90.cuh): the GEMMs and the online softmax of one
// work tile's segment. Consumer warpgroup c
// owns rows 64c .. 64c+63 of the tile (each warp 16 rows, as in fwd_sm80.cuh).
//   S = Q K^T:  wgmma SS, Q and K from shared memory (both K-major).
//   O += P V:   wgmma RS, P from registers (the S accumulators rounded to the
//               input type are already in the A-fragment layout), V from
//               shared memory: MN-major for 16-bit types; for fp8, which wgmma
//               reads K-major only, a transposed copy Vt (head dim x keys)
//               whose keys are permuted within each 32 so that the fp8
//               A-fragment of P needs no shuffles (see fp8_prep.cuh), in
//               panels of 64 keys with the 64-byte swizzle, so that BC may be
//               any multiple of 64.
// Step t issues S_t = Q K_t^T and O += P_{t-1} V_{t-1} together, then
// computes the softmax of S_t while the P V GEMM runs, and rescales O once it
// has completed.
#pragma once
#include "fwd_sm90_traits.cuh"
#include "named_barriers.cuh"
#include "score_mods.cuh"
#include "softmax_sm90.cuh"
#include "wgmma.cuh"

namespace cuflash {

// A warp's 16 rows (from row0) x NT_S * 8 keys (from n0) of raw scores, in
// the wgmma accumulator layout, into the kernel's score units
// (score_mods.cuh); where MASK, -inf past nk and outside the causal mask or
// window. A function rather than a lambda of the key loop: NVRTC's front end
// crashed on the lambda.
// ALiBi on a block that lies on one side of the diagonal (sign s of
// i + diag - j, ScoreMods::side): the bias -slope |i + diag - j| of element
// (row lane + dr, column lane + dc) is -s slope (dist_lane + dr) for the row
// plus s slope dc, so each score takes one FMA with the constant dc and the
// row part goes to row_bias[r] (rows lane / 4 + 8 r), which the online softmax
// adds to its row max (two instructions a score cost ALiBi 9-17% of the
// forward). Elsewhere row_bias stays as the caller set it (0) and each score
// takes its |distance|.
// ROW_BIAS: the kernel takes that form (fwd_sm90_kernel: ALiBi at head dims up
// to 128; at 256 it made ptxas spill up to 180 bytes more).
// ALIBI_GEMM: the S GEMM has already added g slope (j - n0) to every score,
// g the sign of i + diag - j on the consumer's 64 rows (+1 where they take
// both; fwd_sm90_kernel). A block on one side of every row of the tile (not
// BAND, and not MASK unless the causal mask puts every visible score on one
// side) keeps it and takes the row part from n0; a masked block without the
// causal mask, or one that holds the tile's diagonal (BAND: KeyOrder's band),
// takes it out again and each score its own |distance|. Which form a block
// takes is a compile-time choice: accumulators written on a runtime branch
// made ptxas serialise the wgmmas (C7520).
template <bool MASK, bool BAND, bool ROW_BIAS, bool ALIBI_GEMM, int NT_S, class Mods>
__device__ __forceinline__ void apply_score_mods(float (&acc_s)[NT_S * 4], const Mods& mods, int row0, int n0,
                                                 int lane, float (&row_bias)[2], int g) {
    if constexpr (MASK || Mods::ANY) {
        const int row_lane = row0 + (lane >> 2), col_lane = n0 + 2 * (lane & 3);
        const float dist_lane = mods.distance(row_lane, col_lane);
        if constexpr (ALIBI_GEMM) {
            if constexpr (!BAND && (!MASK || Mods::ONE_SIDED)) {
                const float dist_n0 = mods.distance(row_lane, n0);
#pragma unroll
                for (int r = 0; r < 2; ++r) row_bias[r] = -(float)g * mods.alibi_slope * (dist_n0 + (float)(8 * r));
                if constexpr (MASK) {
#pragma unroll
                    for (int j = 0; j < NT_S; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const bool seen = mods.visible(row_lane + 8 * (e >> 1), col_lane + j * 8 + (e & 1));
                            acc_s[j * 4 + e] = seen ? acc_s[j * 4 + e] : neg_inf();
                        }
                }
                return;
            }
            const float gemm_slope = (float)g * mods.alibi_slope, kc_lane = (float)(2 * (lane & 3));
#pragma unroll
            for (int j = 0; j < NT_S; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc_s[j * 4 + e] = fmaf(-gemm_slope, kc_lane + (float)(j * 8 + (e & 1)), acc_s[j * 4 + e]);
        } else if constexpr (ROW_BIAS) {
            const int side = mods.side(row0, 16, n0, NT_S * 8);
            if (side != 0) {
                const float signed_slope = side > 0 ? mods.alibi_slope : -mods.alibi_slope;
#pragma unroll
                for (int r = 0; r < 2; ++r) row_bias[r] = -signed_slope * (dist_lane + (float)(8 * r));
#pragma unroll
                for (int j = 0; j < NT_S; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int dr = 8 * (e >> 1), dc = j * 8 + (e & 1);
                        float u = fmaf(signed_slope, (float)dc, mods.transform(acc_s[j * 4 + e]));
                        if (MASK && !mods.visible(row_lane + dr, col_lane + dc)) u = neg_inf();
                        acc_s[j * 4 + e] = u;
                    }
                return;
            }
        }
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int dr = 8 * (e >> 1), dc = j * 8 + (e & 1);
                acc_s[j * 4 + e] = mods.template score<MASK>(acc_s[j * 4 + e], row_lane + dr, col_lane + dc,
                                                             dist_lane + (float)(dr - dc));
            }
    }
}

// A consumer's position in the K/V ring (key blocks consumed) and the parity
// of the work tiles it has taken. Two registers keep the position
// warp-uniform, so that each key step's stage and descriptor arithmetic runs
// on the uniform datapath: one register for both (position times two plus
// parity) left it there on the vector ALU, and head dim 64 ran 2-7% slower.
// The fp8 kernels at head dim 256 spill with two registers: PACKED.
template <bool PACKED>
struct RingPosition {
    int pos = 0, tiles = 0;  // PACKED: pos holds both, tiles is unused
    __device__ __forceinline__ int key_blocks() const { return PACKED ? pos >> 1 : pos; }
    __device__ __forceinline__ int tile_parity() const { return PACKED ? pos & 1 : tiles & 1; }
    __device__ __forceinline__ void advance(int blocks) { pos += PACKED ? 2 * blocks : blocks; }
    __device__ __forceinline__ void next_tile() {
        if constexpr (PACKED)
            pos ^= 1;
        else
            ++tiles;
    }
};

// A consumer's running state over a segment: O (unnormalised), and each of
// the thread's two rows' running max and (per-thread partial) sum.
template <int D>
struct SoftmaxAccumulators {
    float o[D / 2];
    float row_max[2], row_sum[2];
};

}  // namespace cuflash
