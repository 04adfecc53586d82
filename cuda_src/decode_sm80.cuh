// Attention over a KV cache for few query rows (decoding, speculative and
// chunked steps): FlashDecoding on mma.sync, for sm_80 and Hopper alike. A
// decoding step reads every cached key and value once and does little math
// per byte, so the kernel is built to keep the memory system busy, not the
// tensor cores; where many query rows share a kv head the math grows, and on
// Hopper those tiles run their GEMMs on wgmma (WGMMA, decode_wgmma.cuh).
//
// GQA packing: the query heads that share kv head hk, times the nq queries,
// are the rows of one tile, packed row r = i * group + g for query i and head
// hk * group + g; so each kv head's keys are read once per CTA for all of them.
// A CTA takes BM packed rows of one (batch, kv head) and one split of its key
// blocks (blockIdx = (split, row block, batch * Hk + hk)). K and V stream
// through a STAGES-deep cp.async ring of BN keys. WARPS_M x WARPS_N warps split
// the rows WARPS_M ways and each stage's keys WARPS_N ways; each warp keeps its own
// online softmax over its keys, and the warps' (max, sum, O) are merged
// through shared memory at the end. With one split the CTA writes the output
// and lse; with several, each split's normalised output and lse in fp32:
// on sm_90, where the host launches a row block's splits as thread-block
// clusters, in shared memory, merged by the cluster (merge_cluster_splits; a
// row block of several clusters leaves each cluster's result to combine_kernel);
// else in global memory, merged by the last of a row block's split CTAs to
// finish (merge_splits) for tiles of up to DECODE_MERGE_MAX_ROWS rows, by
// combine_kernel (combine.cuh) for larger ones.
//
// An fp8 (e4m3) cache (FP8; kv_cache.cuh has its semantics) streams e4m3 rows
// through the ring: the keys' MMA fragments are widened in registers
// (gemm_q_e4m3_keys, Q's columns stored in their order), the values through a
// 16-bit tile per stage (widen_values); the descales scale the scores and the
// output.
//
// The new keys and values of the call go into the cache first (append_new_rows,
// kv_cache.cuh): each CTA writes those of its own key blocks (keys rotated; an
// e4m3 cache's quantised), and its ring then copies them as cached rows; the
// first split of the first row block also writes those its row block does not
// attend. CTAs of other row blocks that write the same rows write the same values.
#pragma once
#include "combine.cuh"
#include "common.cuh"
#include "decode_wgmma.cuh"
#include "kv_cache.cuh"
#include "named_barriers.cuh"
#include "score_mods.cuh"
#include "sm80_mma.cuh"
#include "softmax_sm80.cuh"
#include "softmax_sm90.cuh"

namespace cuflash {

// Splits of a row block's keys at most (cuflash/dispatch.py reads it): the merge keeps a weight
// per split and row in shared memory.
constexpr int DECODE_MAX_SPLITS = 128;
// Rows per tile up to which the kernel merges its splits itself (merge_splits; larger tiles leave
// it to combine_kernel, and compile no merge). cuflash/decode_launch.py reads it, and has the
// measurement behind it.
constexpr int DECODE_MERGE_MAX_ROWS = 16;
// Floats after each row of a warp's output in the merge's shared memory (cuflash/config.py reads
// it). Rows D floats apart put a warp's float2 stores of 8 rows in one bank group, 8 ways: the
// stores took 1.2 us of an 11-us MQA step (bench/PERFLOG.md, "small steps"); 8 more floats put each
// half-warp's 4 rows in 4 distinct groups.
constexpr int DECODE_MERGE_PAD = 8;
// Split CTAs a thread-block cluster merges at most (KVCacheArgs::merge_in_cluster; cuflash/config.py
// reads it): Hopper's largest cluster, 16 CTAs, which the host launches only where the GPU holds every
// cluster of the step at once (8, the portable size, launches everywhere).
constexpr int DECODE_CLUSTER_MAX = 16;
// WGMMA tiles: the warps after the row warps that stream the ring, a warpgroup (cuflash/config.py
// reads it). One copy warp beside 8 row warps would cap every thread at 168 registers as a
// warpgroup does (an SM's quarter holds 3 of the 9 warps), and setmaxnreg moves registers between
// whole warpgroups only.
constexpr int DECODE_COPY_WARPS = 4;

template <int D_, int WARPS_M_, int WARPS_N_, int STAGES_, bool FP8_ = false, bool WGMMA_ = false>
struct DecodeTraits {
    static constexpr int D = D_;
    static constexpr int WARPS_M = WARPS_M_;
    static constexpr int WARPS_N = WARPS_N_;
    static constexpr int STAGES = STAGES_;
    static constexpr bool FP8 = FP8_;  // an e4m3 cache (kv_cache.cuh)
    static constexpr bool WGMMA = WGMMA_;  // the GEMMs on wgmma, the ring streamed by copy warps
    static constexpr int WARPS = WARPS_M * WARPS_N;
    static constexpr int THREADS = 32 * WARPS;  // the row and key warps'
    static constexpr int ALL_THREADS = THREADS + (WGMMA ? 32 * DECODE_COPY_WARPS : 0);
    // Two row warpgroups and the copy warpgroup: registers split as the Hopper forward's are
    // (SM90_ENTRY_REGS each at entry). A row thread, which holds no copy addresses, fits in 200; a
    // copy thread takes the rest (at 232 and 216 for a row thread the copy code spilled).
    static constexpr bool SPLIT_REGS = WGMMA && WARPS_M == 8;
    static constexpr int ROW_REGS = 200;
    static constexpr int COPY_REGS = 3 * SM90_ENTRY_REGS - 2 * ROW_REGS;
    static constexpr int BM = 16 * WARPS_M;    // packed rows per CTA
    static constexpr int BN = 64;              // keys per stage
    static constexpr int KW = BN / WARPS_N;    // keys per warp per stage
    static constexpr int NTILES_S = KW / 8;
    static constexpr int KSTEPS_PV = KW / 16;
    static constexpr int KSTEPS_QK = D / 16;
    static constexpr int NTILES_O = D / 8;
    static constexpr int KV_ELEMS = BN * D;
    static constexpr int CACHE_BYTES = FP8 ? 1 : 2;           // per cached element
    static constexpr int STAGE_BYTES = CACHE_BYTES * KV_ELEMS;  // one ring stage of K (or V)
    static constexpr int CHUNK_ELEMS = 16 / CACHE_BYTES;        // cached elements per 16-byte chunk
    // Shared memory (byte offsets; cuflash/config.py DecodeConfig.smem_layout): the Q tile,
    // STAGES K tiles, STAGES V tiles; with an fp8 cache (e4m3 tiles, e4m3_tile_offset) one V
    // tile in q's dtype that each stage's values are widened into for the P V MMAs (the keys'
    // fragments are widened in registers). After the key loop the region from OFF_K holds the
    // warps' fp32 outputs (WARPS_N x BM rows of O_STRIDE), then their row maxima and sums. WGMMA
    // tiles end with each stage's two mbarriers (full, then empty: 8 bytes each) and the merge's two.
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_K = OFF_Q + 2 * BM * D;
    static constexpr int OFF_V = OFF_K + STAGES * STAGE_BYTES;
    static constexpr int OFF_V16 = OFF_V + STAGES * STAGE_BYTES;
    static constexpr int OFF_BARS = OFF_V16 + (FP8 ? 2 * KV_ELEMS : 0);
    static constexpr int SMEM_BYTES = OFF_BARS + (WGMMA ? 16 * STAGES + 16 : 0);
    static constexpr int RING_END = OFF_BARS;  // the region from OFF_K the epilogue reuses
    static constexpr int O_STRIDE = D + DECODE_MERGE_PAD;  // floats between two rows of a warp's output
    static constexpr int MERGE_BYTES = 4 * WARPS_N * BM * (O_STRIDE + 2);

    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim must be a multiple of 32 in [32, 256]");
    static_assert(WARPS_M == 1 || WARPS_M == 2 || WARPS_M == 4 || WARPS_M == 8, "1, 2, 4 or 8 row warps");
    static_assert(WARPS_N == 1 || WARPS_N == 2 || WARPS_N == 4, "1, 2 or 4 key warps");
    static_assert(WARPS == 4 || WARPS == 8, "4 or 8 warps");
    static_assert(STAGES >= 2 && STAGES <= 8, "2 to 8 stages");
    static_assert(MERGE_BYTES <= RING_END - OFF_K, "the warps' outputs must fit in the K/V ring");
    static_assert(BM > DECODE_MERGE_MAX_ROWS || 4 * (DECODE_MAX_SPLITS + 1) * BM <= RING_END - OFF_K,
                  "the splits' weights must fit in the ring");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tile does not fit in shared memory");
    static_assert(!SPLIT_REGS || (COPY_REGS >= 24 && COPY_REGS % 8 == 0 && ROW_REGS % 8 == 0),
                  "setmaxnreg takes multiples of 8, 24 at least");
};

// Byte offset of row `row`'s 16-byte chunk `chunk` in a ROWS x D tile of e4m3 (D bytes a row):
// column panels of 8, 4 or 2 chunks, XOR-swizzled with the row as tile_offset's 16-bit tiles
// are, so that the 8 rows of one ldmatrix phase fall into 8 distinct bank groups.
template <int ROWS, int D>
__device__ __forceinline__ int e4m3_tile_offset(int row, int chunk) {
    constexpr int CH = D / 16;
    if constexpr (CH % 8 == 0) {
        return (chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
    } else if constexpr (CH % 4 == 0) {
        return (chunk >> 2) * (ROWS * 64) + row * 64 + (((chunk & 3) ^ ((row >> 1) & 3)) << 4);
    } else {
        return (chunk >> 1) * (ROWS * 32) + row * 32 + (((chunk & 1) ^ ((row >> 2) & 1)) << 4);
    }
}

// Q's 16 columns [16p, 16p + 16) as the fp8 key GEMM reads them (two 8-column chunks in, two out):
// position 2t + e of the first chunk holds column 4t + e, position 2t + e of the second column
// 4t + 2 + e (t < 4, e < 2). That is the order in which one ldmatrix of an e4m3 key row hands a
// lane its key bytes: 4t .. 4t + 3, widened to the B fragments of positions (2t, 2t + 1) and
// (2t + 8, 2t + 9).
__device__ __forceinline__ void permute_q_for_e4m3(uint4& lo, uint4& hi) {
    const uint4 a = lo, b = hi;
    lo = make_uint4(a.x, a.z, b.x, b.z);
    hi = make_uint4(a.y, a.w, b.y, b.w);
}

// acc[NT][4] (16 rows x 8*NT keys) += Q K^T over an e4m3 key tile: Q's fragments from shared memory
// (permuted, permute_q_for_e4m3) through q_off, the keys' straight from the e4m3 tile by ldmatrix
// (GROUP k16 steps of 8 keys at a time, 4 bytes a lane and step) and widened in registers; keys
// key0, key0 + 1, ...
template <bool BF16, int BN, int D, int NT, class AOff>
__device__ __forceinline__ void gemm_q_e4m3_keys(float (&acc)[NT][4], u32 q_smem, const AOff& q_off, u32 k_tile,
                                                 int key0, int lane) {
    constexpr int KSTEPS = D / 16, GROUP = KSTEPS % 4 == 0 ? 4 : 2;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ks += GROUP) {
        u32 a[GROUP][4];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) ldmatrix_x4(a[g], q_smem + q_off.at(0, (ks + g) * 2));
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            u32 b[GROUP];
            const u32 addr = k_tile + e4m3_tile_offset<BN, D>(key0 + j * 8 + (lane & 7), ks + (lane >> 3) % GROUP);
            if constexpr (GROUP == 4) {
                ldmatrix_x4(b, addr);
            } else {
                ldmatrix_x2(b, addr);
            }
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const uint2 w = widen_e4m3x4<BF16>(b[g]);
                mma_16816<BF16>(acc[j], a[g], w.x, w.y);
            }
        }
    }
}

// Four output columns [col, col + 4) of packed row `row` (query q0 + row / group, head hk * group +
// row % group) of batch b, and the row's lse where col is 0 and the caller wants it.
template <bool BF16>
__device__ __forceinline__ void store_output(const KVCacheArgs& a, int b, int hk, int q0, int row, int col, float4 o,
                                             float lse) {
    const int i = row / a.group, h = hk * a.group + row % a.group;
    *reinterpret_cast<uint2*>(a.out + b * a.o_sb + (long long)(q0 + i) * a.o_sn + h * a.o_sh + col) =
        make_uint2(pack2<BF16>(o.x, o.y), pack2<BF16>(o.z, o.w));
    if (col == 0 && a.lse != nullptr)
        a.lse[a.cu_seqlens_q ? (long long)h * a.total_q + q0 + i : ((long long)b * a.nheads + h) * a.nq + i] = lse;
}

// Split s's partial row of packed row `row` (query row / group, head hk * group + row % group) of batch
// b: the partials are (splits, B, nq, H) rows of d floats, and gridDim.z is B * Hk.
__device__ __forceinline__ long long partial_row(const KVCacheArgs& a, int s, int b, int hk, int row) {
    const int i = row / a.group, h = hk * a.group + row % a.group;
    return (((long long)s * gridDim.z / a.nheads_kv + b) * a.nq + i) * a.nheads + h;
}

// Split s's partial of packed row `row`, columns [col, col + 4): o, and the row's lse with column 0.
__device__ __forceinline__ void store_partial(const KVCacheArgs& a, int s, int b, int hk, int row, int col, float4 o,
                                              float lse) {
    const long long prow = partial_row(a, s, b, hk, row);
    *reinterpret_cast<float4*>(a.partial_o + prow * a.d + col) = o;
    if (col == 0) a.partial_lse[prow] = lse;
}

// The end of a split CTA (rows [m0, m0 + BM) of kv head hk, batch b, its partials written)
// when the host asked for the merge here (a.splits_done set): the last of the row block's split
// CTAs to count itself merges every split's partials into out and lse. Each CTA's threads
// fence their partial writes before its count (the classic last-block pattern), the last one
// reads the others' with loads that bypass L1, and it resets the count, so the next launch on
// the stream (a CUDA graph replay too) starts at 0. The whole CTA merges, each phase's loads
// independent of each other: the splits' lse of every row into shared memory (the free K/V
// ring), then a warp per row turns them into weights, then each thread sums 4 columns of a row
// over the splits.
template <bool BF16, int BM>
__device__ __forceinline__ void merge_splits(const KVCacheArgs& a, float* smem, int b, int hk, int m0, int rows,
                                             int q0, int lane, int warp) {
    __threadfence();
    __syncthreads();
    int* done = a.splits_done + blockIdx.z * gridDim.y + blockIdx.y;
    const int finished = threadIdx.x == 0 ? atomicAdd(done, 1) : 0;
    if (!__syncthreads_or(threadIdx.x == 0 && finished == a.num_splits - 1)) return;
    __threadfence();
    if (threadIdx.x == 0) *done = 0;
    const int splits = a.num_splits, n_rows = min(BM, rows - m0), warps = blockDim.x / 32;
    const long long l_ss = (long long)(gridDim.z / a.nheads_kv) * a.nq * a.nheads;  // partial rows per split
    auto split0_row = [&](int r) { return partial_row(a, 0, b, hk, m0 + r); };
    float* weights = smem;  // [split][row]: each split's lse, then its weight
    float* row_lse = smem + splits * BM;
    for (int idx = threadIdx.x; idx < splits * n_rows; idx += blockDim.x) {
        const int s = idx / n_rows, r = idx % n_rows;
        weights[s * BM + r] = __ldcg(a.partial_lse + s * l_ss + split0_row(r));
    }
    __syncthreads();
    for (int r = warp; r < n_rows; r += warps) {
        const float lse = warp_merged_lse(weights + r, BM, splits, lane);
        for (int s = lane; s < splits; s += 32) weights[s * BM + r] = split_weight(weights[s * BM + r], lse);
        if (lane == 0) row_lse[r] = lse;
    }
    __syncthreads();
    const int quads = a.d / 4;
    for (int item = threadIdx.x; item < n_rows * quads; item += blockDim.x) {
        const int r = item / quads, col = 4 * (item % quads);
        const float* o_col = a.partial_o + split0_row(r) * a.d + col;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int s = 0; s < splits; ++s) {
            const float w = weights[s * BM + r];
            const float4 os = __ldcg(reinterpret_cast<const float4*>(o_col + s * l_ss * a.d));
            if (w != 0.f)  // a split without keys adds nothing, whatever its output holds
                o = make_float4(fmaf(w, os.x, o.x), fmaf(w, os.y, o.y), fmaf(w, os.z, o.z), fmaf(w, os.w, o.w));
        }
        store_output<BF16>(a, b, hk, q0, m0 + r, col, o, row_lse[r]);
    }
}

// The end of a split CTA when its row block's splits are thread-block clusters of a.merge_in_cluster
// CTAs (sm_90): each CTA holds its split's normalised output of packed row r at sO + r * O_STRIDE (its
// first d columns) and the row's lse in the float after its D columns (the stride's padding). After one
// cluster barrier the cluster's CTAs share the rows' column quads and read every split's values from
// the others' shared memory, all of one quad's loads at once; a second barrier keeps each CTA's shared
// memory until the others have read it. Against the global merge (merge_splits: stores, a fence, the
// count's atomic and two rounds of loads, all through L2) this is a round trip within the GPC. Where
// a row block has several clusters (more splits than one holds), each writes its merged result as
// the partial of split blockIdx.x / cluster, which combine_kernel merges.
template <bool BF16, int BM, int D, int O_STRIDE, int THREADS>
__device__ __forceinline__ void merge_cluster_splits(const KVCacheArgs& a, const float* sO, int b, int hk, int m0,
                                                     int rows, int q0) {
    static_assert(O_STRIDE > D, "each row's lse sits in its padding");
    cluster_sync();
    const int splits = a.merge_in_cluster, quads = a.d / 4, n_rows = min(BM, rows - m0);
    const int partial = a.num_splits > splits ? blockIdx.x / splits : -1;  // this cluster's partial, if several
    const u32 base = smem_addr(sO);
    for (int item = cluster_rank() * THREADS + threadIdx.x; item < n_rows * quads; item += splits * THREADS) {
        const int r = item / quads, col = 4 * (item % quads);
        float lse_s[DECODE_CLUSTER_MAX];
        float4 o_s[DECODE_CLUSTER_MAX];
#pragma unroll
        for (int s = 0; s < DECODE_CLUSTER_MAX; ++s)
            if (s < splits) {
                lse_s[s] = ld_cluster(base + 4 * (r * O_STRIDE + D), s);
                o_s[s] = ld_cluster4(base + 4 * (r * O_STRIDE + col), s);
            }
        float m = neg_inf(), sum = 0.f;
#pragma unroll
        for (int s = 0; s < DECODE_CLUSTER_MAX; ++s)
            if (s < splits) m = fmaxf(m, lse_s[s]);
#pragma unroll
        for (int s = 0; s < DECODE_CLUSTER_MAX; ++s)
            if (s < splits && m != neg_inf()) sum += exp2_approx((lse_s[s] - m) * LOG2E);
        const float lse = merged_lse(m, sum);
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < DECODE_CLUSTER_MAX; ++s) {
            const float w = s < splits ? split_weight(lse_s[s], lse) : 0.f;
            if (w != 0.f)  // a split without keys adds nothing, whatever its output holds
                o = make_float4(fmaf(w, o_s[s].x, o.x), fmaf(w, o_s[s].y, o.y), fmaf(w, o_s[s].z, o.z),
                                fmaf(w, o_s[s].w, o.w));
        }
        if (partial < 0) {
            store_output<BF16>(a, b, hk, q0, m0 + r, col, o, lse);
        } else {
            store_partial(a, partial, b, hk, m0 + r, col, o, lse);
        }
    }
    cluster_sync();
}

// One CTA an SM promised to the register allocator, 8 warps too (cuflash/dispatch.py decode_slots
// fills an SM with one 8-warp CTA): capped at 128 registers for two, the 8-warp causal and score
// option kernels spilled 8-36 bytes.
// WGMMA: the GEMMs on Hopper's wgmma (decode_wgmma.cuh; the decode_sm90 family, built for sm_90a),
// in tiles of whole row warpgroups (4 or 8 row warps, 1 key warp) over a 16-bit cache. Key step t
// issues S_t = Q K_t^T and then O += P_{t-1} V_{t-1}, computes the softmax of S_t while the P V GEMM
// runs, and rescales O once it has completed (the Hopper forward's overlap, fwd_sm90_mainloop.cuh);
// block t - 1's stage stays in use through step t, so the ring holds one block fewer in flight.
// There copy warps stream the ring (DECODE_COPY_WARPS) through a full and an empty mbarrier a
// stage, so that no CTA-wide barrier holds the row warpgroups in step, and two warpgroups take turns
// issuing their GEMMs (the forward's ping-pong, ConsumerTurns): one's softmax runs under the other's
// GEMMs.
template <int D, int WARPS_M, int WARPS_N, int STAGES, bool BF16, bool FP8, bool PAGED, bool CAUSAL, int MODS,
          bool WGMMA = false>
__global__ void __launch_bounds__(DecodeTraits<D, WARPS_M, WARPS_N, STAGES, FP8, WGMMA>::ALL_THREADS, 1)
    decode_kernel(const KVCacheArgs a, const ScoreModArgs mod_args) {
    using T = DecodeTraits<D, WARPS_M, WARPS_N, STAGES, FP8, WGMMA>;
    static_assert(!WGMMA || (WARPS_M % 4 == 0 && WARPS_N == 1 && !FP8 && STAGES >= 3),
                  "wgmma: row warpgroups, a 16-bit cache, a block in flight besides the two in use");
    // mma.sync tiles: blocks the ring loads ahead of the one whose S GEMM a step issues (the wgmma
    // tiles' copy warps run ahead as far as the empty barriers let them).
    constexpr int AHEAD = STAGES - 1;
    constexpr int BM = T::BM, BN = T::BN, KW = T::KW, THREADS = T::THREADS, ALL_THREADS = T::ALL_THREADS;
    // The threads that issue the ring's copies: the copy warps, or every warp without WGMMA.
    constexpr int COPY_THREADS = WGMMA ? 32 * DECODE_COPY_WARPS : THREADS;
    constexpr int Q_CHUNKS = D / 8, CHUNKS = D / T::CHUNK_ELEMS;  // 16-byte chunks of a Q row, of a cache row
    using Mods = ScoreMods<MODS, CAUSAL, false>;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw + T::OFF_Q);
    auto k_tile = [&](int stage) { return smem_addr(smem_raw + T::OFF_K + stage * T::STAGE_BYTES); };
    // The V tile the P V MMAs read: a ring stage, or with an fp8 cache the widened copy of one.
    auto v_tile = [&](int stage) { return smem_addr(smem_raw + (FP8 ? T::OFF_V16 : T::OFF_V + stage * T::STAGE_BYTES)); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool copy_warp = WGMMA && warp >= T::WARPS;
    const int ctid = WGMMA ? tid - THREADS : tid;  // this thread's index among COPY_THREADS (copy warps)
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int split = blockIdx.x, m0 = blockIdx.y * BM;
    const int b = blockIdx.z / a.nheads_kv, hk = blockIdx.z % a.nheads_kv;
    const CacheSpan span = cache_span(a, b);
    const float k_desc = FP8 ? descale_of(a.k_descale, a, b, hk) : 1.f;
    // fp8: q . k = (q . e4m3) k_descale. Without score options a positive descale joins the
    // exponent's scale, a multiply a score fewer (the fp8 MQA steps are issue-bound); with options,
    // or a descale that is not positive (it would reverse the scores' order), each score takes it.
    const bool descale_in_scale = FP8 && !Mods::ANY && k_desc > 0.f;
    const float score_log2 = descale_in_scale ? a.scale_log2 * k_desc : a.scale_log2;
    const float v_desc = FP8 ? descale_of(a.v_descale, a, b, hk) : 1.f;

    const QuerySpan queries = query_span(a, b);
    const int rows = queries.nq * a.group;
    const bool attends = m0 < rows;  // false: a packed batch's shorter sequence
    const int nk = span.end - span.leftpad;  // attended keys; key column c is cache position leftpad + c
    Mods mods(mod_args, queries.nq, nk);
    const int i_first = m0 / a.group, i_last = (min(m0 + BM, rows) - 1) / a.group;
    const KeyBlocks blocks = mods.template key_blocks<BN>(i_first, i_last - i_first + 1);
    const int per_split = (blocks.end - blocks.begin + a.num_splits - 1) / a.num_splits;
    const int blk0 = blocks.begin + split * per_split;
    const int n_steps = attends ? max(min(blocks.end, blk0 + per_split) - blk0, 0) : 0;

    // New keys (rotated) and values go into the cache first; the ring then copies them as it copies
    // cached rows. Rotated by the ring's copies instead, a new key row cost a synchronous round trip
    // among the block's asynchronous copies (bench/PERFLOG.md). A CTA writes the new rows of its own
    // key blocks, so that its copies read its own writes (the CTAs of other row blocks write the same
    // values); the first split of the first row block writes those its row block does not attend
    // too (a window can leave some).
    auto append_new = [&](int thread, int threads) {
        if (a.k_new == nullptr) return;
        const int own0 = max(span.leftpad + blk0 * BN, span.cache_len);
        const int own1 = min(span.leftpad + (blk0 + n_steps) * BN, span.end);
        const bool rest = blockIdx.y == 0 && split == 0;
        const int seen0 = attends ? min(span.leftpad + blocks.begin * BN, span.end) : span.end;
        const int seen1 = attends ? max(span.leftpad + blocks.end * BN, span.cache_len) : span.end;
        const AppendRows new_rows{own0, max(own1 - own0, 0), span.cache_len,
                                  rest ? max(seen0 - span.cache_len, 0) : 0, seen1, rest ? max(span.end - seen1, 0) : 0};
        append_new_rows<BF16, FP8, PAGED>(a, b, hk, span, new_rows, thread, threads, k_desc, v_desc);
    };
    // The ring's copies: each thread owns one 16-byte chunk column of every ROW_STEP-th row (when the
    // threads cover whole rows). A paged cache's page ids of those rows are read one block ahead,
    // while the block before is computed: read just before the copies that need them, their round
    // trip (long, under a saturated memory system) halved the paged kernel's bandwidth. Pages hold
    // a multiple of 16 positions, so one id serves the GROUP owned rows of a 16-row group.
    constexpr bool ROW_OWNER = COPY_THREADS % CHUNKS == 0;
    constexpr int ROW_STEP = ROW_OWNER ? COPY_THREADS / CHUNKS : 1, OWNED_ROWS = ROW_OWNER ? BN / ROW_STEP : 1;
    constexpr int GROUP = ROW_OWNER && ROW_STEP < 16 ? 16 / ROW_STEP : 1;
    // Row runs, where the shapes allow: each thread copies chunks c and c + HALF of RUN consecutive
    // rows (of one page: a paged cache has no leftpad, so 16-row groups are whole pages' parts), so
    // one page id, one page division and one row address per cache serve 2 RUN copies. A paged
    // cache takes them (the per-row page arithmetic made the paged MQA tile issue-bound); a
    // contiguous one in the 64-row tile, whose MMAs leave the copies few issue slots (MQA with
    // Nq = 8: 6-12% faster); elsewhere it keeps the owned rows' whole-row copies, faster for MHA
    // and GQA (bench/PERFLOG.md, "page runs", "row runs").
    constexpr int HALF = CHUNKS / 2, RUN = BN * CHUNKS / (2 * COPY_THREADS);
    constexpr bool ROW_RUNS = (PAGED || WARPS_M >= 4) && CHUNKS % 2 == 0 && COPY_THREADS % HALF == 0 && RUN >= 1 &&
                               16 % RUN == 0 && 2 * RUN * COPY_THREADS == BN * CHUNKS;
    static_assert(!WGMMA || ROW_RUNS, "the copy warps copy row runs");
    constexpr int PAGE_IDS = ROW_RUNS ? 1 : OWNED_ROWS / GROUP;
    auto page_at = [&](int blk, int r) {
        const int j = span.leftpad + blk * BN + r;
        return PAGED && j < span.end ? page_of(a, b, j) : 0;
    };
    int pages[PAGE_IDS];
    auto fetch_pages = [&](int blk) {
        if constexpr (ROW_RUNS) {
            pages[0] = page_at(blk, ctid / HALF * RUN);
        } else if constexpr (PAGED && ROW_OWNER) {
#pragma unroll
            for (int g = 0; g < PAGE_IDS; ++g) pages[g] = page_at(blk, ctid / CHUNKS + g * GROUP * ROW_STEP);
        }
    };
    // The mma.sync tiles: the first block's page ids before the append and Q's loads, so that their
    // round trips overlap (paged small steps 1-2% faster, bench/PERFLOG.md). The copy warps read
    // them first thing.
    if (PAGED && !WGMMA && n_steps > 0) fetch_pages(blk0);
    if constexpr (!WGMMA) {
        // The last threads append, so that where a tile's rows are few their round trips overlap Q's
        // loads by the first threads. (The wgmma tiles: the copy warps, beside the row warps' Q.)
        append_new(ALL_THREADS - 1 - tid, ALL_THREADS);
        if (!attends) return;
    }

    // Q, rotated at positions cache_len + rotary_q_step * i; with an fp8 cache in the key GEMM's column order, so
    // each thread takes the two chunks of a 16-column group.
    constexpr int Q_GROUP = FP8 ? 2 : 1;
    // Ring stage s's barriers (WGMMA): full (the copy warps' copies of its block have landed: an
    // arrival a copy thread) and empty (the row warps are done with it: an arrival a row warp).
    // Then the merge's two (merge_sync: an arrival a row thread).
    const u32 full_bar = smem_addr(smem_raw + T::OFF_BARS), empty_bar = full_bar + 8 * STAGES;
    const u32 merge_bar = empty_bar + 8 * STAGES;
    if constexpr (WGMMA) {
        if (tid == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(full_bar + 8 * s, COPY_THREADS);
                mbar_init(empty_bar + 8 * s, T::WARPS);
            }
            for (int k = 0; k < 2; ++k) mbar_init(merge_bar + 8 * k, THREADS);
        }
        fence_barrier_init();
        __syncthreads();
        if (!attends && !copy_warp) return;  // the copy warps append
    }
    // Where a thread has many Q chunks (8 in the wgmma tiles), it issues their loads before their
    // stores: a round trip a chunk, one after another, cost those steps 4-7%. Rotated, ROTARY_BATCH
    // items at a time (their table values take 8 more registers a chunk). The 32-row tile's two
    // chunks a thread too (MQA steps 1-3% faster, paged ones up to 5%); the 16-row tiles' two a
    // chunk at a time (batched, they ran 1-4% slower).
    constexpr int Q_ITEMS = BM * Q_CHUNKS / Q_GROUP, Q_PER_THREAD = (Q_ITEMS + THREADS - 1) / THREADS;
    constexpr bool Q_BATCHED = Q_PER_THREAD > 2 || (Q_PER_THREAD == 2 && BM == 32);
    constexpr int ROTARY_BATCH = 4 / Q_GROUP < Q_PER_THREAD ? 4 / Q_GROUP : Q_PER_THREAD;
    constexpr int ITEMS_A_ROW = Q_CHUNKS / Q_GROUP;
    // Item c covers Q_GROUP chunks of packed row c / ITEMS_A_ROW; packed row `row` is query row
    // row / group of head hk * group + row % group.
    auto item_chunk = [](int c, int g) { return Q_GROUP * (c % ITEMS_A_ROW) + g; };
    auto q_row_of = [&](int row) {
        const int i = row / a.group, h = hk * a.group + row % a.group;
        return a.q + b * a.q_sb + (long long)(queries.q0 + i) * a.q_sn + h * a.q_sh;
    };
    auto store_q_item = [&](int c, uint4 (&val)[Q_GROUP]) {
        if constexpr (FP8) permute_q_for_e4m3(val[0], val[1]);
#pragma unroll
        for (int g = 0; g < Q_GROUP; ++g)
            *reinterpret_cast<uint4*>(sQ + tile_offset<BM, D>(c / ITEMS_A_ROW, item_chunk(c, g))) = val[g];
    };
    // Rotated Q, ROTARY_BATCH items at a time: all their loads, then their rotation and stores.
    // Items past the tile's rows (or past Q_ITEMS) load the last row's values and drop them.
    using RotatedQLoads = RotaryLoads[ROTARY_BATCH][Q_GROUP];
    auto load_rotated_q = [&](RotatedQLoads& loads, int k0) {
#pragma unroll
        for (int k = 0; k < ROTARY_BATCH; ++k) {
            const int c = tid + (k0 + k) * THREADS, row = min(m0 + c / ITEMS_A_ROW, rows - 1);
#pragma unroll
            for (int g = 0; g < Q_GROUP; ++g)
                loads[k][g] = rotary_loads(a, q_row_of(row), 8 * item_chunk(c, g),
                                           span.cache_len + a.rotary_q_step * (row / a.group));
        }
    };
    auto store_rotated_q = [&](const RotatedQLoads& loads, int k0) {
#pragma unroll
        for (int k = 0; k < ROTARY_BATCH; ++k) {
            const int c = tid + (k0 + k) * THREADS;
            if (k0 + k >= Q_PER_THREAD || c >= Q_ITEMS) continue;
            const bool inside = m0 + c / ITEMS_A_ROW < rows;
            uint4 val[Q_GROUP];
#pragma unroll
            for (int g = 0; g < Q_GROUP; ++g)
                val[g] = inside ? rotated_from_loads<BF16>(a, loads[k][g], 8 * item_chunk(c, g)) : make_uint4(0, 0, 0, 0);
            store_q_item(c, val);
        }
    };
    // The 32-row tile over a contiguous cache (MQA at Nq = 1: 32 rows of one position, two items a
    // thread) rotates its Q after issuing the ring's first copies, so that the rotation runs under
    // their round trip; its loads stay here (MQA steps with new keys and rotary 1-4% faster; the paged
    // tile's plain steps ran up to 2% slower with it, bench/PERFLOG.md).
    constexpr bool Q_ROTATED_LATE = !WGMMA && !PAGED && BM == 32 && Q_BATCHED && Q_PER_THREAD == ROTARY_BATCH;
    RotatedQLoads late_q;
    const bool q_late = Q_ROTATED_LATE && a.rotary_dim > 0;
    if (Q_BATCHED && !copy_warp && a.rotary_dim > 0) {
        if constexpr (Q_ROTATED_LATE) {
            load_rotated_q(late_q, 0);
        } else {
#pragma unroll
            for (int k0 = 0; k0 < Q_PER_THREAD; k0 += ROTARY_BATCH) {
                RotatedQLoads loads;
                load_rotated_q(loads, k0);
                store_rotated_q(loads, k0);
            }
        }
    } else if (Q_BATCHED && !copy_warp) {
        uint4 val[Q_PER_THREAD][Q_GROUP];
#pragma unroll
        for (int k = 0; k < Q_PER_THREAD; ++k) {
            const int c = tid + k * THREADS, row = m0 + c / ITEMS_A_ROW;
            const u16* q_row = q_row_of(row);
#pragma unroll
            for (int g = 0; g < Q_GROUP; ++g) {
                const int chunk = item_chunk(c, g);
                val[k][g] = c < Q_ITEMS && row < rows && 8 * chunk < a.d
                                ? *reinterpret_cast<const uint4*>(q_row + 8 * chunk) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int k = 0; k < Q_PER_THREAD; ++k)
            if (tid + k * THREADS < Q_ITEMS) store_q_item(tid + k * THREADS, val[k]);
    } else {
        // chunk0 + g, not item_chunk: with the lambda the 16-row tiles' code changed.
        for (int c = tid; c < (copy_warp ? 0 : Q_ITEMS); c += THREADS) {
            const int chunk0 = Q_GROUP * (c % ITEMS_A_ROW), row = m0 + c / ITEMS_A_ROW;
            uint4 val[Q_GROUP];
#pragma unroll
            for (int g = 0; g < Q_GROUP; ++g) {
                const int chunk = chunk0 + g;
                val[g] = make_uint4(0, 0, 0, 0);
                if (row < rows) {
                    const int i = row / a.group;
                    const u16* q_row = q_row_of(row);
                    if (a.rotary_dim > 0)
                        val[g] = load_rotated_chunk<BF16>(a, q_row, 8 * chunk, span.cache_len + a.rotary_q_step * i);
                    else if (8 * chunk < a.d)
                        val[g] = *reinterpret_cast<const uint4*>(q_row + 8 * chunk);
                }
            }
            store_q_item(c, val);
        }
    }

    // Keys and values of block `blk` into ring stage `stage`: positions before the end by cp.async
    // from the cache (new rows included: append_new wrote them), zeros past it.
    // The copies of this CTA's first block holding new rows wait for a barrier after the append (the
    // copy warps' named barrier, or __syncthreads): the blocks before it go out while the append's
    // round trip runs. -1: no such block.
    const int new_blk = (span.cache_len - span.leftpad) / BN;  // the block of the first new row
    const int first_new_blk = a.k_new != nullptr && new_blk < blk0 + n_steps ? max(new_blk, blk0) : -1;
    // The cached rows of this kv head: with owned rows or row runs, at this thread's (first) chunk.
    const int own_chunk_bytes = ROW_RUNS ? 16 * (ctid % HALF) : ROW_OWNER ? 16 * (ctid % CHUNKS) : 0;
    const unsigned char* k_head = head_of<PAGED, T::CACHE_BYTES>(a.k_cache, a.kc_sb, a.kc_sh, hk, span, own_chunk_bytes);
    const unsigned char* v_head = head_of<PAGED, T::CACHE_BYTES>(a.v_cache, a.vc_sb, a.vc_sh, hk, span, own_chunk_bytes);
    auto load_row_chunk = [&](int blk, int r, int chunk, u32 k_dst, u32 v_dst, int page) {
        const int j = span.leftpad + blk * BN + r;  // cache position
        if (j >= span.end || T::CHUNK_ELEMS * chunk >= a.d) {
            cp_async_16(k_dst, a.k_cache, false);
            cp_async_16(v_dst, a.v_cache, false);
        } else {
            const CachePos pos = cache_pos<PAGED>(a, span, j, page);
            const int chunk_bytes = 16 * chunk - own_chunk_bytes;  // k_head and v_head point at the own chunk
            cp_async_16(k_dst, row_at<PAGED, T::CACHE_BYTES>(k_head, pos, a.kc_sb, a.kc_sn) + chunk_bytes, true);
            cp_async_16(v_dst, row_at<PAGED, T::CACHE_BYTES>(v_head, pos, a.vc_sb, a.vc_sn) + chunk_bytes, true);
        }
    };
    // Byte offset of row r's chunk in a ring stage: swizzled 16-bit or e4m3 tiles.
    auto ring_offset = [](int r, int chunk) {
        return FP8 ? e4m3_tile_offset<BN, D>(r, chunk) : 2 * tile_offset<BN, D>(r, chunk);
    };
    // Block `blk` into ring stage `stage` (a paged cache: with `pages` fetched for it).
    auto load_block = [&](int blk, int stage) {
        const u32 k_base = smem_addr(smem_raw + T::OFF_K + stage * T::STAGE_BYTES);
        const u32 v_base = smem_addr(smem_raw + T::OFF_V + stage * T::STAGE_BYTES);
        if constexpr (ROW_RUNS) {
            const int chunk = ctid % HALF, r0 = ctid / HALF * RUN, j0 = (PAGED ? 0 : span.leftpad) + blk * BN + r0;
            if (j0 + RUN <= span.end) {  // every row of the run in the cache: in page pages[0]
                const CachePos pos = cache_pos<PAGED>(a, span, j0, pages[0]);
                const unsigned char* k_row = row_at<PAGED, T::CACHE_BYTES>(k_head, pos, a.kc_sb, a.kc_sn);
                const unsigned char* v_row = row_at<PAGED, T::CACHE_BYTES>(v_head, pos, a.vc_sb, a.vc_sn);
                const u32 k_step = T::CACHE_BYTES * (u32)a.kc_sn, v_step = T::CACHE_BYTES * (u32)a.vc_sn;
#pragma unroll
                for (int i = 0; i < RUN; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int off = ring_offset(r0 + i, chunk + h * HALF);
                        const bool inside = T::CHUNK_ELEMS * (chunk + h * HALF) < a.d;  // zeros past a padded head dim
                        cp_async_16(k_base + off, inside ? k_row + i * k_step + 16 * HALF * h : k_row, inside);
                        cp_async_16(v_base + off, inside ? v_row + i * v_step + 16 * HALF * h : v_row, inside);
                    }
            } else {
#pragma unroll
                for (int i = 0; i < RUN; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int off = ring_offset(r0 + i, chunk + h * HALF);
                        load_row_chunk(blk, r0 + i, chunk + h * HALF, k_base + off, v_base + off, pages[0]);
                    }
            }
        } else if constexpr (ROW_OWNER) {
            const int chunk = ctid % CHUNKS, r0 = ctid / CHUNKS;
#pragma unroll
            for (int it = 0; it < OWNED_ROWS; ++it) {
                const int r = r0 + it * ROW_STEP, off = ring_offset(r, chunk);
                load_row_chunk(blk, r, chunk, k_base + off, v_base + off, pages[it / GROUP]);
            }
        } else {
            for (int c = ctid; c < BN * CHUNKS; c += COPY_THREADS) {
                const int r = c / CHUNKS, chunk = c % CHUNKS, off = ring_offset(r, chunk);
                load_row_chunk(blk, r, chunk, k_base + off, v_base + off, page_at(blk, r));
            }
        }
    };
    // An fp8 cache: ring stage `stage`'s e4m3 V tile widened into the 16-bit tile the P V MMAs read
    // (each thread a 16-byte chunk of e4m3 at a time, two swizzled chunks out).
    auto widen_values = [&](int stage) {
        for (int c = tid; c < BN * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, chunk = c % CHUNKS;
            const uint4 e4m3 =
                *reinterpret_cast<const uint4*>(smem_raw + T::OFF_V + stage * T::STAGE_BYTES + ring_offset(r, chunk));
            u16* tile = reinterpret_cast<u16*>(smem_raw + T::OFF_V16);
            const uint2 w0 = widen_e4m3x4<BF16>(e4m3.x), w1 = widen_e4m3x4<BF16>(e4m3.y);
            const uint2 w2 = widen_e4m3x4<BF16>(e4m3.z), w3 = widen_e4m3x4<BF16>(e4m3.w);
            *reinterpret_cast<uint4*>(tile + tile_offset<BN, D>(r, 2 * chunk)) = make_uint4(w0.x, w0.y, w1.x, w1.y);
            *reinterpret_cast<uint4*>(tile + tile_offset<BN, D>(r, 2 * chunk + 1)) = make_uint4(w2.x, w2.y, w3.x, w3.y);
        }
    };

    if constexpr (WGMMA) {
        // The copy warps: block n into stage n % STAGES once the row warps have freed it (their P V of
        // block n - STAGES done), the copies' landing arriving on the stage's full barrier; each block's
        // page ids read while the block before is copied.
        if (copy_warp) {
            if constexpr (T::SPLIT_REGS) setmaxnreg_dec<T::COPY_REGS>();
            if (n_steps > 0) fetch_pages(blk0);
            append_new(ctid, COPY_THREADS);
            for (int n = 0; n < n_steps; ++n) {
                const int stage = n % STAGES;
                if (n >= STAGES) mbar_wait(empty_bar + 8 * stage, (n / STAGES - 1) & 1);
                if (blk0 + n == first_new_blk) named_bar_sync<COPY_THREADS>(DECODE_COPY_WARPS_APPENDED);
                load_block(blk0 + n, stage);
                cp_async_arrive_noinc(full_bar + 8 * stage);
                if (n + 1 < n_steps) fetch_pages(blk0 + n + 1);
            }
            cp_async_wait<0>();
            return;  // the row warps merge on their own (merge_sync)
        }
        if constexpr (T::SPLIT_REGS) setmaxnreg_inc<T::ROW_REGS>();
    } else {
#pragma unroll
        for (int s = 0; s < AHEAD; ++s) {
            if (s < n_steps) {
                if (blk0 + s == first_new_blk) __syncthreads();  // later blocks: after the loop's barriers
                if (!PAGED || s > 0) fetch_pages(blk0 + s);
                load_block(blk0 + s, s);
            }
            cp_async_commit();
        }
        if (AHEAD < n_steps) fetch_pages(blk0 + AHEAD);
        if (q_late) store_rotated_q(late_q, 0);
    }

    // This lane's two rows (lane / 4 and + 8 of the warp's 16): query index and ALiBi slope.
    int query[2];
    float slope[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = min(m0 + wm * 16 + (lane >> 2) + 8 * r, rows - 1);
        query[r] = row / a.group;
        slope[r] = Mods::ALIBI ? mod_args.alibi_slopes[b * mod_args.alibi_batch_stride + hk * a.group +
                                                       row % a.group] * mod_args.alibi_unit
                               : 0.f;
    }

    const LaneOffsets<BM, D> q_off(lane & 15, lane >> 4);
    const u32 q_smem = smem_addr(sQ) + 2 * wm * 16 * LaneOffsets<BM, D>::PW;
    const LaneOffsets<BN, D> k_off((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LaneOffsets<BN, D> v_off((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    float acc_o[T::NTILES_O][4];
    zero(acc_o);
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};

    // Block blk's scores in the kernel's units (the score options applied), -inf where masked.
    auto score_mods = [&](float (&acc_s)[T::NTILES_S][4], int blk) {
        const bool whole = blk >= blocks.full_begin && blk < blocks.full_end;
        if (Mods::ANY || !whole) {
#pragma unroll
            for (int j = 0; j < T::NTILES_S; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = query[e >> 1], col = blk * BN + wn * KW + j * 8 + 2 * (lane & 3) + (e & 1);
                    float s = mods.transform(acc_s[j][e]);
                    if constexpr (Mods::ALIBI) s = fmaf(-slope[e >> 1], fabsf(mods.distance(i, col)), s);
                    acc_s[j][e] = whole || mods.visible(i, col) ? s : neg_inf();
                }
        }
    };

    u32 p_frag[T::KSTEPS_PV][4];
    if constexpr (WGMMA) {
        // Row warpgroup c (of one or two) takes turns issuing its GEMMs with the other.
        constexpr bool TWO = WARPS_M == 8;
        const ConsumerTurns<TWO, false, DECODE_GEMM_TURN> turns{warp / 4};
        named_bar_sync<THREADS>(DECODE_ROW_WARPS);  // Q is whole
        u32 q_frag[T::KSTEPS_QK][4];  // the warp's rows of Q, the S GEMM's A operand
#pragma unroll
        for (int ks = 0; ks < T::KSTEPS_QK; ++ks) ldmatrix_x4(q_frag[ks], q_smem + q_off.at(0, 2 * ks));
        named_bar_sync<THREADS>(DECODE_ROW_WARPS);  // and read: its first words serve order_before_wait
        turns.open();
        for (int t = 0; t < n_steps; ++t) {
            const int blk = blk0 + t, stage = t % STAGES;
            mbar_wait(full_bar + 8 * stage, (t / STAGES) & 1);  // block t landed
            fence_proxy_async();  // the copies' writes seen by wgmma's reads
            float acc_s[T::NTILES_S][4];
            zero(acc_s);
            turns.begin_gemms();
            wgmma_fence();
            wgmma_scores<BF16, BN, D>(acc_s, q_frag, k_tile(stage));
            wgmma_commit();
            if (t > 0) {
                wgmma_fence();  // the branch's register moves (ptxas injected this fence otherwise: C7519)
                wgmma_pv<BF16, BN, D>(acc_o, p_frag, v_tile((t - 1) % STAGES));
                wgmma_commit();
                turns.end_gemms();
                wgmma_wait<1>();  // S_t is in; P V still runs
            } else {
                turns.end_gemms();
                wgmma_wait<0>();
            }
            score_mods(acc_s, blk);
            float alpha[2];
            constexpr float no_bias[2] = {0.f, 0.f};
            online_softmax_sm90<T::NTILES_S, 4, 4, false, false>(reinterpret_cast<float(&)[BN / 2]>(acc_s),
                                                                 row_max, row_sum, alpha, score_log2, no_bias);
            // The exponentials before the wait (ptxas hoisted the wait above them, and the softmax ran
            // after the P V instead of under it): a word of the Q tile, free once Q is in registers.
            order_before_wait(smem_addr(sQ) + 4 * tid, row_sum[0] + row_sum[1]);
            wgmma_wait<0>();  // P_{t-1} V_{t-1} is in: O and P's registers, block t - 1's stage are free
            if (t > 0) warp_arrive(empty_bar + 8 * ((t - 1) % STAGES), lane);
            rescale_o<T::NTILES_O>(reinterpret_cast<float(&)[D / 2]>(acc_o), alpha);
            acc_to_a<BF16, T::NTILES_S>(p_frag, acc_s);
        }
        if (n_steps > 0) {  // the last block's P V
            wgmma_fence();
            wgmma_pv<BF16, BN, D>(acc_o, p_frag, v_tile((n_steps - 1) % STAGES));
            wgmma_commit();
            wgmma_wait<0>();
        }
        turns.close();
    } else {
        for (int t = 0; t < n_steps; ++t) {
            cp_async_wait<AHEAD - 1>();  // block t landed
            __syncthreads();             // and every warp is past step t - 1: the stage of block t + AHEAD is free
            if (t + AHEAD < n_steps) load_block(blk0 + t + AHEAD, (t + AHEAD) % STAGES);
            cp_async_commit();
            if (t + AHEAD + 1 < n_steps) fetch_pages(blk0 + t + AHEAD + 1);

            const int blk = blk0 + t, stage = t % STAGES;
            if constexpr (FP8) widen_values(stage);  // into the V tile the previous block's P V is done with
            float acc_s[T::NTILES_S][4];
            zero(acc_s);
            if constexpr (FP8)
                gemm_q_e4m3_keys<BF16, BN, D>(acc_s, q_smem, q_off, k_tile(stage), wn * KW, lane);
            else
                gemm_ss_nt<BF16, T::KSTEPS_QK>(acc_s, q_smem, q_off, 0, k_tile(stage), k_off, wn * KW);
            if (FP8 && !descale_in_scale) {  // the keys' dequantisation, where it is not in score_log2
#pragma unroll
                for (int j = 0; j < T::NTILES_S; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[j][e] *= k_desc;
            }
            score_mods(acc_s, blk);
            online_softmax_sm80(acc_s, acc_o, row_max, row_sum, score_log2);
            acc_to_a<BF16, T::NTILES_S>(p_frag, acc_s);
            if constexpr (FP8) __syncthreads();  // the widened V tile is whole
            gemm_rs_nn<BF16>(acc_o, p_frag, v_tile(stage), v_off, wn * KW);
        }
    }
    // A combine kernel launched after this one (programmatically, sm_90) may be scheduled once every
    // CTA is past its key loop: it waits for the partials in the kernel.
    allow_next_grid();
    // The merge's two orderings among the threads that merge: the ring free of every warp's reads
    // (k = 0), then every warp's outputs written (k = 1). Where the copy warps have left (WGMMA) the
    // row threads order them on two mbarriers: compute-sanitizer's racecheck follows those, and it
    // reported the two warpgroups' accesses as hazards across a 256-thread named barrier.
    auto merge_sync = [&](int k) {
        if constexpr (WGMMA) {
            mbar_arrive(merge_bar + 8 * k);
            mbar_wait(merge_bar + 8 * k, 0);
        } else {
            __syncthreads();
        }
    };
    cp_async_wait<0>();
    merge_sync(0);  // the ring is free: it holds the warps' outputs now

    // Merge the WARPS_N warps of each row: O = sum_w 2^((m_w - M) c) O_w / L, L likewise over l_w.
    float* sO = reinterpret_cast<float*>(smem_raw + T::OFF_K);
    float* sM = sO + T::WARPS_N * BM * T::O_STRIDE;
    float* sL = sM + T::WARPS_N * BM;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wm * 16 + (lane >> 2) + 8 * r, slot = wn * BM + row;
        const float l = quad_sum(row_sum[r]);
        if ((lane & 3) == 0) {
            sM[slot] = row_max[r];
            sL[slot] = l;
        }
#pragma unroll
        for (int j = 0; j < T::NTILES_O; ++j)
            *reinterpret_cast<float2*>(sO + slot * T::O_STRIDE + j * 8 + 2 * (lane & 3)) =
                make_float2(acc_o[j][2 * r], acc_o[j][2 * r + 1]);
    }
    merge_sync(1);

    const float c = score_log2;
    // The wgmma tiles' copy warps have left: those never merge in a cluster, whose barriers count
    // every thread (the host launches clusters for the mma.sync tiles only).
    const bool merge_in_cluster = !WGMMA && a.num_splits > 1 && a.merge_in_cluster > 1;
    for (int idx = tid; idx < BM * (D / 4); idx += THREADS) {
        const int r = idx / (D / 4), col = 4 * (idx % (D / 4)), row = m0 + r;
        if (row >= rows || col >= a.d) continue;
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < T::WARPS_N; ++w) m = fmaxf(m, sM[w * BM + r]);
        float l = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < T::WARPS_N; ++w) {
            const float mw = sM[w * BM + r];
            const float weight = mw == neg_inf() ? 0.f : exp2_approx((mw - m) * c);
            const float4 ow = *reinterpret_cast<const float4*>(sO + (w * BM + r) * T::O_STRIDE + col);
            l = fmaf(weight, sL[w * BM + r], l);
            o = make_float4(fmaf(weight, ow.x, o.x), fmaf(weight, ow.y, o.y), fmaf(weight, ow.z, o.z),
                            fmaf(weight, ow.w, o.w));
        }
        const float inv = l > 0.f ? v_desc / l : 0.f;  // v_desc: the values' dequantisation (1 unless fp8)
        const float lse = row_lse_of(m, l, c);
        o = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
        if (a.num_splits == 1) {
            store_output<BF16>(a, b, hk, queries.q0, row, col, o, lse);
        } else if (merge_in_cluster) {  // into key warp 0's slot, which only this thread reads at (r, col)
            *reinterpret_cast<float4*>(sO + r * T::O_STRIDE + col) = o;
            if (col == 0) sO[r * T::O_STRIDE + D] = lse;
        } else {
            store_partial(a, split, b, hk, row, col, o, lse);
        }
    }
    if (merge_in_cluster) {
        merge_cluster_splits<BF16, BM, D, T::O_STRIDE, THREADS>(a, sO, b, hk, m0, rows, queries.q0);
        return;
    }
    if constexpr (BM <= DECODE_MERGE_MAX_ROWS)
        if (a.splits_done != nullptr)
            merge_splits<BF16, BM>(a, reinterpret_cast<float*>(smem_raw + T::OFF_K), b, hk, m0, rows, queries.q0,
                                   lane, warp);
}

}  // namespace cuflash
