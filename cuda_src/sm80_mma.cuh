// Warp-level GEMMs and fragment moves of the sm_80 kernels (mma.sync
// m16n8k16, operands from shared memory through ldmatrix), shared by the
// forward (fwd_sm80.cuh) and the backward (bwd_sm80.cuh).
//
// Element e of a lane's m16n8 accumulator tile sits at row (lane / 4) +
// 8 * (e / 2) and column 2 * (lane % 4) + (e % 2). A warp's accumulator of
// MT 16-row tiles by NT 8-column tiles is float[MT][NT][4]; with one row tile
// it is float[NT][4].
#pragma once
#include "common.cuh"

namespace cuflash {

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

// One k16 step of acc[MT][NT] += A B: B's fragments from [n][k] storage
// (non-transposed ldmatrix, rows b_row0.., k chunk 2 ks), each read once and
// applied to the MT row tiles; a_at(mt, scratch) returns row tile mt's A
// fragment of this step: one held in registers, or `scratch` loaded from
// shared memory.
template <bool BF16, int MT, int NT, class AAt, class BOff>
__device__ __forceinline__ void mma_k_step_nt(float (&acc)[MT][NT][4], AAt&& a_at, u32 b_smem, const BOff& b_off,
                                              int b_row0, int ks) {
#pragma unroll
    for (int nj = 0; nj < NT / 2; ++nj) {
        u32 bb[4];  // B fragments of rows b_row0 + nj*16 .. +15
        ldmatrix_x4(bb, b_smem + b_off.at(b_row0 + nj * 16, ks * 2));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 scratch[4];
            const u32(&a)[4] = a_at(mt, scratch);
            mma_16816<BF16>(acc[mt][2 * nj], a, bb[0], bb[1]);
            mma_16816<BF16>(acc[mt][2 * nj + 1], a, bb[2], bb[3]);
        }
    }
}

// acc[NT][4] (16 x 8*NT) += A (16 x 16*KS) * B, A fragments read from shared
// memory through `a_off` (rows a_row0.., row-major [m][k] storage) and B from
// [n][k] storage (non-transposed ldmatrix, rows b_row0..) through `b_off`.
template <bool BF16, int KS, int NT, class AOff, class BOff>
__device__ __forceinline__ void gemm_ss_nt(float (&acc)[NT][4], u32 a_smem, const AOff& a_off, int a_row0,
                                           u32 b_smem, const BOff& b_off, int b_row0) {
    auto& acc1 = reinterpret_cast<float(&)[1][NT][4]>(acc);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        u32 a[4];
        ldmatrix_x4(a, a_smem + a_off.at(a_row0, ks * 2));
        mma_k_step_nt<BF16>(
            acc1, [&](int, u32(&)[4]) -> const u32(&)[4] { return a; }, b_smem, b_off, b_row0, ks);
    }
}

// acc[MT][NT][4] += A * B with A from registers (MT row tiles of KS k16
// fragments) and B from [k][n] storage (transposed ldmatrix), rows starting
// at b_row0; each B fragment is read once for the MT row tiles.
template <bool BF16, int MT, int KS, int NT, class BOff>
__device__ __forceinline__ void gemm_rs_nn(float (&acc)[MT][NT][4], const u32 (&a)[MT][KS][4], u32 b_smem,
                                           const BOff& b_off, int b_row0) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int dn = 0; dn < NT / 2; ++dn) {
            u32 bb[4];  // B fragments of rows b_row0 + kk*16 .. +15, columns dn*16 .. +15
            ldmatrix_x4_trans(bb, b_smem + b_off.at(b_row0 + kk * 16, dn * 2));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<BF16>(acc[mt][2 * dn], a[mt][kk], bb[0], bb[1]);
                mma_16816<BF16>(acc[mt][2 * dn + 1], a[mt][kk], bb[2], bb[3]);
            }
        }
    }
}
template <bool BF16, int KS, int NT, class BOff>
__device__ __forceinline__ void gemm_rs_nn(float (&acc)[NT][4], const u32 (&a)[KS][4], u32 b_smem, const BOff& b_off,
                                           int b_row0) {
    gemm_rs_nn<BF16>(reinterpret_cast<float(&)[1][NT][4]>(acc), reinterpret_cast<const u32(&)[1][KS][4]>(a), b_smem,
                     b_off, b_row0);
}

// Accumulator tiles 2k, 2k+1 of a 16 x 8*NT fp32 accumulator, rounded to
// 16-bit: the A fragment of k16 step k.
template <bool BF16, int NT>
__device__ __forceinline__ void acc_to_a(u32 (&a)[NT / 2][4], const float (&acc)[NT][4]) {
#pragma unroll
    for (int k = 0; k < NT / 2; ++k) {
        a[k][0] = pack2<BF16>(acc[2 * k][0], acc[2 * k][1]);
        a[k][1] = pack2<BF16>(acc[2 * k][2], acc[2 * k][3]);
        a[k][2] = pack2<BF16>(acc[2 * k + 1][0], acc[2 * k + 1][1]);
        a[k][3] = pack2<BF16>(acc[2 * k + 1][2], acc[2 * k + 1][3]);
    }
}

// Writes a warp's 16 x D fp32 accumulator, times `mul`, as 16-bit values into
// rows row0.. of a swizzled ROWS x D shared-memory tile.
template <bool BF16, int ROWS, int D>
__device__ __forceinline__ void acc_to_smem(u16* tile, const float (&acc)[D / 8][4], int row0, float mul, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + (lane >> 2) + 8 * r;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int col = j * 8 + 2 * (lane & 3);
            *reinterpret_cast<u32*>(tile + tile_offset<ROWS, D>(row, col >> 3) + (col & 7)) =
                pack2<BF16>(acc[j][2 * r] * mul, acc[j][2 * r + 1] * mul);
        }
    }
}

}  // namespace cuflash
