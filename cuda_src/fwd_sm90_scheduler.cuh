// Which work tile next, in the persistent Hopper forward (fwd_sm90.cuh).
//
// A work tile is BR query rows of one (batch, head). The producer takes work
// items: blockIdx.x first, then one ticket from a global counter per item
// taken. Items below full_tiles are whole tiles; the others are runs of the
// split tiles' key blocks (tail_split.cuh), one or two segments each. The
// producer hands each segment to the consumers through shared memory
// (SegmentSlot); a tile index past the last tells them to stop.
#pragma once
#include "common.cuh"
#include "seq_span.cuh"
#include "tail_split.cuh"

namespace cuflash {

// BR query rows from m0 of head h, batch b.
struct Tile {
    int m0, h, b;
};

// Work tile t -> (query block, head, batch): query blocks innermost, so that
// a head's K and V stay in L2 while its blocks run; under a causal mask the
// longest blocks first. Each warpgroup passes the block count itself: one
// computed before the register split (setmaxnreg) was kept in local memory
// at head dim 256.
template <int BR, bool CAUSAL>
__device__ __forceinline__ Tile tile_at(int t, int m_blocks, int nheads) {
    int m = t % m_blocks;
    if constexpr (CAUSAL) m = m_blocks - 1 - m;
    const int hb = t / m_blocks;
    return Tile{m * BR, hb % nheads, hb / nheads};
}

// The order in which a segment's key blocks [lo, hi) are visited: step i takes block(i). Descending,
// so that the masked blocks, the top n_masked, come first. FROM_DIAGONAL (ALiBi's column GEMM
// without a causal mask: fwd_sm90_kernel): the masked blocks (a partial last one), then from the
// block d that holds the tile's last row's diagonal key (`last_key`: i + diag of that row) down to
// lo, then up from d + 1. The first n_band of those hold the tile's diagonal (from `first_key`, the
// first row's): the rest lie on one side of every row's. Each side thus comes nearest block first,
// so a row's biased max is met early: descending, right of the diagonal every block raised it (by
// slope BC log2(e), above rescale_log2 for most heads' slopes) and O was rescaled at every step.
// d is formed without branches (max before the division): a branch here left the column GEMM's A
// word in a divergent path for ptxas, which then serialised the wgmmas (C7520).
template <bool FROM_DIAGONAL>
struct KeyOrder {
    int lo, hi, n_masked, d, n_band;
    __device__ __forceinline__ KeyOrder(int lo_, int hi_, int n_masked_, int first_key, int last_key, int bc)
        : lo(lo_), hi(hi_), n_masked(n_masked_), d(0), n_band(0) {
        if (FROM_DIAGONAL) {
            d = min(hi - n_masked - 1, max(lo, max(last_key, 0) / bc));
            n_band = min(d - max(lo, min(d, max(first_key, 0) / bc)) + 1, hi - lo - n_masked);
        }
    }
    __device__ __forceinline__ int block(int i) const {
        if (!FROM_DIAGONAL || i < n_masked) return hi - 1 - i;
        const int j = i - n_masked;  // past the masked blocks: d down to lo, then lo + j up from d + 1
        return j <= d - lo ? d - j : lo + j;
    }
};

// Tile t of tile_at's order for a tile: its inverse.
template <int BR, bool CAUSAL>
__device__ __forceinline__ int tile_index(const Tile& tile, int m_blocks, int nheads) {
    const int m = tile.m0 / BR;
    return (tile.b * nheads + tile.h) * m_blocks + (CAUSAL ? m_blocks - 1 - m : m);
}

// Varlen (a packed batch, seq_span.cuh): the producer's items run over the
// heads, and within a head over slots of BR query rows. Sequence b holds the
// slots [slot0(b), slot0(b) + ceil(nq_b / BR)), slot0(b) = cu_seqlens_q[b] / BR + b,
// at least its block count past the previous sequence's; so a head has
// total_q / BR + num_seqs slots, of which at most num_seqs are holes, and no
// tile spans two sequences. Item -> its tile and sequence (under a causal
// mask a sequence's longest blocks first), or false for a hole; nq, nk: the
// longest sequence's lengths. The tile's index in tile_at's order over the longest
// sequence's blocks (tile_index) is what the consumers receive.
template <int BR, bool CAUSAL>
__device__ __forceinline__ bool varlen_tile_at(int item, const ScoreModArgs& args, int nq, int nk, Tile& tile,
                                               SeqSpan& seq) {
    const int slots_per_head = args.total_q / BR + args.num_seqs;
    const int h = item / slots_per_head, slot = item - h * slots_per_head;
    int lo = 0, hi = args.num_seqs;  // slot0(lo) <= slot < slot0(hi): find the sequence
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(args.cu_seqlens_q + mid) / BR + mid <= slot)
            lo = mid;
        else
            hi = mid;
    }
    seq = seq_span<true>(args, lo, nq, nk);
    const int blocks = (seq.nq + BR - 1) / BR, m = slot - (seq.q0 / BR + lo);
    if (m < 0 || m >= blocks) return false;
    tile = Tile{(CAUSAL ? blocks - 1 - m : m) * BR, h, lo};
    return true;
}

// A segment's position in the producer's sequence: item x 2 + part (part 0
// or 1: an item of the split tiles may end in a second tile, tail_segment).
__device__ __forceinline__ int first_segment() { return 2 * blockIdx.x; }

// Draws the next item's ticket, once the current item's copies are issued.
// Every item taken draws one, so tickets run 0 .. num_items - 1 and the last
// one's holder resets the counter for the next launch (one counter per
// stream, cuflash/launch.py: StreamState). Drawn after the copies so that the ticket is not
// live across them (at head dim 256 the producer has 24 registers); the
// consumers are then STAGES key blocks behind, which hides the atomic's
// latency.
__device__ __forceinline__ int draw_next_segment(int* tile_counter, int num_items) {
    const int ticket = atomicAdd(tile_counter, 1);
    if (ticket == num_items - 1) atomicExch(tile_counter, 0);
    return 2 * (ticket + gridDim.x);
}

// The segment in flight, in shared memory: written by the producer's thread
// before it arrives on full_q, read by the consumers after their wait on
// full_q, rewritten only after every consumer thread has arrived on empty_q
// (which each does after its own last read of it: docs/sanitizers.md).
struct SegmentSlot {
    volatile int* words;  // tile, lo, hi, slot; then the producer's next segment; then SEQ
    // Varlen: the segment's sequence (first query row, query and key lengths),
    // past the producer's next-segment word (fwd_sm90_traits.cuh).
    static constexpr int SEQ = 5;

    __device__ __forceinline__ void publish(const Segment& seg) const {
        words[0] = seg.tile;
        words[1] = seg.lo;
        words[2] = seg.hi;
        words[3] = seg.slot;
    }
    __device__ __forceinline__ void publish_seq(const SeqSpan& seq) const {
        words[SEQ] = seq.q0;
        words[SEQ + 1] = seq.nq;
        words[SEQ + 2] = seq.nk;
    }
    __device__ __forceinline__ void publish_stop(int num_tiles) const { words[0] = num_tiles; }
    __device__ __forceinline__ int tile() const { return words[0]; }
    __device__ __forceinline__ int lo() const { return words[1]; }
    __device__ __forceinline__ int hi() const { return words[2]; }
    __device__ __forceinline__ int slot() const { return words[3]; }
    // k0 is the producer's alone: 0 here.
    __device__ __forceinline__ SeqSpan seq() const { return SeqSpan{words[SEQ], 0, words[SEQ + 1], words[SEQ + 2]}; }
};

}  // namespace cuflash
