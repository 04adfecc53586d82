// FlashAttention-2 backward for sm_80+ (mma.sync m16n8k16, fp32 accumulation).
//
// With S = Q K^T, P = softmax(S * scale) recomputed from the forward's
// logsumexp, and Delta = rowsum(dO o O):
//   dV = P^T dO,   dP = dO V^T,   dS = P o (dP - Delta),
//   dK = scale * dS^T Q,   dQ = scale * dS K.
// Kernels:
//   bwd_preprocess_kernel  Delta, and the logsumexp in exp2 units (lse2).
//   bwd_dkdv_kernel        one CTA per K/V block (and kv head): dK, dV summed
//                          over the query heads of a GQA group, no atomics;
//                          with ATOMIC_DQ also dQ, added to an fp32 buffer.
//   bwd_convert_dq_kernel  dQ = scale * fp32 buffer, in the input dtype.
//   bwd_dq_kernel          one CTA per Q block: dQ without atomics
//                          (deterministic mode; recomputes S and dP).
#pragma once
#include "common.cuh"
#include "dropout.cuh"
#include "score_mods.cuh"
#include "seq_span.cuh"
#include "sm80_mma.cuh"

namespace cuflash {

template <bool BF16>
__device__ __forceinline__ float to_float(u16 x) {
    if constexpr (BF16) {
        return __uint_as_float(((u32)x) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
}

// ---------------------------------------------------------------- preprocess
// ROW_LANES lanes (a power of two, 4 to 16) per query row:
//   delta[row] = sum_d dO[row, d] * O[row, d]
//   lse2[row]  = lse[row] * log2(e), or +inf where the row saw no key (so that
//                2^(S * c - lse2) = 0 there), and for padding rows past nq;
//   dq_accum[row, :accum_row] = 0 (the atomic dQ's sums start here; accum_row
//                0 in deterministic mode, which has none).
// Rows are read 16 bytes a lane where they are 16-byte aligned (measured on an
// H100 at 16k x 2048 fp16: one 2-byte load a lane and a separate memset of
// dq_accum took 60 + 45 us), so a row of d elements needs d / 8 lanes
// (cuflash/config.py's preprocess_row_lanes; 16 lanes at head dim 64 left half
// of them idle and took 131 us against 98 at 128). nq_pad: rows per head of
// lse2, delta and dq_accum (seq_span.cuh); varlen: the grid covers the longest
// sequence's padded rows.
template <bool BF16, bool VARLEN, int ROW_LANES>
__global__ void bwd_preprocess_kernel(const u16* __restrict__ o, const u16* __restrict__ dout,
                                      const float* __restrict__ lse, float* __restrict__ lse2,
                                      float* __restrict__ delta, float* __restrict__ dq_accum, int nq, int nq_pad,
                                      int d, int accum_row, long long o_sb, long long o_sn, long long o_sh,
                                      long long do_sb, long long do_sn, long long do_sh, const ScoreModArgs mod_args) {
    static_assert(ROW_LANES >= 4 && ROW_LANES <= 16 && (ROW_LANES & (ROW_LANES - 1)) == 0,
                  "a row's lanes: a power of two within a warp");
    allow_next_grid();  // the Hopper dK/dV kernel's CTAs may settle in (it waits for this grid's rows)
    const int sub = threadIdx.x % ROW_LANES;
    const unsigned row_mask = ((1u << ROW_LANES) - 1) << (threadIdx.x & 31 & ~(ROW_LANES - 1));
    const int row = blockIdx.x * (blockDim.x / ROW_LANES) + threadIdx.x / ROW_LANES;
    const int h = blockIdx.y, b = blockIdx.z, nheads = gridDim.y;
    const SeqSpan seq = seq_span<VARLEN>(mod_args, b, nq, 0);
    if (row >= (VARLEN ? (seq.nq + BWD_ROW_PAD - 1) / BWD_ROW_PAD * BWD_ROW_PAD : nq_pad)) return;
    const long long idx = seq.padded_row0<VARLEN>(b, h, nheads, nq_pad) + row;
    float4* accum = reinterpret_cast<float4*>(dq_accum + idx * accum_row);
    for (int c = sub; c < accum_row / 4; c += ROW_LANES) accum[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row >= seq.nq) {
        if (sub == 0) {
            lse2[idx] = pos_inf();
            delta[idx] = 0.f;
        }
        return;
    }
    const u16* o_row = o + b * o_sb + h * o_sh + (seq.q0 + row) * o_sn;
    const u16* do_row = dout + b * do_sb + h * do_sh + (seq.q0 + row) * do_sn;
    float sum = 0.f;
    if (((reinterpret_cast<size_t>(o_row) | reinterpret_cast<size_t>(do_row)) & 15) == 0 && d % 8 == 0) {
        for (int c = 8 * sub; c < d; c += 8 * ROW_LANES) {
            const uint4 x = *reinterpret_cast<const uint4*>(o_row + c);
            const uint4 y = *reinterpret_cast<const uint4*>(do_row + c);
            const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 a = unpack2<BF16>(xs[i]), g = unpack2<BF16>(ys[i]);
                sum = fmaf(a.x, g.x, fmaf(a.y, g.y, sum));
            }
        }
    } else {
        for (int c = sub; c < d; c += ROW_LANES) sum += to_float<BF16>(o_row[c]) * to_float<BF16>(do_row[c]);
    }
#pragma unroll
    for (int off = ROW_LANES / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(row_mask, sum, off);
    if (sub == 0) {
        const float l = lse[seq.lse_row0<VARLEN>(mod_args, b, h, nheads) + row];
        lse2[idx] = l == neg_inf() ? pos_inf() : l * LOG2E;
        delta[idx] = sum;
    }
}

// p[0] += x, p[1] += y in global memory, without reading back; one vector
// reduction on sm_90+.
__device__ __forceinline__ void red_add_f32x2(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

// One warp per query row: dq[row, :d] = scale * dq_accum[row, :d] in the input dtype.
template <bool BF16, bool VARLEN>
__global__ void bwd_convert_dq_kernel(const float* __restrict__ dq_accum, u16* __restrict__ dq, int nq, int nq_pad,
                                      int d, int d_pad, long long dq_sb, long long dq_sn, long long dq_sh,
                                      float scale, const ScoreModArgs mod_args) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int h = blockIdx.y, b = blockIdx.z, nheads = gridDim.y;
    const SeqSpan seq = seq_span<VARLEN>(mod_args, b, nq, 0);
    if (row >= seq.nq) return;
    const float* src = dq_accum + (seq.padded_row0<VARLEN>(b, h, nheads, nq_pad) + row) * d_pad;
    u16* dst = dq + b * dq_sb + h * dq_sh + (seq.q0 + row) * dq_sn;
    for (int c = 2 * lane; c < d; c += 64) {
        const float2 x = *reinterpret_cast<const float2*>(src + c);
        *reinterpret_cast<u32*>(dst + c) = pack2<BF16>(x.x * scale, x.y * scale);
    }
}

// Writes a warp's dS^T fragments (16 keys from key0 x 16*KS queries from
// query0, the A-operand layout of acc_to_a) into a swizzled [key][query] tile.
template <int KEYS, int QUERIES, int KS>
__device__ __forceinline__ void store_ds_t(u16* tile, const u32 (&ds)[KS][4], int key0, int query0, int lane) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + (lane >> 2) + 8 * r;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int col = query0 + kk * 16 + half * 8 + 2 * (lane & 3);
                *reinterpret_cast<u32*>(tile + tile_offset<KEYS, QUERIES>(key, col >> 3) + (col & 7)) =
                    ds[kk][2 * half + r];
            }
        }
}

template <int D_, int BR_, int QC_, int WARPS_, int STAGES_, bool ATOMIC_DQ_>
struct BwdDkdvTraits {
    static constexpr int D = D_, BR = BR_, WARPS = WARPS_, STAGES = STAGES_;
    // Queries per register pass: a warp holds the scores of 16 keys x QC
    // queries at a time, next to its dK and dV accumulators (16 keys x D each).
    static constexpr int QC = QC_;
    static constexpr bool ATOMIC_DQ = ATOMIC_DQ_;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int BC = 16 * WARPS;  // keys per CTA: 16 per warp
    static constexpr int KV_ELEMS = BC * D;
    static constexpr int QB_ELEMS = BR * D;
    // dQ = dS K splits into 16-row tiles x DQ_SPLIT column slices, one per warp.
    static constexpr int DQ_SPLIT = WARPS / (BR / 16);
    static constexpr int DQ_COLS = D / DQ_SPLIT;
    // Shared memory (byte offsets; cuflash/config.py BwdConfig.dkdv_smem_layout):
    // K, V, STAGES x Q, STAGES x dO, STAGES x lse2 rows, STAGES x delta rows,
    // dS^T (16-bit, [key][query]) when dQ is fused.
    static constexpr int OFF_K = 0;
    static constexpr int OFF_V = OFF_K + 2 * KV_ELEMS;
    static constexpr int OFF_Q = OFF_V + 2 * KV_ELEMS;
    static constexpr int OFF_DO = OFF_Q + 2 * STAGES * QB_ELEMS;
    static constexpr int OFF_LSE2 = OFF_DO + 2 * STAGES * QB_ELEMS;
    static constexpr int OFF_DELTA = OFF_LSE2 + 4 * STAGES * BR;
    static constexpr int OFF_DS = OFF_DELTA + 4 * STAGES * BR;
    static constexpr int SMEM_BYTES = OFF_DS + (ATOMIC_DQ ? 2 * BC * BR : 0);

    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim must be a multiple of 32 in [32, 256]");
    // BR divides 128, the padding of the lse2 / delta / dq_accum rows.
    static_assert(BR == 32 || BR == 64 || BR == 128, "BR must be 32, 64 or 128");
    static_assert(QC % 16 == 0 && BR % QC == 0, "QC must be a multiple of 16 dividing BR");
    static_assert(STAGES >= 2 && STAGES <= 3, "2 or 3 stages");
    static_assert(!ATOMIC_DQ || (WARPS % (BR / 16) == 0 && DQ_COLS % 16 == 0), "dQ warp split must be exact");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tiles do not fit in shared memory");
};

template <int D, int BR, int QC, int WARPS, int STAGES, int MIN_BLOCKS, bool BF16, bool CAUSAL, bool EVEN_N,
          bool EVEN_D, bool ATOMIC_DQ, int MODS>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
    bwd_dkdv_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    const u16* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
                    float* __restrict__ dq_accum, u16* __restrict__ dk, u16* __restrict__ dv, int nq, int nk, int d,
                    int group, int nq_pad, long long q_sb, long long q_sn, long long q_sh, long long k_sb,
                    long long k_sn, long long k_sh, long long v_sb, long long v_sn, long long v_sh, long long do_sb,
                    long long do_sn, long long do_sh, long long dk_sb, long long dk_sn, long long dk_sh,
                    long long dv_sb, long long dv_sn, long long dv_sh, float scale_log2, float scale,
                    const ScoreModArgs mod_args) {
    using T = BwdDkdvTraits<D, BR, QC, WARPS, STAGES, ATOMIC_DQ>;
    constexpr int BC = T::BC, THREADS = T::THREADS;
    constexpr int NT_C = QC / 8;   // n8 tiles of a chunk of S^T (columns = queries)
    constexpr int KS_C = QC / 16;  // k16 steps over a chunk's queries
    constexpr int KS_D = D / 16;   // k16 steps over the head dim
    constexpr int NT_D = D / 8;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw + T::OFF_K);
    u16* sV = reinterpret_cast<u16*>(smem_raw + T::OFF_V);
    u16* sQ = reinterpret_cast<u16*>(smem_raw + T::OFF_Q);
    u16* sdO = reinterpret_cast<u16*>(smem_raw + T::OFF_DO);
    float* sLse2 = reinterpret_cast<float*>(smem_raw + T::OFF_LSE2);
    float* sDelta = reinterpret_cast<float*>(smem_raw + T::OFF_DELTA);
    u16* sdS = reinterpret_cast<u16*>(smem_raw + T::OFF_DS);  // dS^T: [key][query]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int nheads_kv = gridDim.y, nheads = nheads_kv * group;
    const int n0 = n_block * BC;
    using Mods = ScoreMods<MODS, CAUSAL, EVEN_N>;
    // Varlen: the grid covers the longest sequence; from here on the pointers start at this
    // sequence's rows, and nq, nk are its lengths.
    const SeqSpan seq = seq_span<Mods::VARLEN>(mod_args, b, nq, nk);
    if (Mods::VARLEN && n0 >= seq.nk) return;
    q += seq.q0 * q_sn;
    dout += seq.q0 * do_sn;
    k += seq.k0 * k_sn;
    v += seq.k0 * v_sn;
    dk += seq.k0 * dk_sn;
    dv += seq.k0 * dv_sn;
    nq = seq.nq;
    nk = seq.nk;
    Mods mods(mod_args, nq, nk);

    const QueryBlockSteps<BR> steps(mods, n_block, n0, BC, group);
    const int n_iter = steps.count;

    float acc_dk[NT_D][4], acc_dv[NT_D][4];
    zero(acc_dk);
    zero(acc_dv);

    auto load_q_block = [&](int t) {
        const int g = steps.head(t), m0 = steps.query_block(t) * BR, h = hk * group + g;
        const int st = t % STAGES;
        const int tid = thread_index_volatile();
        const long long q_off = b * q_sb + h * q_sh + m0 * q_sn, do_off = b * do_sb + h * do_sh + m0 * do_sn;
        load_tile_async<BR, D, THREADS, !EVEN_N, !EVEN_D>(sQ + st * T::QB_ELEMS, q + q_off, q_sn, nq - m0, d, tid);
        load_tile_async<BR, D, THREADS, !EVEN_N, !EVEN_D>(sdO + st * T::QB_ELEMS, dout + do_off, do_sn, nq - m0, d,
                                                          tid);
        // lse2 / delta rows are padded to nq_pad: BR floats are always in range.
        const long long row_off = seq.padded_row0<Mods::VARLEN>(b, h, nheads, nq_pad) + m0;
        for (int c = tid; c < 2 * (BR / 4); c += THREADS) {
            const bool is_delta = c >= BR / 4;
            const int cc = is_delta ? c - BR / 4 : c;
            float* dst = (is_delta ? sDelta : sLse2) + st * BR + cc * 4;
            cp_async_16(smem_addr(dst), (is_delta ? delta : lse2) + row_off + cc * 4, true);
        }
    };

    // K, V tiles with the first query block; then the ring of query blocks.
    load_tile_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sK, k + b * k_sb + hk * k_sh + n0 * k_sn, k_sn, nk - n0, d, tid);
    load_tile_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sV, v + b * v_sb + hk * v_sh + n0 * v_sn, v_sn, nk - n0, d, tid);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_iter) load_q_block(s);
        cp_async_commit();
    }

    // ldmatrix lane offsets (see fwd_sm80.cuh): A from [m][k] storage; B from
    // [n][k] storage (non-transposed); B from [k][n] storage (transposed).
    const LaneOffsets<BC, D> kv_a_off(lane & 15, lane >> 4);
    const LaneOffsets<BR, D> q_b_off((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LaneOffsets<BR, D> q_bt_off((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    const int warp_key0 = warp * 16;

    for (int t = 0; t < n_iter; ++t) {
        const int g = steps.head(t), m0 = steps.query_block(t) * BR, h = hk * group + g;
        const int st = t % STAGES;
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // block t landed; every warp is done with block t-1
        if (t + STAGES - 1 < n_iter) load_q_block(t + STAGES - 1);
        cp_async_commit();

        const u32 q_smem = smem_addr(sQ + st * T::QB_ELEMS);
        const u32 do_smem = smem_addr(sdO + st * T::QB_ELEMS);
        const float* lse2_s = sLse2 + st * BR;
        const float* delta_s = sDelta + st * BR;
        mods.set_head(mod_args, b, h);

        // The block's queries in chunks of QC: only one chunk's scores live in
        // registers next to the dK and dV accumulators. A real loop, so that
        // the compiler cannot overlap two chunks' scores again.
#pragma unroll 1
        for (int qc = 0; qc < BR; qc += QC) {
            // S^T = K Q^T: this warp's 16 keys x QC queries
            float acc_s[NT_C][4];
            zero(acc_s);
            gemm_ss_nt<BF16, KS_D, NT_C>(acc_s, smem_addr(sK), kv_a_off, warp_key0, q_smem, q_b_off, qc);

            // P^T = 2^(score^T * c - lse2[query]) (score_mods.cuh); masked pairs get P = 0
            const int mc = m0 + qc;
            const bool masked =
                !mods.block_visible(mc, QC, n0, BC) || (!EVEN_N && (mc + QC > nq || n0 + BC > nk));
            float score_grad[Mods::SOFTCAP ? NT_C : 1][4];  // d score / d (scaled) S under softcap
#pragma unroll
            for (int j = 0; j < NT_C; ++j) {
                const float2 l2 = *reinterpret_cast<const float2*>(lse2_s + qc + j * 8 + 2 * (lane & 3));
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float u = mods.transform(acc_s[j][e]);
                    if constexpr (Mods::SOFTCAP) score_grad[j][e] = mods.score_grad(u);
                    if constexpr (Mods::ALIBI) {
                        const int key = n0 + warp_key0 + (lane >> 2) + 8 * (e >> 1);
                        u = mods.bias(u, mods.distance(mc + j * 8 + 2 * (lane & 3) + (e & 1), key));
                    }
                    float p = exp2_approx(fmaf(u, scale_log2, -((e & 1) ? l2.y : l2.x)));
                    if (masked) {
                        const int key = n0 + warp_key0 + (lane >> 2) + 8 * (e >> 1);
                        const int query = mc + j * 8 + 2 * (lane & 3) + (e & 1);
                        bool keep = key < nk && query < nq;
                        if constexpr (Mods::RIGHT_BOUND) keep = keep && mods.visible(query, key);
                        if (!keep) p = 0.f;
                    }
                    acc_s[j][e] = p;
                }
            }

            // P^T rounded to 16 bits: the A operand of dV += P^T dO, and the P of
            // dS below (as in the naive computation in the input dtype); the
            // fp32 scores die here. Dropout: dV += (P o M)^T dO (its 1 / (1 - p) left to
            // the epilogue), and dS = P o (dP o M / (1 - p) - delta) with the keep mask M.
            u32 p_frag[KS_C][4];
            acc_to_a<BF16, NT_C>(p_frag, acc_s);
            KeepBits<NT_C> kept{};
            if constexpr (Mods::DROPOUT) {
                kept = dropout_bits_t<NT_C, Mods::DROPOUT_STATE>(mod_args, b * nheads + h, mc, n0 + warp_key0,
                                                                 lane);
                apply_dropout(acc_s, kept, 1.f);
                u32 dropped_frag[KS_C][4];
                acc_to_a<BF16, NT_C>(dropped_frag, acc_s);
                gemm_rs_nn<BF16, KS_C, NT_D>(acc_dv, dropped_frag, do_smem, q_bt_off, qc);
            } else {
                gemm_rs_nn<BF16, KS_C, NT_D>(acc_dv, p_frag, do_smem, q_bt_off, qc);
            }

            // dP^T = V dO^T
            float acc_dp[NT_C][4];
            zero(acc_dp);
            gemm_ss_nt<BF16, KS_D, NT_C>(acc_dp, smem_addr(sV), kv_a_off, warp_key0, do_smem, q_b_off, qc);

            // dS^T = P^T o (dP^T - delta[query])
#pragma unroll
            for (int j = 0; j < NT_C; ++j) {
                const float2 dl = *reinterpret_cast<const float2*>(delta_s + qc + j * 8 + 2 * (lane & 3));
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float2 p = unpack2<BF16>(p_frag[j / 2][2 * (j % 2) + r]);
                    if constexpr (Mods::DROPOUT) {
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int e = 2 * r + c;
                            acc_dp[j][e] = kept.test(4 * j + e) ? acc_dp[j][e] * mod_args.dropout_scale : 0.f;
                        }
                    }
                    acc_dp[j][2 * r] = p.x * (acc_dp[j][2 * r] - dl.x);
                    acc_dp[j][2 * r + 1] = p.y * (acc_dp[j][2 * r + 1] - dl.y);
                    if constexpr (Mods::SOFTCAP) {
                        acc_dp[j][2 * r] *= score_grad[j][2 * r];
                        acc_dp[j][2 * r + 1] *= score_grad[j][2 * r + 1];
                    }
                }
            }
            u32 ds_frag[KS_C][4];
            acc_to_a<BF16, NT_C>(ds_frag, acc_dp);

            // dK += dS^T Q   (times scale at the end)
            gemm_rs_nn<BF16, KS_C, NT_D>(acc_dk, ds_frag, q_smem, q_bt_off, qc);
            if constexpr (ATOMIC_DQ) store_ds_t<BC, BR, KS_C>(sdS, ds_frag, warp_key0, qc, lane);
        }

        if constexpr (ATOMIC_DQ) {
            // dQ[block] += dS K into the fp32 buffer.
            __syncthreads();
            constexpr int NT_DQ = T::DQ_COLS / 8;
            const int mt = warp / T::DQ_SPLIT, col_chunk0 = (warp % T::DQ_SPLIT) * (T::DQ_COLS / 8);
            const LaneOffsets<BC, BR> ds_at_off((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1, mt * 2);
            const LaneOffsets<BC, D> k_bt_off((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4, col_chunk0);
            // dq_accum has padded rows of D floats (seq_span.cuh): rows and columns need no bounds check.
            const long long dq_row = seq.padded_row0<Mods::VARLEN>(b, h, nheads, nq_pad) + m0 + mt * 16 + (lane >> 2);
            float* dq_rows = dq_accum + dq_row * D + col_chunk0 * 8 + 2 * (lane & 3);
            // Where the dK and dV accumulators are small (D <= 64), all of the
            // warp's columns at once: each dS fragment is read once. Else
            // column slices of 32 (or 16) keep the dQ accumulator small.
            constexpr int NT_SLICE = D <= 64 ? NT_DQ : (NT_DQ % 4 == 0 ? 4 : 2);
            static_assert(NT_DQ % NT_SLICE == 0, "dQ slices must tile the warp's columns");
#pragma unroll
            for (int s0 = 0; s0 < NT_DQ; s0 += NT_SLICE) {
                float acc_dq[NT_SLICE][4];
                zero(acc_dq);
#pragma unroll
                for (int kk = 0; kk < BC / 16; ++kk) {
                    u32 a[4];  // A = dS (queries x keys), read transposed from dS^T
                    ldmatrix_x4_trans(a, smem_addr(sdS) + ds_at_off.at(kk * 16, 0));
#pragma unroll
                    for (int dn = 0; dn < NT_SLICE / 2; ++dn) {
                        u32 bb[4];
                        ldmatrix_x4_trans(bb, smem_addr(sK) + k_bt_off.at(kk * 16, s0 + dn * 2));
                        mma_16816<BF16>(acc_dq[2 * dn], a, bb[0], bb[1]);
                        mma_16816<BF16>(acc_dq[2 * dn + 1], a, bb[2], bb[3]);
                    }
                }
#pragma unroll
                for (int j = 0; j < NT_SLICE; ++j)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        red_add_f32x2(dq_rows + 8 * r * D + (s0 + j) * 8, acc_dq[j][2 * r], acc_dq[j][2 * r + 1]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with K and V: their tiles take dK and dV

    acc_to_smem<BF16, BC, D>(sK, acc_dk, warp_key0, scale, lane);
    acc_to_smem<BF16, BC, D>(sV, acc_dv, warp_key0, Mods::DROPOUT ? mod_args.dropout_scale : 1.f, lane);
    __syncthreads();
    store_tile<BC, D, THREADS>(dk + b * dk_sb + hk * dk_sh + n0 * dk_sn, sK, dk_sn, nk - n0, d, tid);
    store_tile<BC, D, THREADS>(dv + b * dv_sb + hk * dv_sh + n0 * dv_sn, sV, dv_sn, nk - n0, d, tid);
}

template <int D_, int WARPS_, int BC_, int STAGES_>
struct BwdDqTraits {
    static constexpr int D = D_, WARPS = WARPS_, BC = BC_, STAGES = STAGES_;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int BR = 16 * WARPS;  // queries per CTA: 16 per warp
    static constexpr int KV_ELEMS = BC * D;
    static constexpr int QB_ELEMS = BR * D;
    // Shared memory (byte offsets; cuflash/config.py BwdConfig.dq_smem_layout):
    // Q, dO, STAGES x K, STAGES x V.
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_DO = OFF_Q + 2 * QB_ELEMS;
    static constexpr int OFF_K = OFF_DO + 2 * QB_ELEMS;
    static constexpr int OFF_V = OFF_K + 2 * STAGES * KV_ELEMS;
    static constexpr int SMEM_BYTES = OFF_V + 2 * STAGES * KV_ELEMS;

    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim must be a multiple of 32 in [32, 256]");
    static_assert(BC % 16 == 0, "BC must be a multiple of 16");
    static_assert(BR == 32 || BR == 64 || BR == 128, "BR (16 x warps) must divide 128, the row padding");
    static_assert(STAGES >= 2 && STAGES <= 3, "2 or 3 stages");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tiles do not fit in shared memory");
};

template <int D, int WARPS, int BC, int STAGES, int MIN_BLOCKS, bool BF16, bool CAUSAL, bool EVEN_N, bool EVEN_D,
          int MODS>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
    bwd_dq_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                  const u16* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
                  u16* __restrict__ dq, int nq, int nk, int d, int group, int nq_pad, long long q_sb, long long q_sn,
                  long long q_sh, long long k_sb, long long k_sn, long long k_sh, long long v_sb, long long v_sn,
                  long long v_sh, long long do_sb, long long do_sn, long long do_sh, long long dq_sb,
                  long long dq_sn, long long dq_sh, float scale_log2, float scale, const ScoreModArgs mod_args) {
    using T = BwdDqTraits<D, WARPS, BC, STAGES>;
    constexpr int BR = T::BR, THREADS = T::THREADS;
    constexpr int NT_K = BC / 8, KS_K = BC / 16, KS_D = D / 16, NT_D = D / 8;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw + T::OFF_Q);
    u16* sdO = reinterpret_cast<u16*>(smem_raw + T::OFF_DO);
    u16* sK = reinterpret_cast<u16*>(smem_raw + T::OFF_K);
    u16* sV = reinterpret_cast<u16*>(smem_raw + T::OFF_V);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m_block = CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, nheads = gridDim.y, hk = h / group;
    const int m0 = m_block * BR;
    const int warp_row0 = warp * 16;
    using Mods = ScoreMods<MODS, CAUSAL, EVEN_N>;
    // Varlen: as in bwd_dkdv_kernel, the pointers and lengths of this block's sequence.
    const SeqSpan seq = seq_span<Mods::VARLEN>(mod_args, b, nq, nk);
    if (Mods::VARLEN && m0 >= seq.nq) return;
    q += seq.q0 * q_sn;
    dout += seq.q0 * do_sn;
    dq += seq.q0 * dq_sn;
    k += seq.k0 * k_sn;
    v += seq.k0 * v_sn;
    nq = seq.nq;
    nk = seq.nk;
    u16* dq_tile = dq + b * dq_sb + h * dq_sh + m0 * dq_sn;

    Mods mods(mod_args, nq, nk);
    mods.set_head(mod_args, b, h);
    const KeyBlocks blocks = mods.template key_blocks<BC>(m0, BR);
    const int n_begin = blocks.begin, n_end = blocks.end;

    const u16* k_head = k + b * k_sb + hk * k_sh;
    const u16* v_head = v + b * v_sb + hk * v_sh;
    auto load_kv = [&](int n) {  // the ring's step n: key block n_begin + n
        const int st = n % STAGES, kn0 = (n_begin + n) * BC;
        load_tile_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sK + st * T::KV_ELEMS, k_head + kn0 * k_sn, k_sn, nk - kn0,
                                                          d, tid);
        load_tile_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sV + st * T::KV_ELEMS, v_head + kn0 * v_sn, v_sn, nk - kn0,
                                                          d, tid);
    };
    load_tile_async<BR, D, THREADS, !EVEN_N, !EVEN_D>(sQ, q + b * q_sb + h * q_sh + m0 * q_sn, q_sn, nq - m0, d, tid);
    load_tile_async<BR, D, THREADS, !EVEN_N, !EVEN_D>(sdO, dout + b * do_sb + h * do_sh + m0 * do_sn, do_sn, nq - m0,
                                                      d, tid);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_end - n_begin) load_kv(s);
        cp_async_commit();
    }

    // Per-row constants of this lane's two rows (padded buffers: always in range).
    const long long row_base = seq.padded_row0<Mods::VARLEN>(b, h, nheads, nq_pad) + m0 + warp_row0 + (lane >> 2);
    const float lse2_r[2] = {lse2[row_base], lse2[row_base + 8]};
    const float delta_r[2] = {delta[row_base], delta[row_base + 8]};

    const LaneOffsets<BR, D> a_off(lane & 15, lane >> 4);
    const LaneOffsets<BC, D> b_off((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LaneOffsets<BC, D> bt_off((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    float acc_dq[NT_D][4];
    zero(acc_dq);

    for (int n = 0; n < n_end - n_begin; ++n) {
        const int st = n % STAGES, kn0 = (n_begin + n) * BC;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (n + STAGES - 1 < n_end - n_begin) load_kv(n + STAGES - 1);
        cp_async_commit();
        const u32 k_smem = smem_addr(sK + st * T::KV_ELEMS), v_smem = smem_addr(sV + st * T::KV_ELEMS);

        // S = Q K^T, P = 2^(score * c - lse2[row]) (score_mods.cuh), masked pairs P = 0
        float acc_s[NT_K][4];
        zero(acc_s);
        gemm_ss_nt<BF16, KS_D, NT_K>(acc_s, smem_addr(sQ), a_off, warp_row0, k_smem, b_off, 0);
        const bool masked = !mods.block_visible(m0, BR, kn0, BC) || (!EVEN_N && (kn0 + BC > nk || m0 + BR > nq));
        float score_grad[Mods::SOFTCAP ? NT_K : 1][4];  // d score / d (scaled) S under softcap
#pragma unroll
        for (int j = 0; j < NT_K; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + warp_row0 + (lane >> 2) + 8 * (e >> 1);
                const int key = kn0 + j * 8 + 2 * (lane & 3) + (e & 1);
                const float u = mods.transform(acc_s[j][e]);
                if constexpr (Mods::SOFTCAP) score_grad[j][e] = mods.score_grad(u);
                float p = exp2_approx(fmaf(mods.bias(u, mods.distance(row, key)), scale_log2, -lse2_r[e >> 1]));
                if (masked && !(key < nk && row < nq && mods.visible(row, key))) p = 0.f;
                acc_s[j][e] = p;
            }

        // dP = dO V^T, dS = P o (dP - delta[row]); dropout: dP o M / (1 - p) in place of dP
        float acc_dp[NT_K][4];
        zero(acc_dp);
        gemm_ss_nt<BF16, KS_D, NT_K>(acc_dp, smem_addr(sdO), a_off, warp_row0, v_smem, b_off, 0);
        if constexpr (Mods::DROPOUT)
            dropout_tile<Mods::DROPOUT_STATE>(acc_dp, mod_args, b * nheads + h, m0 + warp_row0, kn0, lane,
                                              mod_args.dropout_scale);
#pragma unroll
        for (int j = 0; j < NT_K; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc_dp[j][e] = acc_s[j][e] * (acc_dp[j][e] - delta_r[e >> 1]);
                if constexpr (Mods::SOFTCAP) acc_dp[j][e] *= score_grad[j][e];
            }

        // dQ += dS K   (times scale at the end)
        u32 ds_frag[KS_K][4];
        acc_to_a<BF16, NT_K>(ds_frag, acc_dp);
        gemm_rs_nn<BF16, KS_K, NT_D>(acc_dq, ds_frag, k_smem, bt_off, 0);
    }
    cp_async_wait<0>();
    // Every thread's copies into the Q tile have landed (a block whose rows
    // see no key skips the loop and its barriers: without this one, another
    // thread's Q copy could overwrite the dQ rows written below).
    __syncthreads();
    acc_to_smem<BF16, BR, D>(sQ, acc_dq, warp_row0, scale, lane);
    __syncthreads();
    store_tile<BR, D, THREADS>(dq_tile, sQ, dq_sn, nq - m0, d, tid);
}

}  // namespace cuflash
