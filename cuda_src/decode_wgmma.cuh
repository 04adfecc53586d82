// The decoding kernel's two GEMMs on Hopper (decode_sm80.cuh, WGMMA): each four
// row warps form a warpgroup, which issues each GEMM once for its 64 rows,
// reading K and V from shared memory once a warpgroup where mma.sync read them
// once a warp (and Q's fragments per step): a quarter of the shared-memory
// traffic per key, which bound the mma.sync tile where many query rows share a
// kv head (MQA and wide GQA groups with several queries).
// The ring's 16-bit tiles (tile_offset, D % 64 == 0) are wgmma's 128-byte-
// swizzled layout, and a warp's part of the accumulators is mma.sync's m16n8
// layout (wgmma.cuh), so the masking, softmax and merge code is shared.
#pragma once
#include "sm90_tiles.cuh"
#include "wgmma.cuh"

namespace cuflash {

template <bool IS_BF16>
constexpr int wgmma_dtype() {
    return IS_BF16 ? BF16 : F16;
}

// A descriptor `bytes` further into shared memory: its start-address field (bytes >> 4) advanced. A
// k step's descriptor is the tile's first one plus a constant, a uniform add instead of a rebuild
// (the rebuilds were a fifth of the key loop's instructions); tiles lie below 256 KB, so the field
// never carries into the next.
__device__ __forceinline__ constexpr u64 desc_step(int bytes) {
    return (u64)(bytes >> 4);
}

// Issues acc_s (the warp's 16 rows x BN keys) += Q K^T over the whole head dim: Q's A fragments from
// registers (the warp's rows, mma.sync's layout), K the BN x D ring stage at k_tile (K-major). Q
// from shared memory (wgmma SS) read 4 KB of it per k step of an m64n64k16, as much as the step's
// 32 cycles of tensor work can take; from registers K's 2 KB alone. The caller fences, commits and
// waits.
template <bool IS_BF16, int BN, int D>
__device__ __forceinline__ void wgmma_scores(float (&acc_s)[BN / 8][4], const u32 (&q)[D / 16][4], u32 k_tile) {
    static_assert(D % 64 == 0, "128-byte-swizzled panels of 64 columns");
    float(&d)[BN / 2] = reinterpret_cast<float(&)[BN / 2]>(acc_s);
    const u64 desc0 = desc_k_major_sw128<BN>(k_tile, 0, 0);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
        Wgmma<BN, wgmma_dtype<IS_BF16>()>::template rs<false>(d, q[ks], desc0 + desc_step(ks * 32 % 128 + ks / 4 * BN * 128));
}

// Issues acc_o (the warp's 16 rows x D) += P V: P's A fragments from registers, V the BN x D ring
// stage at v_tile (the MN-major B operand: 64-column panels BN * 128 bytes apart, 8-row atoms 1024
// apart). The caller fences, commits and waits, and leaves acc_o and p alone until the wait.
template <bool IS_BF16, int BN, int D>
__device__ __forceinline__ void wgmma_pv(float (&acc_o)[D / 8][4], const u32 (&p)[BN / 16][4], u32 v_tile) {
    float(&d)[D / 2] = reinterpret_cast<float(&)[D / 2]>(acc_o);
    const u64 desc0 = desc_mn_major_sw128<BN * 128, 1024>(v_tile, 0);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<D, wgmma_dtype<IS_BF16>()>::template rs<true>(d, p[kk], desc0 + desc_step(kk * 16 * 128));
}

}  // namespace cuflash
