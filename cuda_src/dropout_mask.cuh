// Dropout's keep mask written out, one byte an element (cuflash.dropout_keep_mask): what every
// attention kernel draws for (seed, offset), from the same functions (dropout.cuh), so that a test
// can check a call against a reference given the mask the kernels used, as flash-attn's
// return_attn_probs allows. Not a fast path.
#pragma once
#include "dropout.cuh"

namespace cuflash {

constexpr int DROPOUT_MASK_THREADS = 256;

// keep: (heads, seqlen_q, seqlen_k) bytes, contiguous, heads = batch * nheads (bh as the kernels
// number heads; under varlen a sequence's own positions). One thread a unit (dropout.cuh): a 16 x 16
// tile holds 32 units, unit u at rows {r, r + 8} and columns {c, c + 1, c + 8, c + 9} with
// r = u / 4 and c = 2 (u % 4) in the tile; `units` = heads x tiles x 32.
__global__ void __launch_bounds__(DROPOUT_MASK_THREADS)
    dropout_mask_kernel(unsigned char* keep, long long units, int seqlen_q, int seqlen_k, u32 seed_lo, u32 key_hi,
                        u32 offset_lo, u32 threshold) {
    const long long index = (long long)blockIdx.x * DROPOUT_MASK_THREADS + threadIdx.x;
    if (index >= units) return;
    const int col_tiles = (seqlen_k + 15) / 16;
    const long long tiles_per_head = (long long)((seqlen_q + 15) / 16) * col_tiles;
    const long long tile = index / 32;
    const int unit = (int)(index % 32);
    const int bh = (int)(tile / tiles_per_head);
    const int tile_in_head = (int)(tile % tiles_per_head);
    const int r = (tile_in_head / col_tiles) * 16 + unit / 4;
    const int c = (tile_in_head % col_tiles) * 16 + 2 * (unit % 4);
    const DropoutKey key{seed_lo, key_hi, offset_lo, threshold};
    // word w = 2 a + b1 of the unit holds rows r + 8 a, columns c + 8 b1 (+ b0 for its high half):
    // its keeps at bits 2 w (low half) and 2 w + 16 (high half)
    const u32 pairs = unit_keep_pairs(dropout_unit(key, bh, r, c), key.threshold2());
    unsigned char* head = keep + (long long)bh * seqlen_q * seqlen_k;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int row = r + 8 * a;
        if (row >= seqlen_q) continue;
#pragma unroll
        for (int b1 = 0; b1 < 2; ++b1)
#pragma unroll
            for (int b0 = 0; b0 < 2; ++b0) {
                const int col = c + 8 * b1 + b0;
                if (col < seqlen_k)
                    head[(long long)row * seqlen_k + col] = (pairs >> (2 * (2 * a + b1) + 16 * b0)) & 1u;
            }
    }
}

}  // namespace cuflash
