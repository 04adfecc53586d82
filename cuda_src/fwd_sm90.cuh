// FlashAttention forward for Hopper (sm_90a): wgmma.
//
// One CTA computes BR = 64 * WGS query rows of one (batch, head); warpgroup g
// owns rows 64g .. 64g+63 (each of its warps 16 of them, as in fwd_sm80.cuh).
// K and V tiles of BC keys stream through a STAGES-deep cp.async ring in the
// core-matrix layout of sm90_tiles.cuh.
//   S = Q K^T:  wgmma m64nBCk16, Q and K from shared memory (both K-major).
//   O += P V:   wgmma m64nDk16, P from registers (the S accumulators rounded to
//               16 bits are already in the A-fragment layout), V from shared
//               memory (MN-major).
// The online softmax is the one of fwd_sm80.cuh: running row max and sum,
// exp2 with scale*log2(e) folded into one FMA, 1/l deferred to the end.
#pragma once
#include "common.cuh"
#include "sm90_tiles.cuh"
#include "wgmma.cuh"

namespace cuflash {

template <int D_, int BC_, int WGS_, int STAGES_>
struct FwdSm90Traits {
    static constexpr int D = D_, BC = BC_, WGS = WGS_, STAGES = STAGES_;
    static constexpr int THREADS = 128 * WGS;
    static constexpr int BR = 64 * WGS;
    static constexpr int Q_BYTES = BR * D * 2;
    static constexpr int KV_BYTES = BC * D * 2;
    // Q tile (reused for the output tile) + STAGES K tiles + STAGES V tiles.
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES;

    static_assert(D == 64 || D == 128 || D == 256, "wgmma n = head dim: 64, 128 or 256");
    static_assert(BC == 64 || BC == 128, "wgmma n = BC: 64 or 128");
    static_assert(WGS >= 1 && WGS <= 3, "1 to 3 warpgroups");
    static_assert(STAGES >= 1 && STAGES <= 3, "1 to 3 stages");
    static_assert((BC * D / 8) % THREADS == 0 && (BR * D / 8) % THREADS == 0, "copies must tile the threads");
    static_assert(SMEM_BYTES <= 227 * 1024, "tiles do not fit in shared memory");
};

template <int D, int BC, int WGS, int STAGES, bool BF16, bool CAUSAL, bool EVEN_N, bool EVEN_D>
__global__ void __launch_bounds__(128 * WGS, 1)
    fwd_sm90_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    u16* __restrict__ o, float* __restrict__ lse, int nq, int nk, int d, int group, long long q_sb,
                    long long q_sn, long long q_sh, long long k_sb, long long k_sn, long long k_sh, long long v_sb,
                    long long v_sn, long long v_sh, long long o_sb, long long o_sn, long long o_sh,
                    float scale_log2) {
    using T = FwdSm90Traits<D, BC, WGS, STAGES>;
    constexpr int BR = T::BR, THREADS = T::THREADS;
    constexpr int NT_S = BC / 8, NT_O = D / 8;
    constexpr int PIPE_WAIT = 2 * STAGES - 2;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 sQ = smem_addr(smem_raw);
    const u32 sK = sQ + T::Q_BYTES;
    const u32 sV = sK + STAGES * T::KV_BYTES;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int m_block = CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group, nheads = gridDim.y;
    const int m0 = m_block * BR;
    const int rows_valid = nq - m0;

    const u16* q_tile = q + b * q_sb + h * q_sh + m0 * q_sn;
    const u16* k_head = k + b * k_sb + hk * k_sh;
    const u16* v_head = v + b * v_sb + hk * v_sh;
    u16* o_tile = o + b * o_sb + h * o_sh + m0 * o_sn;
    float* lse_rows = lse + ((long long)b * nheads + h) * nq + m0;

    // Key blocks [0, n_end) are visited, [n_unmasked, n_end) with the mask
    // (causal bottom-right aligned: query i sees keys j <= i + nk - nq).
    const int diag = nk - nq;
    const int n_blocks = (nk + BC - 1) / BC;
    int n_end = n_blocks, n_unmasked = n_blocks;
    if constexpr (CAUSAL) {
        const int last_key = m0 + BR - 1 + diag;
        n_end = last_key < 0 ? 0 : min(n_blocks, last_key / BC + 1);
        const int first_limit = m0 + diag + 1;
        n_unmasked = first_limit <= 0 ? 0 : min(n_end, first_limit / BC);
    }
    if constexpr (!EVEN_N) n_unmasked = min(n_unmasked, nk / BC);

    if (n_end == 0) {  // no row of this block sees a key: O = 0, lse = -inf
        for (int i = tid; i < BR * (D / 8); i += THREADS) {
            const int row = i / (D / 8), chunk = i % (D / 8);
            if (row < rows_valid && chunk * 8 < d)
                *reinterpret_cast<uint4*>(o_tile + row * o_sn + chunk * 8) = make_uint4(0, 0, 0, 0);
        }
        for (int row = tid; row < BR; row += THREADS)
            if (row < rows_valid) lse_rows[row] = neg_inf();
        return;
    }

    auto block_of = [&](int t) { return n_end - 1 - t; };  // descending: masked blocks first
    auto load_k = [&](int t) {
        const int n0 = block_of(t) * BC;
        load_tile_cm_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sK + (t % STAGES) * T::KV_BYTES, k_head + n0 * k_sn,
                                                             k_sn, nk - n0, d, tid);
    };
    auto load_v = [&](int t) {
        const int n0 = block_of(t) * BC;
        load_tile_cm_async<BC, D, THREADS, !EVEN_N, !EVEN_D>(sV + (t % STAGES) * T::KV_BYTES, v_head + n0 * v_sn,
                                                             v_sn, nk - n0, d, tid);
    };

    // Pipeline prologue; commit order is {Q, K0}, V0, K1, V1, ..., K[S-1].
    load_tile_cm_async<BR, D, THREADS, !EVEN_N, !EVEN_D>(sQ, q_tile, q_sn, rows_valid, d, tid);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        if (s < n_end) load_k(s);
        cp_async_commit();
        if (s + 1 < STAGES) {
            if (s < n_end) load_v(s);
            cp_async_commit();
        }
    }

    const int warp_row0 = wg * 64 + (warp & 3) * 16;
    float acc_o[NT_O * 4];
#pragma unroll
    for (int i = 0; i < NT_O * 4; ++i) acc_o[i] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};

    auto step = [&](int t, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int n0 = block_of(t) * BC;
        const int stage = t % STAGES;

        cp_async_wait<PIPE_WAIT>();  // K[t] (and Q at t == 0) landed
        fence_proxy_async();
        __syncthreads();
        if (t + STAGES - 1 < n_end) load_v(t + STAGES - 1);
        cp_async_commit();

        // S = Q K^T (raw scores)
        float acc_s[NT_S * 4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
            Wgmma<BC, BF16>::ss(acc_s, desc_k_major<D>(sQ, wg * 64, ks),
                                desc_k_major<D>(sK + stage * T::KV_BYTES, 0, ks), ks > 0);
        wgmma_commit();
        wgmma_wait<0>();

        if constexpr (MASK) {
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
        }

        // Online softmax (see fwd_sm80.cuh); a row with no key yet keeps P = 0.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int j = 0; j < NT_S; ++j) mx = fmaxf(mx, fmaxf(acc_s[j * 4 + 2 * r], acc_s[j * 4 + 2 * r + 1]));
            mx = quad_max(mx);
            const float offset = mx == neg_inf() ? 0.f : mx * scale_log2;
            const float alpha = exp2_approx(row_max[r] * scale_log2 - offset);
            row_max[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < NT_S; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float p = exp2_approx(fmaf(acc_s[j * 4 + 2 * r + c], scale_log2, -offset));
                    acc_s[j * 4 + 2 * r + c] = p;
                    sum += p;
                }
            row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
            for (int j = 0; j < NT_O; ++j) {
                acc_o[j * 4 + 2 * r] *= alpha;
                acc_o[j * 4 + 2 * r + 1] *= alpha;
            }
        }
        u32 p_frag[BC / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            p_frag[kk][0] = pack2<BF16>(acc_s[(2 * kk) * 4 + 0], acc_s[(2 * kk) * 4 + 1]);
            p_frag[kk][1] = pack2<BF16>(acc_s[(2 * kk) * 4 + 2], acc_s[(2 * kk) * 4 + 3]);
            p_frag[kk][2] = pack2<BF16>(acc_s[(2 * kk + 1) * 4 + 0], acc_s[(2 * kk + 1) * 4 + 1]);
            p_frag[kk][3] = pack2<BF16>(acc_s[(2 * kk + 1) * 4 + 2], acc_s[(2 * kk + 1) * 4 + 3]);
        }

        cp_async_wait<PIPE_WAIT>();  // V[t] landed
        fence_proxy_async();
        __syncthreads();
        // Every warpgroup finished S = Q K^T[t] (waited above): its K stage may be refilled.
        if (t + STAGES < n_end) load_k(t + STAGES);
        cp_async_commit();

        // O += P V
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            Wgmma<D, BF16>::template rs<true>(acc_o, p_frag[kk], desc_mn_major<D>(sV + stage * T::KV_BYTES, kk));
        wgmma_commit();
        wgmma_wait<0>();
    };

    int t = 0;
    for (; t < n_end - n_unmasked; ++t) step(t, BoolConst<true>{});
    for (; t < n_end; ++t) step(t, BoolConst<false>{});
    cp_async_wait<0>();
    __syncthreads();  // all warpgroups are done reading Q: its tile takes the output

    // Epilogue: O /= l, lse = (m * c + log2 l) * ln 2, O through shared memory.
    constexpr float LN2 = 0.6931471805599453f;
    unsigned char* smem_q = smem_raw;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(row_sum[r]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = warp_row0 + (lane >> 2) + 8 * r;
        if ((lane & 3) == 0 && row < rows_valid)
            lse_rows[row] = l > 0.f ? (row_max[r] * scale_log2 + log2_approx(l)) * LN2 : neg_inf();
#pragma unroll
        for (int j = 0; j < NT_O; ++j) {
            const int col = j * 8 + 2 * (lane & 3);
            *reinterpret_cast<u32*>(smem_q + cm_offset_bytes<D>(row, col)) =
                pack2<BF16>(acc_o[j * 4 + 2 * r] * inv, acc_o[j * 4 + 2 * r + 1] * inv);
        }
    }
    __syncthreads();
    for (int i = tid; i < BR * (D / 8); i += THREADS) {
        const int row = i / (D / 8), chunk = i % (D / 8);
        if (row < rows_valid && chunk * 8 < d)
            *reinterpret_cast<uint4*>(o_tile + row * o_sn + chunk * 8) =
                *reinterpret_cast<const uint4*>(smem_q + cm_offset_bytes<D>(row, chunk * 8));
    }
}

}  // namespace cuflash
