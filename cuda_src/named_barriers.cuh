// Named barrier IDs of the Hopper kernels (bar.sync / bar.arrive; ID 0 is
// __syncthreads). Each kernel numbers its own; a per-consumer barrier is
// `first ID + c` for consumer warpgroup c (0 or 1), and handing a turn to the
// other consumer arrives on `first ID + (1 - c)`.
#pragma once

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

__device__ __forceinline__ int own_barrier(int first, int c) { return first + c; }
__device__ __forceinline__ int other_barrier(int first, int c) { return first + (1 - c); }

}  // namespace cuflash
