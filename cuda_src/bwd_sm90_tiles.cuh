// The Hopper dK/dV kernels' work tiles (bwd_sm90.cuh, bwd_sm90_wide.cuh).
#pragma once
#include "common.cuh"

namespace cuflash {

// A dK/dV kernel's work tile t -> (key block, kv head, batch): key blocks
// innermost, so that the CTAs running together share a head's Q and dO in L2
// (under a causal mask a head's longest block first).
struct KvTile {
    int n_block, hk, b;
};

__device__ __forceinline__ KvTile kv_tile_at(int t, int n_blocks, int kv_heads) {
    const int hb = t / n_blocks;
    return KvTile{t - hb * n_blocks, hb % kv_heads, hb / kv_heads};
}

}  // namespace cuflash
