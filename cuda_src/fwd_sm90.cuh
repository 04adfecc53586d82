// FlashAttention forward for Hopper (sm_90a): wgmma, bulk tensor copies, warp
// specialisation, fp16 / bf16 / fp8 e4m3.
//
// The grid is persistent: one CTA per SM takes work tiles (BR = 128 query rows
// of one (batch, head)) from a global counter until none is left, so that the
// next tile's copies run under the current tile's last GEMMs and epilogue,
// and CTAs that drew short causal tiles draw more. Without a causal mask (and
// below head dim 256) the last wave's tiles are split along the keys into one
// run per CTA, their partial outputs combined (tail_split.cuh). Each CTA has
// three warpgroups. Warpgroup 0 is the producer: one thread copies a tile's Q (once
// the consumers have read the previous one) and then K and V tiles of BC keys
// into a STAGES-deep ring with bulk tensor copies (TMA, 128-byte swizzle, see
// sm90_tiles.cuh), each completing on a "full" mbarrier, and refills a stage
// once the consumers have arrived on its "empty" barrier; the ring's position
// runs on across work tiles. The producer gives its registers to the
// consumers (setmaxnreg). Warpgroups 1 and 2 are the consumers; consumer c
// owns rows 64c .. 64c+63 of a tile (each warp 16 rows, as in fwd_sm80.cuh).
//   S = Q K^T:  wgmma SS, Q and K from shared memory (both K-major).
//   O += P V:   wgmma RS, P from registers (the S accumulators rounded to the
//               input type are already in the A-fragment layout), V from
//               shared memory: MN-major for 16-bit types; for fp8, which wgmma
//               reads K-major only, a transposed copy Vt (head dim x keys)
//               whose keys are permuted within each 32 so that the fp8
//               A-fragment of P needs no shuffles (see fp8_prep.cuh), in
//               panels of 64 keys with the 64-byte swizzle, so that BC may be
//               any multiple of 64.
// Two overlaps keep the tensor cores busy during the softmax:
// - ping-pong (PINGPONG): the consumers take turns issuing their GEMMs (two
//   named barriers; a tile's last P V is issued outside the turns), so one's
//   softmax runs while the other's GEMMs execute. Without it each consumer
//   issues as soon as its tiles are in (faster at head dim 64 up to 2k keys
//   and for fp8 at head dim 128, slower elsewhere: dispatch.py; a tuner
//   choice); fp8 at head dim 128 without a mask takes turns for the softmax
//   instead (SOFTMAX_TURNS);
// - within a consumer, step t issues S_t = Q K_t^T and O += P_{t-1} V_{t-1}
//   together, then computes the softmax of S_t while the P V GEMM runs, and
//   rescales O once it has completed.
// The output tile leaves through shared memory and bulk tensor stores where
// it fits beside the ring (STAGE_O), so that the consumers start the next tile
// while it is written out; else straight from registers.
// The online softmax is the one of fwd_sm80.cuh: running row max and sum,
// exp2 with scale*log2(e) folded into one FMA, 1/l deferred to the end. fp8
// scores and outputs are dequantised by per-(batch, kv head) factors: the
// score scale by q_descale * k_descale, O by v_descale; the output is bf16.
#pragma once
#include "common.cuh"
#include "sm90_tiles.cuh"
#include "tail_split.cuh"
#include "wgmma.cuh"

namespace cuflash {

template <int D_, int BC_, int STAGES_, int DTYPE_, bool STAGE_O_>
struct FwdSm90Traits {
    static constexpr int D = D_, BC = BC_, STAGES = STAGES_, DTYPE = DTYPE_;
    static constexpr bool STAGE_O = STAGE_O_;
    static constexpr int ELEM = DTYPE == E4M3 ? 1 : 2;  // bytes per input element
    static constexpr int CONSUMERS = 2;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int BR = 64 * CONSUMERS;
    // Tiles are 128-byte-wide swizzled panels: PANEL_ELEMS elements per row.
    static constexpr int PANEL_ELEMS = 128 / ELEM;
    // Tile bytes, which are also each copy's transfer count (TMA writes whole boxes).
    static constexpr int Q_BYTES = BR * D * ELEM, KV_BYTES = BC * D * ELEM;
    // The output tile staged for its bulk tensor store (16-bit elements).
    static constexpr int O_BYTES = STAGE_O ? BR * D * 2 : 0;
    static constexpr int BARRIERS = 2 + 4 * STAGES;
    // A word per consumer thread that orders its softmax before a wgmma wait
    // (order_before_wait), and 32 bytes per consumer warp that keep its work
    // tile's coordinates, kv head, index, segment slot and length across the
    // key loop (stash_shared); the last word of a consumer's first warp holds
    // the consumer's flag for a tail combine (tail_split.cuh).
    static constexpr int SINK_BYTES = 4 * 128 * CONSUMERS, TILE_WORDS_BYTES = 32 * 4 * CONSUMERS;
    // + the segment in flight, handed from producer to consumers (16 bytes),
    // and the producer's next segment (16 bytes, one word used).
    static constexpr int SLOT_BYTES = 32;
    static constexpr int SMEM_BYTES =
        Q_BYTES + 2 * STAGES * KV_BYTES + O_BYTES + 8 * BARRIERS + SLOT_BYTES + SINK_BYTES + TILE_WORDS_BYTES;
    // Register split (setmaxnreg): the warpgroups share the CTA's allocation
    // at entry, 168 per thread (__launch_bounds__(384, 1)), so PRODUCER_REGS +
    // 2 x CONSUMER_REGS must not exceed 3 x 168 (a consumer's increase waits
    // for registers the producer gave back: more would hang). 240 only where
    // the consumers need it (head dim 256: O alone is 128 registers); the
    // producer spills below 40.
    static constexpr int ENTRY_REGS = 168;
    static constexpr int CONSUMER_REGS = D == 256 ? 240 : 232;
    static constexpr int PRODUCER_REGS = (1 + CONSUMERS) * ENTRY_REGS - CONSUMERS * CONSUMER_REGS;
    // k steps (32 bytes of each row) of the two GEMMs.
    static constexpr int KSTEPS_QK = D * ELEM / 32, KSTEPS_PV = BC * ELEM / 32;

    static_assert(D == 64 || D == 128 || D == 256, "wgmma n = head dim: 64, 128 or 256");
    static_assert(BC == 64 || BC == 80 || BC == 128 || BC == 176 || BC == 192,
                  "wgmma n = BC: 64, 80, 128, 176 or 192 (tools/gen_wgmma.py)");
    static_assert(DTYPE != E4M3 || (BC % 64 == 0 && D >= 128), "fp8: 64-key panels of Vt, 128-byte rows of Q, K");
    static_assert(STAGES >= 1 && STAGES <= 4, "1 to 4 stages");
    static_assert(SMEM_BYTES <= 227 * 1024, "tiles do not fit in shared memory");
};

// One step of the online softmax on a 16-row x BC tile of raw scores held as
// wgmma accumulators (two rows per thread): s becomes P = 2^(s c - m c) for
// the running max m, the running sum is updated, and alpha receives the
// factor 2^(m_old c - m c) that O must be multiplied by. m moves only when
// the tile's max exceeds it by more than RESCALE_LOG2 (in log2 units): P then
// stays below 2^RESCALE_LOG2, within every P type's range, and most steps
// leave alpha = 1 and O untouched (the result is the same: O and the sum
// share the stale max, and the epilogue uses it). A row with no key yet
// (max -inf) keeps P = 0.
constexpr float RESCALE_LOG2 = 8.f;

// The row max and the row sum are computed as MAX_CHAINS and SUM_CHAINS
// interleaved chains joined by a tree (powers of two): one chain of NT
// dependent instructions made each a latency stall between the S GEMM and
// the exponentials, and after them (SASS and ncu of the fp8 kernel). The
// kernel picks the counts (fwd_sm90_kernel: MAX_CHAINS, SUM_CHAINS).
template <int NT, int MAX_CHAINS, int SUM_CHAINS>
__device__ __forceinline__ void online_softmax(float (&s)[NT * 4], float (&row_max)[2], float (&row_sum)[2],
                                               float (&alpha)[2], float scale_log2) {
    static_assert(NT >= MAX_CHAINS && NT >= SUM_CHAINS, "a chain per partial max and sum");
    float mx[2];  // the max of this thread's scores of each row and the running max
    bool grows = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float part[MAX_CHAINS];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float m2 = fmaxf(s[j * 4 + 2 * r], s[j * 4 + 2 * r + 1]);
            part[j % MAX_CHAINS] = j < MAX_CHAINS ? m2 : fmaxf(part[j % MAX_CHAINS], m2);
        }
#pragma unroll
        for (int w = MAX_CHAINS / 2; w > 0; w /= 2)
#pragma unroll
            for (int k = 0; k < w; ++k) part[k] = fmaxf(part[k], part[k + w]);
        mx[r] = fmaxf(row_max[r], part[0]);
        grows = grows || mx[r] * scale_log2 > row_max[r] * scale_log2 + RESCALE_LOG2;
        alpha[r] = 1.f;
    }
    // A row's max moves only when the max over its quad passes the running max
    // by RESCALE_LOG2. Where no thread of the warp holds such a score (most
    // steps once a row has seen a few tiles) one vote skips the two shuffle
    // rounds of the quad max, which lie between the S GEMM and the first
    // exponential; the result is the same.
    if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m = quad_max(mx[r]);
            if (m * scale_log2 > row_max[r] * scale_log2 + RESCALE_LOG2) {
                alpha[r] = exp2_approx((row_max[r] - m) * scale_log2);
                row_max[r] = m;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float offset = row_max[r] == neg_inf() ? 0.f : row_max[r] * scale_log2;
        float sum[SUM_CHAINS];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float pair = 0.f;
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const float p = exp2_approx(fmaf(s[j * 4 + 2 * r + cc], scale_log2, -offset));
                s[j * 4 + 2 * r + cc] = p;
                pair = cc == 0 ? p : pair + p;
            }
            sum[j % SUM_CHAINS] = j < SUM_CHAINS ? pair : sum[j % SUM_CHAINS] + pair;
        }
#pragma unroll
        for (int w = SUM_CHAINS / 2; w > 0; w /= 2)
#pragma unroll
            for (int k = 0; k < w; ++k) sum[k] += sum[k + w];
        row_sum[r] = row_sum[r] * alpha[r] + sum[0];
    }
}

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
    constexpr int NT_S = BC / 8, NT_O = D / 8;
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

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sQ = smem_addr(smem_raw);
    const u32 sK = sQ + T::Q_BYTES;
    const u32 sV = sK + STAGES * T::KV_BYTES;
    const u32 sO = sV + STAGES * T::KV_BYTES;
    const u32 bars = sO + T::O_BYTES;
    const u32 full_q = bars, empty_q = bars + 8;
    // Written by the producer before it arrives on full_q, read by the
    // consumers after their wait on it; rewritten after empty_q completes.
    // The segment in flight (tile, lo, hi, slot: tail_split.cuh).
    volatile int* tile_slot = reinterpret_cast<volatile int*>(smem_raw + (bars - sQ) + 8 * T::BARRIERS);
    auto full_k = [&](int s) { return bars + 8 * (2 + s); };
    auto full_v = [&](int s) { return bars + 8 * (2 + STAGES + s); };
    auto empty_k = [&](int s) { return bars + 8 * (2 + 2 * STAGES + s); };
    auto empty_v = [&](int s) { return bars + 8 * (2 + 3 * STAGES + s); };

    // Tiles are the 128-byte-swizzled panels of common.cuh (tile_offset),
    // written so by TMA (swizzle 128B) and read by wgmma through descriptors
    // with swizzle mode 128B. Measured on an H200 (hdim 128, 8k, cp.async
    // version): 577 TFLOP/s, against 328 with unswizzled 8 x 8 core matrices.
    auto q_desc = [&](int row0, int ks) { return desc_k_major_sw128<BR>(sQ, row0, ks); };
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

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int diag = nk - nq;
    // Work tile -> (query block, head, batch): query blocks innermost, so
    // that a head's K and V stay in L2 while its blocks run; under a causal
    // mask the longest blocks first. Each warpgroup passes the block count
    // itself: one computed before the register split (setmaxnreg) was kept in
    // local memory at head dim 256.
    struct Tile {
        int m0, h, b;
    };
    auto tile_at = [&](int t, int m_blocks) {
        int m = t % m_blocks;
        if constexpr (CAUSAL) m = m_blocks - 1 - m;
        const int hb = t / m_blocks;
        return Tile{m * BR, hb % nheads, hb / nheads};
    };

    if (tid == 0) {
        mbar_init(full_q, 1);
        mbar_init(empty_q, 4 * T::CONSUMERS);  // one arrival per consumer warp
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 4 * T::CONSUMERS);
            mbar_init(empty_v(s), 4 * T::CONSUMERS);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<T::PRODUCER_REGS>();
        if (tid != 0) return;
        tma_prefetch_desc(map_q);
        tma_prefetch_desc(map_k);
        tma_prefetch_desc(map_v);
        // Items: blockIdx.x first, then one from the counter per item taken.
        // Items below full_tiles are whole tiles, the others runs of split
        // tiles' key blocks (tail_split.cuh), one segment per pass; a tile
        // index past the last tells the consumers to stop.
        // The next segment, as item x 2 + part, waits in shared memory during
        // the key loop (at head dim 256 the producer has 24 registers).
        const u32 next_word = bars + 8 * T::BARRIERS + 16;
        int kv_iter = 0, q_iter = 0;
        const int num_items = full_tiles + tail_items;
        for (int next = 2 * blockIdx.x;; ++q_iter) {
            const int item = next >> 1, part = next & 1;
            if (q_iter > 0) mbar_wait(empty_q, (q_iter - 1) & 1);
            if (item >= num_items) {
                tile_slot[0] = num_tiles;
                mbar_arrive(full_q);
                break;
            }
            // The lengths made opaque per tile: ptxas otherwise hoists the
            // tile arithmetic's invariants out of this loop, and at head dim
            // 256 (24 producer registers) kept them in local memory.
            const int nq_t = opaque(nq), nk_t = opaque(nk);
            Segment seg{item, 0, 0, -1, false};
            if (TAIL_SPLIT && item >= full_tiles)
                seg = tail_segment(item, part, full_tiles, num_tiles - full_tiles, tail_items, (nk_t + BC - 1) / BC);
            const Tile tile = tile_at(seg.tile, (nq_t + BR - 1) / BR);
            const int hk = tile.h / group;
            if (seg.slot < 0) seg.hi = forward_key_blocks<BR, BC, CAUSAL, EVEN_N>(tile.m0, nq_t, nk_t).end;
            tile_slot[0] = seg.tile;
            tile_slot[1] = seg.lo;
            tile_slot[2] = seg.hi;
            tile_slot[3] = seg.slot;
            stash_shared(next_word, seg.more ? next + 1 : -1);
            if (seg.hi == 0) {  // the consumers write its empty rows
                mbar_arrive(full_q);
            } else {
                // Q, K and 16-bit V: one box per 128-byte panel of the row
                // (tensor dims: head dim, seq, head, batch). fp8 Vt: one box of
                // 64 keys x D rows per panel (dims: keys, head dim, kv head, batch).
                mbar_arrive_expect_tx(full_q, T::Q_BYTES);
                for (int p = 0; p < D / T::PANEL_ELEMS; ++p)
                    tma_load_4d(sQ + p * BR * 128, map_q, p * T::PANEL_ELEMS, tile.m0, tile.h, tile.b, full_q);
                // Key blocks descending, so that the masked ones come first.
                for (int n = seg.hi - 1; n >= seg.lo; --n, ++kv_iter) {
                    const int st = kv_iter % STAGES, use = kv_iter / STAGES, n0 = n * BC;
                    const u32 k_tile = sK + st * T::KV_BYTES, v_tile = sV + st * T::KV_BYTES;
                    if (use > 0) mbar_wait(empty_k(st), (use - 1) & 1);
                    mbar_arrive_expect_tx(full_k(st), T::KV_BYTES);
                    for (int p = 0; p < D / T::PANEL_ELEMS; ++p)
                        tma_load_4d(k_tile + p * BC * 128, map_k, p * T::PANEL_ELEMS, n0, hk, tile.b, full_k(st));
                    if (use > 0) mbar_wait(empty_v(st), (use - 1) & 1);
                    mbar_arrive_expect_tx(full_v(st), T::KV_BYTES);
                    if constexpr (FP8) {
                        for (int p = 0; p < BC / 64; ++p)
                            tma_load_4d(v_tile + p * D * 64, map_v, n0 + 64 * p, 0, hk, tile.b, full_v(st));
                    } else {
                        for (int p = 0; p < D / T::PANEL_ELEMS; ++p)
                            tma_load_4d(v_tile + p * BC * 128, map_v, p * T::PANEL_ELEMS, n0, hk, tile.b, full_v(st));
                    }
                }
            }
            next = unstash_shared(next_word);
            if (next >= 0) continue;  // the item's second segment
            // Every item taken draws one ticket, so tickets run 0 .. num_items - 1
            // and the last one's holder resets the counter for the next launch
            // (one counter per stream, cuflash/api.py). Drawn once the item's
            // copies are issued, so that the ticket is not live across them (at
            // head dim 256 the producer has 24 registers); the consumers are
            // then STAGES key blocks behind, which hides the atomic's latency.
            const int ticket = atomicAdd(tile_counter, 1);
            if (ticket == num_items - 1) atomicExch(tile_counter, 0);
            next = 2 * (ticket + gridDim.x);
        }
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<T::CONSUMER_REGS>();
    const int c = wg - 1;
    const int warp_row0 = c * 64 + (warp & 3) * 16;
    const bool stage_leader = STAGE_O && tid % 128 == 0;  // issues this consumer's output stores
    const u32 sink = bars + 8 * T::BARRIERS + T::SLOT_BYTES + 4 * (tid - 128);
    const u32 tile_words = bars + 8 * T::BARRIERS + T::SLOT_BYTES + T::SINK_BYTES + 32 * (warp - 4);

    auto issue_s = [&](float (&acc_s)[NT_S * 4], int st) {
#pragma unroll
        for (int ks = 0; ks < T::KSTEPS_QK; ++ks)
            Wgmma<BC, DTYPE>::ss(acc_s, q_desc(c * 64, ks), k_desc(sK + st * T::KV_BYTES, ks), ks > 0);
    };
    auto release = [&](u32 bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };

    // Ping-pong: consumer c issues its GEMMs after a sync on barrier 1 + c,
    // then lets the other consumer issue. Consumer 1 opens the first turn for
    // consumer 0; consumer 0 takes a last sync at the end for consumer 1's
    // last hand-over, so that every arrival has a matching sync.
    auto begin_turn = [&] {
        if constexpr (PINGPONG) named_bar_sync<256>(1 + c);
    };
    auto end_turn = [&] {
        if constexpr (PINGPONG) named_bar_arrive<256>(2 - c);
    };
    if (PINGPONG && c == 1) named_bar_arrive<256>(1);

    // Softmax turns (fp8 at head dim 128 without a mask and without
    // ping-pong): the consumers take turns computing a softmax step (barriers
    // 5 and 6, as the GEMM turns above), so that one's exponentials run on
    // the MUFU pipe while the other's GEMMs run. There the exponentials hold
    // the MUFU pipe as long as the step's GEMMs hold the tensor cores (16 per
    // clock per SM against the fp8 rate), and without turns the consumers
    // fell in phase (ncu: both pipes 52% busy). Measured with ncu (SM active
    // cycles, H100): -3% at 2k-16k; turns around the exponentials only, +3.5%;
    // under the causal mask, +4.5% (bench/PERFLOG.md v21).
    constexpr bool SOFTMAX_TURNS = FP8_128 && !CAUSAL && !PINGPONG;
    auto softmax = [&](float (&acc_s)[NT_S * 4], float (&row_max)[2], float (&row_sum)[2], float (&alpha)[2],
                       float qk_scale_log2) {
        if constexpr (SOFTMAX_TURNS) named_bar_sync<256>(5 + c);
        online_softmax<NT_S, MAX_CHAINS, SUM_CHAINS>(acc_s, row_max, row_sum, alpha, qk_scale_log2);
        if constexpr (SOFTMAX_TURNS) named_bar_arrive<256>(6 - c);
    };
    if (SOFTMAX_TURNS && c == 1) named_bar_arrive<256>(5);

    RingPosition<FP8 && D == 256> ring;
    for (;; ring.next_tile()) {
        mbar_wait(full_q, ring.tile_parity());
        const int kv_iter = ring.key_blocks();
        const int t = tile_slot[0];
        if (t >= num_tiles) break;
        // Key blocks [lo, hi) of tile t; slot >= 0: a split tile's segment.
        // Without a causal mask the masked blocks are the last (a partial one).
        const Tile tile = tile_at(t, (nq + BR - 1) / BR);
        const KeyBlocks blocks = forward_key_blocks<BR, BC, CAUSAL, EVEN_N>(tile.m0, nq, nk);
        const int lo = TAIL_SPLIT ? tile_slot[1] : 0, hi = TAIL_SPLIT ? tile_slot[2] : blocks.end;
        const int slot = TAIL_SPLIT ? tile_slot[3] : -1;
        const int hk = tile.h / group;
        stash_shared(tile_words, tile.m0);  // every lane stores the same values
        stash_shared(tile_words + 4, tile.h);
        stash_shared(tile_words + 8, tile.b);
        stash_shared(tile_words + 12, hk);
        stash_shared(tile_words + 16, t);
        stash_shared(tile_words + 20, slot);
        stash_shared(tile_words + 24, hi - lo);
        // Formed where used, not live across the key loop (at head dim 256
        // the consumers' registers are short).
        auto o_tile = [&](const Tile& tl) { return o + tl.b * o_sb + tl.h * o_sh + tl.m0 * o_sn; };
        auto lse_rows = [&](const Tile& tl) { return lse + ((long long)tl.b * nheads + tl.h) * nq + tl.m0; };
        const int n_blocks = hi - lo;
        const int n_masked = TAIL_SPLIT ? max(0, hi - max(lo, blocks.unmasked)) : blocks.end - blocks.unmasked;
        if (hi == 0) {  // no row of this tile sees a key
            release(empty_q);
            write_empty_rows<64, D, 128>(o_tile(tile) + c * 64 * o_sn, o_sn, lse_rows(tile) + c * 64,
                                         nq - tile.m0 - c * 64, d, tid - 128 * wg);
            continue;
        }
        float qk_scale_log2 = scale_log2;
        if constexpr (FP8) {
            const int kv_index = tile.b * nheads_kv + hk;
            qk_scale_log2 *= descale_q[kv_index] * descale_k[kv_index];
        }

        float acc_o[NT_O * 4];
#pragma unroll
        for (int i = 0; i < NT_O * 4; ++i) acc_o[i] = 0.f;
        float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f}, alpha[2];
        AFragments<DTYPE, BC> p_frag;

        auto issue_pv = [&](int st) {
#pragma unroll
            for (int kk = 0; kk < T::KSTEPS_PV; ++kk)
                Wgmma<D, DTYPE>::template rs<!FP8>(acc_o, p_frag.r[kk], v_desc(sV + st * T::KV_BYTES, kk));
        };
        auto apply_mask = [&](float (&acc_s)[NT_S * 4], int i) {
            const int n0 = (hi - 1 - i) * BC;
#pragma unroll
            for (int j = 0; j < NT_S; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = tile.m0 + warp_row0 + (lane >> 2) + 8 * (e >> 1);
                    const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1);
                    bool keep = EVEN_N || col < nk;
                    if constexpr (CAUSAL) keep = keep && col <= row + diag;
                    if (!keep) acc_s[j * 4 + e] = neg_inf();
                }
        };
        // The last S GEMM of the tile has read Q: the producer may load the next.
        auto after_s = [&](int i, int st) {
            release(empty_k(st));
            if (i == n_blocks - 1) release(empty_q);
        };

        // Key block 0: S_0 alone.
        {
            const int st = kv_iter % STAGES, parity = (kv_iter / STAGES) & 1;
            float acc_s[NT_S * 4];
            mbar_wait(full_k(st), parity);
            begin_turn();
            wgmma_fence();
            issue_s(acc_s, st);
            wgmma_commit();
            end_turn();
            wgmma_wait<0>();
            after_s(0, st);
            if (n_masked > 0) apply_mask(acc_s, 0);
            softmax(acc_s, row_max, row_sum, alpha, qk_scale_log2);
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
            mbar_wait(full_k(st), parity);
            mbar_wait(full_v(st_prev), parity_prev);
            begin_turn();
            wgmma_fence();
            issue_s(acc_s, st);
            wgmma_commit();
            issue_pv(st_prev);
            wgmma_commit();
            end_turn();
            wgmma_wait<1>();  // S_i is in; P V still runs
            after_s(i, st);
            if constexpr (decltype(masked)::value) apply_mask(acc_s, i);
            softmax(acc_s, row_max, row_sum, alpha, qk_scale_log2);
            // The row sums depend on every exponential: without this, ptxas
            // hoists the wait above the softmax and P V no longer hides it
            // (+3-5% at head dims 128 and 256, fp8 at 256 +5-9%; head dim 64,
            // whose P V is short, 2-6% slower with it, and fp8 at 128, 7-11%).
            if constexpr (D >= 128 && !FP8_128) order_before_wait(sink, row_sum[0] + row_sum[1]);
            wgmma_wait<0>();
            release(empty_v(st_prev));
            if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
                for (int j = 0; j < NT_O; ++j) {
                    acc_o[j * 4 + 0] *= alpha[0];
                    acc_o[j * 4 + 1] *= alpha[0];
                    acc_o[j * 4 + 2] *= alpha[1];
                    acc_o[j * 4 + 3] *= alpha[1];
                }
            }
            p_frag.pack(acc_s);
        };
        int i = 1;
        for (; i < n_masked; ++i) step(i, BoolConst<true>{});
        for (; i < n_blocks; ++i) step(i, BoolConst<false>{});

        // Last P V.
        {
            const int it = kv_iter + n_blocks - 1;
            const int st = it % STAGES, parity = (it / STAGES) & 1;
            mbar_wait(full_v(st), parity);
            wgmma_fence();
            issue_pv(st);
            wgmma_commit();
            wgmma_wait<0>();
            release(empty_v(st));
        }
        ring.advance(n_blocks);

        // Epilogue: O /= l (times v_descale), lse = (m * c + log2 l) * ln 2.
        // STAGE_O: this consumer's 64 rows go to its half of the staging tile
        // (D / 64 panels of the 128-byte swizzle; a quad writes one 16-byte
        // chunk of a row, 8 rows in 8 distinct chunks: conflict-free), which
        // one thread then hands to bulk tensor stores (rows past nq and
        // columns past d are clipped by the tensor map), so that the consumer
        // goes on to the next tile while they run. Otherwise each quad stores
        // its 16 contiguous bytes of a row straight to global memory.
        // The tile's coordinates, kv head and segment from shared memory, the
        // fp8 output scale from global memory: none is kept live across the
        // key loop (at head dim 256 they went to local memory).
        const Tile out_tile{unstash_shared(tile_words), unstash_shared(tile_words + 4),
                            unstash_shared(tile_words + 8)};
        const int rows_valid = nq - out_tile.m0;
        const float o_scale = FP8 ? descale_v[out_tile.b * nheads_kv + unstash_shared(tile_words + 12)] : 1.f;
        constexpr float LN2 = 0.6931471805599453f;
        // Row scales and lse values first, so that only they stay live beside
        // O while it is stored; the lse rows are written once O is out.
        float inv[2], row_lse[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(row_sum[r]);
            // l >= 1 (the row's largest score gives at least 2^0), so the fast
            // division is accurate to 2 ulp; the IEEE one calls a slow-path
            // routine whose registers the epilogue at head dim 256 cannot spare.
            inv[r] = l > 0.f ? __fdividef(o_scale, l) : 0.f;
            row_lse[r] = l > 0.f ? (row_max[r] * qk_scale_log2 + log2_approx(l)) * LN2 : neg_inf();
        }
        if constexpr (TAIL_SPLIT) {
            const int out_slot = unstash_shared(tile_words + 20);
            if (out_slot >= 0) {
                // A split tile's segment: its rows' partial output and lse go
                // to the workspace slot; the consumer whose segment completes
                // the tile half's key blocks (counted in tail_done, reset by
                // that consumer for the next launch) combines them.
                float* o_part = ws_o + (long long)out_slot * BR * D;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = warp_row0 + (lane >> 2) + 8 * r;
#pragma unroll
                    for (int j = 0; j < NT_O; ++j)
                        *reinterpret_cast<float2*>(o_part + row * D + j * 8 + 2 * (lane & 3)) =
                            make_float2(acc_o[j * 4 + 2 * r] * inv[r], acc_o[j * 4 + 2 * r + 1] * inv[r]);
                    if ((lane & 3) == 0) ws_lse[out_slot * BR + row] = row_lse[r];
                }
                // The consumer's stores, then one thread's release of them
                // (and acquire of the other segments') at GPU scope, as
                // CUTLASS's semaphores do: a fence per thread cost more.
                named_bar_sync<128>(3 + c);
                const int split_tile = unstash_shared(tile_words + 16) - full_tiles, key_blocks = (nk + BC - 1) / BC;
                const u32 last_word = tile_words - 32 * (warp & 3) + 28;  // in the consumer's first warp's words
                if (tid % 128 == 0) {
                    int* done = tail_done + 2 * split_tile + c;
                    const int seg_blocks = unstash_shared(tile_words + 24);
                    const bool last = atomic_add_acq_rel(done, seg_blocks) + seg_blocks == key_blocks;
                    if (last) *done = 0;
                    stash_shared(last_word, last);
                }
                named_bar_sync<128>(3 + c);
                if (unstash_shared(last_word)) {
                    combine_partials<BR, D, BF16_OUT>(
                        ws_o, ws_lse, tail_slots(split_tile, num_tiles - full_tiles, tail_items, key_blocks),
                        warp_row0, o_tile(out_tile), o_sn, lse_rows(out_tile), rows_valid, d, lane);
                }
                continue;
            }
        }
        u16* o_stage = reinterpret_cast<u16*>(smem_raw + (sO - sQ)) + c * 64 * D;
        if constexpr (STAGE_O) {
            if (stage_leader) bulk_wait<0, true>();  // the last tile's stores have read the staging tile
            named_bar_sync<128>(3 + c);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + (lane >> 2) + 8 * r;
            if constexpr (STAGE_O) {
#pragma unroll
                for (int j = 0; j < NT_O; ++j)
                    *reinterpret_cast<u32*>(o_stage + tile_offset<64, D>(row - c * 64, j) + 2 * (lane & 3)) =
                        pack2<BF16_OUT>(acc_o[j * 4 + 2 * r] * inv[r], acc_o[j * 4 + 2 * r + 1] * inv[r]);
            } else {
                if (row >= rows_valid) continue;
                u16* o_row = o_tile(out_tile) + row * o_sn;
#pragma unroll
                for (int j = 0; j < NT_O; ++j) {
                    const int col = j * 8 + 2 * (lane & 3);
                    if (col < d)
                        *reinterpret_cast<u32*>(o_row + col) =
                            pack2<BF16_OUT>(acc_o[j * 4 + 2 * r] * inv[r], acc_o[j * 4 + 2 * r + 1] * inv[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + (lane >> 2) + 8 * r;
            if (row < rows_valid && (lane & 3) == 0) lse_rows(out_tile)[row] = row_lse[r];
        }
        if constexpr (STAGE_O) {
            fence_proxy_async();  // the staged rows, before the async proxy reads them
            named_bar_sync<128>(3 + c);
            if (stage_leader && c * 64 < rows_valid) {
                for (int p = 0; p < D / 64; ++p)
                    tma_store_4d(map_o, sO + c * 64 * D * 2 + p * 64 * 128, p * 64, out_tile.m0 + c * 64,
                                 out_tile.h, out_tile.b);
                bulk_commit();
            }
        }
    }
    if (STAGE_O && stage_leader) bulk_wait<0, true>();  // shared memory stays until the stores have read it
    if (c == 0) begin_turn();  // a no-op without PINGPONG
    if (SOFTMAX_TURNS && c == 0) named_bar_sync<256>(5);  // consumer 1's last hand-over
}

}  // namespace cuflash
