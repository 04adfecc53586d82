// The score of query i against key j, and which blocks of keys and queries
// meet at all: the mask and score options every kernel family shares.
//
// Semantics are flash-attn's (docs/design.md, "Score options"). With
// diag = nk - nq and s = scale * q_i . k_j:
//   softcap  s -> softcap * tanh(s / softcap);
//   ALiBi    s -> s - slope[b, h] * |i + diag - j|;
//   mask     query i sees keys j < nk with i + diag - left <= j <= i + diag + right,
//            where causal means right = 0 and a window bounds left (and right);
//   varlen   a packed batch: sequence b's queries and keys are rows
//            [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and [cu_seqlens_k[b], ...) of the
//            packed q and k, each its own attention (nq, nk and diag per sequence:
//            seq_span.cuh), of only the first seqused_q[b] and seqused_k[b] of
//            those rows where given; diag = 0 in every sequence where top_left
//            (jax.nn's masks on padded batches).
// Each option is a bit of a kernel's MODS template argument, so a kernel
// without it compiles no trace of it; ScoreModArgs carries the values.
//
// Score units: the kernels keep a score u whose exponent factor c (the
// host's scale_log2) gives P = 2^(u c - m c). Without softcap u is the raw
// Q K^T and c = scale log2(e); with softcap u = tanh(raw * scale / softcap)
// and c = softcap log2(e), so that u c = (softcap tanh) log2(e). ALiBi's bias
// enters in the same units: -slope |i + diag - j| log2(e) / c.
#pragma once
#include "common.cuh"

namespace cuflash {

constexpr int MOD_WINDOW = 1;   // a left bound, or a right bound other than causal's
constexpr int MOD_SOFTCAP = 2;
constexpr int MOD_ALIBI = 4;
constexpr int MOD_VARLEN = 8;
constexpr int MOD_DROPOUT = 16;  // dropout.cuh; not a score option: applied to P
constexpr int MOD_DROPOUT_STATE = 32;  // with MOD_DROPOUT: the seed and offset read from device memory

// Kernel parameter (cuflash/score_mods.py packs it, field for field).
struct ScoreModArgs {
    int window_left, window_right;  // key offsets from i + diag; nq + nk where unbounded
    float tanh_scale;               // scale / softcap
    float inv_score_log2;           // 1 / c
    float alibi_unit;               // log2(e) / c: a score's bias into the kernel's units
    const float* alibi_slopes;      // the slope of (b, h) at b * alibi_batch_stride + h
    long long alibi_batch_stride;
    const int* cu_seqlens_q;        // varlen: sequence b's rows of the packed q start at cu_seqlens_q[b]
    const int* cu_seqlens_k;        // and of the packed k and v at cu_seqlens_k[b]
    int total_q, total_k;           // varlen: rows of the packed q (the lse's row stride) and k
    int num_seqs;                   // varlen: sequences in the batch
    unsigned dropout_seed_lo, dropout_seed_hi;      // dropout (dropout.cuh): the Philox key
    unsigned dropout_offset_lo, dropout_offset_hi;  // and the stream's offset
    unsigned dropout_threshold;                     // keep a draw below this (of 2^14: dropout.cuh)
    float dropout_scale;                            // 1 / (1 - p)
    const unsigned* dropout_state;                  // MOD_DROPOUT_STATE: seed lo, hi, offset lo, hi
    const int* seqused_q;           // varlen, or null: sequence b uses the first seqused_q[b] rows of its span
    const int* seqused_k;           // and the first seqused_k[b] keys (flash-attn 3's seqused)
    int top_left;                   // varlen: the masks' diagonal is i (diag = 0), not i + nk - nq
};

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Key blocks of BC keys a block of query rows visits: [begin, end), of which
// [full_begin, full_end) are seen whole by every row and need no mask.
struct KeyBlocks {
    int begin, end, full_begin, full_end;
};

// One (batch, head)'s view of the options: the score transform and mask at
// (row, col), and the block ranges the masks leave.
template <int MODS, bool CAUSAL, bool EVEN_N>
struct ScoreMods {
    static constexpr bool WINDOW = MODS & MOD_WINDOW;
    static constexpr bool SOFTCAP = MODS & MOD_SOFTCAP;
    static constexpr bool ALIBI = MODS & MOD_ALIBI;
    static constexpr bool VARLEN = MODS & MOD_VARLEN;
    static constexpr bool DROPOUT = MODS & MOD_DROPOUT;
    static constexpr bool DROPOUT_STATE = MODS & MOD_DROPOUT_STATE;
    static constexpr bool RIGHT_BOUND = CAUSAL || WINDOW;
    static constexpr bool ONE_SIDED = CAUSAL;  // every visible score has i + diag - j >= 0

    int nq, nk, diag;
    int left, right;    // window bounds (right = 0 under causal)
    float tanh_scale, inv_score_log2;
    float alibi_slope;  // in the kernel's score units

    // Query i's diagonal key is i + diag in a sequence of nq_ queries and nk_ keys: bottom-right
    // aligned, or top-left where a packed batch asks for it.
    __device__ __forceinline__ static int diagonal(const ScoreModArgs& args, int nq_, int nk_) {
        return VARLEN && args.top_left ? 0 : nk_ - nq_;
    }
    // nq_, nk_: the call's lengths, or varlen's sequence's (set_lengths for later ones).
    __device__ __forceinline__ ScoreMods(const ScoreModArgs& args, int nq_, int nk_)
        : nq(nq_), nk(nk_), diag(diagonal(args, nq_, nk_)) {
        left = WINDOW ? args.window_left : 0;
        right = WINDOW && !CAUSAL ? args.window_right : 0;
        tanh_scale = SOFTCAP ? args.tanh_scale : 0.f;
        inv_score_log2 = SOFTCAP ? args.inv_score_log2 : 0.f;
        alibi_slope = 0.f;
    }
    // The lengths of one sequence of a packed batch (varlen).
    __device__ __forceinline__ void set_lengths(const ScoreModArgs& args, int nq_, int nk_) {
        nq = nq_;
        nk = nk_;
        diag = diagonal(args, nq_, nk_);
    }
    // The scores of query head h of batch b (ALiBi's slope).
    __device__ __forceinline__ void set_head(const ScoreModArgs& args, int b, int h) {
        if constexpr (ALIBI) alibi_slope = args.alibi_slopes[b * args.alibi_batch_stride + h] * args.alibi_unit;
    }

    // Raw Q K^T -> the kernel's score units (before the mask).
    __device__ __forceinline__ float transform(float s) const {
        if constexpr (SOFTCAP) s = tanh_approx(s * tanh_scale);
        return s;
    }
    // ALiBi's bias at distance i + diag - j, a float: the kernels form it as a base per lane and
    // row plus a constant per fragment element (one FADD; converting the integer per element, ALiBi
    // cost the Hopper forward 13-20% at 8k, H100).
    __device__ __forceinline__ float bias(float s, float distance) const {
        if constexpr (ALIBI) s = fmaf(-alibi_slope, fabsf(distance), s);
        return s;
    }
    __device__ __forceinline__ float distance(int row, int col) const { return (float)(row + diag - col); }
    // The sign of the distance i + diag - j over rows [m0, m0 + rows) x keys [n0, n0 + cols), 0 where
    // it takes both: on one side ALiBi's bias -slope |i + diag - j| is a row part plus a column part.
    // Causal: every visible score has i + diag - j >= 0 (the others are masked).
    __device__ __forceinline__ int side(int m0, int rows, int n0, int cols) const {
        if constexpr (CAUSAL) return 1;
        if (m0 + diag - (n0 + cols - 1) >= 0) return 1;
        return m0 + rows - 1 + diag - n0 <= 0 ? -1 : 0;
    }
    // side() < 0 as a mask (-1, else 0) formed without branches, for keys from n0 (at least two):
    // the Hopper forward's ALiBi column GEMM chooses its sign by it (fwd_sm90_kernel).
    __device__ __forceinline__ int below_mask(int m0, int rows, int n0) const {
        if constexpr (CAUSAL) return 0;
        return (m0 + rows - 1 + diag - n0 - 1) >> 31;
    }
    __device__ __forceinline__ bool visible(int row, int col) const {
        bool keep = EVEN_N || col < nk;
        if constexpr (RIGHT_BOUND) keep = keep && col <= row + diag + right;
        if constexpr (WINDOW) keep = keep && col >= row + diag - left;
        return keep;
    }
    // The score of (row, col), at ALiBi distance `dist`, from raw Q K^T; -inf where masked (MASK: a
    // boundary block).
    template <bool MASK>
    __device__ __forceinline__ float score(float s, int row, int col, float dist) const {
        s = bias(transform(s), dist);
        if (MASK && !visible(row, col)) s = neg_inf();
        return s;
    }
    // d score / d (raw scaled score) from the score u: 1 - tanh^2 under softcap.
    __device__ __forceinline__ float score_grad(float u) const { return SOFTCAP ? fmaf(-u, u, 1.f) : 1.f; }
    // The same from the probability p = 2^((u + bias) c - lse2) instead of u, where keeping u
    // would cost registers: u = (log2 p + lse2) / c - bias, clamped to [-1, 1] (p = 0 gives 0).
    __device__ __forceinline__ float score_grad_from_prob(float p, float lse2, float dist) const {
        const float u = fmaf(log2_approx(p) + lse2, inv_score_log2, -bias(0.f, dist));
        return score_grad(fminf(fmaxf(u, -1.f), 1.f));
    }
    // An option that touches scores.
    static constexpr bool ANY = (MODS & ~(MOD_VARLEN | MOD_DROPOUT | MOD_DROPOUT_STATE)) != 0;

    // Key blocks seen by query rows [m0, m0 + rows) (rows past nq included).
    template <int BC>
    __device__ __forceinline__ KeyBlocks key_blocks(int m0, int rows) const {
        const int n_blocks = (nk + BC - 1) / BC;
        KeyBlocks kb{0, n_blocks, 0, n_blocks};
        const int first = m0 + diag, last = m0 + rows - 1 + diag;  // i + diag of the first and last rows
        if constexpr (RIGHT_BOUND) {
            const int last_key = last + right;                    // the last row's last key
            kb.end = last_key < 0 ? 0 : min(n_blocks, last_key / BC + 1);
            const int whole = first + right + 1;                  // keys [0, whole) pass every row's right bound
            kb.full_end = whole <= 0 ? 0 : min(kb.end, whole / BC);
        }
        if constexpr (WINDOW) {
            const int first_key = first - left;                   // the first row's first key
            kb.begin = first_key <= 0 ? 0 : min(kb.end, first_key / BC);
            const int whole = last - left;                        // keys from here pass every row's left bound
            kb.full_begin = whole <= 0 ? 0 : (whole + BC - 1) / BC;
        }
        if constexpr (!EVEN_N) kb.full_end = min(kb.full_end, nk / BC);
        if constexpr (WINDOW) {  // the two bounds' ranges may miss each other: then every block is masked
            kb.full_begin = max(kb.full_begin, kb.begin);
            kb.full_end = max(min(kb.full_end, kb.end), kb.full_begin);
            if (kb.full_begin >= kb.full_end) kb.full_begin = kb.full_end = kb.begin;
        }
        return kb;
    }

    // Query blocks of BM rows that see keys [n0, n0 + cols): [begin, end).
    template <int BM>
    __device__ __forceinline__ int2 query_blocks(int n0, int cols) const {
        const int m_blocks = (nq + BM - 1) / BM;
        int begin = 0, end = m_blocks;
        if constexpr (RIGHT_BOUND) {  // rows i >= n0 - diag - right see key n0
            const int first_row = n0 - diag - right;
            begin = first_row <= 0 ? 0 : first_row / BM;  // past m_blocks: an empty range below
        }
        if constexpr (WINDOW) {  // rows i <= n0 + cols - 1 - diag + left see the last key
            const int last_row = n0 + cols - 1 - diag + left;
            end = last_row < 0 ? 0 : min(m_blocks, last_row / BM + 1);
        }
        return make_int2(begin, max(begin, end));
    }
    // Whether every (row, col) of rows [m0, m0 + rows) x keys [n0, n0 + cols) is visible
    // (past nq and nk included: the caller checks the sequence ends).
    __device__ __forceinline__ bool block_visible(int m0, int rows, int n0, int cols) const {
        bool whole = true;
        if constexpr (RIGHT_BOUND) whole = whole && n0 + cols - 1 <= m0 + diag + right;
        if constexpr (WINDOW) whole = whole && n0 >= m0 + rows - 1 + diag - left;
        return whole;
    }
};

// ---------------------------------------------------------------- backward blocks
// The steps of a dK/dV CTA over the query blocks of BM rows that see its key
// block (keys [n0, n0 + BN)): query blocks [m_begin, m_end) of each of the
// `group` query heads sharing the kv head; step t takes head t / per_head.
// Each key block starts at a different query block (rotated by its index),
// so the CTAs of one head do not add into the same dQ rows at the same time.
template <int BM>
struct QueryBlockSteps {
    int m_begin, per_head, rotation;
    int count;  // steps in all

    template <class Mods>
    __device__ __forceinline__ QueryBlockSteps(const Mods& mods, int n_block, int n0, int bn, int group) {
        if constexpr (Mods::WINDOW) {
            const int2 range = mods.template query_blocks<BM>(n0, bn);
            m_begin = range.x;
            per_head = range.y - range.x;
        } else {  // the plain and causal kernels' arithmetic as it was: with the window's, they spilled
            const int m_blocks = (mods.nq + BM - 1) / BM, diag = Mods::VARLEN ? mods.diag : mods.nk - mods.nq;
            m_begin = Mods::RIGHT_BOUND ? (n0 - diag <= 0 ? 0 : (n0 - diag) / BM) : 0;
            per_head = m_blocks > m_begin ? m_blocks - m_begin : 0;
        }
        count = group * per_head;
        rotation = per_head > 0 ? n_block % per_head : 0;
    }
    __device__ __forceinline__ int head(int t) const { return t / per_head; }  // within the group
    __device__ __forceinline__ int query_block(int t) const { return query_block_of_head(t % per_head); }
    // Step j of a head's per_head steps (no division: a loop over heads and then blocks takes these).
    __device__ __forceinline__ int query_block_of_head(int j) const {
        const int i = j + rotation;
        return m_begin + (i >= per_head ? i - per_head : i);
    }
};

}  // namespace cuflash
