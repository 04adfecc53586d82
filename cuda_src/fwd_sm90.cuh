// FlashAttention forward for Hopper (sm_90a): wgmma, bulk tensor copies, warp
// specialisation, fp16 / bf16 / fp8 e4m3.
//
// The grid is persistent: one CTA per SM takes work tiles (BR = 128 query rows
// of one (batch, head)) until none is left (fwd_sm90_scheduler.cuh), so that
// the next tile's copies run under the current tile's last GEMMs and
// epilogue, and CTAs that drew short causal tiles draw more. Without a causal
// mask (and below head dim 256) the last wave's tiles are split along the
// keys into one run per CTA, their partial outputs combined (tail_split.cuh).
// Each CTA has three warpgroups, built from these parts:
//   warpgroup 0, the producer (fwd_sm90_producer.cuh): one thread copies Q,
//     K and V tiles into a ring of shared-memory stages on mbarriers, then
//     gives its registers to the consumers (setmaxnreg);
//   warpgroups 1 and 2, the consumers: the key loop, GEMMs and online
//     softmax (fwd_sm90_mainloop.cuh, softmax_sm90.cuh), then the epilogue
//     (fwd_sm90_epilogue.cuh).
// The shared-memory layout and register split: fwd_sm90_traits.cuh.
// The output tile leaves through shared memory and bulk tensor stores where
// it fits beside the ring (STAGE_O), so that the consumers start the next tile
// while it is written out; else straight from registers.
// The online softmax is the one of fwd_sm80.cuh: running row max and sum,
// exp2 with scale*log2(e) folded into one FMA, 1/l deferred to the end. fp8
// scores and outputs are dequantised by per-(batch, kv head) factors: the
// score scale by q_descale * k_descale, O by v_descale; the output is bf16.
#pragma once
#include "common.cuh"
#include "dropout.cuh"
#include "fwd_sm90_epilogue.cuh"
#include "fwd_sm90_mainloop.cuh"
#include "fwd_sm90_producer.cuh"
#include "fwd_sm90_scheduler.cuh"
#include "fwd_sm90_traits.cuh"
#include "score_mods.cuh"
#include "sm90_tiles.cuh"

namespace cuflash {

template <int D, int BC, int STAGES, int DTYPE, bool CAUSAL, bool EVEN_N, bool PINGPONG, bool STAGE_O, int MODS>
__global__ void __launch_bounds__(384, 1)
    fwd_sm90_kernel(const __grid_constant__ TmaDesc map_q, const __grid_constant__ TmaDesc map_k,
                    const __grid_constant__ TmaDesc map_v, const __grid_constant__ TmaDesc map_o,
                    u16* __restrict__ o, float* __restrict__ lse,
                    const float* __restrict__ descale_q, const float* __restrict__ descale_k,
                    const float* __restrict__ descale_v, int* __restrict__ tile_counter, float* __restrict__ ws_o,
                    float* __restrict__ ws_lse, int* __restrict__ tail_done, int full_tiles, int tail_items,
                    int nq, int nk, int d,
                    int group, int nheads, int nheads_kv, int num_tiles, long long o_sb, long long o_sn, long long o_sh,
                    float scale_log2, const ScoreModArgs mod_args) {
    // nheads_kv (= nheads / group) comes from the host: computed here, ptxas
    // kept it live across the key loop and, at head dim 256, in local memory.
    // ALiBi's column part from the tensor cores (apply_score_mods), at head dims 64 and 128 without softcap
    // (whose tanh comes before the bias). ALIBI_B: shared memory holds that GEMM's B operand
    // (config.py: FwdSm90Config.alibi_gemm). ALIBI_GEMM: the kernel uses it; without the causal
    // mask it takes the key blocks from the diagonal outwards (FROM_DIAGONAL, KeyOrder), so that
    // the blocks that hold a tile's diagonal are known, and so no window.
    constexpr bool ALIBI_B = (MODS & MOD_ALIBI) && !(MODS & MOD_SOFTCAP) && (D == 64 || D == 128) &&
                             DTYPE != E4M3;
    constexpr bool ALIBI_GEMM = ALIBI_B && (CAUSAL || !(MODS & MOD_WINDOW));
    constexpr bool FROM_DIAGONAL = ALIBI_GEMM && !CAUSAL;
    using T = FwdSm90Traits<D, BC, STAGES, DTYPE, STAGE_O, ALIBI_B, FROM_DIAGONAL>;
    constexpr int BR = T::BR;
    constexpr bool FP8 = DTYPE == E4M3;
    constexpr bool BF16_OUT = DTYPE != F16;  // fp8 attention writes bf16
    // fp8 at head dim 128, whose GEMMs are short beside its softmax, has the
    // widest chains: 8 for the max and the sum, against 4 and 4 +2-14% at
    // 8k-16k (same-run A/B, bench/PERFLOG.md v17); 16-bit kernels gain
    // nothing from 8 max chains (-3% to +2%), nor from 4 sum chains.
    constexpr bool FP8_128 = FP8 && D == 128;
    constexpr int MAX_CHAINS = FP8_128 ? 8 : 4, SUM_CHAINS = FP8_128 ? 8 : 1;
    using Mods = ScoreMods<MODS, CAUSAL, EVEN_N>;
    // The last wave split along the keys (tail_split.cuh): not under a causal
    // mask or a window, whose tiles differ in length, nor at head dims 192 and 256: at
    // 256 the consumers spill with the split's epilogue, and its combine (combine_partials)
    // sums 2 or 4 columns a lane, not 192's 6 (the host passes tail_items = 0 there).
    // Nor for a packed batch (varlen), whose tiles differ in length too. Nor with ALiBi's column
    // GEMM at head dim 128, where each segment's own diagonal blocks cost more than the split gave
    // (same-process A/B, H100, 16k tokens: 2k 3-5% slower, 8k within 2%; head dim 64: 8k 3-5%
    // faster, 2k even). The host mirrors this (config.py: FwdSm90Config.tail_split).
    constexpr bool TAIL_SPLIT = !CAUSAL && !Mods::WINDOW && !Mods::VARLEN && D <= 128 && !(ALIBI_B && D == 128);
    constexpr bool SOFTMAX_TURNS = FP8_128 && !CAUSAL && !PINGPONG;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const FwdSm90Smem<T> sm(smem_addr(smem_raw));
    const SegmentSlot segment{reinterpret_cast<volatile int*>(smem_raw + T::OFF_SEGMENT)};

    // ALIBI_GEMM with the tail split: the warp index from lane 0, so that ptxas knows it is the same
    // across the warp (the tile words' address, and the split tile's slot read there, follow from
    // it). As tid >> 5 it took the epilogue's branch on the slot for a divergent one and serialised
    // these kernels' wgmmas (C7520); in the others the broadcast moved registers: the fp8 kernels
    // at head dims 128 and 256 spilled (NVRTC 12.9 and 13.0).
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = ALIBI_GEMM && TAIL_SPLIT ? __shfl_sync(0xffffffffu, tid >> 5, 0) : tid >> 5, wg = warp >> 2;
    Mods mods(mod_args, nq, nk);

    if (tid == 0) {
        mbar_init(sm.full_q(), 1);
        mbar_init(sm.empty_q(), 128 * T::CONSUMERS);  // one arrival per consumer thread: thread_arrive
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.full_k(s), 1);
            mbar_init(sm.full_v(s), 1);
            mbar_init(sm.empty_k(s), 4 * T::CONSUMERS);
            mbar_init(sm.empty_v(s), 4 * T::CONSUMERS);
        }
        fence_barrier_init();
    }
    if (ALIBI_GEMM && tid < BC) {  // key kc's row of the column GEMM's B: (kc, kc, 0, ..., 0) in fp16
        const u32 kc2 = pack2<false>((float)tid, (float)tid);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(sm.alibi_b() + 16 * tid), "r"(kc2), "r"(0u),
                     "r"(0u), "r"(0u)
                     : "memory");
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sm.alibi_b() + 16 * (BC + tid)), "r"(0u)
                     : "memory");
        fence_proxy_async();
    }
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<T::PRODUCER_REGS>();
        if (tid != 0) return;
        fwd_sm90_produce<T, CAUSAL, TAIL_SPLIT>(sm, segment, map_q, map_k, map_v, tile_counter, full_tiles,
                                                tail_items, mods, mod_args, group, nheads, num_tiles);
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<T::CONSUMER_REGS>();
    const int c = wg - 1;
    const int warp_row0 = c * 64 + (warp & 3) * 16;
    const bool stage_leader = STAGE_O && tid % 128 == 0;  // issues this consumer's output stores
    // This thread's sink word (order_before_wait), formed here: through a
    // helper the compiler folded the sum otherwise and moved it out of the key loop.
    const u32 sink = sm.bars + (T::OFF_SEGMENT - T::OFF_BARS) + (T::OFF_SINK - T::OFF_SEGMENT) + 4 * (tid - 128);
    const TileWords words{sm.tile_words(warp - 4)};
    // Varlen: nq is the longest sequence's length (the tiles' order), and the lse has total_q rows per head.
    const FwdOutput out{o, lse, o_sb, o_sn, o_sh, Mods::VARLEN ? mod_args.total_q : nq, nheads};
    const TailSplit split{ws_o, ws_lse, tail_done, full_tiles, tail_items, num_tiles};
    const ConsumerTurns<PINGPONG, SOFTMAX_TURNS> turns{c};
    turns.open();

    RingPosition<FP8 && D == 256> ring;
    for (;; ring.next_tile()) {
        mbar_wait(sm.full_q(), ring.tile_parity());
        const int kv_iter = ring.key_blocks();
        const int t = segment.tile();
        if (t >= num_tiles) break;
        // Key blocks [lo, hi) of tile t; slot >= 0: a split tile's segment.
        // Without a causal mask or a window the masked blocks are the last (a partial one).
        const Tile tile = tile_at<BR, CAUSAL>(t, (nq + BR - 1) / BR, nheads);
        OutRows varlen_rows{tile, 0};  // varlen: the tile's rows in O and its sequence
        if constexpr (Mods::VARLEN) {
            const SeqSpan seq = segment.seq();
            mods.set_lengths(mod_args, seq.nq, seq.nk);
            varlen_rows = OutRows{Tile{seq.q0 + tile.m0, tile.h, 0}, seq.nq - tile.m0};
        }
        const KeyBlocks blocks = mods.template key_blocks<BC>(tile.m0, BR);
        const int lo = TAIL_SPLIT ? segment.lo() : blocks.begin, hi = TAIL_SPLIT ? segment.hi() : blocks.end;
        const int slot = TAIL_SPLIT ? segment.slot() : -1;
        const int hk = tile.h / group;
        stash_shared(words.addr + TileWords::M0, tile.m0);  // every lane stores the same values
        stash_shared(words.addr + TileWords::HEAD, tile.h);
        stash_shared(words.addr + TileWords::BATCH, tile.b);
        stash_shared(words.addr + TileWords::KV_HEAD, hk);
        stash_shared(words.addr + TileWords::TILE, t);
        stash_shared(words.addr + TileWords::SLOT, slot);
        stash_shared(words.addr + TileWords::N_BLOCKS, hi - lo);
        const int n_blocks = hi - lo;
        // Steps [0, n_masked) and (window) [n_whole_end, n_blocks) take masked blocks.
        const int n_masked = TAIL_SPLIT ? max(0, hi - max(lo, blocks.full_end)) : blocks.end - blocks.full_end;
        const int n_whole_end = hi - blocks.full_begin;
        if (hi == (TAIL_SPLIT ? 0 : lo)) {  // no row of this tile sees a key (a split segment has keys)
            thread_arrive(sm.empty_q());
            const OutRows rows = Mods::VARLEN ? varlen_rows : OutRows{tile, out.nq - tile.m0};
            write_empty_rows<64, D, 128>(out.o_tile(rows.at) + c * 64 * o_sn, o_sn, out.lse_rows(rows.at) + c * 64,
                                         rows.valid - c * 64, d, tid - 128 * wg);
            continue;
        }
        float qk_scale_log2 = scale_log2;
        mods.set_head(mod_args, tile.b, tile.h);
        // ALIBI_GEMM: the slope split into two fp16 values (hi, lo), the lanes' A-fragment word of
        // the column GEMM (k 0 and 1 of each row: lanes 4r; zero elsewhere).
        u32 alibi_a = 0;
        if constexpr (ALIBI_GEMM) {
            const float hi = unpack2<false>(pack2<false>(mods.alibi_slope, 0.f)).x;
            alibi_a = (lane & 3) == 0 ? pack2<false>(hi, mods.alibi_slope - hi) : 0u;
        }
        if constexpr (FP8) {  // the descales scale the raw scores: under softcap, inside the tanh
            const int kv_index = tile.b * nheads_kv + hk;
            const float descale_qk = descale_q[kv_index] * descale_k[kv_index];
            if constexpr (Mods::SOFTCAP)
                mods.tanh_scale = mod_args.tanh_scale * descale_qk;
            else
                qk_scale_log2 *= descale_qk;
        }

        SoftmaxAccumulators<D> acc;
        // The key loop (fwd_sm90_mainloop.cuh has its parts): blocks [0, n_blocks) of the segment,
        // block i (ring position kv_iter + i) holding keys from order.block(i) * BC, the producer's
        // order (KeyOrder), the first n_masked masked. The last S GEMM releases the Q tile (empty_q)
        // for the producer's next segment. It is written out here rather than called: as a function
        // of its own, the compiler ordered its locals otherwise and scheduled the fp8 softmax turns
        // 4-5% slower (same-run A/B, H100, head dim 128, non-causal).
        {
            const int m0 = tile.m0;
            const KeyOrder<FROM_DIAGONAL> order(lo, hi, n_masked, m0 + mods.diag, m0 + mods.diag + BR - 1, BC);

            constexpr int NT_S = BC / 8, NT_O = D / 8;

            // Tiles are the 128-byte-swizzled panels of common.cuh (tile_offset),
            // written so by TMA (swizzle 128B) and read by wgmma through descriptors
            // with swizzle mode 128B. Measured on an H200 (hdim 128, 8k, cp.async
            // version): 577 TFLOP/s, against 328 with unswizzled 8 x 8 core matrices.
            auto q_desc = [&](int ks) { return desc_k_major_sw128<BR>(sm.q(), c * 64, ks); };
            auto k_desc = [&](u32 panel, int ks) { return desc_k_major_sw128<BC>(panel, 0, ks); };
            // 16-bit V is the MN-major B operand of P V: the descriptor's leading
            // offset is the distance between 64-column panels (BC * 128 B), its stride
            // that between 8-row atoms (1024 B) (tests/test_sm90_gpu.py). fp8 Vt is
            // K-major: BC / 64 panels of D rows of 64 key bytes.
            auto v_desc = [&](u32 panel, int ks) {
                if constexpr (FP8)
                    return desc_k_major_sw64<D>(panel, ks);
                else
                    return desc_mn_major_sw128<BC * 128, 1024>(panel, ks);
            };

#pragma unroll
            for (int i = 0; i < NT_O * 4; ++i) acc.o[i] = 0.f;
            acc.row_max[0] = acc.row_max[1] = neg_inf();
            acc.row_sum[0] = acc.row_sum[1] = 0.f;
            float alpha[2];
            AFragments<T::DTYPE, BC> p_frag;

            // S = Q K^T (raw scores; the scale is applied inside the exponent). ALIBI_GEMM: plus ALiBi's
            // column part g slope (j - n0) of the block from n0, one more k step (A: the slope's hi
            // and lo parts in k 0 and 1 of every row, from registers; B: (j - n0) twice in k 0 and 1,
            // then zeros, from shared memory without swizzle: 8-key core matrices 128 bytes apart, k
            // 8-15 BC * 16 bytes on).
            const u64 alibi_b_desc = smem_desc(sm.alibi_b(), BC * 16, 128);
            // g: the sign of i + diag - j on the consumer's 64 rows, +1 where they take both, from a
            // mask (-1, else 0) formed without branches: with the A word chosen on a branch ptxas
            // serialised the wgmmas (C7520) and the non-causal kernel ran 1.4x slower.
            auto below_mask = [&](int n0) { return ALIBI_GEMM ? mods.below_mask(m0 + 64 * c, 64, n0) : 0; };
            auto alibi_word = [&](int mask) { return alibi_a ^ ((u32)mask & 0x80008000u); };
            auto issue_s = [&](float (&acc_s)[NT_S * 4], int st, u32 alibi_w) {
#pragma unroll
                for (int ks = 0; ks < T::KSTEPS_QK; ++ks)
                    Wgmma<BC, T::DTYPE>::ss(acc_s, q_desc(ks), k_desc(sm.k(st), ks), ks > 0);
                if constexpr (ALIBI_GEMM) {
                    // k 8-15 of A meet B's zero rows: the same word there as in k 0-7 leaves the sums
                    // exact and needs no zero registers. With zeros there NVRTC 13.5's ptxas spilled
                    // 232-5616 bytes in these kernels and they ran 1.7-3x slower (12.9, 13.0: no spill).
                    const unsigned a[4] = {alibi_w, alibi_w, alibi_w, alibi_w};
                    Wgmma<BC, F16>::template rs<false>(acc_s, a, alibi_b_desc);
                }
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
                if (i == n_blocks - 1) thread_arrive(sm.empty_q());
            };
            const int row0 = m0 + warp_row0;
            // row_bias: ALiBi's row part of the block's scores where ROW_BIAS (apply_score_mods), else 0.
            constexpr bool ROW_BIAS = Mods::ALIBI && D <= 128;
            auto softmax = [&](float (&acc_s)[NT_S * 4], const float (&row_bias)[2]) {
                turns.begin_softmax();
                online_softmax_sm90<NT_S, MAX_CHAINS, SUM_CHAINS, FP8, ROW_BIAS>(acc_s, acc.row_max, acc.row_sum,
                                                                               alpha, qk_scale_log2, row_bias);
                turns.end_softmax();
            };
            // Dropout after the row sums (the softmax normalises the undropped P): keep masks clear
            // dropped values in the packed P, the kept ones' 1 / (1 - p) left to the epilogue's row
            // scale. The masks of a block's first EARLY steps are drawn while its S GEMM runs, the
            // others as P is packed: a quarter early took head dim 128 causal from 1.72 to 1.50x the
            // plain forward at 8k, others within 2%; half or all of them spilled and ran slower
            // (same-process A/B, bench/PERFLOG.md, "Dropout: seven Philox rounds").
            constexpr int STEPS = AFragments<T::DTYPE, BC>::STEPS, EARLY = STEPS / 4;
            using KeepMasks = PackedKeepMasks<Mods::DROPOUT ? EARLY : 1>;
            const int bh = tile.b * nheads + tile.h;
            auto draw_masks = [&](KeepMasks& masks, int n0) {
                if constexpr (Mods::DROPOUT)
                    masks = dropout_masks<Mods::DROPOUT_STATE, EARLY>(mod_args, bh, row0, n0, lane);
            };
            // P as the A operand of P V.
            auto pack_p = [&](const float (&acc_s)[NT_S * 4], const KeepMasks& masks, int n0) {
                p_frag.pack(acc_s);
                if constexpr (Mods::DROPOUT) {
                    masks.apply(p_frag.r);
                    if constexpr (EARLY < STEPS)
                        dropout_masks<Mods::DROPOUT_STATE, STEPS - EARLY>(mod_args, bh, row0, n0 + 16 * EARLY, lane)
                            .apply(p_frag.r + EARLY);
                }
            };

            // Key block 0: S_0 alone.
            {
                const int st = kv_iter % STAGES, parity = (kv_iter / STAGES) & 1;
                float acc_s[NT_S * 4];
                const int mask = below_mask(order.block(0) * BC), g = 2 * mask + 1;
                const u32 alibi_w = alibi_word(mask);
                mbar_wait(sm.full_k(st), parity);
                turns.begin_gemms();
                wgmma_fence();
                issue_s(acc_s, st, alibi_w);
                wgmma_commit();
                turns.end_gemms();
                KeepMasks masks;
                draw_masks(masks, order.block(0) * BC);
                wgmma_wait<0>();
                after_s(0, st);
                float row_bias[2] = {0.f, 0.f};
                // (ALIBI_GEMM: the masked form always; choosing on a branch serialised the wgmmas, C7520.)
                if (ALIBI_GEMM || n_masked > 0 || (Mods::WINDOW && n_whole_end <= 0))
                    apply_score_mods<true, false, ROW_BIAS, ALIBI_GEMM, NT_S>(acc_s, mods, row0, order.block(0) * BC,
                                                                              lane, row_bias, g);
                else
                    apply_score_mods<false, false, ROW_BIAS, ALIBI_GEMM, NT_S>(acc_s, mods, row0, order.block(0) * BC,
                                                                               lane, row_bias, g);
                softmax(acc_s, row_bias);
                pack_p(acc_s, masks, order.block(0) * BC);
            }

            // Key block i: S_i and P_{i-1} V_{i-1} in one turn; the softmax of S_i
            // runs during P V. (Issuing P V only once S_i is in measured up to 4%
            // slower for fp8 at head dim 128, and 12-19% for 16-bit types.)
            // band: a block that holds the tile's diagonal (FROM_DIAGONAL), each score its own bias.
            auto step = [&](int i, auto masked, auto band) {
                const int it = kv_iter + i;
                const int st = it % STAGES, parity = (it / STAGES) & 1;
                const int st_prev = (it - 1) % STAGES, parity_prev = ((it - 1) / STAGES) & 1;
                float acc_s[NT_S * 4];
                const int mask = below_mask(order.block(i) * BC), g = 2 * mask + 1;
                const u32 alibi_w = alibi_word(mask);
                mbar_wait(sm.full_k(st), parity);
                mbar_wait(sm.full_v(st_prev), parity_prev);
                turns.begin_gemms();
                wgmma_fence();
                issue_s(acc_s, st, alibi_w);
                wgmma_commit();
                issue_pv(st_prev);
                wgmma_commit();
                turns.end_gemms();
                KeepMasks masks;
                draw_masks(masks, order.block(i) * BC);
                wgmma_wait<1>();  // S_i is in; P V still runs
                after_s(i, st);
                float row_bias[2] = {0.f, 0.f};
                apply_score_mods<decltype(masked)::value, decltype(band)::value, ROW_BIAS, ALIBI_GEMM, NT_S>(
                    acc_s, mods, row0, order.block(i) * BC, lane, row_bias, g);
                softmax(acc_s, row_bias);
                // The row sums depend on every exponential: without this, ptxas
                // hoists the wait above the softmax and P V no longer hides it
                // (+3-5% at head dims 128 and 256, fp8 at 256 +5-9%; head dim 64,
                // whose P V is short, 2-6% slower with it, and fp8 at 128, 7-11%).
                if constexpr (D >= 128 && !FP8_128) order_before_wait(sink, acc.row_sum[0] + acc.row_sum[1]);
                wgmma_wait<0>();
                warp_arrive(sm.empty_v(st_prev), lane);
                rescale_o<NT_O>(acc.o, alpha);
                pack_p(acc_s, masks, order.block(i) * BC);
            };
            int i = 1;
            for (; i < n_masked; ++i) step(i, BoolConst<true>{}, BoolConst<false>{});
            if constexpr (FROM_DIAGONAL)
                for (; i < n_masked + order.n_band; ++i) step(i, BoolConst<false>{}, BoolConst<true>{});
            for (; i < (Mods::WINDOW ? n_whole_end : n_blocks); ++i) step(i, BoolConst<false>{}, BoolConst<false>{});
            if constexpr (Mods::WINDOW)
                for (; i < n_blocks; ++i) step(i, BoolConst<true>{}, BoolConst<false>{});

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
        ring.advance(n_blocks);
        fwd_sm90_epilogue<T, TAIL_SPLIT, BF16_OUT, Mods::VARLEN>(acc, sm, words, out, split, map_o, descale_v,
                                                                 Mods::DROPOUT ? mod_args.dropout_scale : 1.f, nk, d,
                                                                 nheads_kv, qk_scale_log2, c, tid, warp, lane,
                                                                 warp_row0, stage_leader, varlen_rows);
    }
    if (STAGE_O && stage_leader) bulk_wait<0, true>();  // shared memory stays until the stores have read it
    turns.close();
}

}  // namespace cuflash
