// The consumers' key loop of the Hopper forward (fwd_sm90.cuh): the GEMMs
// and the online softmax of one work tile's segment. Consumer warpgroup c
// owns rows 64c .. 64c+63 of the tile (each warp 16 rows, as in fwd_sm80.cuh).
//   S = Q K^T:  wgmma SS, Q and K from shared memory (both K-major).
//   O += P V:   wgmma RS, P from registers (the S accumulators rounded to the
//               input type are already in the A-fragment layout), V from
//               shared memory: MN-major for 16-bit types; for fp8, which wgmma
//               reads K-major only, a transposed copy Vt (head dim x keys)
//               whose keys are permuted within each 32 so that the fp8
//               A-fragment of P needs no shuffles (see fp8_prep.cuh), in
//               panels of 64 keys with the 64-byte swizzle, so that BC may be
//               any multiple of 64.
// Step t issues S_t = Q K_t^T and O += P_{t-1} V_{t-1} together, then
// computes the softmax of S_t while the P V GEMM runs, and rescales O once it
// has completed.
#pragma once
#include "fwd_sm90_traits.cuh"
#include "named_barriers.cuh"
#include "softmax_sm90.cuh"
#include "wgmma.cuh"

namespace cuflash {

// A consumer's position in the K/V ring (key blocks consumed) and the parity
// of the work tiles it has taken. Two registers keep the position
// warp-uniform, so that each key step's stage and descriptor arithmetic runs
// on the uniform datapath: one register for both (position times two plus
// parity) left it there on the vector ALU, and head dim 64 ran 2-7% slower.
// The fp8 kernels at head dim 256 spill with two registers: PACKED.
template <bool PACKED>
struct RingPosition {
    int pos = 0, tiles = 0;  // PACKED: pos holds both, tiles is unused
    __device__ __forceinline__ int key_blocks() const { return PACKED ? pos >> 1 : pos; }
    __device__ __forceinline__ int tile_parity() const { return PACKED ? pos & 1 : tiles & 1; }
    __device__ __forceinline__ void advance(int blocks) { pos += PACKED ? 2 * blocks : blocks; }
    __device__ __forceinline__ void next_tile() {
        if constexpr (PACKED)
            pos ^= 1;
        else
            ++tiles;
    }
};

// The consumers' turns, each on a pair of named barriers (FwdNamedBarrier):
// consumer c begins a turn with a sync on its own barrier and ends it with an
// arrival on the other's. Consumer 1 opens the first turns for consumer 0
// (open); consumer 0 takes a last sync at the end for consumer 1's last
// hand-over (close), so that every arrival has a matching sync.
// - GEMM_TURNS (ping-pong): the consumers take turns issuing their GEMMs (a
//   tile's last P V is issued outside the turns), so one's softmax runs while
//   the other's GEMMs execute. Without it each consumer issues as soon as its
//   tiles are in (faster at head dim 64 up to 2k keys and for fp8 at head dim
//   128, slower elsewhere: dispatch.py; a tuner choice).
// - SOFTMAX_TURNS (fp8 at head dim 128 without a mask and without ping-pong):
//   the consumers take turns computing a softmax step, so that one's
//   exponentials run on the MUFU pipe while the other's GEMMs run. There the
//   exponentials hold the MUFU pipe as long as the step's GEMMs hold the
//   tensor cores (16 per clock per SM against the fp8 rate), and without
//   turns the consumers fell in phase (ncu: both pipes 52% busy). Measured
//   with ncu (SM active cycles, H100): -3% at 2k-16k; turns around the
//   exponentials only, +3.5%; under the causal mask, +4.5% (bench/PERFLOG.md v21).
template <bool GEMM_TURNS, bool SOFTMAX_TURNS>
struct ConsumerTurns {
    int c;

    __device__ __forceinline__ void begin_gemms() const {
        if constexpr (GEMM_TURNS) named_bar_sync<256>(own_barrier(FWD_GEMM_TURN, c));
    }
    __device__ __forceinline__ void end_gemms() const {
        if constexpr (GEMM_TURNS) named_bar_arrive<256>(other_barrier(FWD_GEMM_TURN, c));
    }
    __device__ __forceinline__ void begin_softmax() const {
        if constexpr (SOFTMAX_TURNS) named_bar_sync<256>(own_barrier(FWD_SOFTMAX_TURN, c));
    }
    __device__ __forceinline__ void end_softmax() const {
        if constexpr (SOFTMAX_TURNS) named_bar_arrive<256>(other_barrier(FWD_SOFTMAX_TURN, c));
    }
    __device__ __forceinline__ void open() const {
        if (GEMM_TURNS && c == 1) named_bar_arrive<256>(FWD_GEMM_TURN);
        if (SOFTMAX_TURNS && c == 1) named_bar_arrive<256>(FWD_SOFTMAX_TURN);
    }
    __device__ __forceinline__ void close() const {
        if (c == 0) begin_gemms();
        if (SOFTMAX_TURNS && c == 0) named_bar_sync<256>(FWD_SOFTMAX_TURN);
    }
};

// A consumer's running state over a segment: O (unnormalised), and each of
// the thread's two rows' running max and (per-thread partial) sum.
template <int D>
struct SoftmaxAccumulators {
    float o[D / 2];
    float row_max[2], row_sum[2];
};

// The key loop over blocks [0, n_blocks) of a segment of a tile from query
// row m0: block i (ring position kv_iter + i) holds keys from (hi - 1 - i) *
// BC, the producer's descending order, and the first n_masked need the mask.
// The last S GEMM releases the Q tile (empty_q) for the producer's next
// segment. (The mask is a lambda here, not a function of its own: as one,
// ptxas formed its comparisons otherwise.)
template <class T, bool CAUSAL, bool EVEN_N, int MAX_CHAINS, int SUM_CHAINS, class Turns>
__device__ __forceinline__ void fwd_sm90_mainloop(SoftmaxAccumulators<T::D>& acc, const FwdSm90Smem<T>& sm,
                                                  const Turns& turns, int kv_iter, int n_blocks, int n_masked,
                                                  int hi, int m0, int warp_row0, int nk, int diag,
                                                  float qk_scale_log2, int c, u32 sink, int lane) {
    constexpr int D = T::D, BC = T::BC, STAGES = T::STAGES, BR = T::BR;
    constexpr int NT_S = BC / 8, NT_O = D / 8;
    constexpr bool FP8 = T::DTYPE == E4M3;
    constexpr bool FP8_128 = FP8 && D == 128;

    // Tiles are the 128-byte-swizzled panels of common.cuh (tile_offset),
    // written so by TMA (swizzle 128B) and read by wgmma through descriptors
    // with swizzle mode 128B. Measured on an H200 (hdim 128, 8k, cp.async
    // version): 577 TFLOP/s, against 328 with unswizzled 8 x 8 core matrices.
    auto q_desc = [&](int ks) { return desc_k_major_sw128<BR>(sm.q(), c * 64, ks); };
    auto k_desc = [&](u32 tile, int ks) { return desc_k_major_sw128<BC>(tile, 0, ks); };
    // 16-bit V is the MN-major B operand of P V: the descriptor's leading
    // offset is the distance between 64-column panels (BC * 128 B), its stride
    // that between 8-row atoms (1024 B) (tests/test_sm90_gpu.py). fp8 Vt is
    // K-major: BC / 64 panels of D rows of 64 key bytes.
    auto v_desc = [&](u32 tile, int ks) {
        if constexpr (FP8)
            return desc_k_major_sw64<D>(tile, ks);
        else
            return desc_mn_major_sw128<BC * 128, 1024>(tile, ks);
    };

#pragma unroll
    for (int i = 0; i < NT_O * 4; ++i) acc.o[i] = 0.f;
    acc.row_max[0] = acc.row_max[1] = neg_inf();
    acc.row_sum[0] = acc.row_sum[1] = 0.f;
    float alpha[2];
    AFragments<T::DTYPE, BC> p_frag;

    // S = Q K^T (raw scores; the scale is applied inside the exponent)
    auto issue_s = [&](float (&acc_s)[NT_S * 4], int st) {
#pragma unroll
        for (int ks = 0; ks < T::KSTEPS_QK; ++ks)
            Wgmma<BC, T::DTYPE>::ss(acc_s, q_desc(ks), k_desc(sm.k(st), ks), ks > 0);
    };
    // O += P V
    auto issue_pv = [&](int st) {
#pragma unroll
        for (int kk = 0; kk < T::KSTEPS_PV; ++kk)
            Wgmma<D, T::DTYPE>::template rs<!FP8>(acc.o, p_frag.r[kk], v_desc(sm.v(st), kk));
    };
    // The last S GEMM of the segment has read Q: the producer may load the next.
    auto after_s = [&](int i, int st) {
        warp_arrive(sm.empty_k(st), lane);
        if (i == n_blocks - 1) warp_arrive(sm.empty_q(), lane);
    };
    // Scores of keys past nk, or (causal) past query i + diag, become -inf.
    auto apply_mask = [&](float (&acc_s)[NT_S * 4], int i) {
        const int n0 = (hi - 1 - i) * BC;
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + warp_row0 + (lane >> 2) + 8 * (e >> 1);
                const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1);
                bool keep = EVEN_N || col < nk;
                if constexpr (CAUSAL) keep = keep && col <= row + diag;
                if (!keep) acc_s[j * 4 + e] = neg_inf();
            }
    };
    auto softmax = [&](float (&acc_s)[NT_S * 4]) {
        turns.begin_softmax();
        online_softmax_sm90<NT_S, MAX_CHAINS, SUM_CHAINS>(acc_s, acc.row_max, acc.row_sum, alpha, qk_scale_log2);
        turns.end_softmax();
    };

    // Key block 0: S_0 alone.
    {
        const int st = kv_iter % STAGES, parity = (kv_iter / STAGES) & 1;
        float acc_s[NT_S * 4];
        mbar_wait(sm.full_k(st), parity);
        turns.begin_gemms();
        wgmma_fence();
        issue_s(acc_s, st);
        wgmma_commit();
        turns.end_gemms();
        wgmma_wait<0>();
        after_s(0, st);
        if (n_masked > 0) apply_mask(acc_s, 0);
        softmax(acc_s);
        p_frag.pack(acc_s);
    }

    // Key block i: S_i and P_{i-1} V_{i-1} in one turn; the softmax of S_i
    // runs during P V. (Issuing P V only once S_i is in measured up to 4%
    // slower for fp8 at head dim 128, and 12-19% for 16-bit types.)
    auto step = [&](int i, auto masked) {
        const int it = kv_iter + i;
        const int st = it % STAGES, parity = (it / STAGES) & 1;
        const int st_prev = (it - 1) % STAGES, parity_prev = ((it - 1) / STAGES) & 1;
        float acc_s[NT_S * 4];
        mbar_wait(sm.full_k(st), parity);
        mbar_wait(sm.full_v(st_prev), parity_prev);
        turns.begin_gemms();
        wgmma_fence();
        issue_s(acc_s, st);
        wgmma_commit();
        issue_pv(st_prev);
        wgmma_commit();
        turns.end_gemms();
        wgmma_wait<1>();  // S_i is in; P V still runs
        after_s(i, st);
        if constexpr (decltype(masked)::value) apply_mask(acc_s, i);
        softmax(acc_s);
        // The row sums depend on every exponential: without this, ptxas
        // hoists the wait above the softmax and P V no longer hides it
        // (+3-5% at head dims 128 and 256, fp8 at 256 +5-9%; head dim 64,
        // whose P V is short, 2-6% slower with it, and fp8 at 128, 7-11%).
        if constexpr (D >= 128 && !FP8_128) order_before_wait(sink, acc.row_sum[0] + acc.row_sum[1]);
        wgmma_wait<0>();
        warp_arrive(sm.empty_v(st_prev), lane);
        rescale_o<NT_O>(acc.o, alpha);
        p_frag.pack(acc_s);
    };
    int i = 1;
    for (; i < n_masked; ++i) step(i, BoolConst<true>{});
    for (; i < n_blocks; ++i) step(i, BoolConst<false>{});

    // Last P V.
    {
        const int it = kv_iter + n_blocks - 1;
        const int st = it % STAGES, parity = (it / STAGES) & 1;
        mbar_wait(sm.full_v(st), parity);
        wgmma_fence();
        issue_pv(st);
        wgmma_commit();
        wgmma_wait<0>();
        warp_arrive(sm.empty_v(st), lane);
    }
}

}  // namespace cuflash
