// Compile-time shape of one Hopper forward specialisation (fwd_sm90.cuh):
// tile sizes, the register split, and the shared-memory layout, which
// cuflash/config.py (FwdSm90Config.smem_layout) mirrors offset for offset
// (tests/test_smem_layout.py compiles the two against each other).
#pragma once
#include "sm90_tiles.cuh"

namespace cuflash {

template <int D_, int BC_, int STAGES_, int DTYPE_, bool STAGE_O_, bool ALIBI_B_, bool FROM_DIAGONAL_ = false>
struct FwdSm90Traits {
    static constexpr int D = D_, BC = BC_, STAGES = STAGES_, DTYPE = DTYPE_;
    static constexpr bool STAGE_O = STAGE_O_, ALIBI_B = ALIBI_B_;
    static constexpr bool FROM_DIAGONAL = FROM_DIAGONAL_;  // the key blocks' order (KeyOrder)
    static constexpr int ELEM = DTYPE == E4M3 ? 1 : 2;  // bytes per input element
    static constexpr int CONSUMERS = 2;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int BR = 64 * CONSUMERS;
    // Tiles are 128-byte-wide swizzled panels: PANEL_ELEMS elements per row.
    static constexpr int PANEL_ELEMS = 128 / ELEM;
    // Tile bytes, which are also each copy's transfer count (TMA writes whole boxes).
    static constexpr int Q_BYTES = BR * D * ELEM, KV_BYTES = BC * D * ELEM;
    // The output tile staged for its bulk tensor store (16-bit elements).
    static constexpr int O_BYTES = STAGE_O ? BR * D * 2 : 0;
    // full_q, empty_q, then full_k, full_v, empty_k, empty_v of each stage.
    static constexpr int BARRIERS = 2 + 4 * STAGES;
    // The segment in flight, handed from producer to consumers (4 ints:
    // tile, lo, hi, slot), and the producer's next segment (one int), then
    // a varlen segment's sequence (3 ints: SegmentSlot).
    static constexpr int SEGMENT_BYTES = 16, NEXT_BYTES = 16;
    // A word per consumer thread that orders its softmax before a wgmma wait
    // (order_before_wait), and 32 bytes per consumer warp that keep its work
    // tile's coordinates, kv head, index, segment slot and length across the
    // key loop (TileWords, fwd_sm90_epilogue.cuh).
    static constexpr int SINK_BYTES = 4 * 128 * CONSUMERS, TILE_WORDS_BYTES = 32 * 4 * CONSUMERS;
    // ALIBI_B (fwd_sm90.cuh): the B operand of ALiBi's column GEMM, a k16 x BC tile (k 0-7, then k 8-15).
    static constexpr int ALIBI_B_BYTES = ALIBI_B ? BC * 32 : 0;

    // Shared memory, in this order from the 1024-byte-aligned base.
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_K = OFF_Q + Q_BYTES;            // STAGES K tiles
    static constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;  // STAGES V tiles (fp8: Vt)
    static constexpr int OFF_O = OFF_V + STAGES * KV_BYTES;
    static constexpr int OFF_BARS = OFF_O + O_BYTES;
    static constexpr int OFF_SEGMENT = OFF_BARS + 8 * BARRIERS;
    static constexpr int OFF_NEXT = OFF_SEGMENT + SEGMENT_BYTES;
    static constexpr int OFF_SINK = OFF_NEXT + NEXT_BYTES;
    static constexpr int OFF_TILE_WORDS = OFF_SINK + SINK_BYTES;
    static constexpr int OFF_ALIBI_B = OFF_TILE_WORDS + TILE_WORDS_BYTES;
    static constexpr int SMEM_BYTES = OFF_ALIBI_B + ALIBI_B_BYTES;

    // Register split (setmaxnreg, SM90_ENTRY_REGS): 240 per consumer thread
    // only where the consumers need it (head dims 192 and 256: O alone is 96
    // and 128 registers); the producer spills below 40.
    static constexpr int ENTRY_REGS = SM90_ENTRY_REGS;
    static constexpr int CONSUMER_REGS = D >= 192 ? 240 : 232;
    static constexpr int PRODUCER_REGS = (1 + CONSUMERS) * ENTRY_REGS - CONSUMERS * CONSUMER_REGS;
    // k steps (32 bytes of each row) of the two GEMMs.
    static constexpr int KSTEPS_QK = D * ELEM / 32, KSTEPS_PV = BC * ELEM / 32;

    static_assert(D == 64 || D == 128 || D == 192 || D == 256, "wgmma n = head dim: 64, 128, 192 or 256");
    static_assert(BC == 64 || BC == 80 || BC == 96 || BC == 112 || BC == 128 || BC == 176 || BC == 192,
                  "wgmma n = BC: 64, 80, 96, 112, 128, 176 or 192 (tools/gen_wgmma.py)");
    static_assert(DTYPE != E4M3 || (BC % 64 == 0 && (D == 128 || D == 256)),
                  "fp8: 64-key panels of Vt, whole 128-byte panels of Q, K");
    static_assert(STAGES >= 1 && STAGES <= 4, "1 to 4 stages");
    static_assert(OFF_K % 1024 == 0 && OFF_V % 1024 == 0 && OFF_O % 1024 == 0 && KV_BYTES % 1024 == 0,
                  "tiles start on 1024-byte swizzle atoms");
    static_assert(OFF_BARS % 8 == 0 && OFF_SEGMENT % 16 == 0 && OFF_ALIBI_B % 16 == 0,
                  "mbarriers 8-byte, segment and ALiBi's B operand 16-byte aligned");
    static_assert(PRODUCER_REGS >= 24 && PRODUCER_REGS % 8 == 0, "setmaxnreg takes multiples of 8");
    static_assert(SMEM_BYTES <= SMEM_LIMIT, "tiles do not fit in shared memory");
};

// Shared-memory addresses of a forward CTA (T: FwdSm90Traits). Each region's
// start is formed from the previous one's (a chain of adds the compiler
// keeps as is; one sum per region from the base gave the kernel other
// instructions, some hoisted into its key loop).
template <class T>
struct FwdSm90Smem {
    u32 q_tile, k_ring, v_ring, o_tile, bars, empty_q_bar;

    __device__ __forceinline__ explicit FwdSm90Smem(u32 base)
        : q_tile(base + T::OFF_Q),
          k_ring(q_tile + (T::OFF_K - T::OFF_Q)),
          v_ring(k_ring + (T::OFF_V - T::OFF_K)),
          o_tile(v_ring + (T::OFF_O - T::OFF_V)),
          bars(o_tile + (T::OFF_BARS - T::OFF_O)),
          empty_q_bar(bars + 8) {}

    __device__ __forceinline__ u32 q() const { return q_tile; }
    __device__ __forceinline__ u32 k(int st) const { return k_ring + st * T::KV_BYTES; }
    __device__ __forceinline__ u32 v(int st) const { return v_ring + st * T::KV_BYTES; }
    __device__ __forceinline__ u32 o() const { return o_tile; }
    // mbarriers: the Q tile is in / has been read; stage st's K (V) tile is in / has been read.
    __device__ __forceinline__ u32 full_q() const { return bars; }
    __device__ __forceinline__ u32 empty_q() const { return empty_q_bar; }
    __device__ __forceinline__ u32 full_k(int st) const { return bars + 8 * (2 + st); }
    __device__ __forceinline__ u32 full_v(int st) const { return bars + 8 * (2 + T::STAGES + st); }
    __device__ __forceinline__ u32 empty_k(int st) const { return bars + 8 * (2 + 2 * T::STAGES + st); }
    __device__ __forceinline__ u32 empty_v(int st) const { return bars + 8 * (2 + 3 * T::STAGES + st); }
    __device__ __forceinline__ u32 segment_words() const { return bars + (T::OFF_SEGMENT - T::OFF_BARS); }
    __device__ __forceinline__ u32 next_segment() const { return segment_words() + (T::OFF_NEXT - T::OFF_SEGMENT); }
    // Consumer warp `cw` (0 .. 7): its tile words. (A consumer thread's sink
    // word is formed in the kernel: through a helper, the compiler folded the
    // sum otherwise and moved it out of the key loop.)
    __device__ __forceinline__ u32 tile_words(int cw) const {
        return segment_words() + (T::OFF_TILE_WORDS - T::OFF_SEGMENT) + 32 * cw;
    }
    __device__ __forceinline__ u32 alibi_b() const { return segment_words() + (T::OFF_ALIBI_B - T::OFF_SEGMENT); }
};

}  // namespace cuflash
