// Tile helpers shared by the cuflash kernel families: PTX wrappers for the
// sm_80+ tensor-core path (mma.sync, ldmatrix, cp.async), numeric helpers and
// the swizzled shared-memory tile layout. NVRTC-safe: no standard headers.
#pragma once

namespace cuflash {

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// A bool as a type, to select a template branch from a generic lambda's argument.
template <bool B>
struct BoolConst {
    static constexpr bool value = B;
};

// ln 2 and log2 e: the kernels' exponentials and logarithms are base 2,
// exp(x) = 2^(x log2 e) and ln(x) = log2(x) ln 2.
constexpr float LN2 = 0.6931471805599453f;
constexpr float LOG2E = 1.4426950408889634f;

// The most dynamic shared memory a block may opt into on any target (Hopper,
// 227 KB); the host checks the device's own limit before a launch.
constexpr int SMEM_LIMIT = 227 * 1024;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000u); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

// ---------------------------------------------------------------- cp.async
// 16-byte global -> shared copy; when `valid` is false nothing is read and the
// destination is zero-filled (src-size 0), so out-of-range rows hold zeros.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------- ldmatrix
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---------------------------------------------------------------- mma.sync
// c += a * b for one m16n8k16 tile, fp32 accumulation. A is row-major 16x16
// (4 regs of 2 elements), B is "col" 16x8 (2 regs), C/D 16x8 fp32 (4 regs).
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats -> one register of two 16-bit values, `lo` in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// One register of two 16-bit values -> two floats (low half first).
template <bool BF16>
__device__ __forceinline__ float2 unpack2(u32 x) {
    if constexpr (BF16) {
        return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
    } else {
        float lo, hi;
        asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }\n"
            : "=f"(lo), "=f"(hi)
            : "r"(x));
        return make_float2(lo, hi);
    }
}

// ---------------------------------------------------------------- launch order
// Programmatic dependent launch (sm_90; no-ops before): a kernel the host
// launches with programmatic stream serialization may start while the
// stream's previous kernel still runs. wait_prior_grid returns once that
// kernel has completed and its writes are visible; a kernel so launched calls
// it before it reads what the previous kernel wrote. allow_next_grid lets the
// stream's next such kernel be scheduled once every CTA of this one has called
// it (or exited).
__device__ __forceinline__ void wait_prior_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------- thread-block clusters
// (sm_90; the host launches clusters there only, and an earlier build traps.) cluster_sync: every
// thread of the cluster's CTAs arrives, and the shared-memory writes before it are seen by the
// cluster's reads after it. ld_cluster: a float (or four) at this CTA's shared-memory address
// `addr` in the cluster's CTA `rank` (distributed shared memory).
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ int cluster_rank() {
    u32 rank = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
    return (int)rank;
}
__device__ __forceinline__ float ld_cluster(u32 addr, int rank) {
    float x = 0.f;
#if __CUDA_ARCH__ >= 900
    asm volatile("{ .reg .u32 r; mapa.shared::cluster.u32 r, %1, %2; ld.shared::cluster.f32 %0, [r]; }\n"
                 : "=f"(x)
                 : "r"(addr), "r"(rank)
                 : "memory");
#endif
    return x;
}
__device__ __forceinline__ float4 ld_cluster4(u32 addr, int rank) {
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    asm volatile("{ .reg .u32 r; mapa.shared::cluster.u32 r, %4, %5; ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [r]; }\n"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                 : "r"(addr), "r"(rank)
                 : "memory");
#endif
    return x;
}

// ---------------------------------------------------------------- numerics
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float log2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Reductions over the 4 lanes of a quad: in an mma accumulator the 4 lanes
// lane&~3 .. lane|3 together hold one row.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A 4 x 4 transpose across a quad: lane p holds w[i] = word i of row p before,
// word p of row i after (two butterfly exchanges, 4 shuffles). In an mma
// accumulator lane p holds columns 2p, 2p + 1 of each 8-column tile; given the
// packed pairs of tiles 4g .. 4g + 3, lane q ends with the 8 columns of tile
// 4g + q, to store as 16 contiguous bytes.
__device__ __forceinline__ void quad_transpose(u32 (&w)[4], int lane) {
    const bool odd = lane & 1, high = lane & 2;
    // Partner lane ^ 1: the off-diagonal words of each 2 x 2 block.
    const u32 a = __shfl_xor_sync(0xffffffffu, odd ? w[0] : w[1], 1);
    const u32 b = __shfl_xor_sync(0xffffffffu, odd ? w[2] : w[3], 1);
    if (odd) w[0] = a, w[2] = b;
    else w[1] = a, w[3] = b;
    // Partner lane ^ 2: the off-diagonal 2 x 2 blocks.
    const u32 x = __shfl_xor_sync(0xffffffffu, high ? w[0] : w[2], 2);
    const u32 y = __shfl_xor_sync(0xffffffffu, high ? w[1] : w[3], 2);
    if (high) w[0] = x, w[1] = y;
    else w[2] = x, w[3] = y;
}

// Row r (0 or 1) of a thread's mma accumulator tile, NT 8-column tiles
// (acc[j * 4 + 2 r + e] holds column 8 j + 2 (lane & 3) + e), times `scale`,
// to the 16-bit row `dst` (16-byte aligned), 16 bytes a lane: quad_transpose
// gives lane q the 8 columns of tile 4g + q. Columns from d on are not
// written (d a multiple of 8), nor is a row that is not `valid`; every lane
// takes part in the shuffles. (With 4-byte stores, a quad's 16 bytes of a
// row, the Hopper dK/dV epilogue held 8% of the consumers' warp samples,
// half of them waiting on the store queue: ncu, H100, 8 x 2k x 16 heads of 128.)
template <bool BF16, int NT>
__device__ __forceinline__ void store_acc_row(const float (&acc)[NT * 4], int r, float scale, u16* dst, bool valid,
                                              int d, int lane) {
    static_assert(NT % 4 == 0, "whole groups of four 8-column tiles");
#pragma unroll
    for (int g = 0; g < NT / 4; ++g) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = 4 * g + i;
            w[i] = pack2<BF16>(acc[j * 4 + 2 * r] * scale, acc[j * 4 + 2 * r + 1] * scale);
        }
        quad_transpose(w, lane);
        const int col = 8 * (4 * g + (lane & 3));
        if (valid && col < d) *reinterpret_cast<uint4*>(dst + col) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// threadIdx.x, read afresh: the compiler cannot hoist what is derived from it
// out of a loop. For per-thread copy addresses that are cheap to recompute
// but would otherwise stay live across a register-bound main loop (and spill).
__device__ __forceinline__ int thread_index_volatile() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return t;
}

// ---------------------------------------------------------------- smem tiles
// A ROWS x D tile of 16-bit elements is stored as D/PW column panels of PW
// elements (PW = 64 when D % 64 == 0, else 32). Within a panel each row is
// PW*2 bytes; its 16-byte chunks are XOR-swizzled with the row so that the 8
// row addresses of one ldmatrix phase (same chunk column, 8 consecutive rows)
// fall into 8 distinct 16-byte bank groups: conflict-free loads and stores.
template <int ROWS, int D>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
    static_assert(D % 32 == 0, "tile head dim must be a multiple of 32");
    if constexpr (D % 64 == 0) {
        return (chunk >> 3) * (ROWS * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
    } else {
        return (chunk >> 2) * (ROWS * 32) + row * 32 + (((chunk & 3) ^ ((row >> 1) & 3)) << 3);
    }
}

// Byte offsets of the 16-byte chunks one lane addresses in ldmatrix calls over
// a tile: (row_base + row_lane, chunk_base + chunk_bit) with row_base a
// multiple of 8 and chunk_base even, both compile-time constants in unrolled
// loops. The swizzle then depends on the lane alone, so each address is one of
// NB per-lane registers plus an immediate offset (instead of one register per
// distinct (row, chunk) the loops touch). A chunk offset known only at run time
// (a warp's column slice) goes into the constructor's `chunk0`, never into
// at(): indexing `base` with a run-time value would put it in local memory.
// (Folding it in is exact: tile_offset(row, c + CPP) = tile_offset(row, c) +
// ROWS * PW, the next panel.)
template <int ROWS, int D>
struct LaneOffsets {
    static constexpr int PW = D % 64 == 0 ? 64 : 32;  // panel width in elements
    static constexpr int CPP = PW / 8;                // chunks per panel row
    static constexpr int NB = CPP / 2;
    u32 base[NB];

    __device__ __forceinline__ LaneOffsets(int row_lane, int chunk_bit, int chunk0 = 0) {
#pragma unroll
        for (int i = 0; i < NB; ++i) base[i] = 2 * tile_offset<ROWS, D>(row_lane, chunk0 + ((2 * i) | chunk_bit));
    }
    __device__ __forceinline__ u32 at(int row_base, int chunk_base) const {
        return base[(chunk_base % CPP) / 2] + 2 * ((chunk_base / CPP) * ROWS * PW + row_base * PW);
    }
};

// Global -> shared copy of a ROWS x D tile with cp.async. When the threads
// cover whole rows, each thread owns one 16-byte chunk column and every
// (THREADS / CHUNKS)-th row, so its addresses advance by constant strides.
// Rows at or past `rows_valid` and columns at or past `d` are zero-filled
// (CHECK_ROWS / CHECK_COLS off: the caller guarantees the tile is in range).
template <int ROWS, int D, int THREADS, bool CHECK_ROWS, bool CHECK_COLS>
__device__ __forceinline__ void load_tile_async(u16* smem, const u16* gmem, long long row_stride, int rows_valid,
                                                int d, int tid) {
    constexpr int CHUNKS = D / 8;
    const u32 base = smem_addr(smem);
    if constexpr (THREADS % CHUNKS == 0) {
        constexpr int ROW_STEP = THREADS / CHUNKS;
        const int chunk = tid % CHUNKS, row0 = tid / CHUNKS;
        const bool col_ok = !CHECK_COLS || chunk * 8 < d;
        const u16* src = gmem + row0 * row_stride + chunk * 8;
#pragma unroll
        for (int it = 0; it < (ROWS + ROW_STEP - 1) / ROW_STEP; ++it) {
            const int row = row0 + it * ROW_STEP;
            if (ROWS % ROW_STEP != 0 && row >= ROWS) break;
            const bool valid = col_ok && (!CHECK_ROWS || row < rows_valid);
            cp_async_16(base + 2 * tile_offset<ROWS, D>(row, chunk), valid ? src : gmem, valid);
            src += ROW_STEP * row_stride;
        }
    } else {
        constexpr int TOTAL = ROWS * CHUNKS;
#pragma unroll
        for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
            const int i = tid + it * THREADS;
            if (TOTAL % THREADS != 0 && i >= TOTAL) break;
            const int row = i / CHUNKS, chunk = i % CHUNKS;
            const bool valid = (!CHECK_ROWS || row < rows_valid) && (!CHECK_COLS || chunk * 8 < d);
            cp_async_16(base + 2 * tile_offset<ROWS, D>(row, chunk), valid ? gmem + row * row_stride + chunk * 8 : gmem,
                        valid);
        }
    }
}

// Shared -> global copy of a ROWS x D tile with 16-byte stores, skipping rows
// at or past `rows_valid` and columns at or past `d`.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void store_tile(u16* gmem, const u16* smem, long long row_stride, int rows_valid, int d,
                                           int tid) {
    constexpr int CHUNKS = D / 8;
    constexpr int TOTAL = ROWS * CHUNKS;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
        const int i = tid + it * THREADS;
        if (TOTAL % THREADS != 0 && i >= TOTAL) break;
        const int row = i / CHUNKS, chunk = i % CHUNKS;
        if (row < rows_valid && chunk * 8 < d) {
            *reinterpret_cast<uint4*>(gmem + row * row_stride + chunk * 8) =
                *reinterpret_cast<const uint4*>(smem + tile_offset<ROWS, D>(row, chunk));
        }
    }
}

// A row's logsumexp (natural log) from its running max m and sum l, c the exponent factor:
// (m c + log2 l) ln 2; -inf for a row that saw no key (l = 0), +inf for one whose largest
// score is +inf, NaN for a row with a NaN score (l is NaN), as the float64 reference gives.
__device__ __forceinline__ float row_lse_of(float m, float l, float c) {
    if (l == 0.f) return neg_inf();
    return m == pos_inf() ? pos_inf() : (m * c + log2_approx(l)) * LN2;
}

// Output of query rows that see no key: O = 0, lse = -inf.
template <int BR, int D, int THREADS>
__device__ __forceinline__ void write_empty_rows(u16* o_tile, long long o_sn, float* lse_rows, int rows_valid,
                                                 int d, int tid) {
    for (int i = tid; i < BR * (D / 8); i += THREADS) {
        const int row = i / (D / 8), chunk = i % (D / 8);
        if (row < rows_valid && chunk * 8 < d)
            *reinterpret_cast<uint4*>(o_tile + row * o_sn + chunk * 8) = make_uint4(0, 0, 0, 0);
    }
    for (int row = tid; row < BR; row += THREADS)
        if (row < rows_valid) lse_rows[row] = neg_inf();
}

}  // namespace cuflash
