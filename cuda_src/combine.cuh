// Merging partial attention results by their logsumexps: the outputs O_s and
// lse_s of one query row over S disjoint key sets (the splits of a decoding
// step, the steps of a ring) combine exactly into
//   lse = log sum_s e^{lse_s},  O = sum_s e^{lse_s - lse} O_s.
// A key set that held no key has lse_s = -inf and weighs 0; a row whose sets
// are all empty gets O = 0 and lse = -inf.
#pragma once
#include "common.cuh"

namespace cuflash {

constexpr int COMBINE_OUT_F16 = 0;
constexpr int COMBINE_OUT_BF16 = 1;
constexpr int COMBINE_OUT_F32 = 2;

// Kernel parameter (cuflash/combine.py packs it, field for field). Rows are (b, n, h);
// every array's last dim (d) is contiguous; strides in elements.
struct CombineArgs {
    const float* partial_o;    // (S, B, N, H, d)
    const float* partial_lse;  // (S, B, N, H) by its strides
    void* out;                 // (B, N, H, d)
    float* lse;                // (B, N, H) by its strides; null: not written
    long long po_ss, po_sb, po_sn, po_sh;
    long long pl_ss, pl_sb, pl_sn, pl_sh;
    long long o_sb, o_sn, o_sh;
    long long l_sb, l_sn, l_sh;
    int num_splits, batch, seqlen, nheads, d;
};

// The merged lse of a row whose splits' logsumexps have maximum m and sum_s e^{lse_s - m} = sum;
// m = +inf (a set with an infinite score) or NaN carry through as the reference's.
__device__ __forceinline__ float merged_lse(float m, float sum) {
    return m == neg_inf() ? neg_inf() : (m == pos_inf() ? m : m + log2_approx(sum) * LN2);
}

// Split s's weight e^{lse_s - lse} in the merged output: 0 for a set without keys.
__device__ __forceinline__ float split_weight(float lse_s, float lse) {
    return lse_s == neg_inf() ? 0.f : exp2_approx((lse_s - lse) * LOG2E);
}

// The merged lse of one row from its splits' lse_row[s * l_ss] (global or shared memory), by one
// warp (every lane gets it).
__device__ __forceinline__ float warp_merged_lse(const float* lse_row, long long l_ss, int num_splits, int lane) {
    float m = neg_inf();
    for (int s = lane; s < num_splits; s += 32) m = fmaxf(m, lse_row[s * l_ss]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.f;
    if (m != neg_inf())
        for (int s = lane; s < num_splits; s += 32) sum += exp2_approx((lse_row[s * l_ss] - m) * LOG2E);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    return merged_lse(m, sum);
}

// Splits whose outputs (a lane's first 4 columns) combine_row<OUT, true> loads before it merges the
// logsumexps, so that the outputs' round trip to memory overlaps the logsumexps' instead of following
// it: a decoding step's partials (its clusters', or its splits') are mostly this few. The registers
// that hold them (107-109 a thread on sm_90, against 78-80) leave 4 CTAs an SM, so the host takes
// this form for grids of few rows (decode_launch.COMBINE_PREFETCH_MAX_CTAS_PER_SM).
constexpr int COMBINE_PREFETCH_SPLITS = 8;

// One row's merge by one warp: lse_row[s * l_ss] and o_row[s * o_ss + col] are split s's
// logsumexp and output (d columns); writes d columns at out_row (OUT: fp16, bf16 or fp32)
// and, where lse_out is not null, the row's lse. A decoding step combines few rows over many
// splits, so this is latency-bound: each lane turns one split's lse into its weight, and the
// loop over the splits' outputs takes the weights by shuffle and has no load that depends on
// another (unrolled, the loads of 8 splits are in flight at once; a loop that read each split's
// lse before its output took ~1 us a split). PREFETCH: the first COMBINE_PREFETCH_SPLITS splits'
// first 128 columns are loaded before the lse merge.
template <int OUT, bool PREFETCH>
__device__ __forceinline__ void combine_row(const float* lse_row, long long l_ss, const float* o_row, long long o_ss,
                                            int num_splits, int d, void* out_row, float* lse_out, int lane) {
    float4 ahead[PREFETCH ? COMBINE_PREFETCH_SPLITS : 1];
#pragma unroll
    for (int j = 0; j < (PREFETCH ? COMBINE_PREFETCH_SPLITS : 0); ++j)
        ahead[j] = j < num_splits && 4 * lane < d ? *reinterpret_cast<const float4*>(o_row + j * o_ss + 4 * lane)
                                                  : make_float4(0.f, 0.f, 0.f, 0.f);
    const float lse = warp_merged_lse(lse_row, l_ss, num_splits, lane);

    // Every lane runs every pass of the column loop, since the weights travel by full-warp
    // shuffles; lanes past d (head dims that are not a multiple of 128) load and store nothing.
    for (int col0 = 0; col0 < d; col0 += 128) {
        const int col = col0 + 4 * lane;
        const bool active = col < d;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int base = 0; base < num_splits && lse != neg_inf(); base += 32) {
            const int mine = base + lane;
            const float weight = mine < num_splits ? split_weight(lse_row[mine * l_ss], lse) : 0.f;
            const int count = min(32, num_splits - base);
            const float* o_split = o_row + (long long)base * o_ss + col;
            int first = 0;  // splits taken from `ahead`
            if constexpr (PREFETCH) {
                if (col0 == 0 && base == 0) {
#pragma unroll
                    for (int j = 0; j < COMBINE_PREFETCH_SPLITS; ++j) {
                        const float w = __shfl_sync(0xffffffffu, weight, j);  // 0 past num_splits
                        const float4 os = ahead[j];
                        if (w != 0.f)
                            o = make_float4(fmaf(w, os.x, o.x), fmaf(w, os.y, o.y), fmaf(w, os.z, o.z),
                                            fmaf(w, os.w, o.w));
                    }
                    first = COMBINE_PREFETCH_SPLITS;
                }
            }
#pragma unroll 8
            for (int j = first; j < count; ++j) {
                const float w = __shfl_sync(0xffffffffu, weight, j);
                const float4 os = active ? *reinterpret_cast<const float4*>(o_split + j * o_ss)
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
                if (w != 0.f)  // a set without keys adds nothing, whatever its output holds
                    o = make_float4(fmaf(w, os.x, o.x), fmaf(w, os.y, o.y), fmaf(w, os.z, o.z), fmaf(w, os.w, o.w));
            }
        }
        if (!active) continue;
        if constexpr (OUT == COMBINE_OUT_F32) {
            *reinterpret_cast<float4*>(static_cast<float*>(out_row) + col) = o;
        } else {
            *reinterpret_cast<uint2*>(static_cast<u16*>(out_row) + col) =
                make_uint2(pack2<OUT == COMBINE_OUT_BF16>(o.x, o.y), pack2<OUT == COMBINE_OUT_BF16>(o.z, o.w));
        }
    }
    if (lane == 0 && lse_out != nullptr) *lse_out = lse;
}

// One warp per row, 4 rows per CTA of 128 threads.
template <int OUT, bool PREFETCH>
__global__ void __launch_bounds__(128, 4) combine_kernel(const CombineArgs a) {
    wait_prior_grid();  // the partials' writer, where this launch follows it programmatically (sm_90)
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= (long long)a.batch * a.seqlen * a.nheads) return;
    const int h = row % a.nheads, n = (row / a.nheads) % a.seqlen, b = row / ((long long)a.nheads * a.seqlen);
    constexpr int OUT_BYTES = OUT == COMBINE_OUT_F32 ? 4 : 2;
    char* out_row = static_cast<char*>(a.out) + (b * a.o_sb + n * a.o_sn + h * a.o_sh) * OUT_BYTES;
    combine_row<OUT, PREFETCH>(a.partial_lse + b * a.pl_sb + n * a.pl_sn + h * a.pl_sh, a.pl_ss,
                     a.partial_o + b * a.po_sb + n * a.po_sn + h * a.po_sh, a.po_ss, a.num_splits, a.d, out_row,
                     a.lse != nullptr ? a.lse + b * a.l_sb + n * a.l_sn + h * a.l_sh : nullptr, lane);
}

}  // namespace cuflash
