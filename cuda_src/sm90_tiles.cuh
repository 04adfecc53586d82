// Hopper helpers: element types, wgmma shared-memory descriptors for the
// 128-byte-swizzled tiles of common.cuh, bulk tensor copies (TMA), the
// async-proxy fence, mbarriers, named barriers and setmaxnreg.
#pragma once
#include "common.cuh"

namespace cuflash {

// Element types of the Hopper kernels (the DTYPE template argument).
enum : int { F16 = 0, BF16 = 1, E4M3 = 2 };

// wgmma shared-memory matrix descriptor: start address, leading and stride
// byte offsets, each encoded >> 4 (swizzle mode in bits 62-63, set below).
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lead_bytes, u32 stride_bytes) {
    return (u64)((addr >> 4) & 0x3fff) | ((u64)((lead_bytes >> 4) & 0x3fff) << 16) |
           ((u64)((stride_bytes >> 4) & 0x3fff) << 32);
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

// ---------------------------------------------------------------- 64B swizzle
// Panels of ROWS rows of 64 bytes, row r at r * 64 B, 16-byte chunk c at
// ((c ^ ((r / 2) % 4)) * 16): each 8-row group is a 512-byte swizzle atom, as
// TMA writes a box of 64-byte rows with CU_TENSOR_MAP_SWIZZLE_64B. K-major
// operand, 32-byte k step `ks`: two steps per panel, panels ROWS * 64 B apart.
template <int ROWS>
__device__ __forceinline__ u64 desc_k_major_sw64(u32 tile_addr, int ks) {
    return smem_desc(tile_addr + (ks >> 1) * (ROWS * 64) + (ks & 1) * 32, 16, 512) | (2ull << 62);
}

// MN-major B operand (K = tile rows, N = tile columns), k16 step `ks`: rows
// ks*16 .. +15 of every panel; LEAD and STRIDE are the descriptor's byte
// offsets (for V: panel distance and 8-row atom distance).
template <int LEAD, int STRIDE>
__device__ __forceinline__ u64 desc_mn_major_sw128(u32 tile_addr, int ks) {
    return smem_desc_sw128(tile_addr + ks * 16 * 128, LEAD, STRIDE);
}

// Stores x to this thread's word of shared memory at `sink`, so that the
// arithmetic x depends on is done before a later wgmma.wait_group: ptxas keeps
// shared-memory stores in order with the wait but moves arithmetic freely
// across it, and (SASS of the forward) placed the wait for P V before the
// softmax meant to run under it.
__device__ __forceinline__ void order_before_wait(u32 sink, float x) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sink), "f"(x) : "memory");
}

// Orders shared-memory writes this thread has observed (its own, or others'
// through a barrier or mbarrier wait) before its later reads through the
// async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// x, hidden from the compiler at this point, so that arithmetic on it is not
// hoisted out of the enclosing loop (to be kept live there, or spilled).
__device__ __forceinline__ int opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

// A word kept in shared memory rather than in a register across a long loop
// (by one thread, or by every lane of a warp storing the same value): the
// accesses are opaque to the compiler, which would otherwise keep the value
// live, or spill it to local memory.
__device__ __forceinline__ void stash_shared(u32 addr, int x) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(x));
}
__device__ __forceinline__ int unstash_shared(u32 addr) {
    int x;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(x) : "r"(addr));
    return x;
}

// ---------------------------------------------------------------- A fragments
// Four fp32 values as e4m3 bytes, x0 in the lowest byte.
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | ((u32)hi << 16);
}

// A 64 x BC accumulator tile (e.g. the softmax numerators P of the forward)
// rounded to the input type as the A fragments of a register-sourced wgmma
// (e.g. O += P V): for 16-bit types one k16 step per two 8-column tiles; for fp8 one
// k32 step per four tiles, k slot 4 * (lane % 4) + i holding column
// 2 * (lane % 4) + {0, 1, 8, 9}[i] (+16 in the upper half): the key order of Vt.
template <int DTYPE, int BC>
struct AFragments {
    static constexpr int STEPS = DTYPE == E4M3 ? BC / 32 : BC / 16;
    u32 r[STEPS][4];

    __device__ __forceinline__ void pack(const float (&s)[BC / 2]) {
#pragma unroll
        for (int kk = 0; kk < STEPS; ++kk) {
            if constexpr (DTYPE == E4M3) {
                const float* a = s + 16 * kk;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float* lo = a + 8 * half;  // 8-column tiles 4kk + 2 half, +1
                    r[kk][2 * half] = pack4_e4m3(lo[0], lo[1], lo[4], lo[5]);
                    r[kk][2 * half + 1] = pack4_e4m3(lo[2], lo[3], lo[6], lo[7]);
                }
            } else {
                const float* a = s + 8 * kk;
                r[kk][0] = pack2<DTYPE == BF16>(a[0], a[1]);
                r[kk][1] = pack2<DTYPE == BF16>(a[2], a[3]);
                r[kk][2] = pack2<DTYPE == BF16>(a[4], a[5]);
                r[kk][3] = pack2<DTYPE == BF16>(a[6], a[7]);
            }
        }
    }
};

// ---------------------------------------------------------------- bulk tensor copies
// A CUtensorMap (cuTensorMapEncodeTiled, cuflash/tma.py): 128 opaque bytes,
// passed by value as a __grid_constant__ kernel parameter so that its
// generic address is valid for cp.async.bulk.tensor.
struct alignas(64) TmaDesc {
    u64 opaque[16];
};

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global
// memory to shared memory at `dst`, counted on mbarrier `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// dst[i] += src[i] for `bytes` / 4 floats, from shared memory to global memory
// (element-wise atomic adds; both addresses 16-byte aligned, bytes a multiple
// of 16). Completes in the issuing thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups are pending: READ, until
// their sources have been read (the shared memory may be rewritten); else
// until they have completed.
template <int N, bool READ>
__device__ __forceinline__ void bulk_wait() {
    if constexpr (READ)
        asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
    else
        asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Copies the box at coordinates (c0 innermost .. c3) of the tensor map into
// shared memory at `dst`; the bytes are counted on mbarrier `bar`
// (out-of-range elements arrive as zeros and are counted too).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc& map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Copies shared memory at `src` (laid out as tma_load_4d would write the box)
// to the box at coordinates (c0 innermost .. c3) of the tensor map; elements
// past a dim's end are not written. Completes in the issuing thread's bulk
// group (bulk_commit, bulk_wait).
__device__ __forceinline__ void tma_store_4d(const TmaDesc& map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     reinterpret_cast<u64>(&map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc& map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&map)) : "memory");
}

// ---------------------------------------------------------------- mbarriers
// A barrier completes a phase when `count` arrivals have happened; waiters
// name the phase by its parity (0 for the 1st, 3rd, ... completion).
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialised barriers visible to the async proxy (the TMA unit).
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` and adds `bytes` to the transfer count its phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives on `bar` once this thread's cp.async copies issued so far have landed (one arrival a
// thread, counted in the barrier's init count: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(u32 bar) {
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

// A consumer warp's arrival on `bar` (counted once per warp) after all its
// lanes are done: __syncwarp orders every lane's earlier accesses before lane
// 0's arrival, which releases them to the thread that waits on `bar`. For
// barriers that free tiles only wgmma reads (the async proxy, ordered by
// wgmma_wait before the arrival).
__device__ __forceinline__ void warp_arrive(u32 bar, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
}

// Arrivals of each consumer thread (the barrier counts 128 per consumer
// warpgroup): for barriers that free shared words every lane reads with
// ordinary loads (the backward's lse2 and Delta rows). Each thread's own
// arrival releases its own loads to the producer that waits, a chain
// compute-sanitizer's racecheck follows; the chain through a warp's
// __syncwarp and lane 0's arrival it does not follow, and it reported the
// producer's next writes as hazards against the other lanes' loads.
__device__ __forceinline__ void thread_arrive(u32 bar) {
    mbar_arrive(bar);
}

// Named barriers (ids 1..15, named_barriers.cuh; 0 is __syncthreads): `threads` counts the
// threads that sync plus those that arrive.
template <int THREADS>
__device__ __forceinline__ void named_bar_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void named_bar_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

// Registers per thread at entry of the Hopper kernels (__launch_bounds__(384,
// 1): 65536 / 384, rounded down to a multiple of 8), which their warpgroups
// then split with setmaxnreg: producer + 2 x consumer <= 3 x SM90_ENTRY_REGS
// (a consumer's increase waits for registers the producer gave back: more
// would hang). `python -m cuflash check` verifies the entry allocation.
constexpr int SM90_ENTRY_REGS = 168;

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
