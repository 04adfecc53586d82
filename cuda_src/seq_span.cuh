// Where batch b's sequence lies: a batch of equal lengths (B, N, H, D), or a
// packed batch of sequences of different lengths (varlen: q (total_q, H, D),
// k and v (total_k, Hk, D), sequence b from row cu_seqlens[b]). Every kernel
// family takes its pointers, lengths and row offsets from here, so that a
// plain kernel compiles the same code as before varlen existed (q0 = k0 = 0).
//
// Per-row buffers: the lse is (B, H, nq), varlen (H, total_q). The
// backward's row statistics and dQ accumulator have rows padded to a
// multiple of BWD_ROW_PAD per (b, h), so that every kernel's row tile is in
// range; varlen: (H, rows_per_head) with sequence b from
// round_down(q0 + b * BWD_ROW_PAD, BWD_ROW_PAD), at least its padded length
// after sequence b - 1's start (rows_per_head: total_q rounded up to
// BWD_ROW_PAD, + B * BWD_ROW_PAD).
#pragma once
#include "score_mods.cuh"

namespace cuflash {

// Query rows of the backward's per-row buffers are padded to a multiple of this (every row tile divides it).
constexpr int BWD_ROW_PAD = 128;

struct SeqSpan {
    int q0, k0;  // the sequence's first rows in q and in k, v (0 without varlen)
    int nq, nk;  // its lengths

    // Offset of row 0 of head h in the lse.
    template <bool VARLEN>
    __device__ __forceinline__ long long lse_row0(const ScoreModArgs& args, int b, int h, int nheads) const {
        return VARLEN ? (long long)h * args.total_q + q0 : ((long long)b * nheads + h) * nq;
    }
    // Offset of row 0 of head h in the backward's padded per-row buffers.
    template <bool VARLEN>
    __device__ __forceinline__ long long padded_row0(int b, int h, int nheads, int rows_per_head) const {
        return VARLEN ? (long long)h * rows_per_head + (q0 + b * BWD_ROW_PAD) / BWD_ROW_PAD * BWD_ROW_PAD
                      : ((long long)b * nheads + h) * rows_per_head;
    }
};

// Batch b's span; nq, nk: the call's lengths (varlen: the longest sequence's,
// which bound every span's lengths). Varlen: nq and nk of the span are the
// used lengths (seqused_q, seqused_k: score_mods.cuh) where those are given. Offsets are clamped into the packed rows,
// so that no cu_seqlens content makes a kernel read or write outside them.
template <bool VARLEN>
__device__ __forceinline__ SeqSpan seq_span(const ScoreModArgs& args, int b, int nq, int nk) {
    if constexpr (VARLEN) {
        // Read-only loads (L1): every CTA of a sequence, and the Hopper forward's producer per tile, reads them.
        const int q0 = min(max(__ldg(args.cu_seqlens_q + b), 0), args.total_q);
        const int k0 = min(max(__ldg(args.cu_seqlens_k + b), 0), args.total_k);
        const int q1 = min(max(__ldg(args.cu_seqlens_q + b + 1), q0), args.total_q);
        const int k1 = min(max(__ldg(args.cu_seqlens_k + b + 1), k0), args.total_k);
        int used_q = min(q1 - q0, nq), used_k = min(k1 - k0, nk);
        // seqused: the first rows of the span only (a branch on a kernel parameter, uniform per CTA).
        if (args.seqused_q != nullptr) used_q = min(max(__ldg(args.seqused_q + b), 0), used_q);
        if (args.seqused_k != nullptr) used_k = min(max(__ldg(args.seqused_k + b), 0), used_k);
        return SeqSpan{q0, k0, used_q, used_k};
    } else {
        return SeqSpan{0, 0, nq, nk};
    }
}

}  // namespace cuflash
