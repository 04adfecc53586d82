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

// One CTA of 256 threads moves VT_BLOCK_KEYS = 128 keys x VT_BLOCK_COLS = 128
// head-dim columns through shared memory (d is a multiple of 16: the API's
// fp8 rows are whole 16-byte chunks). Loads: 16-byte chunks of V rows, four per
// thread in flight, kept with chunk c of key n at chunk c ^ ((n / 16) % 8).
// Transpose: warp w holds columns 16w .. 16w + 15, lane l the 16-key chunk
// l / 4 and the columns 16w + 4 (l % 4) .. + 3; four 4 x 4 byte transposes of
// words read from keys 2i + {0, 1, 8, 9} (i = 0..3) give its 16 slot-ordered
// key bytes of four Vt rows (reads: 32 distinct banks under the swizzle),
// which go out as 16-byte stores, 8 lanes filling 128 contiguous bytes of a
// row. Grid: (batch * kv heads, ceil(nk_pad / VT_BLOCK_KEYS), ceil(d / 128))
// (x has no 65535 limit).
constexpr int VT_BLOCK_KEYS = 128, VT_BLOCK_COLS = 128;
// The lane and warp maps below: 8 lanes' 16-key chunks per 128 keys, 8 warps'
// 16 columns per 128 columns.
static_assert(VT_BLOCK_KEYS == 8 * 16 && VT_BLOCK_COLS == 8 * 16, "one CTA of 8 warps");

__global__ void __launch_bounds__(256) fp8_transpose_v_kernel(const unsigned char* __restrict__ v,
                                                               unsigned char* __restrict__ vt, int nk, int nk_pad,
                                                               int d, int heads_kv, long long v_sb, long long v_sn,
                                                               long long v_sh) {
    constexpr int COLS = VT_BLOCK_COLS, LOADS = VT_BLOCK_KEYS * COLS / 16 / 256;
    __shared__ __align__(16) unsigned char tile[VT_BLOCK_KEYS * COLS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.y * VT_BLOCK_KEYS, d0 = blockIdx.z * COLS;
    const int b = blockIdx.x / heads_kv, h = blockIdx.x % heads_kv;
    auto at = [](int key, int chunk) { return key * COLS + ((chunk ^ ((key >> 4) & 7)) << 4); };

    {
        uint4 x[LOADS];
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int c = tid + 256 * i, key = c >> 3, col = 16 * (c & 7), n = n0 + key;
            x[i] = make_uint4(0, 0, 0, 0);
            if (n < nk && d0 + col < d)
                x[i] = *reinterpret_cast<const uint4*>(v + b * v_sb + (long long)n * v_sn + h * v_sh + d0 + col);
        }
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int c = tid + 256 * i;
            *reinterpret_cast<uint4*>(tile + at(c >> 3, c & 7)) = x[i];
        }
    }
    __syncthreads();

    const int q = lane >> 2, col = 16 * warp + 4 * (lane & 3);
    if (n0 + 16 * q >= nk_pad || d0 + col >= d) return;
    u32 out[4][4];  // out[j][i]: word i of Vt row col + j
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 a[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
            a[e] = *reinterpret_cast<const u32*>(tile + at(16 * q + 2 * i + (e & 1) + 8 * (e >> 1), warp) +
                                                 4 * (lane & 3));
        const u32 lo01 = __byte_perm(a[0], a[1], 0x5140), lo23 = __byte_perm(a[2], a[3], 0x5140);
        const u32 hi01 = __byte_perm(a[0], a[1], 0x7362), hi23 = __byte_perm(a[2], a[3], 0x7362);
        out[0][i] = __byte_perm(lo01, lo23, 0x5410);
        out[1][i] = __byte_perm(lo01, lo23, 0x7632);
        out[2][i] = __byte_perm(hi01, hi23, 0x5410);
        out[3][i] = __byte_perm(hi01, hi23, 0x7632);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // col + j < d: d is a multiple of 16
        unsigned char* dst = vt + ((long long)blockIdx.x * d + d0 + col + j) * nk_pad + n0 + 16 * q;
        *reinterpret_cast<uint4*>(dst) = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
    }
}

}  // namespace cuflash
