// FlashAttention backward for Hopper (sm_90a) at head dims 192 and 256: dK and dV; bwd_sm90_dq_kernel
// computes dQ; fp16 / bf16. The math is bwd_sm90.cuh's; the split of the work differs.
//
// bwd_sm90_kernel's consumer owns 64 keys and holds their dK and dV rows whole: D registers a
// thread for the two, more than a thread has at D = 256. Here a CTA owns BN = 64 keys (and kv
// head, batch), and the two consumer warpgroups split each step two ways:
//   S = Q K^T, dP = dO V^T:  wgmma SS, M = BM = 64 queries, N = 32 keys: consumer c takes keys
//       32c..; P and dS (rounded to 16 bits) go to the step's [query][key] tiles in shared memory
//       (two of each, used in turn), then both consumers meet at a barrier;
//   dV += P^T dO, dK += dS^T Q:  wgmma SS, M = 64 keys (A = P^T or dS^T, read MN-major from the
//       tiles; B = dO or Q, MN-major). At D = 256, N = 128: consumer c takes head-dim columns
//       128c.. of both. At D = 192, whose halves would start inside a 64-column panel, N = 192:
//       consumer 0 takes dV, consumer 1 dK (BY_OUTPUT).
// A consumer thread holds 64 + 64 dK and dV accumulators (D = 192: 96 of one) and 16 + 16 of S
// and dP. The producer
// warpgroup's one thread copies K and V once, then each step's Q, dO and their lse2 and Delta
// rows into a STAGES-deep ring. One CTA a tile (kv_tile_at), not persistent.
// dQ is not summed here: a first form added dS K into dq_accum (two 64-column halves a step,
// bulk reductions as bwd_sm90_kernel's) and ran 4-6% slower than this kernel followed by
// bwd_sm90_dq_kernel, which recomputes S and dP for its query blocks (H100, bench/PERFLOG.md).
#pragma once
#include "bwd_sm90_tiles.cuh"
#include "common.cuh"
#include "dropout.cuh"
#include "named_barriers.cuh"
#include "score_mods.cuh"
#include "seq_span.cuh"
#include "sm90_tiles.cuh"
#include "wgmma.cuh"

namespace cuflash {

template <int D_, int BM_, int STAGES_, bool ATOMIC_DQ_>
struct BwdSm90WideTraits {
    static constexpr int D = D_, BM = BM_, STAGES = STAGES_;
    static constexpr int CONSUMERS = 2;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int BN = 64;                  // keys per CTA
    static constexpr int S_N = BN / CONSUMERS;     // keys of S and dP a consumer computes
    // Halves of the columns that would start inside a 64-column panel (D = 192): consumer 0 computes
    // dV, consumer 1 dK, instead.
    static constexpr bool BY_OUTPUT = D / CONSUMERS % 64 != 0;
    static constexpr int OUTPUTS = BY_OUTPUT ? 1 : 2;              // of dV, dK, a consumer computes
    static constexpr int COLS = BY_OUTPUT ? D : D / CONSUMERS;     // ... for these head-dim columns
    static constexpr int KV_BYTES = BN * D * 2, QB_BYTES = BM * D * 2;
    static constexpr int PS_BYTES = BM * BN * 2;   // one P or dS tile: [query][key], 16-bit
    static constexpr int ROW_BYTES = BM * 4;       // one block's lse2 (or Delta)
    static constexpr int BARRIERS = 1 + 2 * STAGES;  // full_kv; full and empty per stage
    // Shared memory (cuflash/config.py BwdConfig.dkdv_smem_layout): K, V, STAGES x Q, STAGES x dO,
    // 2 x P, 2 x dS (tiles 1024-byte aligned), STAGES x lse2 and Delta, mbarriers.
    static constexpr int OFF_K = 0;
    static constexpr int OFF_V = OFF_K + KV_BYTES;
    static constexpr int OFF_Q = OFF_V + KV_BYTES;
    static constexpr int OFF_DO = OFF_Q + STAGES * QB_BYTES;
    static constexpr int OFF_P = OFF_DO + STAGES * QB_BYTES;
    static constexpr int OFF_DS = OFF_P + 2 * PS_BYTES;
    static constexpr int OFF_ROWS = OFF_DS + 2 * PS_BYTES;
    static constexpr int OFF_BARS = OFF_ROWS + 2 * STAGES * ROW_BYTES;
    static constexpr int SMEM_BYTES = OFF_BARS + 8 * BARRIERS;
    // Register split (setmaxnreg, SM90_ENTRY_REGS).
    static constexpr int ENTRY_REGS = SM90_ENTRY_REGS;
    static constexpr int CONSUMER_REGS = 232;
    static constexpr int PRODUCER_REGS = (1 + CONSUMERS) * ENTRY_REGS - CONSUMERS * CONSUMER_REGS;

    static_assert((D == 192 || D == 256) && BM == 64, "head dim 192 or 256 with 64-query steps");
    static_assert(!ATOMIC_DQ_, "dQ comes from bwd_sm90_dq_kernel");
    static_assert(STAGES == 2, "two stages (three do not fit)");
    static_assert(OFF_Q % 1024 == 0 && OFF_DO % 1024 == 0 && OFF_P % 1024 == 0 && OFF_DS % 1024 == 0,
                  "tiles start on 1024-byte swizzle atoms");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tiles do not fit in shared memory");
};

// The arguments are bwd_sm90_kernel's (cuflash/launch.py packs one list for both); dq_accum and
// tile_ticket are not used (dQ: bwd_sm90_dq_kernel; one CTA a tile).
template <int D, int BM, int STAGES, int DTYPE, bool CAUSAL, bool EVEN_N, bool ATOMIC_DQ, int MODS>
__global__ void __launch_bounds__(384, 1)
    bwd_sm90_wide_kernel(const __grid_constant__ TmaDesc map_q, const __grid_constant__ TmaDesc map_k,
                         const __grid_constant__ TmaDesc map_v, const __grid_constant__ TmaDesc map_do,
                         const float* __restrict__ lse2, const float* __restrict__ delta,
                         float* __restrict__ dq_accum, u16* __restrict__ dk, u16* __restrict__ dv,
                         int* __restrict__ tile_ticket, int nq, int nk, int d, int group, int nq_pad, int kv_heads,
                         int batches, long long dk_sb, long long dk_sn, long long dk_sh, long long dv_sb,
                         long long dv_sn, long long dv_sh, float scale_log2, float scale,
                         const ScoreModArgs mod_args) {
    using T = BwdSm90WideTraits<D, BM, STAGES, ATOMIC_DQ>;
    constexpr int BN = T::BN;
    allow_next_grid();  // the dQ kernel's CTAs may settle in
    constexpr int NT_S = T::S_N / 8, NT_COLS = T::COLS / 8;
    constexpr bool IS_BF16 = DTYPE == BF16;
    static_assert(DTYPE == F16 || DTYPE == BF16, "16-bit inputs only");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = smem_addr(smem_raw);
    const u32 sK = base + T::OFF_K, sV = base + T::OFF_V;
    auto sQ = [&](int st) { return base + T::OFF_Q + st * T::QB_BYTES; };
    auto sdO = [&](int st) { return base + T::OFF_DO + st * T::QB_BYTES; };
    auto sP = [&](int buf) { return base + T::OFF_P + buf * T::PS_BYTES; };
    auto sdS = [&](int buf) { return base + T::OFF_DS + buf * T::PS_BYTES; };
    // lse2 of stage st at rows[st * BM], Delta at rows[(STAGES + st) * BM]
    const float* rows = reinterpret_cast<const float*>(smem_raw + T::OFF_ROWS);
    const u32 bars = base + T::OFF_BARS;
    const u32 full_kv = bars;
    auto full = [&](int s) { return bars + 8 * (1 + s); };
    auto empty = [&](int s) { return bars + 8 * (1 + STAGES + s); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int nheads = kv_heads * group;
    const int n_blocks = (nk + BN - 1) / BN;
    if (static_cast<int>(gridDim.x) < n_blocks * kv_heads * batches) __trap();  // tiles would go undone

    using Mods = ScoreMods<MODS, CAUSAL, EVEN_N>;
    // Varlen: nq and nk are the longest sequence's lengths, seq's this sequence's, whose rows start
    // at seq.q0 and seq.k0 of the tensor maps' packed rows; a key block past its sequence is no work.
    const KvTile at = kv_tile_at(blockIdx.x, n_blocks, kv_heads);
    const int n0 = at.n_block * BN, b = at.b, batch = Mods::VARLEN ? 0 : b;  // batch: the maps' coordinate
    const SeqSpan seq = seq_span<Mods::VARLEN>(mod_args, b, nq, nk);
    if (Mods::VARLEN && n0 >= seq.nk) return;
    Mods mods(mod_args, seq.nq, seq.nk);
    const QueryBlockSteps<BM> steps(mods, at.n_block, n0, BN, group);
    const int h0 = at.hk * group;  // the group's first query head

    if (tid == 0) {
        mbar_init(full_kv, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 128 * T::CONSUMERS);  // one arrival per consumer thread: thread_arrive
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<T::PRODUCER_REGS>();
        if (tid != 0) return;
        tma_prefetch_desc(map_q);
        tma_prefetch_desc(map_do);
        mbar_arrive_expect_tx(full_kv, 2 * T::KV_BYTES);
        copy_tile_pair<D, BN>(sK, map_k, sV, map_v, seq.k0 + n0, at.hk, batch, full_kv);
        wait_prior_grid();  // lse2 and Delta from the preprocess
        // lse2 and Delta rows are padded to nq_pad: BM floats are always in range; the heads' rows
        // follow one another (padded_row0). The steps' order (QueryBlockSteps) as nested loops.
        const long long head_rows0 = seq.padded_row0<Mods::VARLEN>(b, h0, nheads, nq_pad);
        const u32 rows_smem = base + T::OFF_ROWS;
        int step = 0;
        for (int g = 0; g < group; ++g) {
            const float* lse2_head = lse2 + head_rows0 + static_cast<long long>(g) * nq_pad;
            const float* delta_head = delta + (lse2_head - lse2);
            for (int j = 0; j < steps.per_head; ++j, ++step) {
                const int st = step % STAGES, m0 = steps.query_block_of_head(j) * BM;
                mbar_wait(empty(st), ((step / STAGES) & 1) ^ 1);  // a fresh barrier's first wait returns at once
                mbar_arrive_expect_tx(full(st), 2 * T::QB_BYTES + 2 * T::ROW_BYTES);
                copy_tile_pair<D, BM>(sQ(st), map_q, sdO(st), map_do, seq.q0 + m0, h0 + g, batch, full(st));
                bulk_load(rows_smem + st * T::ROW_BYTES, lse2_head + m0, T::ROW_BYTES, full(st));
                bulk_load(rows_smem + (STAGES + st) * T::ROW_BYTES, delta_head + m0, T::ROW_BYTES, full(st));
            }
        }
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<T::CONSUMER_REGS>();
    const int c = wg - 1;
    const int warp_row0 = 16 * (warp & 3);  // this warp's 16 rows: queries of S and dP; keys of dK, dV
    const int key0 = T::S_N * c;            // this consumer's keys of S and dP, within the block
    const int col0 = T::BY_OUTPUT ? 0 : T::COLS * c;  // this consumer's head-dim columns of dK and dV
    const int panel0 = col0 / 64;                     // ... as the index of their first 64-column panel

    // acc[0]: dV, acc[1]: dK; BY_OUTPUT: acc[0] alone, consumer 0's dV or consumer 1's dK.
    float acc[T::OUTPUTS][NT_COLS * 4];
#pragma unroll
    for (int o = 0; o < T::OUTPUTS; ++o)
#pragma unroll
        for (int j = 0; j < NT_COLS * 4; ++j) acc[o][j] = 0.f;
    // One output's GEMM over the step: acc_o += A^T B, A the [query][key] tile a_tile (P or dS), B this
    // consumer's columns of b_tile (dO or Q).
    auto accumulate = [&](float (&acc_o)[NT_COLS * 4], u32 a_tile, u32 b_tile) {
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            Wgmma<T::COLS, DTYPE>::template ss<true, true>(
                acc_o, desc_mn_major_sw128<BM * 128, 1024>(a_tile, kk),
                desc_mn_major_sw128<BM * 128, 1024>(b_tile + panel0 * BM * 128, kk), 1);
    };
    mbar_wait(full_kv, 0);

    const int row_lane = warp_row0 + (lane >> 2);     // this lane's first query row of the block
    const int key_lane = n0 + key0 + 2 * (lane & 3);  // its first key of S's n8 tiles
    for (int i = 0; i < steps.count; ++i) {
        const int st = i % STAGES, buf = i & 1;
        const int h = h0 + steps.head(i), m0 = steps.query_block(i) * BM;
        mods.set_head(mod_args, b, h);
        mbar_wait(full(st), (i / STAGES) & 1);

        float acc_s[NT_S * 4], acc_dp[NT_S * 4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
            Wgmma<T::S_N, DTYPE>::ss(acc_s, desc_k_major_sw128<BM>(sQ(st), 0, ks),
                                     desc_k_major_sw128<BN>(sK, key0, ks), ks > 0);
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
            Wgmma<T::S_N, DTYPE>::ss(acc_dp, desc_k_major_sw128<BM>(sdO(st), 0, ks),
                                     desc_k_major_sw128<BN>(sV, key0, ks), ks > 0);
        wgmma_commit();
        // Dropout (dropout.cuh): the keep bits drawn while the GEMMs run.
        KeepBits<NT_S> kept{};
        if constexpr (Mods::DROPOUT)
            kept = dropout_bits<NT_S, Mods::DROPOUT_STATE>(mod_args, b * nheads + h, m0 + warp_row0, n0 + key0,
                                                            lane);
        const float* lse2_s = rows + st * BM;
        const float* delta_s = rows + (STAGES + st) * BM;
        float lse2_r[2], delta_r[2];  // this lane's two rows (lse2 = +inf past nq: P = 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lse2_r[r] = lse2_s[row_lane + 8 * r];
            delta_r[r] = delta_s[row_lane + 8 * r];
        }
        wgmma_wait<1>();

        // P, then dS (bwd_sm90_tiles.cuh); with dropout, P o M for dV, whose 1 / (1 - p) is left to
        // its epilogue.
        probs_by_rows<NT_S>(acc_s, mods, m0 + row_lane, key_lane, lse2_r, scale_log2,
                            !mods.block_visible(m0, BM, n0, BN) || (!EVEN_N && n0 + BN > seq.nk));
        wgmma_wait<0>();
        dscores_by_rows<NT_S>(acc_dp, acc_s, mods, m0 + row_lane, key_lane, lse2_r, delta_r, kept,
                              mod_args.dropout_scale);
        if constexpr (Mods::DROPOUT) {
#pragma unroll
            for (int i = 0; i < NT_S * 4; ++i)
                if (!kept.test(i)) acc_s[i] = 0.f;
        }

        // P and dS into this step's swizzled [query][key] tiles, 16-bit pairs; the other consumer
        // writes the other 32 keys. The tiles of step i - 2 are free: every GEMM of that step
        // completed before either consumer reached step i - 1's barrier.
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int col = key0 + 8 * j + 2 * (lane & 3);
                const u32 offset = 2 * (tile_offset<BM, BN>(row_lane + 8 * r, col >> 3) + (col & 7));
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sP(buf) + offset),
                             "r"(pack2<IS_BF16>(acc_s[j * 4 + 2 * r], acc_s[j * 4 + 2 * r + 1]))
                             : "memory");
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sdS(buf) + offset),
                             "r"(pack2<IS_BF16>(acc_dp[j * 4 + 2 * r], acc_dp[j * 4 + 2 * r + 1]))
                             : "memory");
            }
        fence_proxy_async();
        named_bar_sync<256>(BWD_WIDE_TILES_STORED);

        // dV += P^T dO, dK += dS^T Q (M = keys: P^T and dS^T are the tiles read MN-major; N = this
        // consumer's columns of dO and Q, MN-major). BY_OUTPUT: the operands chosen by address.
        wgmma_fence();
        if constexpr (T::BY_OUTPUT) {
            accumulate(acc[0], c == 0 ? sP(buf) : sdS(buf), c == 0 ? sdO(st) : sQ(st));
        } else {
            accumulate(acc[0], sP(buf), sdO(st));
            accumulate(acc[1], sdS(buf), sQ(st));
        }
        wgmma_commit();
        wgmma_wait<0>();
        thread_arrive(empty(st));
    }

    // Epilogue: dK (times scale) and dV from registers, this consumer's columns of its keys' rows.
    u16* dk_head = dk + b * dk_sb + at.hk * dk_sh + seq.k0 * dk_sn + col0;
    u16* dv_head = dv + b * dv_sb + at.hk * dv_sh + seq.k0 * dv_sn + col0;
    const float dv_scale = Mods::DROPOUT ? mod_args.dropout_scale : 1.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = n0 + warp_row0 + (lane >> 2) + 8 * r;
        if constexpr (T::BY_OUTPUT) {
            const bool dv_side = c == 0;
            store_acc_row<IS_BF16, NT_COLS>(acc[0], r, dv_side ? dv_scale : scale,
                                            dv_side ? dv_head + key * dv_sn : dk_head + key * dk_sn,
                                            key < seq.nk, d - col0, lane);
        } else {
            store_acc_row<IS_BF16, NT_COLS>(acc[1], r, scale, dk_head + key * dk_sn, key < seq.nk, d - col0, lane);
            store_acc_row<IS_BF16, NT_COLS>(acc[0], r, dv_scale, dv_head + key * dv_sn, key < seq.nk, d - col0,
                                            lane);
        }
    }
}

}  // namespace cuflash
