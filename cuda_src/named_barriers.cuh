// Named barrier IDs of the Hopper kernels (bar.sync / bar.arrive; ID 0 is
// __syncthreads). Each kernel numbers its own; a per-consumer barrier is
// `first ID + c` for consumer warpgroup c (0 or 1), and handing a turn to the
// other consumer arrives on `first ID + (1 - c)`.
#pragma once
#include "sm90_tiles.cuh"

namespace cuflash {

// fwd_sm90_kernel.
enum FwdNamedBarrier : int {
    // Ping-pong: consumer c may issue its GEMMs (256 threads: c syncs, the other arrives).
    FWD_GEMM_TURN = 1,
    // Consumer c's own 128 threads: staged output tile, tail-split partials.
    FWD_CONSUMER_SYNC = 3,
    // Softmax turns: consumer c may compute its softmax step (256 threads).
    FWD_SOFTMAX_TURN = 5,
};

// bwd_sm90_kernel.
enum BwdNamedBarrier : int {
    // Both consumers' dS^T tiles are in shared memory (256 threads).
    BWD_DS_STORED = 1,
};

// bwd_sm90_wide_kernel.
enum BwdWideNamedBarrier : int {
    // Both consumers' halves of a step's P and dS tiles are in shared memory (256 threads).
    BWD_WIDE_TILES_STORED = 1,
};

// decode_kernel's wgmma tiles (decode_sm80.cuh).
enum DecodeNamedBarrier : int {
    // The row warps' threads, not the copy warps': Q's tile written, then read.
    DECODE_ROW_WARPS = 1,
    // Ping-pong of two row warpgroups: c may issue its GEMMs (256 threads; IDs 2 and 3).
    DECODE_GEMM_TURN = 2,
    // The copy warps' threads: the new rows they appended are in the cache.
    DECODE_COPY_WARPS_APPENDED = 4,
};

__device__ __forceinline__ int own_barrier(int first, int c) { return first + c; }
__device__ __forceinline__ int other_barrier(int first, int c) { return first + (1 - c); }

// The consumers' turns, each on a pair of named barriers (GEMM_TURN and SOFTMAX_TURN: the first IDs
// of the pairs; the forward's FwdNamedBarrier by default):
// consumer c begins a turn with a sync on its own barrier and ends it with an
// arrival on the other's. Consumer 1 opens the first turns for consumer 0
// (open); consumer 0 takes a last sync at the end for consumer 1's last
// hand-over (close), so that every arrival has a matching sync.
// - GEMM_TURNS (ping-pong): the consumers take turns issuing their GEMMs (a
//   tile's last P V is issued outside the turns), so one's softmax runs while
//   the other's GEMMs execute. Without it each consumer issues as soon as its
//   tiles are in (faster at head dim 64 up to 2k keys and for fp8 at head dim
//   128, slower elsewhere: dispatch.py; a tuner choice).
// - SOFTMAX_TURNS (fp8 at head dim 128 without a mask and without ping-pong):
//   the consumers take turns computing a softmax step, so that one's
//   exponentials run on the MUFU pipe while the other's GEMMs run. There the
//   exponentials hold the MUFU pipe as long as the step's GEMMs hold the
//   tensor cores (16 per clock per SM against the fp8 rate), and without
//   turns the consumers fell in phase (ncu: both pipes 52% busy). Measured
//   with ncu (SM active cycles, H100): -3% at 2k-16k; turns around the
//   exponentials only, +3.5%; under the causal mask, +4.5% (bench/PERFLOG.md v21).
template <bool GEMM_TURNS, bool SOFTMAX_TURNS, int GEMM_TURN = FWD_GEMM_TURN, int SOFTMAX_TURN = FWD_SOFTMAX_TURN>
struct ConsumerTurns {
    int c;

    __device__ __forceinline__ void begin_gemms() const {
        if constexpr (GEMM_TURNS) named_bar_sync<256>(own_barrier(GEMM_TURN, c));
    }
    __device__ __forceinline__ void end_gemms() const {
        if constexpr (GEMM_TURNS) named_bar_arrive<256>(other_barrier(GEMM_TURN, c));
    }
    __device__ __forceinline__ void begin_softmax() const {
        if constexpr (SOFTMAX_TURNS) named_bar_sync<256>(own_barrier(SOFTMAX_TURN, c));
    }
    __device__ __forceinline__ void end_softmax() const {
        if constexpr (SOFTMAX_TURNS) named_bar_arrive<256>(other_barrier(SOFTMAX_TURN, c));
    }
    __device__ __forceinline__ void open() const {
        if (GEMM_TURNS && c == 1) named_bar_arrive<256>(GEMM_TURN);
        if (SOFTMAX_TURNS && c == 1) named_bar_arrive<256>(SOFTMAX_TURN);
    }
    __device__ __forceinline__ void close() const {
        if (c == 0) begin_gemms();
        if (SOFTMAX_TURNS && c == 0) named_bar_sync<256>(SOFTMAX_TURN);
    }
};

}  // namespace cuflash
