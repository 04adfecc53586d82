// fp8 attention's V operand: wgmma reads fp8 B operands K-major only, so the
// Hopper kernel multiplies P by Vt, V transposed to (batch, kv head, head dim,
// keys) with keys contiguous. Within each group of 32 keys, slot s holds key
//   (s & 16) + 2 * ((s & 15) >> 2) + {0, 1, 8, 9}[s & 3]
// which is the key order of P's fp8 A fragments built straight from the S
// accumulators (sm90_tiles.cuh: AFragments). Keys past nk (up to nk_pad, a
// multiple of 64) are zeros.
//
// Varlen (a packed batch, seq_span.cuh): Vt is (1, kv head, head dim,
// total_pad) and sequence b's keys start at vt_key0(b), a multiple of
// VT_KEY_PAD, so that the permuted groups and the forward's 64-key panels
// start at the sequence's first key; nk_pad is then total_pad.
#pragma once
#include "common.cuh"
#include "seq_span.cuh"

namespace cuflash {

// Vt's key padding: the Hopper kernel's 64-key Vt panels (and the 32-key groups and 16-key chunks).
constexpr int VT_KEY_PAD = 64;

// Varlen: where sequence b's keys start in Vt (at least its padded length past sequence b - 1's start).
__device__ __forceinline__ int vt_key0(int k0, int b) { return (k0 + b * VT_KEY_PAD) / VT_KEY_PAD * VT_KEY_PAD; }

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
// (x has no 65535 limit); varlen: (sequences * kv heads, the longest
// sequence's padded keys / VT_BLOCK_KEYS, ...), each sequence's keys from its own start.
constexpr int VT_BLOCK_KEYS = 128, VT_BLOCK_COLS = 128;
// The lane and warp maps below: 8 lanes' 16-key chunks per 128 keys, 8 warps'
// 16 columns per 128 columns.
static_assert(VT_BLOCK_KEYS == 8 * 16 && VT_BLOCK_COLS == 8 * 16, "one CTA of 8 warps");

template <bool VARLEN>
__global__ void __launch_bounds__(256) fp8_transpose_v_kernel(const unsigned char* __restrict__ v,
                                                               unsigned char* __restrict__ vt, int nk, int nk_pad,
                                                               int d, int heads_kv, long long v_sb, long long v_sn,
                                                               long long v_sh, const int* __restrict__ cu_seqlens_k,
                                                               int total_k) {
    constexpr int COLS = VT_BLOCK_COLS, LOADS = VT_BLOCK_KEYS * COLS / 16 / 256;
    __shared__ __align__(16) unsigned char tile[VT_BLOCK_KEYS * COLS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.y * VT_BLOCK_KEYS, d0 = blockIdx.z * COLS;
    const int b = blockIdx.x / heads_kv, h = blockIdx.x % heads_kv;
    // Varlen: this sequence's keys, written from its start in Vt (row h of batch 0).
    long long vt_row0 = (long long)blockIdx.x * d, vt_key = 0;
    int keys_pad = nk_pad;
    if constexpr (VARLEN) {
        ScoreModArgs offsets{};  // seq_span's clamps, keys only
        offsets.cu_seqlens_q = offsets.cu_seqlens_k = cu_seqlens_k;
        offsets.total_q = offsets.total_k = total_k;
        const SeqSpan seq = seq_span<true>(offsets, b, 0, nk);
        v += seq.k0 * v_sn;
        nk = seq.nk;
        keys_pad = (nk + VT_KEY_PAD - 1) / VT_KEY_PAD * VT_KEY_PAD;
        vt_row0 = (long long)h * d;
        vt_key = vt_key0(seq.k0, b);
    }
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
    if (n0 + 16 * q >= keys_pad || d0 + col >= d) return;
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
        unsigned char* dst = vt + (vt_row0 + d0 + col + j) * nk_pad + vt_key + n0 + 16 * q;
        *reinterpret_cast<uint4*>(dst) = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
    }
}

}  // namespace cuflash
