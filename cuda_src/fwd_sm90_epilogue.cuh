// The consumers' epilogue of the Hopper forward (fwd_sm90.cuh): normalise a
// work tile's rows, store O and the logsumexp, and for a split tile's
// segment (tail_split.cuh) its partial output, then the combine.
//   O /= l (times v_descale),  lse = (m * c + log2 l) * ln 2.
#pragma once
#include "fwd_sm90_mainloop.cuh"
#include "fwd_sm90_scheduler.cuh"
#include "named_barriers.cuh"
#include "tail_split.cuh"

namespace cuflash {

// A consumer warp's 32 bytes of shared memory that keep its work tile's
// words across the key loop: every lane stores the same values, and none is
// kept live in registers (at head dim 256 they went to local memory). The
// last word of a consumer's first warp holds the consumer's flag for a tail
// combine.
struct TileWords {
    // Byte offsets of the words (stored by the kernel as it takes a tile:
    // through a helper, ptxas ordered the segment's loads otherwise).
    enum : int { M0 = 0, HEAD = 4, BATCH = 8, KV_HEAD = 12, TILE = 16, SLOT = 20, N_BLOCKS = 24, COMBINE_FLAG = 28 };
    u32 addr;

    __device__ __forceinline__ Tile tile() const {
        return Tile{unstash_shared(addr + M0), unstash_shared(addr + HEAD), unstash_shared(addr + BATCH)};
    }
    __device__ __forceinline__ int kv_head() const { return unstash_shared(addr + KV_HEAD); }
    __device__ __forceinline__ int tile_index() const { return unstash_shared(addr + TILE); }
    __device__ __forceinline__ int slot() const { return unstash_shared(addr + SLOT); }
    __device__ __forceinline__ int n_blocks() const { return unstash_shared(addr + N_BLOCKS); }
    // The combine flag's word, in the words of the consumer's first warp.
    __device__ __forceinline__ u32 combine_flag(int warp) const { return addr - 32 * (warp & 3) + COMBINE_FLAG; }
};

// Where a tile's output rows go: O (batch, seq, head, dim; strides in
// elements) and the lse rows (batch, head, seq). Formed where used, not live
// across the key loop (at head dim 256 the consumers' registers are short).
struct FwdOutput {
    u16* o;
    float* lse;
    long long o_sb, o_sn, o_sh;
    int nq, nheads;

    __device__ __forceinline__ u16* o_tile(const Tile& tl) const { return o + tl.b * o_sb + tl.h * o_sh + tl.m0 * o_sn; }
    __device__ __forceinline__ float* lse_rows(const Tile& tl) const {
        return lse + ((long long)tl.b * nheads + tl.h) * nq + tl.m0;
    }
};

// A tile's rows as O and the lse index them (varlen: the packed rows, batch
// 0), and how many of its rows are in its sequence.
struct OutRows {
    Tile at;
    int valid;
};

// The split of the last wave (tail_split.cuh): partials workspace, the tiles'
// completion counters, and the item counts.
struct TailSplit {
    float* ws_o;
    float* ws_lse;
    int* tail_done;
    int full_tiles, tail_items, num_tiles;
};

// STAGE_O: this consumer's 64 rows go to its half of the staging tile (D / 64
// panels of the 128-byte swizzle; a quad writes one 16-byte chunk of a row,
// 8 rows in 8 distinct chunks: conflict-free), which one thread then hands to
// bulk tensor stores (rows past nq and columns past d are clipped by the
// tensor map), so that the consumer goes on to the next tile while they run.
// Otherwise (and for a varlen tile's rows that end inside it: the tensor map
// would not clip them at the sequence's end) each quad stores its 16
// contiguous bytes of a row straight to global memory. A split tile's segment (TAIL_SPLIT, slot >= 0) leaves its
// rows' partial output and lse in the workspace instead.
template <class T, bool TAIL_SPLIT, bool BF16_OUT, bool VARLEN>
__device__ __forceinline__ void fwd_sm90_epilogue(const SoftmaxAccumulators<T::D>& acc, const FwdSm90Smem<T>& sm,
                                                  TileWords words, FwdOutput out,
                                                  TailSplit split, const TmaDesc& map_o,
                                                  const float* descale_v, float dropout_scale, int nk, int d,
                                                  int nheads_kv, float qk_scale_log2, int c, int tid, int warp,
                                                  int lane, int warp_row0, bool stage_leader,
                                                  const OutRows& varlen_rows) {
    constexpr int D = T::D, BR = T::BR, BC = T::BC, NT_O = D / 8;
    constexpr bool STAGE_O = T::STAGE_O;
    // The tile's coordinates, kv head and segment from shared memory, the
    // fp8 output scale from global memory: none is kept live across the
    // key loop (at head dim 256 they went to local memory).
    // Varlen: the rows the consumer took with the tile (an equal-length tile's are re-formed from the words).
    const Tile tile = words.tile();
    const OutRows rows = VARLEN ? varlen_rows : OutRows{tile, out.nq - tile.m0};
    const Tile out_tile = rows.at;
    const int rows_valid = rows.valid;
    // dropout_scale: 1 / (1 - p) with dropout (the kept P enters P V unscaled), else 1.
    const float o_scale =
        (T::DTYPE == E4M3 ? descale_v[tile.b * nheads_kv + words.kv_head()] : 1.f) * dropout_scale;
    // Row scales and lse values first, so that only they stay live beside
    // O while it is stored; the lse rows are written once O is out.
    float inv[2], row_lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(acc.row_sum[r]);
        // l >= 1 (the row's largest score gives at least 2^0), so the fast
        // division is accurate to 2 ulp; the IEEE one calls a slow-path
        // routine whose registers the epilogue at head dim 256 cannot spare.
        inv[r] = l > 0.f ? __fdividef(o_scale, l) : 0.f;
        row_lse[r] = row_lse_of(acc.row_max[r], l, qk_scale_log2);
    }
    if constexpr (TAIL_SPLIT) {
        const int out_slot = words.slot();
        if (out_slot >= 0) {
            // A split tile's segment: its rows' partial output and lse go
            // to the workspace slot; the consumer whose segment completes
            // the tile half's key blocks (counted in tail_done, reset by
            // that consumer for the next launch) combines them.
            float* o_part = split.ws_o + (long long)out_slot * BR * D;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row0 + (lane >> 2) + 8 * r;
#pragma unroll
                for (int j = 0; j < NT_O; ++j)
                    *reinterpret_cast<float2*>(o_part + row * D + j * 8 + 2 * (lane & 3)) =
                        make_float2(acc.o[j * 4 + 2 * r] * inv[r], acc.o[j * 4 + 2 * r + 1] * inv[r]);
                if ((lane & 3) == 0) split.ws_lse[out_slot * BR + row] = row_lse[r];
            }
            // The consumer's stores, then one thread's release of them
            // (and acquire of the other segments') at GPU scope, as
            // CUTLASS's semaphores do: a fence per thread cost more.
            named_bar_sync<128>(own_barrier(FWD_CONSUMER_SYNC, c));
            const int split_tile = words.tile_index() - split.full_tiles, key_blocks = (nk + BC - 1) / BC;
            const u32 flag = words.combine_flag(warp);
            if (tid % 128 == 0) {
                int* done = split.tail_done + 2 * split_tile + c;
                const int seg_blocks = words.n_blocks();
                const bool last = atomic_add_acq_rel(done, seg_blocks) + seg_blocks == key_blocks;
                if (last) *done = 0;
                stash_shared(flag, last);
            }
            named_bar_sync<128>(own_barrier(FWD_CONSUMER_SYNC, c));
            if (unstash_shared(flag)) {
                combine_partials<BR, D, BF16_OUT>(
                    split.ws_o, split.ws_lse,
                    tail_slots(split_tile, split.num_tiles - split.full_tiles, split.tail_items, key_blocks),
                    warp_row0, out.o_tile(out_tile), out.o_sn, out.lse_rows(out_tile), rows_valid, d, lane);
            }
            return;
        }
    }
    extern __shared__ __align__(1024) unsigned char smem_raw[];  // the kernel's
    u16* o_stage = reinterpret_cast<u16*>(smem_raw + T::OFF_O) + c * 64 * D;
    // Uniform over the consumer's warpgroup.
    const bool staged = STAGE_O && (!VARLEN || c * 64 + 64 <= rows_valid);
    if constexpr (STAGE_O) {
        if (stage_leader) bulk_wait<0, true>();  // the last tile's stores have read the staging tile
        named_bar_sync<128>(own_barrier(FWD_CONSUMER_SYNC, c));
    } else {
        // Every lane has read the tile words before any lane of the warp
        // stores the next tile's (with STAGE_O and for split tiles a named
        // barrier orders them): docs/sanitizers.md.
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + (lane >> 2) + 8 * r;
        if (staged) {
#pragma unroll
            for (int j = 0; j < NT_O; ++j)
                *reinterpret_cast<u32*>(o_stage + tile_offset<64, D>(row - c * 64, j) + 2 * (lane & 3)) =
                    pack2<BF16_OUT>(acc.o[j * 4 + 2 * r] * inv[r], acc.o[j * 4 + 2 * r + 1] * inv[r]);
        } else {
            if (row >= rows_valid) continue;
            u16* o_row = out.o_tile(out_tile) + row * out.o_sn;
#pragma unroll
            for (int j = 0; j < NT_O; ++j) {
                const int col = j * 8 + 2 * (lane & 3);
                if (col < d)
                    *reinterpret_cast<u32*>(o_row + col) =
                        pack2<BF16_OUT>(acc.o[j * 4 + 2 * r] * inv[r], acc.o[j * 4 + 2 * r + 1] * inv[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + (lane >> 2) + 8 * r;
        if (row < rows_valid && (lane & 3) == 0) out.lse_rows(out_tile)[row] = row_lse[r];
    }
    if constexpr (STAGE_O) {
        fence_proxy_async();  // the staged rows, before the async proxy reads them
        named_bar_sync<128>(own_barrier(FWD_CONSUMER_SYNC, c));
        if (stage_leader && staged && c * 64 < rows_valid) {
            for (int p = 0; p < D / 64; ++p)
                tma_store_4d(map_o, sm.o() + c * 64 * D * 2 + p * 64 * 128, p * 64, out_tile.m0 + c * 64, out_tile.h,
                             out_tile.b);
            bulk_commit();
        }
    }
}

}  // namespace cuflash
