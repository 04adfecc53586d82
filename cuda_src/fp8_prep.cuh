// fp8 attention's V operand: wgmma reads fp8 B operands K-major only, so the
// Hopper kernel multiplies P by Vt, V transposed to (batch, kv head, head dim,
// keys) with keys contiguous. Within each group of 32 keys, slot s holds key
//   (s & 16) + 2 * ((s & 15) >> 2) + {0, 1, 8, 9}[s & 3]
// which is the key order of P's fp8 A fragments built straight from the S
// accumulators (sm90_tiles.cuh: AFragments). Keys past nk (up to nk_pad, a
// multiple of 64) are zeros.
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ int vt_slot_key(int s) {
    const int q = s & 3;
    return (s & ~15) + 2 * ((s & 15) >> 2) + (q < 2 ? q : 8 + (q & 1));
}

// One CTA of 256 threads moves VT_BLOCK_KEYS keys x 64 columns through shared
// memory, 64 keys at a time: 16-byte loads along the head dim (all in flight
// before the first is stored), 16-byte stores along the keys. 128 keys per
// CTA: 31 µs for V of 2 x 8k x 16 x 128 on an H100, against 34 with 64 and
// 33-41 with 256 (more CTAs in flight per SM matter as much as loads).
// Grid: (batch * kv heads, ceil(nk_pad / VT_BLOCK_KEYS), ceil(d / 64)) (x has
// no 65535 limit).
constexpr int VT_BLOCK_KEYS = 128;

__global__ void __launch_bounds__(256) fp8_transpose_v_kernel(const unsigned char* __restrict__ v,
                                                               unsigned char* __restrict__ vt, int nk, int nk_pad,
                                                               int d, int heads_kv, long long v_sb, long long v_sn,
                                                               long long v_sh) {
    constexpr int PASSES = VT_BLOCK_KEYS / 64;
    __shared__ __align__(16) unsigned char tile[PASSES][64][64 + 16];
    const int tid = threadIdx.x;
    const int n0 = blockIdx.y * VT_BLOCK_KEYS, d0 = blockIdx.z * 64;
    const int b = blockIdx.x / heads_kv, h = blockIdx.x % heads_kv;

    {
        const int key = tid >> 2, col = 16 * (tid & 3);
        uint4 x[PASSES];
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            const int n = n0 + 64 * p + key;
            x[p] = make_uint4(0, 0, 0, 0);
            if (n < nk && d0 + col < d)
                x[p] = *reinterpret_cast<const uint4*>(v + b * v_sb + (long long)n * v_sn + h * v_sh + d0 + col);
        }
#pragma unroll
        for (int p = 0; p < PASSES; ++p) *reinterpret_cast<uint4*>(&tile[p][key][col]) = x[p];
    }
    __syncthreads();

    const int row = tid >> 2, slot0 = 16 * (tid & 3);
    if (d0 + row >= d) return;
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        if (n0 + 64 * p >= nk_pad) return;
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 word = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) word |= (u32)tile[p][vt_slot_key(slot0 + 4 * i + j)][row] << (8 * j);
            w[i] = word;
        }
        unsigned char* dst = vt + (((long long)blockIdx.x * d + d0 + row) * nk_pad) + n0 + 64 * p + slot0;
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

}  // namespace cuflash
