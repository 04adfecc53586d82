// Shared-memory tiles in the layout wgmma reads without swizzling.
//
// A ROWS x D tile of 16-bit elements is stored as 8 x 8 "core matrices" of
// 128 contiguous bytes (8 rows of 16 bytes), row groups outermost:
//   byte offset of (row, col) = ((row / 8) * (D / 8) + col / 8) * 128 + (row % 8) * 16 + (col % 8) * 2.
// Core matrices adjacent along the columns are 128 bytes apart, along the
// rows D * 16 bytes apart. The same bytes serve as a K-major operand (rows =
// M or N, columns = K: Q and K) and as an MN-major one (rows = K, columns = N:
// V), with the two strides exchanging roles in the descriptor.
#pragma once
#include "common.cuh"

namespace cuflash {

typedef unsigned long long u64;

template <int D>
__device__ __forceinline__ u32 cm_offset_bytes(int row, int col) {
    return (u32)((((row >> 3) * (D / 8) + (col >> 3)) << 7) + ((row & 7) << 4) + ((col & 7) << 1));
}

// wgmma shared-memory matrix descriptor, no swizzle: start address, leading
// and stride byte offsets, each encoded >> 4.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lead_bytes, u32 stride_bytes) {
    return (u64)((addr >> 4) & 0x3fff) | ((u64)((lead_bytes >> 4) & 0x3fff) << 16) |
           ((u64)((stride_bytes >> 4) & 0x3fff) << 32);
}

// Descriptor of a K-major operand's k16 step `ks` in a ROWS x D core-matrix
// tile, from row `row0` (a multiple of 8): the two core matrices along K are
// 128 B apart (leading), row groups D * 16 B apart (stride).
template <int D>
__device__ __forceinline__ u64 desc_k_major(u32 tile_addr, int row0, int ks) {
    return smem_desc(tile_addr + cm_offset_bytes<D>(row0, ks * 16), 128, D * 16);
}

// Descriptor of an MN-major B operand (K = tile rows, N = tile columns) for
// the k16 step `ks`: rows ks*16 .. +15, all D columns. Here the leading byte
// offset is the distance between core matrices along K (D * 16 B) and the
// stride the distance along N (128 B), the reverse of the K-major case
// (tests/test_sm90_gpu.py::test_wgmma_layouts checks it on a GPU).
template <int D>
__device__ __forceinline__ u64 desc_mn_major(u32 tile_addr, int ks) {
    return smem_desc(tile_addr + cm_offset_bytes<D>(ks * 16, 0), D * 16, 128);
}

// ---------------------------------------------------------------- 128B swizzle
// The tiles of common.cuh (tile_offset, D % 64 == 0) are exactly wgmma's
// 128-byte-swizzled layout: 64-column panels of ROWS rows, row r at r * 128 B,
// 16-byte chunk c at ((c ^ (r % 8)) * 16); each 8-row group is a 1024-byte
// swizzle atom (tile bases must be 1024-byte aligned).
__device__ __forceinline__ u64 smem_desc_sw128(u32 addr, u32 lead_bytes, u32 stride_bytes) {
    return smem_desc(addr, lead_bytes, stride_bytes) | (1ull << 62);
}

// K-major operand, k16 step `ks`, rows row0 .. (row0 a multiple of 8): k
// steps advance 32 B inside the panel's atoms; 8-row groups are 1024 B apart.
template <int ROWS>
__device__ __forceinline__ u64 desc_k_major_sw128(u32 tile_addr, int row0, int ks) {
    return smem_desc_sw128(tile_addr + (ks >> 2) * (ROWS * 128) + row0 * 128 + (ks & 3) * 32, 16, 1024);
}

// MN-major B operand (K = tile rows, N = tile columns), k16 step `ks`: rows
// ks*16 .. +15 of every panel. LEAD / STRIDE: byte distances of the
// descriptor (tests/test_sm90_gpu.py::test_wgmma_layouts fixes which is which).
template <int ROWS, int LEAD, int STRIDE>
__device__ __forceinline__ u64 desc_mn_major_sw128(u32 tile_addr, int ks) {
    return smem_desc_sw128(tile_addr + ks * 16 * 128, LEAD, STRIDE);
}

// Global -> shared copy of a ROWS x D tile into the core-matrix layout. Lanes
// 0-7 of a warp fill the 8 rows of one core matrix (128 contiguous bytes: no
// bank conflicts) and consecutive groups of 8 lanes the next 16-byte column
// chunks, so a warp reads 8 rows x 64 bytes of global memory. Each thread's
// addresses advance by constant steps (few live registers: the producer
// warpgroup runs on a small register budget). Rows at or past rows_valid and
// columns at or past d are zero-filled.
template <int ROWS, int D, int THREADS, bool CHECK_ROWS, bool CHECK_COLS>
__device__ __forceinline__ void load_tile_cm_async(u32 smem, const u16* gmem, long long row_stride, int rows_valid,
                                                   int d, int tid) {
    constexpr int CHUNKS = D / 8, GROUPS = THREADS / 8;
    static_assert(GROUPS % CHUNKS == 0 || CHUNKS % GROUPS == 0, "lane groups must tile the column chunks");
    constexpr int RG_STEP = GROUPS >= CHUNKS ? GROUPS / CHUNKS : 1;  // row groups advanced per pass
    constexpr int CREP = GROUPS >= CHUNKS ? 1 : CHUNKS / GROUPS;      // chunks per thread per row group
    static_assert((ROWS / 8) % RG_STEP == 0, "lane groups must tile the row groups");
    const int g = tid >> 3, r8 = tid & 7;
    const int chunk0 = g % CHUNKS, rg0 = GROUPS >= CHUNKS ? g / CHUNKS : 0;
    const u16* src = gmem + (rg0 * 8 + r8) * row_stride + chunk0 * 8;
    u32 dst = smem + cm_offset_bytes<D>(rg0 * 8 + r8, chunk0 * 8);
#pragma unroll
    for (int rg = rg0; rg < ROWS / 8; rg += RG_STEP) {
        const int row = rg * 8 + r8;
#pragma unroll
        for (int cj = 0; cj < CREP; ++cj) {
            const int chunk = chunk0 + cj * GROUPS;
            const bool valid = (!CHECK_ROWS || row < rows_valid) && (!CHECK_COLS || chunk * 8 < d);
            cp_async_16(dst + cj * GROUPS * 128, valid ? src + cj * GROUPS * 8 : gmem, valid);
        }
        src += RG_STEP * 8 * row_stride;
        dst += RG_STEP * CHUNKS * 128;
    }
}

// Orders this thread's completed cp.async / st.shared writes before later
// reads by the tensor cores' async proxy (wgmma); a barrier must follow.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---------------------------------------------------------------- mbarriers
// A barrier completes a phase when `count` arrivals have happened; waiters
// name the phase by its parity (0 for the 1st, 3rd, ... completion).
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have
// landed; the arrival is counted in the barrier's initial count (.noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` counts the
// threads that sync plus those that arrive.
template <int THREADS>
__device__ __forceinline__ void named_bar_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void named_bar_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

// Hand registers from the producer warpgroup to the consumers (sm_90a; needs a
// register cap at kernel entry, from __launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace cuflash
