// FlashAttention backward for Hopper (sm_90a): dK and dV, and dQ by fp32
// atomics, with wgmma, bulk tensor copies and warp specialisation; fp16 / bf16.
//
// The math is that of bwd_sm80.cuh (with lse2 = lse * log2(e) and
// Delta = rowsum(dO o O) from its bwd_preprocess_kernel):
//   S^T = K Q^T,  P^T = 2^(S^T * c - lse2[query]),  dP^T = V dO^T,
//   dS^T = P^T o (dP^T - Delta[query]),
//   dV += P^T dO,  dK += dS^T Q (times scale at the end),  dQ += dS K.
// A work tile is a block of BN = 128 keys (and kv head, batch), a CTA takes one,
// or where the kernel is persistent several in turn (kv_tile_at); three
// warpgroups. Warpgroup 0 is the producer: one thread copies a tile's K and V
// once (once the consumers have released the last tile's: empty_kv), then for every
// query block that sees these keys (over the query heads of a GQA group) Q,
// dO (bulk tensor copies, 128-byte swizzle) and the block's lse2 and Delta
// rows (plain bulk copies) into a STAGES-deep ring on mbarriers. Warpgroups 1
// and 2 are the consumers; consumer c owns keys 64c .. 64c+63 and holds their
// dK and dV accumulators for the whole tile:
//   S^T, dP^T:  wgmma SS, M = 64 keys, N = BM queries (K, V and Q, dO K-major);
//   dV, dK:     wgmma RS, P^T and dS^T from registers (the accumulators
//               rounded to 16 bits), dO and Q as MN-major B operands;
//   dQ:         dS^T goes to shared memory (double-buffered); after a barrier
//               between the consumers, wgmma SS with dS (MN-major A, read
//               from dS^T) and K (MN-major B): consumer c takes query rows
//               64c.. (BM = 128) or head-dim columns c * D/2.. (BM = 64). Its
//               accumulators go to shared memory as they lie in registers
//               (conflict-free 16-byte stores), and each warp adds its part
//               to the query block's fp32 dq_accum with a bulk reduction,
//               issued once the next step's S^T GEMM is under way; so
//               dq_accum holds each block in that fragment order
//               (dq_fragment_row_col), which bwd_sm90_convert_dq_kernel undoes.
//               (Measured on an H200, hdim 128, 8k: per-thread vector
//               reductions instead cost 30% of the backward's time.)
// Without ATOMIC_DQ (deterministic mode) the kernel stops at dK and dV and
// bwd_sm90_dq_kernel (below) computes dQ.
#pragma once
#include "bwd_sm90_tiles.cuh"
#include "bwd_sm90_wide.cuh"
#include "common.cuh"
#include "dropout.cuh"
#include "named_barriers.cuh"
#include "score_mods.cuh"
#include "seq_span.cuh"
#include "sm90_tiles.cuh"
#include "wgmma.cuh"

namespace cuflash {

template <int D_, int BM_, int STAGES_, bool ATOMIC_DQ_>
struct BwdSm90Traits {
    static constexpr int D = D_, BM = BM_, STAGES = STAGES_;
    static constexpr bool ATOMIC_DQ = ATOMIC_DQ_;
    static constexpr int CONSUMERS = 2;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int BN = 64 * CONSUMERS;  // keys per CTA
    static constexpr int KV_BYTES = BN * D * 2, QB_BYTES = BM * D * 2;
    static constexpr int DS_BYTES = ATOMIC_DQ ? BN * BM * 2 : 0;  // one dS^T buffer: [key][query]
    static constexpr int ROW_BYTES = BM * 4;                       // one block's lse2 (or Delta)
    // Each consumer's share of dQ = dS K: 64 query rows x DQ_N head-dim columns.
    static constexpr int DQ_N = BM == 128 ? D : D / 2;
    static constexpr int DQ_BYTES = ATOMIC_DQ ? 64 * DQ_N * 4 : 0;  // one consumer's dQ tile (fp32)
    static constexpr int BARRIERS = 2 + 2 * STAGES;  // full_kv, empty_kv, full and empty per stage
    // Shared memory (cuflash/config.py BwdConfig.dkdv_smem_layout): K, V,
    // STAGES x Q, STAGES x dO, 2 x dS^T (tiles 1024-byte aligned), 2 x dQ (one
    // per consumer), STAGES x lse2, STAGES x Delta, mbarriers, the next tile.
    static constexpr int OFF_K = 0;
    static constexpr int OFF_V = OFF_K + KV_BYTES;
    static constexpr int OFF_Q = OFF_V + KV_BYTES;
    static constexpr int OFF_DO = OFF_Q + STAGES * QB_BYTES;
    static constexpr int OFF_DS = OFF_DO + STAGES * QB_BYTES;
    static constexpr int OFF_DQ = OFF_DS + 2 * DS_BYTES;
    static constexpr int OFF_ROWS = OFF_DQ + CONSUMERS * DQ_BYTES;
    static constexpr int OFF_BARS = OFF_ROWS + 2 * STAGES * ROW_BYTES;
    static constexpr int OFF_TILE = OFF_BARS + 8 * BARRIERS;  // the persistent kernel's next tile (int)
    static constexpr int SMEM_BYTES = OFF_TILE + 16;
    // Register split (setmaxnreg, SM90_ENTRY_REGS).
    static constexpr int ENTRY_REGS = SM90_ENTRY_REGS;
    static constexpr int CONSUMER_REGS = 232;
    static constexpr int PRODUCER_REGS = (1 + CONSUMERS) * ENTRY_REGS - CONSUMERS * CONSUMER_REGS;

    // dK + dV hold D / 2 registers per thread, S^T + dP^T BM / 2 more: the two
    // shapes that fit the consumers' registers (and give dQ a 64-wide wgmma).
    static_assert((D == 64 && BM == 128) || (D == 128 && BM == 64), "head dim 64 with BM 128, or 128 with BM 64");
    static_assert(STAGES >= 2 && STAGES <= 3, "2 or 3 stages");
    static_assert(OFF_Q % 1024 == 0 && OFF_DO % 1024 == 0 && OFF_DS % 1024 == 0 && QB_BYTES % 1024 == 0,
                  "tiles start on 1024-byte swizzle atoms");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tiles do not fit in shared memory");
};

// A query block's dQ (BM x D floats) lies in its dq_accum block in the order
// in which the consumers' accumulators are stored: consumer c, warp w, 8-column
// tile j, lane, element e (see wgmma.cuh for which row and column each
// holds). The float4 at position i of a block holds elements e = 0..3 of one
// lane: (row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1).
template <int BM, int D>
__device__ __forceinline__ int2 dq_fragment_row_col(int i) {
    constexpr int DQ_N = BwdSm90Traits<D, BM, 2, true>::DQ_N;
    constexpr int CONSUMER_VECS = 64 * DQ_N / 4;  // float4s of one consumer's share
    const int c = i / CONSUMER_VECS, lane = i % 32, wj = i % CONSUMER_VECS / 32;  // wj: w * (DQ_N / 8) + j
    const int row = (BM == 128 ? 64 * c : 0) + 16 * (wj / (DQ_N / 8)) + lane / 4;
    const int col = (BM == 128 ? 0 : c * DQ_N) + 8 * (wj % (DQ_N / 8)) + 2 * (lane % 4);
    return make_int2(row, col);
}

// dq = scale * dQ in the input dtype, one CTA per block of BM query rows. The
// block's dq_accum (fragment order, dq_fragment_row_col) is read 16 bytes a
// thread, scaled and rounded, and put in row order in shared memory as 16-bit
// pairs, then written out a column pair a thread, so that both the reads and
// a warp's stores are contiguous. (Measured on an H100 at 16k x 2048 fp16: a
// warp per row reading 8 bytes a lane took 82 us; stores of the fragments'
// pairs straight from registers, 16 bytes of each of 16 rows a warp, 110.)
// The staged pairs take 18 KB at BM x D = 128 x 64 or 64 x 128, so 8 CTAs of
// 256 threads fit an SM (the float tile they replace took 36 KB: 6 CTAs, and
// a backward of 1,024 blocks, 16 x 1k x 8 heads of 64, ran in 1.3 waves).
template <bool BF16_OUT, int D, int BM, bool VARLEN>
__global__ void bwd_sm90_convert_dq_kernel(const float* __restrict__ dq_accum, u16* __restrict__ dq, int nq,
                                           int nq_pad, int d, long long dq_sb, long long dq_sn, long long dq_sh,
                                           float scale, const ScoreModArgs mod_args) {
    // Rows padded by 4 words: a warp's stores of 8 rows x 4 lanes take the 32 banks once.
    constexpr int ROW = D / 2 + 4;
    __shared__ u32 tile[BM * ROW];
    wait_prior_grid();  // the dK/dV kernel's sums
    const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, nheads = gridDim.y;
    const SeqSpan seq = seq_span<VARLEN>(mod_args, b, nq, 0);
    if (m0 >= seq.nq) return;
    const float4* block =
        reinterpret_cast<const float4*>(dq_accum + (seq.padded_row0<VARLEN>(b, h, nheads, nq_pad) + m0) * D);
#pragma unroll 4
    for (int i = threadIdx.x; i < BM * D / 4; i += blockDim.x) {
        const float4 x = block[i];
        const int2 at = dq_fragment_row_col<BM, D>(i);
        tile[at.x * ROW + at.y / 2] = pack2<BF16_OUT>(x.x * scale, x.y * scale);
        tile[(at.x + 8) * ROW + at.y / 2] = pack2<BF16_OUT>(x.z * scale, x.w * scale);
    }
    __syncthreads();
    u16* dst = dq + b * dq_sb + h * dq_sh + (seq.q0 + m0) * dq_sn;
    const int rows = min(BM, seq.nq - m0);
#pragma unroll 4
    for (int i = threadIdx.x; i < BM * D / 2; i += blockDim.x) {
        const int r = i / (D / 2), c = i % (D / 2);
        if (r < rows && 2 * c < d) *reinterpret_cast<u32*>(dst + r * dq_sn + 2 * c) = tile[r * ROW + c];
    }
}

// bwd_sm90_kernel is persistent (bwd_sm90_persistent): one CTA an SM takes tile
// blockIdx.x, then the next one not yet taken, from a ticket (as the Hopper
// forward's scheduler, fwd_sm90_scheduler.cuh), in kv_tile_at's order. With one CTA a
// tile an SM had no consumer at work while a CTA stored its dK and dV and the
// next one loaded its K, V and first Q and dO (ncu, H100, 8 x 2k x 16 heads of
// 128: 8.8 of 12 warps active an SM on average, against 10.0 in cuDNN's
// persistent kernel); now the producer loads the next tile's while the
// consumers store. A fixed turn order (tiles blockIdx.x + i gridDim.x) left
// SMs idle under a causal mask, whose tiles differ in length (1.2-1.4x
// slower, H100). With a window or a packed batch, and in deterministic mode
// (whose tile loop, kept to one pass, fits its registers), a CTA a tile.
template <bool ATOMIC_DQ, int MODS>
constexpr bool bwd_sm90_persistent() {
    return ATOMIC_DQ && !(MODS & (MOD_WINDOW | MOD_VARLEN));
}

template <int D, int BM, int STAGES, int DTYPE, bool CAUSAL, bool EVEN_N, bool ATOMIC_DQ, int MODS>
__global__ void __launch_bounds__(384, 1)
    bwd_sm90_kernel(const __grid_constant__ TmaDesc map_q, const __grid_constant__ TmaDesc map_k,
                    const __grid_constant__ TmaDesc map_v, const __grid_constant__ TmaDesc map_do,
                    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_accum,
                    u16* __restrict__ dk, u16* __restrict__ dv, int* __restrict__ tile_ticket, int nq, int nk, int d,
                    int group, int nq_pad, int kv_heads, int batches, long long dk_sb, long long dk_sn,
                    long long dk_sh, long long dv_sb, long long dv_sn, long long dv_sh, float scale_log2, float scale,
                    const ScoreModArgs mod_args) {
    using T = BwdSm90Traits<D, BM, STAGES, ATOMIC_DQ>;
    constexpr int BN = T::BN;
    allow_next_grid();  // the dQ convert (or deterministic dQ) kernel's CTAs may settle in
    constexpr int NT_S = BM / 8, NT_D = D / 8, NT_DQ = T::DQ_N / 8;
    constexpr bool IS_BF16 = DTYPE == BF16;
    static_assert(DTYPE == F16 || DTYPE == BF16, "16-bit inputs only");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = smem_addr(smem_raw);
    const u32 sK = base + T::OFF_K, sV = base + T::OFF_V;
    auto sQ = [&](int st) { return base + T::OFF_Q + st * T::QB_BYTES; };
    auto sdO = [&](int st) { return base + T::OFF_DO + st * T::QB_BYTES; };
    auto sdS = [&](int buf) { return base + T::OFF_DS + buf * T::DS_BYTES; };
    // lse2 of stage st at rows[st * BM], Delta at rows[(STAGES + st) * BM]
    const float* rows = reinterpret_cast<const float*>(smem_raw + T::OFF_ROWS);
    const u32 bars = base + T::OFF_BARS;
    const u32 full_kv = bars, empty_kv = bars + 8;
    auto full = [&](int s) { return bars + 8 * (2 + s); };
    auto empty = [&](int s) { return bars + 8 * (2 + STAGES + s); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int nheads = kv_heads * group;
    // Tiles: the key blocks of the longest sequence (varlen), of every kv head and batch entry. A
    // kernel that is not persistent takes one, in a grid of one CTA a tile (cuflash/launch.py).
    // The persistent one's producer writes each next tile to next_tile before its arrival on
    // full_kv, and a tile index past the last tells the consumers to stop; the ticket (0 between
    // launches) numbers the tiles taken after the first gridDim.x, and its last holder resets it.
    const int n_blocks = (nk + BN - 1) / BN, tiles = n_blocks * kv_heads * batches;
    constexpr bool PERSISTENT = bwd_sm90_persistent<ATOMIC_DQ, MODS>();
    if (!PERSISTENT && static_cast<int>(gridDim.x) < tiles) __trap();  // tiles would go undone
    // next_tile: the tile the consumers take next; drawn_tile: the one after it (first blockIdx.x),
    // drawn by the first consumer thread as it finishes a tile (the producer, one thread on 40
    // registers, spilled with the ticket's atomics), read by the producer once the consumers
    // release that tile.
    const u32 next_tile = base + T::OFF_TILE, drawn_tile = next_tile + 4;

    using Mods = ScoreMods<MODS, CAUSAL, EVEN_N>;
    // A tile's work, the same for producer and consumers. Varlen: nq and nk are the longest
    // sequence's lengths, seq's this sequence's, whose rows start at seq.q0 and seq.k0 of the
    // tensor maps' packed rows; a key block past its sequence is no work.
    struct TileWork {
        KvTile at;
        int n0, batch;  // batch: the tensor maps' batch coordinate
        SeqSpan seq;
        Mods mods;
        QueryBlockSteps<BM> steps;
    };
    auto work_of = [&](int t) {
        const KvTile at = kv_tile_at(t, n_blocks, kv_heads);
        const int n0 = at.n_block * BN;
        const SeqSpan seq = seq_span<Mods::VARLEN>(mod_args, at.b, nq, nk);
        const Mods mods(mod_args, seq.nq, seq.nk);
        return TileWork{at, n0, Mods::VARLEN ? 0 : at.b, seq, mods,
                        QueryBlockSteps<BM>(mods, at.n_block, n0, BN, group)};
    };

    if (tid == 0) {
        stash_shared(drawn_tile, blockIdx.x);
        mbar_init(full_kv, 1);
        mbar_init(empty_kv, 128 * T::CONSUMERS);
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
        const u32 rows_smem = base + T::OFF_ROWS;
        // The rings' positions: steps so far, and the parity of K/V loads so far (a phase bit: the
        // first wait on the fresh empty_kv, for parity 1, returns at once).
        int step = 0;
        bool kv_phase = false;
        for (int t = blockIdx.x;;) {
            if constexpr (PERSISTENT) {
                mbar_wait(empty_kv, !kv_phase);  // K, V and next_tile are free, drawn_tile drawn
                kv_phase = !kv_phase;
                t = unstash_shared(drawn_tile);
                stash_shared(next_tile, t);
                if (t >= tiles) {
                    mbar_arrive(full_kv);
                    break;
                }
            }
            const TileWork w = work_of(t);
            if (Mods::VARLEN && w.n0 >= w.seq.nk) break;
            mbar_arrive_expect_tx(full_kv, 2 * T::KV_BYTES);
            copy_tile_pair<D, BN>(sK, map_k, sV, map_v, w.seq.k0 + w.n0, w.at.hk, w.batch, full_kv);
            wait_prior_grid();  // lse2 and Delta from the preprocess (K and V were in place before it ran)
            // lse2 and Delta rows are padded to nq_pad: BM floats are always in range. Row 0 of the
            // group's first head; the heads' rows follow one another (padded_row0).
            const int h0 = w.at.hk * group;
            const long long head_rows0 = w.seq.padded_row0<Mods::VARLEN>(w.at.b, h0, nheads, nq_pad);
            // The steps' order (QueryBlockSteps), as nested loops: a division per step took the one
            // producer thread past its registers.
            for (int g = 0; g < group; ++g) {
                const float* lse2_head = lse2 + head_rows0 + static_cast<long long>(g) * nq_pad;
                const float* delta_head = delta + (lse2_head - lse2);
                for (int j = 0; j < w.steps.per_head; ++j, ++step) {
                    const int st = step % STAGES, use = step / STAGES, m0 = w.steps.query_block_of_head(j) * BM;
                    mbar_wait(empty(st), (use & 1) ^ 1);  // the first use's wait, on a fresh barrier, returns at once
                    mbar_arrive_expect_tx(full(st), 2 * T::QB_BYTES + 2 * T::ROW_BYTES);
                    copy_tile_pair<D, BM>(sQ(st), map_q, sdO(st), map_do, w.seq.q0 + m0, h0 + g, w.batch, full(st));
                    bulk_load(rows_smem + st * T::ROW_BYTES, lse2_head + m0, T::ROW_BYTES, full(st));
                    bulk_load(rows_smem + (STAGES + st) * T::ROW_BYTES, delta_head + m0, T::ROW_BYTES, full(st));
                }
            }
            if constexpr (!PERSISTENT) break;
        }
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<T::CONSUMER_REGS>();
    wait_prior_grid();  // dq_accum zeroed by the preprocess
    const int c = wg - 1;
    const int warp_row0 = 16 * (warp & 3);  // this warp's 16 rows of the consumer's 64

    // Q and dO as the MN-major B operands of dK and dV (K = queries, N = head
    // dim): the leading offset is the distance between 64-column panels, the
    // stride that between 8-row atoms (as V in fwd_sm90_mainloop.cuh).
    auto qb_desc = [&](u32 tile, int kk) { return desc_mn_major_sw128<BM * 128, 1024>(tile, kk); };

    // A step's dQ tile into dq_accum ((B, H, nq_pad, D) floats: padded rows
    // need no bounds check), each warp on its own: store_dq puts its
    // accumulators in shared memory in fragment order (a contiguous 4 KB per
    // warp, once the warp's previous reduction has read them); reduce_dq then
    // adds them to the block with one bulk reduction. reduce_dq runs while the
    // next step's S^T is computed, so its proxy fence is not on the GEMMs' path
    // (measured on an H100: 3-7% off this kernel at head dim 128, against the
    // whole flush between the dQ GEMM and the next S^T).
    constexpr int WARP_FLOATS = NT_DQ * 32 * 4;
    const u32 dq_tile = base + T::OFF_DQ + c * T::DQ_BYTES + (warp & 3) * WARP_FLOATS * 4;
    auto store_dq = [&](const float (&acc_dq)[NT_DQ * 4]) {
        if (lane == 0) bulk_wait<0, true>();
        __syncwarp();
#pragma unroll
        for (int j = 0; j < NT_DQ; ++j)
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(dq_tile + (j * 32 + lane) * 16),
                         "f"(acc_dq[4 * j]), "f"(acc_dq[4 * j + 1]), "f"(acc_dq[4 * j + 2]), "f"(acc_dq[4 * j + 3])
                         : "memory");
    };
    auto reduce_dq = [&](long long block) {
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
            bulk_reduce_add_f32(dq_accum + block + (warp & 3) * WARP_FLOATS, dq_tile, WARP_FLOATS * 4);
            bulk_commit();
        }
    };

    long long dq_block = 0;   // the dq_accum block of the dQ tile store_dq left in shared memory,
    bool dq_pending = false;  // not yet reduced (it is, beside the next step's S^T, in this tile or the next)
    int step = 0;  // the rings' positions, as the producer's
    bool kv_phase = false;
    for (int t = blockIdx.x;;) {
        if constexpr (PERSISTENT) {
            mbar_wait(full_kv, kv_phase);
            t = unstash_shared(next_tile);
            if (t >= tiles) break;
        }
        TileWork w = work_of(t);
        if (Mods::VARLEN && w.n0 >= w.seq.nk) break;
        if constexpr (!PERSISTENT) mbar_wait(full_kv, kv_phase);
        kv_phase = !kv_phase;
        const int b = w.at.b, n0 = w.n0;
        const SeqSpan& seq = w.seq;
        Mods& mods = w.mods;
        const int key_lane0 = n0 + 64 * c + warp_row0 + (lane >> 2);
        float acc_dk[NT_D * 4], acc_dv[NT_D * 4];
#pragma unroll
        for (int j = 0; j < NT_D * 4; ++j) acc_dk[j] = acc_dv[j] = 0.f;

        for (int i = 0; i < w.steps.count; ++i, ++step) {
            const int st = step % STAGES;
            const int h = w.at.hk * group + w.steps.head(i), m0 = w.steps.query_block(i) * BM;
            mods.set_head(mod_args, b, h);
            mbar_wait(full(st), (step / STAGES) & 1);

            // S^T, the previous step's dQ reduction beside it, then dP^T, then P^T while dP^T is still computed.
            float acc_s[NT_S * 4], acc_dp[NT_S * 4];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<BM, DTYPE>::ss(acc_s, desc_k_major_sw128<BN>(sK, 64 * c, ks),
                                     desc_k_major_sw128<BM>(sQ(st), 0, ks), ks > 0);
            wgmma_commit();
            if constexpr (ATOMIC_DQ) {
                if (dq_pending) reduce_dq(dq_block);
                wgmma_fence();
            }
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<BM, DTYPE>::ss(acc_dp, desc_k_major_sw128<BN>(sV, 64 * c, ks),
                                     desc_k_major_sw128<BM>(sdO(st), 0, ks), ks > 0);
            wgmma_commit();
            // Dropout (dropout.cuh): the keep bits drawn while the GEMMs run; below, dP^T o M / (1 - p) in
            // place of dP^T, and (P o M / (1 - p))^T for dV.
            KeepBits<NT_S> kept{};
            if constexpr (Mods::DROPOUT)
                kept = dropout_bits_t<NT_S, Mods::DROPOUT_STATE>(mod_args, b * nheads + h, m0, n0 + 64 * c + warp_row0,
                                                                 lane);
            wgmma_wait<1>();

            // P^T = 2^(score^T c - lse2[query]) (score_mods.cuh); keys past nk
            // (zero rows of K, or varlen the next sequence's) and keys outside
            // the causal mask or window get P = 0, in a pass of its own that
            // only boundary blocks take. Queries past nq have lse2 = +inf, hence P = 0.
            const float* lse2_s = rows + st * BM;
            const float* delta_s = rows + (STAGES + st) * BM;
#pragma unroll
            for (int j = 0; j < NT_S; ++j) {
                const float2 l2 = *reinterpret_cast<const float2*>(lse2_s + 8 * j + 2 * (lane & 3));
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float dist =
                        mods.distance(m0 + 2 * (lane & 3), key_lane0) + (float)(8 * j + (e & 1) - 8 * (e >> 1));
                    const float u = mods.transform(acc_s[j * 4 + e]);
                    acc_s[j * 4 + e] = exp2_approx(fmaf(mods.bias(u, dist), scale_log2, -((e & 1) ? l2.y : l2.x)));
                }
            }
            if (!mods.block_visible(m0, BM, n0, BN) || (!EVEN_N && n0 + BN > seq.nk)) {
#pragma unroll
                for (int j = 0; j < NT_S; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!mods.visible(m0 + 8 * j + 2 * (lane & 3) + (e & 1), key_lane0 + 8 * (e >> 1)))
                            acc_s[j * 4 + e] = 0.f;
            }
            wgmma_wait<0>();
            // dS^T = P^T o (dP^T - Delta[query]) (o (1 - tanh^2) under softcap); with dropout dP^T o M /
            // (1 - p) in place of dP^T (dropped_dp_minus), then (P o M)^T for dV, whose 1 / (1 - p) is
            // left to its epilogue.
#pragma unroll
            for (int j = 0; j < NT_S; ++j) {
                const float2 dl = *reinterpret_cast<const float2*>(delta_s + 8 * j + 2 * (lane & 3));
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float delta = (e & 1) ? dl.y : dl.x;
                    const float dp = Mods::DROPOUT ? dropped_dp_minus(acc_dp[j * 4 + e], kept.test(4 * j + e),
                                                                      mod_args.dropout_scale, delta)
                                                   : acc_dp[j * 4 + e] - delta;
                    acc_dp[j * 4 + e] = acc_s[j * 4 + e] * dp;
                    if constexpr (Mods::SOFTCAP) {
                        const float2 l2 = *reinterpret_cast<const float2*>(lse2_s + 8 * j + 2 * (lane & 3));
                        const float dist =
                            mods.distance(m0 + 2 * (lane & 3), key_lane0) + (float)(8 * j + (e & 1) - 8 * (e >> 1));
                        acc_dp[j * 4 + e] *= mods.score_grad_from_prob(acc_s[j * 4 + e], (e & 1) ? l2.y : l2.x, dist);
                    }
                    if constexpr (Mods::DROPOUT)
                        if (!kept.test(4 * j + e)) acc_s[j * 4 + e] = 0.f;
                }
            }
            AFragments<DTYPE, BM> p_frag, ds_frag;
            p_frag.pack(acc_s);
            ds_frag.pack(acc_dp);

            // dV += P^T dO, dK += dS^T Q
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<D, DTYPE>::template rs<true>(acc_dv, p_frag.r[kk], qb_desc(sdO(st), kk));
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                Wgmma<D, DTYPE>::template rs<true>(acc_dk, ds_frag.r[kk], qb_desc(sQ(st), kk));
            wgmma_commit();

            if constexpr (ATOMIC_DQ) {
                // dS^T into the swizzled [key][query] tile; register (kk, 2 half + r)
                // of the A fragments holds row r of the 8-column tile 2 kk + half.
                const u32 ds_tile = sdS(step & 1);
#pragma unroll
                for (int j = 0; j < NT_S; ++j)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int key = 64 * c + warp_row0 + (lane >> 2) + 8 * r;
                        const int col = 8 * j + 2 * (lane & 3);
                        const u32 addr = ds_tile + 2 * (tile_offset<BN, BM>(key, col >> 3) + (col & 7));
                        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(ds_frag.r[j / 2][2 * (j % 2) + r])
                                     : "memory");
                    }
                fence_proxy_async();
                named_bar_sync<256>(BWD_DS_STORED);

                // dQ (64 queries x DQ_N columns) = dS K: A = dS^T read MN-major
                // (M = queries: the 64-column panel of this consumer's rows), B =
                // K read MN-major (N = head dim: this consumer's 64-column panel).
                const u32 a_tile = ds_tile + (BM == 128 ? c * BN * 128 : 0);
                const u32 b_tile = sK + (BM == 128 ? 0 : c * BN * 128);
                float acc_dq[NT_DQ * 4];
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BN / 16; ++ks)
                    Wgmma<T::DQ_N, DTYPE>::template ss<true, true>(
                        acc_dq, desc_mn_major_sw128<BN * 128, 1024>(a_tile, ks),
                        desc_mn_major_sw128<BN * 128, 1024>(b_tile, ks), ks > 0);
                wgmma_commit();
                wgmma_wait<1>();  // dV and dK are done with Q and dO (dQ reads dS^T and K only)
                thread_arrive(empty(st));
                wgmma_wait<0>();
                store_dq(acc_dq);
                dq_block = (seq.padded_row0<Mods::VARLEN>(b, h, nheads, nq_pad) + m0) * D + c * 64 * T::DQ_N;
                dq_pending = true;
            } else {
                wgmma_wait<0>();
                thread_arrive(empty(st));
            }
        }

        // Every GEMM of the tile has completed (each step waited for its own), and next_tile was read:
        // K and V are free for the producer's next tile (drawn now, as the hardware would hand out
        // the next CTA) while the epilogue stores dK (times scale) and dV from registers.
        if (PERSISTENT && tid == 128) {
            const int ticket = atomicAdd(tile_ticket, 1);
            if (ticket == tiles - 1) atomicExch(tile_ticket, 0);
            stash_shared(drawn_tile, ticket + gridDim.x);
        }
        thread_arrive(empty_kv);
        u16* dk_head = dk + b * dk_sb + w.at.hk * dk_sh + seq.k0 * dk_sn;
        u16* dv_head = dv + b * dv_sb + w.at.hk * dv_sh + seq.k0 * dv_sn;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key_lane0 + 8 * r;
            store_acc_row<IS_BF16, NT_D>(acc_dk, r, scale, dk_head + key * dk_sn, key < seq.nk, d, lane);
            store_acc_row<IS_BF16, NT_D>(acc_dv, r, Mods::DROPOUT ? mod_args.dropout_scale : 1.f,
                                         dv_head + key * dv_sn, key < seq.nk, d, lane);
        }
        if constexpr (!PERSISTENT) break;
    }

    // The last step's dQ; its reductions must complete before the CTA exits.
    if constexpr (ATOMIC_DQ) {
        if (dq_pending) reduce_dq(dq_block);
        if (lane == 0) bulk_wait<0, false>();
    }
}


// ---------------------------------------------------------------- dQ alone
// Deterministic mode's dQ: one CTA per block of 128 queries (and head,
// batch) sums over its key blocks in a fixed order, so no atomics:
//   S = Q K^T, P = 2^(S c - lse2[row]), dP = dO V^T, dS = P o (dP - Delta[row]),
//   dQ += dS K   (times scale at the end).
// The producer copies Q, dO and the rows' lse2 and Delta once, then K and V
// tiles of BN keys into a STAGES-deep ring (as the forward kernel does); each
// of the two consumer warpgroups owns 64 query rows: S and dP by wgmma SS,
// dQ by wgmma RS with dS from registers and K as the MN-major B operand.
template <int D_, int BN_, int STAGES_>
struct BwdSm90DqTraits {
    static constexpr int D = D_, BN = BN_, STAGES = STAGES_;
    static constexpr int CONSUMERS = 2;
    static constexpr int BM = 64 * CONSUMERS;
    static constexpr int QB_BYTES = BM * D * 2, KV_BYTES = BN * D * 2, ROW_BYTES = BM * 4;
    static constexpr int BARRIERS = 1 + 4 * STAGES;
    // Shared memory (cuflash/config.py BwdConfig.dq_smem_layout): Q, dO,
    // STAGES x K, STAGES x V (1024-byte aligned tiles), lse2, Delta, mbarriers.
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_DO = OFF_Q + QB_BYTES;
    static constexpr int OFF_K = OFF_DO + QB_BYTES;
    static constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
    static constexpr int OFF_ROWS = OFF_V + STAGES * KV_BYTES;
    static constexpr int OFF_BARS = OFF_ROWS + 2 * ROW_BYTES;
    static constexpr int SMEM_BYTES = OFF_BARS + 8 * BARRIERS;
    static constexpr int ENTRY_REGS = SM90_ENTRY_REGS, CONSUMER_REGS = 232;
    static constexpr int PRODUCER_REGS = (1 + CONSUMERS) * ENTRY_REGS - CONSUMERS * CONSUMER_REGS;

    // dQ holds D / 2 registers a thread, S and dP BN / 2 each.
    static_assert((D == 64 && BN == 128) || (D == 128 && BN == 64) || (D == 192 && (BN == 32 || BN == 64)) ||
                      (D == 256 && BN == 32),
                  "head dim 64 with BN 128, 128 with BN 64, 192 with BN 32 or 64, or 256 with BN 32");
    static_assert(STAGES >= 2 && STAGES <= 3, "2 or 3 stages");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tiles do not fit in shared memory");
};

template <int D, int BN, int STAGES, int DTYPE, bool CAUSAL, bool EVEN_N, int MODS>
__global__ void __launch_bounds__(384, 1)
    bwd_sm90_dq_kernel(const __grid_constant__ TmaDesc map_q, const __grid_constant__ TmaDesc map_k,
                       const __grid_constant__ TmaDesc map_v, const __grid_constant__ TmaDesc map_do,
                       const float* __restrict__ lse2, const float* __restrict__ delta, u16* __restrict__ dq, int nq,
                       int nk, int d, int group, int nq_pad, long long dq_sb, long long dq_sn, long long dq_sh,
                       float scale_log2, float scale, const ScoreModArgs mod_args) {
    using T = BwdSm90DqTraits<D, BN, STAGES>;
    constexpr int BM = T::BM;
    constexpr int NT_S = BN / 8, NT_D = D / 8;
    constexpr bool IS_BF16 = DTYPE == BF16;
    static_assert(DTYPE == F16 || DTYPE == BF16, "16-bit inputs only");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = smem_addr(smem_raw);
    const u32 sQ = base + T::OFF_Q, sdO = base + T::OFF_DO;
    auto sK = [&](int st) { return base + T::OFF_K + st * T::KV_BYTES; };
    auto sV = [&](int st) { return base + T::OFF_V + st * T::KV_BYTES; };
    const float* rows = reinterpret_cast<const float*>(smem_raw + T::OFF_ROWS);  // lse2 [BM], then Delta [BM]
    const u32 bars = base + T::OFF_BARS;
    const u32 full_q = bars;
    auto full_kv = [&](int s) { return bars + 8 * (1 + s); };
    auto empty_kv = [&](int s) { return bars + 8 * (1 + STAGES + s); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    // Causal: the longest query blocks first.
    const int m_block = CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, nheads = gridDim.y, hk = h / group;
    const int m0 = m_block * BM;
    using Mods = ScoreMods<MODS, CAUSAL, EVEN_N>;
    // Varlen: as in bwd_sm90_kernel, this block's sequence.
    const SeqSpan seq = seq_span<Mods::VARLEN>(mod_args, b, nq, nk);
    if (Mods::VARLEN && m0 >= seq.nq) return;
    wait_prior_grid();  // the preprocess's lse2 and Delta (complete once the dK/dV kernel before this one is)
    const int batch = Mods::VARLEN ? 0 : b;  // the tensor maps' batch coordinate
    nq = seq.nq;
    nk = seq.nk;
    Mods mods(mod_args, nq, nk);
    // Key blocks [n_begin, n_begin + n_end) hold keys some row of the block sees.
    const KeyBlocks blocks = mods.template key_blocks<BN>(m0, BM);
    const int n_begin = blocks.begin, n_end = blocks.end - blocks.begin;
    u16* dq_tile = dq + b * dq_sb + h * dq_sh + m0 * dq_sn + seq.q0 * dq_sn;

    if (tid == 0) {
        mbar_init(full_q, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_kv(s), 1);
            mbar_init(empty_kv(s), 4 * T::CONSUMERS);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<T::PRODUCER_REGS>();
        if (tid != 0 || n_end == 0) return;
        mbar_arrive_expect_tx(full_q, 2 * T::QB_BYTES + 2 * T::ROW_BYTES);
        copy_tile_pair<D, BM>(sQ, map_q, sdO, map_do, seq.q0 + m0, h, batch, full_q);
        const long long row_off = seq.padded_row0<Mods::VARLEN>(b, h, nheads, nq_pad) + m0;
        bulk_load(base + T::OFF_ROWS, lse2 + row_off, T::ROW_BYTES, full_q);
        bulk_load(base + T::OFF_ROWS + T::ROW_BYTES, delta + row_off, T::ROW_BYTES, full_q);
        for (int i = 0; i < n_end; ++i) {
            const int st = i % STAGES, use = i / STAGES;
            if (use > 0) mbar_wait(empty_kv(st), (use - 1) & 1);
            mbar_arrive_expect_tx(full_kv(st), 2 * T::KV_BYTES);
            copy_tile_pair<D, BN>(sK(st), map_k, sV(st), map_v, seq.k0 + (n_begin + i) * BN, hk, batch, full_kv(st));
        }
        return;
    }

    // ---------------------------------------------------------------- consumers
    setmaxnreg_inc<T::CONSUMER_REGS>();
    const int c = wg - 1;
    const int warp_row0 = 64 * c + 16 * (warp & 3);  // this warp's 16 rows of the block
    mods.set_head(mod_args, b, h);
    float acc_dq[NT_D * 4];
#pragma unroll
    for (int i = 0; i < NT_D * 4; ++i) acc_dq[i] = 0.f;

    if (n_end > 0) {
        mbar_wait(full_q, 0);
        // This lane's two rows: lse2 (+inf past nq or for a row without keys: P = 0) and Delta.
        float lse2_r[2], delta_r[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lse2_r[r] = rows[warp_row0 + (lane >> 2) + 8 * r];
            delta_r[r] = rows[BM + warp_row0 + (lane >> 2) + 8 * r];
        }
        for (int i = 0; i < n_end; ++i) {
            const int st = i % STAGES, n0 = (n_begin + i) * BN;
            mbar_wait(full_kv(st), (i / STAGES) & 1);
            float acc_s[NT_S * 4], acc_dp[NT_S * 4];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<BN, DTYPE>::ss(acc_s, desc_k_major_sw128<BM>(sQ, 64 * c, ks),
                                     desc_k_major_sw128<BN>(sK(st), 0, ks), ks > 0);
            wgmma_commit();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<BN, DTYPE>::ss(acc_dp, desc_k_major_sw128<BM>(sdO, 64 * c, ks),
                                     desc_k_major_sw128<BN>(sV(st), 0, ks), ks > 0);
            wgmma_commit();
            // Dropout (dropout.cuh): the keep bits drawn while the GEMMs run; dP o M / (1 - p) in place of dP.
            KeepBits<NT_S> kept{};
            if constexpr (Mods::DROPOUT)
                kept = dropout_bits<NT_S, Mods::DROPOUT_STATE>(mod_args, b * nheads + h, m0 + warp_row0, n0, lane);
            wgmma_wait<1>();

            // P, then dS (bwd_sm90_tiles.cuh), as the A fragments of dQ += dS K; keys past nk are zero
            // rows of K, or varlen the next sequence's.
            const int row = m0 + warp_row0 + (lane >> 2), col = n0 + 2 * (lane & 3);
            probs_by_rows<NT_S>(acc_s, mods, row, col, lse2_r, scale_log2,
                                !mods.block_visible(m0, BM, n0, BN) || (!EVEN_N && n0 + BN > nk));
            wgmma_wait<0>();
            dscores_by_rows<NT_S>(acc_dp, acc_s, mods, row, col, lse2_r, delta_r, kept, mod_args.dropout_scale);
            AFragments<DTYPE, BN> ds_frag;
            ds_frag.pack(acc_dp);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                Wgmma<D, DTYPE>::template rs<true>(acc_dq, ds_frag.r[kk],
                                                   desc_mn_major_sw128<BN * 128, 1024>(sK(st), kk));
            wgmma_commit();
            wgmma_wait<0>();
            warp_arrive(empty_kv(st), lane);
        }
    }

    // Epilogue: dQ (times scale) stored from registers; zeros for a block whose rows see no key.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + (lane >> 2) + 8 * r;
        store_acc_row<IS_BF16, NT_D>(acc_dq, r, scale, dq_tile + row * dq_sn, row < nq - m0, d, lane);
    }
}

}  // namespace cuflash
