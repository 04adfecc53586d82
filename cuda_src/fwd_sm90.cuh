// FlashAttention forward for Hopper (sm_90a): wgmma, warp specialisation.
//
// One CTA computes BR = 128 query rows of one (batch, head) with three
// warpgroups. Warpgroup 0 is the producer: it copies Q once and then K and V
// tiles of BC keys into a STAGES-deep ring (128-byte-swizzled panels, see
// sm90_tiles.cuh) with cp.async, each copy completing on a "full" mbarrier,
// and refills a stage once the consumers have arrived on its "empty" barrier.
// It gives its registers to the consumers (setmaxnreg). Warpgroups 1 and 2
// are the consumers; consumer c owns rows 64c .. 64c+63 (each warp 16 rows, as
// in fwd_sm80.cuh). The consumers take turns issuing S = Q K^T (two named
// barriers, "ping-pong"), so that one's softmax runs while the other's GEMMs
// keep the tensor cores busy.
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

template <int D_, int BC_, int STAGES_>
struct FwdSm90Traits {
    static constexpr int D = D_, BC = BC_, STAGES = STAGES_;
    static constexpr int CONSUMERS = 2;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int BR = 64 * CONSUMERS;
    static constexpr int Q_BYTES = BR * D * 2;
    static constexpr int KV_BYTES = BC * D * 2;
    // Q tile (reused for the output tile) + STAGES K and V tiles + barriers.
    static constexpr int BARRIERS = 1 + 4 * STAGES;
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES + 8 * BARRIERS;
    // Register split: 128 x (PRODUCER_REGS + 2 x CONSUMER_REGS) <= 65536.
    static constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;

    static_assert(D == 64 || D == 128 || D == 256, "wgmma n = head dim: 64, 128 or 256");
    static_assert(BC == 64 || BC == 128, "wgmma n = BC: 64 or 128");
    static_assert(STAGES >= 1 && STAGES <= 4, "1 to 4 stages");
    static_assert(SMEM_BYTES <= 227 * 1024, "tiles do not fit in shared memory");
};

template <int D, int BC, int STAGES, bool BF16, bool CAUSAL, bool EVEN_N, bool EVEN_D>
__global__ void __launch_bounds__(384, 1)
    fwd_sm90_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    u16* __restrict__ o, float* __restrict__ lse, int nq, int nk, int d, int group, long long q_sb,
                    long long q_sn, long long q_sh, long long k_sb, long long k_sn, long long k_sh, long long v_sb,
                    long long v_sn, long long v_sh, long long o_sb, long long o_sn, long long o_sh,
                    float scale_log2) {
    using T = FwdSm90Traits<D, BC, STAGES>;
    constexpr int BR = T::BR;
    constexpr int NT_S = BC / 8, NT_O = D / 8;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 sQ = smem_addr(smem_raw);
    const u32 sK = sQ + T::Q_BYTES;
    const u32 sV = sK + STAGES * T::KV_BYTES;
    const u32 bars = sV + STAGES * T::KV_BYTES;
    const u32 full_q = bars;
    auto full_k = [&](int s) { return bars + 8 * (1 + s); };
    auto full_v = [&](int s) { return bars + 8 * (1 + STAGES + s); };
    auto empty_k = [&](int s) { return bars + 8 * (1 + 2 * STAGES + s); };
    auto empty_v = [&](int s) { return bars + 8 * (1 + 3 * STAGES + s); };

    // Tiles use the 128-byte-swizzled panels of common.cuh (tile_offset),
    // which wgmma reads through descriptors with swizzle mode 128B. Measured
    // on an H200 (hdim 128, 8k): 577 TFLOP/s, against 328 with unswizzled
    // 8 x 8 core matrices.
    auto tile_bytes = [&](auto rows_c, int row, int col) -> u32 {
        return 2 * (tile_offset<decltype(rows_c)::value, D>(row, col >> 3) + (col & 7));
    };
    auto load_tile = [&](auto rows_c, u32 dst, const u16* src, long long stride, int rows, int tid_) {
        load_tile_async<decltype(rows_c)::value, D, 128, !EVEN_N, !EVEN_D>(
            reinterpret_cast<u16*>(smem_raw + (dst - sQ)), src, stride, rows, d, tid_);
    };
    // V is the MN-major B operand of P V: the descriptor's leading offset is
    // the distance between 64-column panels (BC * 128 B), its stride that
    // between 8-row atoms (1024 B) (tests/test_sm90_gpu.py::test_wgmma_layouts).
    auto q_desc = [&](int row0, int ks) { return desc_k_major_sw128<BR>(sQ, row0, ks); };
    auto k_desc = [&](u32 tile, int ks) { return desc_k_major_sw128<BC>(tile, 0, ks); };
    auto v_desc = [&](u32 tile, int ks) { return desc_mn_major_sw128<BC * 128, 1024>(tile, ks); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int m_block = CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group, nheads = gridDim.y;
    const int m0 = m_block * BR;
    const int rows_valid = nq - m0;
    u16* o_tile = o + b * o_sb + h * o_sh + m0 * o_sn;
    float* lse_rows = lse + ((long long)b * nheads + h) * nq + m0;

    const int diag = nk - nq;
    const KeyBlocks blocks = forward_key_blocks<BR, BC, CAUSAL, EVEN_N>(m0, nq, nk);
    const int n_end = blocks.end, n_unmasked = blocks.unmasked;
    if (n_end == 0) {  // no row of this block sees a key
        write_empty_rows<BR, D, T::THREADS>(o_tile, o_sn, lse_rows, rows_valid, d, tid);
        return;
    }

    if (tid == 0) {
        mbar_init(full_q, 128);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k(s), 128);
            mbar_init(full_v(s), 128);
            mbar_init(empty_k(s), 4 * T::CONSUMERS);  // one arrival per consumer warp
            mbar_init(empty_v(s), 4 * T::CONSUMERS);
        }
    }
    __syncthreads();

    // Key block of step t: descending, so the masked blocks come first.
    auto block_of = [&](int t) { return n_end - 1 - t; };

    // ---------------------------------------------------------------- consumers
    auto consume = [&](const int c) {
        setmaxnreg_inc<T::CONSUMER_REGS>();
        const int warp_row0 = c * 64 + (warp & 3) * 16;
        float acc_o[NT_O * 4];
#pragma unroll
        for (int i = 0; i < NT_O * 4; ++i) acc_o[i] = 0.f;
        float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};
        mbar_wait(full_q, 0);

        // Ping-pong: consumer c issues its S GEMM after a sync on barrier 1 + c,
        // then lets the other consumer issue. Consumer 1 opens the first turn
        // for consumer 0, and skips its last hand-over so that every arrival
        // has a matching sync.
        if (c == 1) named_bar_arrive<256>(1);

        auto step = [&](int t, auto masked) {
            constexpr bool MASK = decltype(masked)::value;
            const int n0 = block_of(t) * BC;
            const int st = t % STAGES, parity = (t / STAGES) & 1;

            // S = Q K^T (raw scores)
            mbar_wait(full_k(st), parity);
            fence_proxy_async();
            float acc_s[NT_S * 4];
            named_bar_sync<256>(1 + c);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks)
                Wgmma<BC, BF16>::ss(acc_s, q_desc(c * 64, ks), k_desc(sK + st * T::KV_BYTES, ks),
                                    ks > 0);
            wgmma_commit();
            if (c == 0 || t + 1 < n_end) named_bar_arrive<256>(2 - c);
            wgmma_wait<0>();
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_k(st));

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
                    for (int cc = 0; cc < 2; ++cc) {
                        const float p = exp2_approx(fmaf(acc_s[j * 4 + 2 * r + cc], scale_log2, -offset));
                        acc_s[j * 4 + 2 * r + cc] = p;
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

            // O += P V
            mbar_wait(full_v(st), parity);
            fence_proxy_async();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk)
                Wgmma<D, BF16>::template rs<true>(acc_o, p_frag[kk], v_desc(sV + st * T::KV_BYTES, kk));
            wgmma_commit();
            wgmma_wait<0>();
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_v(st));
        };

        int t = 0;
        for (; t < n_end - n_unmasked; ++t) step(t, BoolConst<true>{});
        for (; t < n_end; ++t) step(t, BoolConst<false>{});

        // Epilogue, per warp: O /= l, lse = (m * c + log2 l) * ln 2; the warp's 16
        // output rows go through its own rows of the Q tile (no longer read: the
        // last wgmma reading them has completed) for 16-byte stores.
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
                *reinterpret_cast<u32*>(smem_q + tile_bytes(IntConst<BR>{}, row, col)) =
                    pack2<BF16>(acc_o[j * 4 + 2 * r] * inv, acc_o[j * 4 + 2 * r + 1] * inv);
            }
        }
        __syncwarp();
        for (int i = lane; i < 16 * (D / 8); i += 32) {
            const int row = warp_row0 + i / (D / 8), chunk = i % (D / 8);
            if (row < rows_valid && chunk * 8 < d)
                *reinterpret_cast<uint4*>(o_tile + row * o_sn + chunk * 8) =
                    *reinterpret_cast<const uint4*>(smem_q + tile_bytes(IntConst<BR>{}, row, chunk * 8));
        }
    };

    if (wg == 0) {
        // ------------------------------------------------------------ producer
        setmaxnreg_dec<T::PRODUCER_REGS>();
        const u16* k_head = k + b * k_sb + hk * k_sh;
        const u16* v_head = v + b * v_sb + hk * v_sh;
        load_tile(IntConst<BR>{}, sQ, q + b * q_sb + h * q_sh + m0 * q_sn, q_sn, rows_valid, tid);
        mbar_arrive_cp_async(full_q);
        for (int t = 0; t < n_end; ++t) {
            const int st = t % STAGES, use = t / STAGES, n0 = block_of(t) * BC;
            if (use > 0) mbar_wait(empty_k(st), (use - 1) & 1);
            load_tile(IntConst<BC>{}, sK + st * T::KV_BYTES, k_head + n0 * k_sn, k_sn, nk - n0, tid);
            mbar_arrive_cp_async(full_k(st));
            if (use > 0) mbar_wait(empty_v(st), (use - 1) & 1);
            load_tile(IntConst<BC>{}, sV + st * T::KV_BYTES, v_head + n0 * v_sn, v_sn, nk - n0, tid);
            mbar_arrive_cp_async(full_v(st));
        }
        cp_async_wait<0>();
    } else {
        consume(wg - 1);
    }
}

}  // namespace cuflash
