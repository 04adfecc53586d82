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
#include "fwd_sm90_epilogue.cuh"
#include "fwd_sm90_mainloop.cuh"
#include "fwd_sm90_producer.cuh"
#include "fwd_sm90_scheduler.cuh"
#include "fwd_sm90_traits.cuh"
#include "sm90_tiles.cuh"

namespace cuflash {

template <int D, int BC, int STAGES, int DTYPE, bool CAUSAL, bool EVEN_N, bool PINGPONG, bool STAGE_O>
__global__ void __launch_bounds__(384, 1)
    fwd_sm90_kernel(const __grid_constant__ TmaDesc map_q, const __grid_constant__ TmaDesc map_k,
                    const __grid_constant__ TmaDesc map_v, const __grid_constant__ TmaDesc map_o,
                    u16* __restrict__ o, float* __restrict__ lse,
                    const float* __restrict__ descale_q, const float* __restrict__ descale_k,
                    const float* __restrict__ descale_v, int* __restrict__ tile_counter, float* __restrict__ ws_o,
                    float* __restrict__ ws_lse, int* __restrict__ tail_done, int full_tiles, int tail_items,
                    int nq, int nk, int d,
                    int group, int nheads, int nheads_kv, int num_tiles, long long o_sb, long long o_sn, long long o_sh,
                    float scale_log2) {
    // nheads_kv (= nheads / group) comes from the host: computed here, ptxas
    // kept it live across the key loop and, at head dim 256, in local memory.
    using T = FwdSm90Traits<D, BC, STAGES, DTYPE, STAGE_O>;
    constexpr int BR = T::BR;
    constexpr bool FP8 = DTYPE == E4M3;
    constexpr bool BF16_OUT = DTYPE != F16;  // fp8 attention writes bf16
    // fp8 at head dim 128, whose GEMMs are short beside its softmax, has the
    // widest chains: 8 for the max and the sum, against 4 and 4 +2-14% at
    // 8k-16k (same-run A/B, bench/PERFLOG.md v17); 16-bit kernels gain
    // nothing from 8 max chains (-3% to +2%), nor from 4 sum chains.
    constexpr bool FP8_128 = FP8 && D == 128;
    constexpr int MAX_CHAINS = FP8_128 ? 8 : 4, SUM_CHAINS = FP8_128 ? 8 : 1;
    // The last wave split along the keys (tail_split.cuh): not under a causal
    // mask, whose tiles differ in length, nor at head dim 256, whose consumers
    // spill with the split's epilogue (the host passes tail_items = 0 there).
    constexpr bool TAIL_SPLIT = !CAUSAL && D < 256;
    constexpr bool SOFTMAX_TURNS = FP8_128 && !CAUSAL && !PINGPONG;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const FwdSm90Smem<T> sm(smem_addr(smem_raw));
    const SegmentSlot segment{reinterpret_cast<volatile int*>(smem_raw + T::OFF_SEGMENT)};

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int diag = nk - nq;

    if (tid == 0) {
        mbar_init(sm.full_q(), 1);
        mbar_init(sm.empty_q(), 4 * T::CONSUMERS);  // one arrival per consumer warp
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.full_k(s), 1);
            mbar_init(sm.full_v(s), 1);
            mbar_init(sm.empty_k(s), 4 * T::CONSUMERS);
            mbar_init(sm.empty_v(s), 4 * T::CONSUMERS);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<T::PRODUCER_REGS>();
        if (tid != 0) return;
        fwd_sm90_produce<T, CAUSAL, EVEN_N, TAIL_SPLIT>(sm, segment, map_q, map_k, map_v, tile_counter, full_tiles,
                                                        tail_items, nq, nk, group, nheads, num_tiles);
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
    const FwdOutput out{o, lse, o_sb, o_sn, o_sh, nq, nheads};
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
        // Without a causal mask the masked blocks are the last (a partial one).
        const Tile tile = tile_at<BR, CAUSAL>(t, (nq + BR - 1) / BR, nheads);
        const KeyBlocks blocks = forward_key_blocks<BR, BC, CAUSAL, EVEN_N>(tile.m0, nq, nk);
        const int lo = TAIL_SPLIT ? segment.lo() : 0, hi = TAIL_SPLIT ? segment.hi() : blocks.end;
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
        const int n_masked = TAIL_SPLIT ? max(0, hi - max(lo, blocks.unmasked)) : blocks.end - blocks.unmasked;
        if (hi == 0) {  // no row of this tile sees a key
            warp_arrive(sm.empty_q(), lane);
            write_empty_rows<64, D, 128>(out.o_tile(tile) + c * 64 * o_sn, o_sn, out.lse_rows(tile) + c * 64,
                                         nq - tile.m0 - c * 64, d, tid - 128 * wg);
            continue;
        }
        float qk_scale_log2 = scale_log2;
        if constexpr (FP8) {
            const int kv_index = tile.b * nheads_kv + hk;
            qk_scale_log2 *= descale_q[kv_index] * descale_k[kv_index];
        }

        SoftmaxAccumulators<D> acc;
        fwd_sm90_mainloop<T, CAUSAL, EVEN_N, MAX_CHAINS, SUM_CHAINS>(acc, sm, turns, kv_iter, n_blocks, n_masked, hi,
                                                                     tile.m0, warp_row0, nk, diag, qk_scale_log2, c,
                                                                     sink, lane);
        ring.advance(n_blocks);
        fwd_sm90_epilogue<T, TAIL_SPLIT, BF16_OUT>(acc, sm, words, out, split, map_o, descale_v, nk, d, nheads_kv,
                                                   qk_scale_log2, c, tid, warp, lane, warp_row0, stage_leader);
    }
    if (STAGE_O && stage_leader) bulk_wait<0, true>();  // shared memory stays until the stores have read it
    turns.close();
}

}  // namespace cuflash
