// FlashAttention-2 forward for sm_80+ (mma.sync m16n8k16, fp32 accumulation).
//
// One CTA computes O = softmax(Q K^T * scale) V for BR query rows of one
// (batch, head). Each warp owns MT whole 16-row MMA tiles (split-Q: no
// inter-warp reduction); its Q fragments stay in registers. K and V tiles of
// BC keys stream through a STAGES-deep cp.async ring in shared memory. The
// softmax is online: running row max m and row sum l, the 1/l normalisation
// deferred to the end, exponentials as exp2 with scale*log2(e) folded into one
// FMA. P stays in registers and is fed back as the A operand of P V.
#pragma once
#include "common.cuh"
#include "dropout.cuh"
#include "sm80_mma.cuh"
#include "score_mods.cuh"
#include "seq_span.cuh"
#include "softmax_sm80.cuh"

namespace cuflash {

template <int D_, int BC_, int WARPS_, int MT_, int STAGES_, int MIN_BLOCKS_, bool Q_IN_REGS_, bool BF16_>
struct FwdTraits {
    static constexpr int D = D_;            // head dim of the kernel (actual d <= D, zero-padded)
    static constexpr int BC = BC_;          // keys per K/V tile
    static constexpr int WARPS = WARPS_;
    static constexpr int MT = MT_;          // 16-row MMA tiles per warp
    static constexpr int STAGES = STAGES_;  // K/V tiles in flight
    static constexpr int MIN_BLOCKS = MIN_BLOCKS_;
    static constexpr bool Q_IN_REGS = Q_IN_REGS_;  // else Q fragments are re-read from shared memory
    static constexpr bool BF16 = BF16_;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int BR = 16 * MT * WARPS;  // query rows per CTA
    static constexpr int KSTEPS_QK = D / 16;    // k16 steps of S = Q K^T
    static constexpr int NTILES_S = BC / 8;     // n8 tiles of S
    static constexpr int KSTEPS_PV = BC / 16;   // k16 steps of O += P V
    static constexpr int NTILES_O = D / 8;      // n8 tiles of O
    static constexpr int Q_ELEMS = BR * D;
    static constexpr int KV_ELEMS = BC * D;
    // Shared memory (byte offsets; cuflash/config.py FwdConfig.smem_layout):
    // the Q tile (reused for the output tile), STAGES K tiles, STAGES V tiles.
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_K = OFF_Q + 2 * Q_ELEMS;
    static constexpr int OFF_V = OFF_K + 2 * STAGES * KV_ELEMS;
    static constexpr int SMEM_BYTES = OFF_V + 2 * STAGES * KV_ELEMS;

    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim must be a multiple of 32 in [32, 256]");
    static_assert(BC % 16 == 0 && BC >= 16, "BC must be a multiple of 16");
    static_assert(STAGES >= 1 && STAGES <= 4, "1 to 4 stages");
    static_assert(MT >= 1 && MT <= 2, "1 or 2 row tiles per warp");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tile does not fit in shared memory");
};

template <int D, int BC, int WARPS, int MT, int STAGES, int MIN_BLOCKS, bool Q_IN_REGS, bool BF16, bool CAUSAL,
          bool EVEN_N, bool EVEN_D, int MODS>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
    fwd_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ o, float* __restrict__ lse, int nq, int nk, int d, int group,
               long long q_sb, long long q_sn, long long q_sh, long long k_sb, long long k_sn, long long k_sh,
               long long v_sb, long long v_sn, long long v_sh, long long o_sb, long long o_sn, long long o_sh,
               float scale_log2, const ScoreModArgs mod_args) {
    using T = FwdTraits<D, BC, WARPS, MT, STAGES, MIN_BLOCKS, Q_IN_REGS, BF16>;
    constexpr int BR = T::BR;
    constexpr int THREADS = T::THREADS;
    constexpr int PIPE_WAIT = 2 * STAGES - 2;  // cp.async groups allowed in flight at each wait

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw + T::OFF_Q);
    u16* sK = reinterpret_cast<u16*>(smem_raw + T::OFF_K);
    u16* sV = reinterpret_cast<u16*>(smem_raw + T::OFF_V);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Causal: the last query blocks see the most keys; launch them first.
    const int m_block = CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const int nheads = gridDim.y;
    const int m0 = m_block * BR;
    using Mods = ScoreMods<MODS, CAUSAL, EVEN_N>;
    // Varlen: the grid covers the longest sequence; a block past its own has nothing to do.
    const SeqSpan seq = seq_span<Mods::VARLEN>(mod_args, b, nq, nk);
    if (Mods::VARLEN && m0 >= seq.nq) return;
    const int rows_valid = seq.nq - m0;

    const u16* q_tile = q + b * q_sb + h * q_sh + (seq.q0 + m0) * q_sn;
    const u16* k_head = k + b * k_sb + hk * k_sh + seq.k0 * k_sn;
    const u16* v_head = v + b * v_sb + hk * v_sh + seq.k0 * v_sn;
    u16* o_tile = o + b * o_sb + h * o_sh + (seq.q0 + m0) * o_sn;
    float* lse_rows = lse + seq.lse_row0<Mods::VARLEN>(mod_args, b, h, nheads) + m0;

    Mods mods(mod_args, seq.nq, seq.nk);
    mods.set_head(mod_args, b, h);
    const KeyBlocks blocks = mods.template key_blocks<BC>(m0, BR);
    const int n_end = blocks.end - blocks.begin;  // steps, one key block each
    if (n_end == 0) {  // no row of this block sees a key
        write_empty_rows<BR, D, THREADS>(o_tile, o_sn, lse_rows, rows_valid, d, tid);
        return;
    }

    // Key block visited at step t (descending, so masked blocks come first).
    auto block_of = [&](int t) { return blocks.end - 1 - t; };
    auto load_k = [&](int t) {
        const int n0 = block_of(t) * BC;
        load_tile_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sK + (t % STAGES) * T::KV_ELEMS, k_head + n0 * k_sn,
                                                          k_sn, seq.nk - n0, d, tid);
    };
    auto load_v = [&](int t) {
        const int n0 = block_of(t) * BC;
        load_tile_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sV + (t % STAGES) * T::KV_ELEMS, v_head + n0 * v_sn,
                                                          v_sn, seq.nk - n0, d, tid);
    };

    // Pipeline prologue; commit order is {Q, K0}, V0, K1, V1, ..., K[S-1].
    load_tile_async<BR, D, THREADS, !EVEN_N, !EVEN_D>(sQ, q_tile, q_sn, rows_valid, d, tid);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        if (s < n_end) load_k(s);
        cp_async_commit();
        if (s + 1 < STAGES) {
            if (s < n_end) load_v(s);
            cp_async_commit();
        }
    }

    const int warp_row0 = warp * 16 * MT;
    // A fragments of Q: rows lane % 16, k chunk lane / 16.
    const LaneOffsets<BR, D> q_off(lane & 15, lane >> 4);
    const u32 q_smem = smem_addr(sQ) + 2 * warp_row0 * LaneOffsets<BR, D>::PW;
    u32 q_frag[Q_IN_REGS ? MT : 1][Q_IN_REGS ? T::KSTEPS_QK : 1][4];
    float acc_o[MT][T::NTILES_O][4];
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        zero(acc_o[mt]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[mt][r] = neg_inf();
            row_sum[mt][r] = 0.f;
        }
    }

    // ldmatrix lane offsets. K (non-transposed B): key rows lane % 8 + 8 * (lane / 16),
    // k chunk (lane / 8) % 2. V (transposed B): key rows lane % 8 + 8 * ((lane / 8) % 2),
    // head-dim chunk lane / 16.
    const LaneOffsets<BC, D> k_off((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LaneOffsets<BC, D> v_off((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);

    // One step over key block n: S = Q K^T, online softmax, O += P V.
    auto step = [&](int t, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int n0 = block_of(t) * BC;
        const int stage = t % STAGES;

        cp_async_wait<PIPE_WAIT>();  // K[t] (and Q at t == 0) landed
        __syncthreads();
        if (Q_IN_REGS && t == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int ks = 0; ks < T::KSTEPS_QK; ++ks)
                    ldmatrix_x4(q_frag[Q_IN_REGS ? mt : 0][Q_IN_REGS ? ks : 0], q_smem + q_off.at(mt * 16, ks * 2));
        }
        // Every warp is past O += P V[t-1]: its V stage may be refilled.
        if (t + STAGES - 1 < n_end) load_v(t + STAGES - 1);
        cp_async_commit();

        // S = Q K^T (raw scores; the scale is applied inside the exponent)
        float acc_s[MT][T::NTILES_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero(acc_s[mt]);
        const u32 k_smem = smem_addr(sK + stage * T::KV_ELEMS);
#pragma unroll
        for (int ks = 0; ks < T::KSTEPS_QK; ++ks) {
            auto q_at = [&](int mt, u32(&scratch)[4]) -> const u32(&)[4] {
                if constexpr (Q_IN_REGS) {
                    return q_frag[mt][ks];
                } else {
                    ldmatrix_x4(scratch, q_smem + q_off.at(mt * 16, ks * 2));
                    return scratch;
                }
            };
            mma_k_step_nt<BF16>(acc_s, q_at, k_smem, k_off, 0, ks);
        }

        if constexpr (MASK || decltype(mods)::ANY) {  // scores in the kernel's units, -inf where masked
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < T::NTILES_S; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row_lane = m0 + warp_row0 + (lane >> 2), col_lane = n0 + 2 * (lane & 3);
                        const int dr = mt * 16 + 8 * (e >> 1), dc = j * 8 + (e & 1);
                        const float dist = mods.distance(row_lane, col_lane) + (float)(dr - dc);
                        acc_s[mt][j][e] =
                            mods.template score<MASK>(acc_s[mt][j][e], row_lane + dr, col_lane + dc, dist);
                    }
        }

        // Online softmax; P rounded to 16 bits: the S accumulators of n8 tiles
        // 2kk, 2kk+1 are exactly the A fragment of k16 step kk of O += P V.
        u32 p_frag[MT][T::KSTEPS_PV][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            online_softmax_sm80(acc_s[mt], acc_o[mt], row_max[mt], row_sum[mt], scale_log2);
            acc_to_a<BF16, T::NTILES_S>(p_frag[mt], acc_s[mt]);
            // Dropout after the row sums (the softmax normalises the undropped P), on the packed P.
            if constexpr (decltype(mods)::DROPOUT)
                dropout_packed<Mods::DROPOUT_STATE>(p_frag[mt], mod_args, b * nheads + h, m0 + warp_row0 + mt * 16,
                                                    n0, lane);
        }

        cp_async_wait<PIPE_WAIT>();  // V[t] landed
        __syncthreads();
        // Every warp is past S = Q K^T[t]: its K stage may be refilled.
        if (t + STAGES < n_end) load_k(t + STAGES);
        cp_async_commit();

        // O += P V
        gemm_rs_nn<BF16>(acc_o, p_frag, smem_addr(sV + stage * T::KV_ELEMS), v_off, 0);
    };

    // Descending blocks: masked ones past the right bound, whole ones, masked
    // ones before a window's left bound.
    const int n_whole_end = blocks.end - blocks.full_begin;
    int t = 0;
    for (; t < blocks.end - blocks.full_end; ++t) step(t, BoolConst<true>{});
    for (; t < n_whole_end; ++t) step(t, BoolConst<false>{});
    if constexpr (decltype(mods)::WINDOW)
        for (; t < n_end; ++t) step(t, BoolConst<true>{});
    cp_async_wait<0>();

    // Epilogue: O /= l, lse = (m * c + log2 l) * ln 2; O goes through the
    // warp's own rows of the Q tile for coalesced 16-byte stores.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(row_sum[mt][r]);
            const float inv = l > 0.f ? (decltype(mods)::DROPOUT ? mod_args.dropout_scale : 1.f) / l : 0.f;
            const int row = warp_row0 + mt * 16 + (lane >> 2) + 8 * r;
            if ((lane & 3) == 0 && row < rows_valid)
                lse_rows[row] = row_lse_of(row_max[mt][r], l, scale_log2);
#pragma unroll
            for (int j = 0; j < T::NTILES_O; ++j) {
                const int col = j * 8 + 2 * (lane & 3);
                *reinterpret_cast<u32*>(sQ + tile_offset<BR, D>(row, col >> 3) + (col & 7)) =
                    pack2<BF16>(acc_o[mt][j][2 * r] * inv, acc_o[mt][j][2 * r + 1] * inv);
            }
        }
    }
    __syncthreads();
    store_tile<BR, D, THREADS>(o_tile, sQ, o_sn, rows_valid, d, tid);
}

}  // namespace cuflash
