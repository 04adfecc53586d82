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

// One CTA of 256 threads moves a 64-key x 64-column block through shared
// memory: 16-byte loads along the head dim, 16-byte stores along the keys.
// Grid: (batch * kv heads, nk_pad / 64, ceil(d / 64)) (x has no 65535 limit).
__global__ void __launch_bounds__(256) fp8_transpose_v_kernel(const unsigned char* __restrict__ v,
                                                               unsigned char* __restrict__ vt, int nk, int nk_pad,
                                                               int d, int heads_kv, long long v_sb, long long v_sn,
                                                               long long v_sh) {
    __shared__ __align__(16) unsigned char tile[64][64 + 16];
    const int tid = threadIdx.x;
    const int n0 = blockIdx.y * 64, d0 = blockIdx.z * 64;
    const int b = blockIdx.x / heads_kv, h = blockIdx.x % heads_kv;

    {
        const int key = tid >> 2, col = 16 * (tid & 3);
        uint4 x = make_uint4(0, 0, 0, 0);
        if (n0 + key < nk && d0 + col < d)
            x = *reinterpret_cast<const uint4*>(v + b * v_sb + (long long)(n0 + key) * v_sn + h * v_sh + d0 + col);
        *reinterpret_cast<uint4*>(&tile[key][col]) = x;
    }
    __syncthreads();

    const int row = tid >> 2, slot0 = 16 * (tid & 3);
    if (d0 + row >= d) return;
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 word = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) word |= (u32)tile[vt_slot_key(slot0 + 4 * i + j)][row] << (8 * j);
        w[i] = word;
    }
    unsigned char* dst = vt + (((long long)blockIdx.x * d + d0 + row) * nk_pad) + n0 + slot0;
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace cuflash
