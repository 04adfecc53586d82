// Where a key of a KV cache lives, the in-place append of new keys and
// values, and rotary embedding: the parts the decoding kernel
// (decode_sm80.cuh) builds on.
//
// A cache is contiguous, (B_cache, N_max, Hk, D) with batch b in cache row
// cache_batch_idx[b] (b without it), or paged, (num_pages, page_size, Hk, D)
// with key j of batch b at row j % page_size of page block_table[b, j / page_size].
// Batch b's keys are cache positions [leftpad, cache_len + n_new): the first
// cache_len - leftpad are in the cache, the n_new new ones come from k_new and
// v_new and are written to positions [cache_len, cache_len + n_new) by the same
// launch. No position at or past the cache's capacity is read or written,
// whatever the device-side lengths hold: they are clamped here.
//
// Rotary embedding (rotary_dim > 0) turns new key t at position cache_len + t
// and q row i at cache_len + rotary_q_step * i (flash-attn's convention: step 1
// in causal or windowed steps, else 0, every row at cache_len), with cos/sin
// tables (rows, rotary_dim / 2):
//   interleaved  (x[2p], x[2p+1])        -> (x cos - y sin, x sin + y cos) at cos[pos, p];
//   half-split   (x[p], x[p + rd / 2])   -> the same pair rotation, p < rd / 2.
// Columns at or past rotary_dim are left as they are.
//
// An fp8 cache (FP8) holds e4m3 bytes with a descale per (batch, kv head):
// key = e4m3 * k_descale[b, hk] (values likewise). New keys and values arrive in
// q's dtype and are stored as e4m3(x / descale), rounded to nearest even and
// saturated at +-448 (after the rotation, whose result is rounded to q's dtype
// first). The e4m3 conversions need sm_89 or later.
#pragma once
#include "common.cuh"

namespace cuflash {

// Kernel parameter (cuflash/kv_cache.py packs it, field for field).
struct KVCacheArgs {
    const u16* q;            // (B, nq, H, D)
    u16* k_cache;            // contiguous (B_cache, N_max, Hk, D) or paged (num_pages, page_size, Hk, D)
    u16* v_cache;
    const u16* k_new;        // (B, n_new, Hk, D); null without new keys
    const u16* v_new;
    u16* out;                // (B, nq, H, D)
    float* lse;              // (B, H, nq)
    float* partial_o;        // split keys: (num_splits, B, nq, H, D) fp32, each split's normalised output
    float* partial_lse;      // (num_splits, B, nq, H)
    const int* cache_seqlens;    // (B,): keys in the cache before the call; null: every batch has cache_len_all
    const int* cache_batch_idx;  // (B,) contiguous cache row of batch b; null: b
    const int* cache_leftpad;    // (B,) first attended position; null: 0
    const int* block_table;      // paged: (B, max_pages) page ids
    const int* cu_seqlens_q;     // a packed batch (paged prefill): q (total_q, H, D), sequence b from row
                                 // cu_seqlens_q[b]; lse (H, total_q); null: q (B, nq, H, D)
    const int* cu_seqlens_k;     // with it, batch b's cache holds cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys
    const u16* rotary_cos;       // (rotary_rows, rotary_dim / 2), q's dtype; null without rotary
    const u16* rotary_sin;
    const float* k_descale;      // an fp8 cache: (B, Hk) fp32 dequantisation scales; null: 1
    const float* v_descale;
    int* splits_done;            // split keys: per (batch x Hk, row block), the split CTAs finished; 0 between launches
    long long q_sb, q_sn, q_sh;
    long long kc_sb, kc_sn, kc_sh;   // k_cache strides: batch (paged: page), position, head
    long long vc_sb, vc_sn, vc_sh;
    long long kn_sb, kn_sn, kn_sh;   // k_new strides
    long long vn_sb, vn_sn, vn_sh;
    long long o_sb, o_sn, o_sh;
    long long block_table_stride;
    int nq, n_new, nheads, nheads_kv, group, d;  // nq: the longest sequence's queries in a packed batch
    int total_q;
    int cache_len_all;   // every batch's cache_len when cache_seqlens is null
    int capacity;        // positions a batch may hold: N_max, or max_pages * page_size
    int cache_rows;      // B_cache (contiguous) or num_pages (paged): bounds cache_batch_idx and page ids
    int page_size;
    unsigned page_mul;   // j / page_size = (umulhi(j, page_mul) + j) >> page_shift (cuflash/decode_launch.py)
    int page_shift;
    int rotary_dim, rotary_interleaved, rotary_rows;
    int rotary_q_step;   // q row i's rotary position: cache_len + rotary_q_step * i
    int num_splits;
    int merge_in_cluster;  // sm_90: CTAs a cluster of a row block's splits, which merges them; 0: none
    float scale_log2;
};

// Batch b's key positions: [leftpad, end) attended, [cache_len, end) new.
struct CacheSpan {
    int leftpad, cache_len, end;
    int cache_row;  // contiguous cache: the batch's row
};

// Batch b's queries: rows [q0, q0 + nq) of q (q0 = 0 unless packed).
struct QuerySpan {
    int q0, nq;
};

__device__ __forceinline__ QuerySpan query_span(const KVCacheArgs& a, int b) {
    if (a.cu_seqlens_q == nullptr) return QuerySpan{0, a.nq};
    const int q0 = min(max(__ldg(a.cu_seqlens_q + b), 0), a.total_q);
    const int q1 = min(max(__ldg(a.cu_seqlens_q + b + 1), q0), a.total_q);
    return QuerySpan{q0, min(q1 - q0, a.nq)};
}

__device__ __forceinline__ CacheSpan cache_span(const KVCacheArgs& a, int b) {
    CacheSpan s;
    const int len = a.cu_seqlens_k ? __ldg(a.cu_seqlens_k + b + 1) - __ldg(a.cu_seqlens_k + b)
                                   : (a.cache_seqlens ? __ldg(a.cache_seqlens + b) : a.cache_len_all);
    s.cache_len = min(max(len, 0), a.capacity);
    s.end = min(s.cache_len + a.n_new, a.capacity);
    s.leftpad = a.cache_leftpad ? min(max(__ldg(a.cache_leftpad + b), 0), s.cache_len) : 0;
    s.cache_row = a.cache_batch_idx ? min(max(__ldg(a.cache_batch_idx + b), 0), a.cache_rows - 1) : b;
    return s;
}

// Where position j of batch b lies: `unit` (the batch's cache row, or the page)
// and `row` within it; element offset unit * sb + row * sn + hk * sh (head_of, row_at). A
// paged cache's page id comes from page_of, read ahead by the caller so that the page-table
// loads of several rows are in flight together.
struct CachePos {
    int unit;
    int row;
};
// j / page_size for 0 <= j < 2^31 by a multiply (Granlund-Montgomery; an integer
// division is ~20 instructions, and the paged loads are issue-bound).
__device__ __forceinline__ int page_index(const KVCacheArgs& a, int j) {
    return (__umulhi((u32)j, a.page_mul) + (u32)j) >> a.page_shift;
}
// The load is volatile asm, so that it issues where it is written: the compiler
// otherwise sinks a read-ahead load to just before its use.
__device__ __forceinline__ int page_of(const KVCacheArgs& a, int b, int j) {
    int page;
    asm volatile("ld.global.nc.s32 %0, [%1];\n"
                 : "=r"(page)
                 : "l"(a.block_table + b * a.block_table_stride + page_index(a, j))
                 : "memory");
    return page;
}
__device__ __forceinline__ int clamp_page(const KVCacheArgs& a, int page) { return min(max(page, 0), a.cache_rows - 1); }
template <bool PAGED>
__device__ __forceinline__ CachePos cache_pos(const KVCacheArgs& a, const CacheSpan& span, int j, int page) {
    if constexpr (PAGED) {
        return CachePos{clamp_page(a, page), j - page_index(a, j) * a.page_size};
    } else {
        return CachePos{span.cache_row, j};
    }
}
// A cached row's address, from its kv head's first byte `head` (a contiguous cache's batch row
// included: head_of) and 32-bit strides, which the host keeps below 2^32 (cuflash/kv_cache.py):
// one or two wide multiply-adds (IMAD.WIDE.U32). Three 64-bit products per row made the
// decoding tile's copies issue-bound (bench/PERFLOG.md). ELEM_BYTES: 2, or 1 for an fp8 cache.
template <bool PAGED, int ELEM_BYTES>
__device__ __forceinline__ const unsigned char* head_of(const u16* cache, long long sb, long long sh, int hk,
                                                        const CacheSpan& span, int offset) {
    return reinterpret_cast<const unsigned char*>(cache) + ELEM_BYTES * (hk * sh + (PAGED ? 0 : span.cache_row * sb)) +
           offset;
}
template <bool PAGED, int ELEM_BYTES>
__device__ __forceinline__ const unsigned char* row_at(const unsigned char* head, const CachePos& p, long long sb,
                                                       long long sn) {
    const u64 in_unit = (u64)(u32)p.row * (u32)sn;
    return head + ELEM_BYTES * (PAGED ? (u64)(u32)p.unit * (u32)sb + in_unit : in_unit);
}

__device__ __forceinline__ float half_to_float(u16 x, bool bf16) {
    if (bf16) return __uint_as_float((u32)x << 16);
    float y;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(y) : "h"(x));
    return y;
}
template <bool BF16>
__device__ __forceinline__ u16 float_to_half(float x) {
    const u32 two = pack2<BF16>(x, 0.f);
    return (u16)(two & 0xffffu);
}

// Rotary's arithmetic on one interleaved pair (x[2p], x[2p + 1]) into y, and on one half-split
// element x with its partner `other` (`first`: x in the first half), at the angle whose cosine and
// sine are c and s.
template <bool BF16>
__device__ __forceinline__ void rotate_pair(const u16* x, int p, float c, float s, u16* y) {
    const float x0 = half_to_float(x[2 * p], BF16), x1 = half_to_float(x[2 * p + 1], BF16);
    y[2 * p] = float_to_half<BF16>(x0 * c - x1 * s);
    y[2 * p + 1] = float_to_half<BF16>(x0 * s + x1 * c);
}
template <bool BF16>
__device__ __forceinline__ u16 rotate_half_split(const u16* x, const u16* other, int e, bool first, float c,
                                                 float s) {
    const float xe = half_to_float(x[e], BF16), oe = half_to_float(other[e], BF16);
    // first half: x cos - x[p + half] sin; second half: x cos + x[p - half] sin
    return float_to_half<BF16>(first ? xe * c - oe * s : xe * c + oe * s);
}

// The cos/sin tables' index of the first value that rotates the chunk at columns [col, col + 8)
// (col < rotary_dim) at position `pos` (positions past the tables' rows take the last row):
// interleaved, pair p of the chunk takes index + p; half-split, element e takes index + e.
__device__ __forceinline__ int rotary_table_index(const KVCacheArgs& a, int col, int pos) {
    const int half = a.rotary_dim / 2;
    return min(pos, a.rotary_rows - 1) * half + (a.rotary_interleaved ? col / 2 : (col < half ? col : col - half));
}

// The 8 elements at columns [col, col + 8) of a row, rotated at position `pos`
// (columns at or past d read as 0). rotary_dim is a multiple of 16, so a chunk
// lies wholly inside or outside the rotated columns, and a half-split chunk's
// partner chunk is rotary_dim / 2 away.
template <bool BF16>
__device__ __forceinline__ uint4 load_rotated_chunk(const KVCacheArgs& a, const u16* row, int col, int pos) {
    if (col >= a.d) return make_uint4(0, 0, 0, 0);
    const uint4 raw = *reinterpret_cast<const uint4*>(row + col);
    if (col >= a.rotary_dim) return raw;
    const int half = a.rotary_dim / 2, f = rotary_table_index(a, col, pos);
    const u16* x = reinterpret_cast<const u16*>(&raw);
    u16 y[8];
    if (a.rotary_interleaved) {
#pragma unroll
        for (int p = 0; p < 4; ++p)
            rotate_pair<BF16>(x, p, half_to_float(a.rotary_cos[f + p], BF16), half_to_float(a.rotary_sin[f + p], BF16),
                              y);
    } else {
        const bool first = col < half;
        const uint4 other_raw = *reinterpret_cast<const uint4*>(row + (first ? col + half : col - half));
        const u16* other = reinterpret_cast<const u16*>(&other_raw);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            y[e] = rotate_half_split<BF16>(x, other, e, first, half_to_float(a.rotary_cos[f + e], BF16),
                                           half_to_float(a.rotary_sin[f + e], BF16));
        }
    }
    return *reinterpret_cast<const uint4*>(y);
}

// A rotated chunk's loads, issued without a branch so that a thread's chunks can go out together:
// the chunk, its partner (half-split) and its 8 table values (cos and sin as two 4-value halves;
// interleaved, the first half alone serves). Every address is valid whatever the column (a column
// past d reads column 0; one past rotary_dim reads its own chunk and the table's first values);
// rotated_from_loads discards what it does not need. The tables are 16-byte aligned (kv_cache.py
// copies them otherwise) and a chunk's table offset is a multiple of 4 values, so the 8-byte loads
// are aligned.
struct RotaryLoads {
    uint4 x, other;
    uint2 cos[2], sin[2];
};
__device__ __forceinline__ RotaryLoads rotary_loads(const KVCacheArgs& a, const u16* row, int col, int pos) {
    const int half = a.rotary_dim / 2, c = col < a.d ? col : 0;
    const bool rotated = c < a.rotary_dim, first = c < half;
    const bool split = rotated && !a.rotary_interleaved;
    const int f = rotary_table_index(a, rotated ? c : 0, pos), second = split ? 4 : 0;
    RotaryLoads l;
    l.x = *reinterpret_cast<const uint4*>(row + c);
    l.other = *reinterpret_cast<const uint4*>(row + (split ? (first ? c + half : c - half) : c));
    l.cos[0] = *reinterpret_cast<const uint2*>(a.rotary_cos + f);
    l.cos[1] = *reinterpret_cast<const uint2*>(a.rotary_cos + f + second);
    l.sin[0] = *reinterpret_cast<const uint2*>(a.rotary_sin + f);
    l.sin[1] = *reinterpret_cast<const uint2*>(a.rotary_sin + f + second);
    return l;
}

// The chunk at columns [col, col + 8) from its rotary_loads, as load_rotated_chunk gives it.
template <bool BF16>
__device__ __forceinline__ uint4 rotated_from_loads(const KVCacheArgs& a, const RotaryLoads& l, int col) {
    if (col >= a.d) return make_uint4(0, 0, 0, 0);
    if (col >= a.rotary_dim) return l.x;
    const u16* x = reinterpret_cast<const u16*>(&l.x);
    const u16* cos = reinterpret_cast<const u16*>(l.cos);
    const u16* sin = reinterpret_cast<const u16*>(l.sin);
    u16 y[8];
    if (a.rotary_interleaved) {
#pragma unroll
        for (int p = 0; p < 4; ++p)
            rotate_pair<BF16>(x, p, half_to_float(cos[p], BF16), half_to_float(sin[p], BF16), y);
    } else {
        const bool first = col < a.rotary_dim / 2;
        const u16* other = reinterpret_cast<const u16*>(&l.other);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            y[e] = rotate_half_split<BF16>(x, other, e, first, half_to_float(cos[e], BF16),
                                           half_to_float(sin[e], BF16));
    }
    return *reinterpret_cast<const uint4*>(y);
}

// The 16 values of two 8-element chunks in q's dtype, divided by `descale`, as e4m3 bytes (the
// first chunk's in the low 8 bytes): round to nearest even, saturating at +-448.
template <bool BF16>
__device__ __forceinline__ uint4 quantize_e4m3(uint4 lo, uint4 hi, float descale) {
    const u16* x[2] = {reinterpret_cast<const u16*>(&lo), reinterpret_cast<const u16*>(&hi)};
    u32 out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const u16* src = x[w / 2] + 4 * (w % 2);
        u16 pair[2];
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const float e0 = __fdiv_rn(half_to_float(src[2 * p], BF16), descale);
            const float e1 = __fdiv_rn(half_to_float(src[2 * p + 1], BF16), descale);
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(pair[p]) : "f"(e1), "f"(e0));
        }
        out[w] = (u32)pair[0] | ((u32)pair[1] << 16);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// Row t of batch b's new keys (key) or values, kv head hk.
__device__ __forceinline__ const u16* new_row(const KVCacheArgs& a, bool key, int b, int t, int hk) {
    return key ? a.k_new + b * a.kn_sb + t * a.kn_sn + hk * a.kn_sh : a.v_new + b * a.vn_sb + t * a.vn_sn + hk * a.vn_sh;
}

// The 16 elements at columns [col, col + 16) of a new key row (rotated at position pos) or
// value row, quantised to e4m3 as the cache stores them.
template <bool BF16>
__device__ __forceinline__ uint4 new_chunk_e4m3(const KVCacheArgs& a, const u16* row, int col, int pos, bool key,
                                                float descale) {
    if (key)
        return quantize_e4m3<BF16>(load_rotated_chunk<BF16>(a, row, col, pos),
                                   load_rotated_chunk<BF16>(a, row, col + 8, pos), descale);
    return quantize_e4m3<BF16>(*reinterpret_cast<const uint4*>(row + col),
                               *reinterpret_cast<const uint4*>(row + col + 8), descale);
}

// Four e4m3 bytes (the first in the lowest) as four values of q's dtype, exactly (e4m3 is a subset
// of fp16 and of bf16).
template <bool BF16>
__device__ __forceinline__ uint2 widen_e4m3x4(u32 four) {
    u32 h[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const u16 pair = (u16)(four >> (16 * p));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h[p]) : "h"(pair));
        if constexpr (BF16) {
            const float lo = half_to_float((u16)(h[p] & 0xffffu), false), hi = half_to_float((u16)(h[p] >> 16), false);
            h[p] = pack2<true>(lo, hi);
        }
    }
    return make_uint2(h[0], h[1]);
}

// The descale of batch b, kv head hk (1 without an fp8 cache or without the array).
__device__ __forceinline__ float descale_of(const float* descale, const KVCacheArgs& a, int b, int hk) {
    return descale != nullptr ? __ldg(descale + b * a.nheads_kv + hk) : 1.f;
}

// The new rows one CTA appends: cache positions [own0, own0 + n_own) and [low0, low0 + n_low),
// [high0, high0 + n_high) (parts of [cache_len, end)), numbered in that order.
struct AppendRows {
    int own0, n_own, low0, n_low, high0, n_high;
    __device__ __forceinline__ int count() const { return n_own + n_low + n_high; }
    __device__ __forceinline__ int position(int t) const {
        if (t < n_own) return own0 + t;
        t -= n_own;
        return t < n_low ? low0 + t : high0 + t - n_low;
    }
};

// Writes batch b's new keys (rotated) and values of kv head hk at the positions of `rows` into the
// cache, a 16-byte chunk of a row at a time among `threads` threads. An fp8 cache takes them
// quantised by the caller's k_desc and v_desc (descale_of), 16 to a chunk.
template <bool BF16, bool FP8, bool PAGED>
__device__ __forceinline__ void append_new_rows(const KVCacheArgs& a, int b, int hk, const CacheSpan& span,
                                                const AppendRows& rows, int tid, int threads, float k_desc,
                                                float v_desc) {
    constexpr int ELEMS = FP8 ? 16 : 8;  // per 16-byte chunk of a cache row
    constexpr int ELEM_BYTES = FP8 ? 1 : 2;
    const int chunks = (a.d + ELEMS - 1) / ELEMS;
    const unsigned char* k_head = head_of<PAGED, ELEM_BYTES>(a.k_cache, a.kc_sb, a.kc_sh, hk, span, 0);
    const unsigned char* v_head = head_of<PAGED, ELEM_BYTES>(a.v_cache, a.vc_sb, a.vc_sh, hk, span, 0);
    for (int c = tid; c < rows.count() * 2 * chunks; c += threads) {
        const int j = rows.position(c / (2 * chunks)), kc = c % (2 * chunks);
        const bool key = kc < chunks;
        const int col = ELEMS * (key ? kc : kc - chunks);
        const u16* row = new_row(a, key, b, j - span.cache_len, hk);
        const CachePos pos = cache_pos<PAGED>(a, span, j, PAGED ? page_of(a, b, j) : 0);
        unsigned char* dst = const_cast<unsigned char*>(key ? row_at<PAGED, ELEM_BYTES>(k_head, pos, a.kc_sb, a.kc_sn)
                                                            : row_at<PAGED, ELEM_BYTES>(v_head, pos, a.vc_sb, a.vc_sn));
        uint4 chunk;
        if constexpr (FP8) {
            chunk = new_chunk_e4m3<BF16>(a, row, col, j, key, key ? k_desc : v_desc);
        } else {
            chunk = key ? load_rotated_chunk<BF16>(a, row, col, j) : *reinterpret_cast<const uint4*>(row + col);
        }
        *reinterpret_cast<uint4*>(dst + ELEM_BYTES * col) = chunk;
    }
}

}  // namespace cuflash
