// The producer of the Hopper forward (fwd_sm90.cuh): one thread of warpgroup
// 0 copies each segment's Q tile (once the consumers have read the previous
// one) and then its K and V tiles of BC keys into the STAGES-deep ring with
// bulk tensor copies (TMA, 128-byte swizzle, see sm90_tiles.cuh), each
// completing on a "full" mbarrier, and refills a stage once the consumers
// have arrived on its "empty" barrier. The ring's position runs on across
// work tiles.
#pragma once
#include "fp8_prep.cuh"
#include "fwd_sm90_scheduler.cuh"
#include "fwd_sm90_traits.cuh"
#include "score_mods.cuh"
#include "seq_span.cuh"

namespace cuflash {

template <class T, bool CAUSAL, bool TAIL_SPLIT, class Mods>
__device__ __forceinline__ void fwd_sm90_produce(const FwdSm90Smem<T>& sm, const SegmentSlot& segment,
                                                 const TmaDesc& map_q, const TmaDesc& map_k, const TmaDesc& map_v,
                                                 int* tile_counter, int full_tiles, int tail_items, Mods mods,
                                                 const ScoreModArgs& mod_args, int group, int nheads, int num_tiles) {
    constexpr int BR = T::BR, BC = T::BC, D = T::D, STAGES = T::STAGES;
    tma_prefetch_desc(map_q);
    tma_prefetch_desc(map_k);
    tma_prefetch_desc(map_v);
    // The next segment waits in shared memory during the key loop (at head
    // dim 256 the producer has 24 registers).
    const u32 next_word = sm.next_segment();
    int kv_iter = 0, q_iter = 0;
    const int num_items = full_tiles + tail_items;
    for (int next = first_segment();; ++q_iter) {
        // Varlen: the item's tile, past any holes (each drawing the next ticket as a whole tile does).
        Tile varlen_tile{0, 0, 0};
        SeqSpan seq{0, 0, 0, 0};
        if constexpr (Mods::VARLEN) {
            while ((next >> 1) < num_items &&
                   !varlen_tile_at<BR, CAUSAL>(next >> 1, mod_args, mods.nq, mods.nk, varlen_tile, seq))
                next = draw_next_segment(tile_counter, num_items);
        }
        const int item = next >> 1, part = next & 1;
        if (q_iter > 0) mbar_wait(sm.empty_q(), (q_iter - 1) & 1);
        if (item >= num_items) {
            segment.publish_stop(num_tiles);
            mbar_arrive(sm.full_q());
            break;
        }
        // The lengths made opaque per tile: ptxas otherwise hoists the
        // tile arithmetic's invariants out of this loop, and at head dim
        // 256 (24 producer registers) kept them in local memory.
        mods.nq = opaque(mods.nq);
        mods.nk = opaque(mods.nk);
        mods.diag = mods.nk - mods.nq;
        const int nq_t = mods.nq, nk_t = mods.nk;
        Segment seg{item, 0, 0, -1, false};  // a whole tile; hi below
        if (TAIL_SPLIT && item >= full_tiles)
            seg = tail_segment(item, part, full_tiles, num_tiles - full_tiles, tail_items, (nk_t + BC - 1) / BC);
        Tile tile = tile_at<BR, CAUSAL>(seg.tile, (nq_t + BR - 1) / BR, nheads);
        // Varlen: the tensor maps' rows are the packed ones (batch 0), the masks the sequence's.
        int batch = tile.b;
        Mods tile_mods = mods;
        if constexpr (Mods::VARLEN) {
            tile = varlen_tile;
            seg.tile = tile_index<BR, CAUSAL>(tile, (nq_t + BR - 1) / BR, nheads);
            tile_mods.set_lengths(mod_args, seq.nq, seq.nk);
            batch = 0;
        }
        const int hk = tile.h / group;
        if (seg.slot < 0) {
            const KeyBlocks blocks = tile_mods.template key_blocks<BC>(tile.m0, BR);
            seg.lo = blocks.begin;
            seg.hi = blocks.end;
        }
        segment.publish(seg);
        if constexpr (Mods::VARLEN) segment.publish_seq(seq);
        stash_shared(next_word, seg.more ? next + 1 : -1);
        if (seg.hi == seg.lo) {  // the consumers write its empty rows
            mbar_arrive(sm.full_q());
        } else {
            // Q, K and 16-bit V: one box per 128-byte panel of the row
            // (tensor dims: head dim, seq, head, batch). fp8 Vt: one box of
            // 64 keys x D rows per panel (dims: keys, head dim, kv head, batch).
            mbar_arrive_expect_tx(sm.full_q(), T::Q_BYTES);
            for (int p = 0; p < D / T::PANEL_ELEMS; ++p)
                tma_load_4d(sm.q() + p * BR * 128, map_q, p * T::PANEL_ELEMS, seq.q0 + tile.m0, tile.h, batch,
                            sm.full_q());
            // Varlen fp8: the sequence's keys in Vt start at a multiple of VT_KEY_PAD (fp8_prep.cuh).
            const int vt_shift = (T::DTYPE == E4M3 && Mods::VARLEN) ? vt_key0(seq.k0, tile.b) - seq.k0 : 0;
            // The key blocks' order (the consumers form the same): the masked ones (a partial last block
            // where it lies in the segment) first.
            int n_masked = 0;
            if constexpr (T::FROM_DIAGONAL)
                n_masked = max(0, seg.hi - max(seg.lo, tile_mods.template key_blocks<BC>(tile.m0, BR).full_end));
            const int first_key = tile.m0 + tile_mods.diag;
            const KeyOrder<T::FROM_DIAGONAL> order(seg.lo, seg.hi, n_masked, first_key, first_key + BR - 1, BC);
            for (int n = seg.hi - 1, i = 0; n >= seg.lo; --n, ++i, ++kv_iter) {
                const int block = T::FROM_DIAGONAL ? order.block(i) : n;
                const int st = kv_iter % STAGES, use = kv_iter / STAGES, n0 = seq.k0 + block * BC;
                const u32 k_tile = sm.k(st), v_tile = sm.v(st);
                if (use > 0) mbar_wait(sm.empty_k(st), (use - 1) & 1);
                mbar_arrive_expect_tx(sm.full_k(st), T::KV_BYTES);
                for (int p = 0; p < D / T::PANEL_ELEMS; ++p)
                    tma_load_4d(k_tile + p * BC * 128, map_k, p * T::PANEL_ELEMS, n0, hk, batch, sm.full_k(st));
                if (use > 0) mbar_wait(sm.empty_v(st), (use - 1) & 1);
                mbar_arrive_expect_tx(sm.full_v(st), T::KV_BYTES);
                if constexpr (T::DTYPE == E4M3) {
                    for (int p = 0; p < BC / 64; ++p)
                        tma_load_4d(v_tile + p * D * 64, map_v, vt_shift + n0 + 64 * p, 0, hk, batch, sm.full_v(st));
                } else {
                    for (int p = 0; p < D / T::PANEL_ELEMS; ++p)
                        tma_load_4d(v_tile + p * BC * 128, map_v, p * T::PANEL_ELEMS, n0, hk, batch, sm.full_v(st));
                }
            }
        }
        next = unstash_shared(next_word);
        if (next >= 0) continue;  // the item's second segment
        next = draw_next_segment(tile_counter, num_items);
    }
}

}  // namespace cuflash
