// Dropout's keep mask, a pure function of (seed, offset, b, h, i, j): every
// kernel family, tiling and pass regenerates the same mask from Philox4x32-7
// (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011: seven
// rounds, the fewest that pass BigCrush, and flash-attn's count), and
// cuflash.reference.dropout_keep_mask computes it on the host.
//
// One Philox call gives eight 16-bit halves, one per element: those of a unit of rows {r, r + 8}
// x columns {c, c + 1, c + 8, c + 9} of head bh = b * nheads + h (r with bit 3
// clear, c with bits 0 and 3 clear; a sequence's own positions under varlen).
// The half of (r + 8 a, c + b0 + 8 b1) is half b0 of word 2 a + b1 of the
// output for counter (r, c, bh, offset_lo) and key (seed_lo, seed_hi ^ offset_hi).
// In an mma accumulator a thread holds exactly one unit of each 16 x 16 tile
// (rows lane / 4 and + 8, columns 2 (lane % 4) + {0, 1, 8, 9}), and an output word's
// two halves are the two columns that one 16-bit register of P holds; in the dK/dV
// kernels, holding S^T, two lanes share two units (dropout_bits_t). Element (i, j) is
// kept when its draw, the low 14 bits of its half (DRAW_MASK2), is below dropout_threshold =
// round((1 - p) 2^14): 14-bit values and thresholds up to 2^14 are non-negative finite fp16
// bit patterns, which order as the integers do, so one fp16x2 compare (set.lt.u32.f16x2)
// decides two elements and yields the 16-bit masks that clear dropped P (keep_halves); with
// 16 bits the patterns past 0x7c00 are NaNs. The keep rate is within 2^-15 of 1 - p.
// Kept values are scaled by 1 / (1 - p). The seed and offset are the
// ScoreModArgs fields, or, in the kernels built with MOD_DROPOUT_STATE (the
// STATE arguments below), four words in device memory at dropout_state, read
// once per tile, so that a framework's random state or a CUDA graph replay can
// change the mask without the host. (A runtime choice between the two held the
// key in registers across the key loop and made ptxas spill up to 276 bytes
// more in the Hopper forward.)
#pragma once
#include "score_mods.cuh"

namespace cuflash {

constexpr int PHILOX_ROUNDS = 7;
constexpr u32 DRAW_MASK2 = 0x3fff3fffu;  // the draws (low 14 bits) of an output word's two halves

__device__ __forceinline__ uint4 philox4x32_7(uint4 c, uint2 key) {
#pragma unroll
    for (int round = 0; round < PHILOX_ROUNDS; ++round) {
        const u32 lo0 = c.x * 0xD2511F53u, hi0 = __umulhi(c.x, 0xD2511F53u);
        const u32 lo1 = c.z * 0xCD9E8D57u, hi1 = __umulhi(c.z, 0xCD9E8D57u);
        c = make_uint4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
        key.x += 0x9E3779B9u;
        key.y += 0xBB67AE85u;
    }
    return c;
}

// A call's Philox key, offset and keep threshold, read once per tile.
struct DropoutKey {
    u32 seed_lo, key_hi, offset_lo, threshold;  // key_hi: seed_hi ^ offset_hi
    __device__ __forceinline__ u32 threshold2() const { return threshold * 0x10001u; }  // in both halves
};

template <bool STATE>
__device__ __forceinline__ DropoutKey dropout_key(const ScoreModArgs& args) {
    if constexpr (STATE) {
        const uint4 s = __ldg(reinterpret_cast<const uint4*>(args.dropout_state));
        return DropoutKey{s.x, s.y ^ s.w, s.z, args.dropout_threshold};
    }
    return DropoutKey{args.dropout_seed_lo, args.dropout_seed_hi ^ args.dropout_offset_hi, args.dropout_offset_lo,
                      args.dropout_threshold};
}

// The draws of the unit at (r, c) of head bh.
__device__ __forceinline__ uint4 dropout_unit(const DropoutKey& key, int bh, int r, int c) {
    return philox4x32_7(make_uint4((u32)r, (u32)c, (u32)bh, key.offset_lo), make_uint2(key.seed_lo, key.key_hi));
}

// 0xffff in each 16-bit half of `word` whose draw keeps its element, else 0 (threshold2: the
// threshold in both halves; 14-bit values compared as fp16, see above).
__device__ __forceinline__ u32 keep_halves(u32 word, u32 threshold2) {
    u32 mask;
    asm("set.lt.u32.f16x2 %0, %1, %2;" : "=r"(mask) : "r"(word & DRAW_MASK2), "r"(threshold2));
    return mask;
}

// The keep bits of a thread's elements of an mma accumulator tile of NT n8 tiles: bit 4 j + e
// (of word (4 j + e) / 32) for element e of n8 tile j. Drawn before the scores they mask are in,
// so that the Philox rounds overlap the GEMM that computes them.
template <int NT>
struct KeepBits {  // KeepBits<NT>{}: none kept
    u32 words[(4 * NT + 31) / 32];
    __device__ __forceinline__ bool test(int i) const { return (words[i / 32] >> (i % 32)) & 1; }
};

// keep_halves of a unit's four words, each reduced to bit 0 (the low half's keep) and bit 16 (the high
// half's): word w's at bits 2 w and 2 w + 16 (one fp16x2 compare per two draws; dropout_bits,
// dropout_bits_t).
__device__ __forceinline__ u32 unit_keep_pairs(const uint4& unit, u32 threshold2) {
    const u32 words[4] = {unit.x, unit.y, unit.z, unit.w};
    u32 pairs = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) pairs |= (keep_halves(words[w], threshold2) & 0x00010001u) << (2 * w);
    return pairs;
}

// Each keep decision of a warp's 16-row tile of S (rows are queries), tile row0 and first column
// col0 (multiples of 16), as its unit is drawn: visit(i, keep) for element i = 4 j + e of n8 tile j.
// In S's accumulator layout a thread holds exactly one unit of each 16 x 16 tile; element e of n8
// tile 2 jj + t has word 2 (e / 2) + t's half e % 2 (unit_keep_pairs' bit 2 (2 (e / 2) + t) + 16 (e % 2)).
template <int NT, bool STATE, class Visit>
__device__ __forceinline__ void for_each_keep(const ScoreModArgs& args, int bh, int row0, int col0, int lane,
                                              Visit&& visit) {
    static_assert(NT % 2 == 0, "units span two n8 tiles");
    const DropoutKey key = dropout_key<STATE>(args);
    const u32 threshold2 = key.threshold2();
    const int r = row0 + (lane >> 2);
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
        const u32 pairs = unit_keep_pairs(dropout_unit(key, bh, r, col0 + 16 * jj + 2 * (lane & 3)), threshold2);
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                visit(4 * (2 * jj + t) + e, ((pairs >> (2 * (2 * (e >> 1) + t) + 16 * (e & 1))) & 1u) != 0);
    }
}

// The keep bits of a warp's 16-row tile of S: for n8 tile 2 jj + t, element e (row half e / 2,
// column e % 2) has word 2 (e / 2) + t's half e % 2, from unit_keep_pairs' bits 2 (2 (e / 2) + t) and + 16.
template <int NT, bool STATE>
__device__ __forceinline__ KeepBits<NT> dropout_bits(const ScoreModArgs& args, int bh, int row0, int col0, int lane) {
    static_assert(NT % 2 == 0, "units span two n8 tiles");
    const DropoutKey key = dropout_key<STATE>(args);
    const u32 threshold2 = key.threshold2();
    const int r = row0 + (lane >> 2);
    KeepBits<NT> bits{};
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
        const u32 pairs = unit_keep_pairs(dropout_unit(key, bh, r, col0 + 16 * jj + 2 * (lane & 3)), threshold2);
        const u32 folded = (pairs | (pairs >> 15)) & 0xffu;  // word w's low and high halves at bits 2 w, 2 w + 1
        // tile t's nibble: words t, then 2 + t (words 1 and 2 swap places)
        const u32 byte = (folded & 0xc3u) | ((folded & 0x0cu) << 2) | ((folded & 0x30u) >> 2);
        bits.words[jj / 4] |= byte << (8 * (jj % 4));
    }
    return bits;
}

// Dropout on an accumulator tile given its keep bits: dropped elements become 0, kept ones x `kept`.
template <int NT>
__device__ __forceinline__ void apply_dropout(float (&x)[NT][4], const KeepBits<NT>& bits, float kept) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[j][e] = bits.test(4 * j + e) ? x[j][e] * kept : 0.f;
}

// dP o M / (1 - p) - Delta for one element of the backward's dS = P o (dP o M / (1 - p) - Delta): one
// FMA by the kept scale or 0 (a select), where masking dP first took a multiply and a select and
// then a subtraction.
__device__ __forceinline__ float dropped_dp_minus(float dp, bool keep, float kept_scale, float delta) {
    return fmaf(dp, keep ? kept_scale : 0.f, -delta);
}

// Dropout on a warp's 16-row tile of S in fp32, each unit applied as it is drawn: dropped
// elements become 0, kept ones x `kept` (the sm_80 backward's dP).
template <bool STATE, int NT>
__device__ __forceinline__ void dropout_tile(float (&x)[NT][4], const ScoreModArgs& args, int bh, int row0, int col0,
                                             int lane, float kept) {
    for_each_keep<NT, STATE>(args, bh, row0, col0, lane, [&](int i, bool keep) {
        x[i / 4][i % 4] = keep ? x[i / 4][i % 4] * kept : 0.f;
    });
}

// The keep masks of a warp's 16-row tile of P packed as the A fragments of k16 steps (acc_to_a,
// AFragments; step kk holds columns col0 + 16 kk ..): register i of step kk is 0xffff in each
// 16-bit half whose element is kept. Register 0, 1, 2, 3 of a step holds (row r, columns c, c + 1),
// (r + 8, c), (r, c + 8), (r + 8, c + 8): words 0, 2, 1, 3 of its unit.
template <int STEPS>
struct PackedKeepMasks {
    u32 m[STEPS][4];
    // Dropped 16-bit values of steps p[0 .. STEPS) cleared, one AND a register; the kept ones'
    // 1 / (1 - p) is left to the output's row scale.
    __device__ __forceinline__ void apply(u32 (*p)[4]) const {
#pragma unroll
        for (int kk = 0; kk < STEPS; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) p[kk][i] &= m[kk][i];
    }
};

template <bool STATE, int STEPS>
__device__ __forceinline__ PackedKeepMasks<STEPS> dropout_masks(const ScoreModArgs& args, int bh, int row0, int col0,
                                                                int lane) {
    const DropoutKey key = dropout_key<STATE>(args);
    const u32 threshold2 = key.threshold2();
    const int r = row0 + (lane >> 2);
    PackedKeepMasks<STEPS> masks;
#pragma unroll
    for (int kk = 0; kk < STEPS; ++kk) {
        const uint4 unit = dropout_unit(key, bh, r, col0 + 16 * kk + 2 * (lane & 3));
        masks.m[kk][0] = keep_halves(unit.x, threshold2);
        masks.m[kk][1] = keep_halves(unit.z, threshold2);
        masks.m[kk][2] = keep_halves(unit.y, threshold2);
        masks.m[kk][3] = keep_halves(unit.w, threshold2);
    }
    return masks;
}

// Dropout on a warp's 16-row tile of P packed as A fragments, each unit drawn where it is applied.
template <bool STATE, int STEPS>
__device__ __forceinline__ void dropout_packed(u32 (&p)[STEPS][4], const ScoreModArgs& args, int bh, int row0,
                                               int col0, int lane) {
    dropout_masks<STATE, STEPS>(args, bh, row0, col0, lane).apply(p);
}

// The keep bits of a warp's 16 keys x 8 NT queries of S^T in the mma accumulator layout: keys
// key0 + lane / 4 + 8 (e / 2), queries query0 + 8 j + 2 (lane % 4) + e % 2 (key0 and query0
// multiples of 16). Lanes L and L ^ 4 hold the same queries and the two halves of the same units:
// for each pair of n8 tiles, those of queries q0 and q0 + 1 (q0 = query0 + 16 jj + 2 (L % 4)),
// each lane draws one of the two units (the lane with bit 2 clear, query q0's) and hands the
// partner the keep bits of the partner's half: one Philox call per eight elements, as in S.
template <int NT, bool STATE>
__device__ __forceinline__ KeepBits<NT> dropout_bits_t(const ScoreModArgs& args, int bh, int query0, int key0,
                                                       int lane) {
    static_assert(NT % 2 == 0, "units span two n8 tiles");
    const DropoutKey key = dropout_key<STATE>(args);
    const u32 threshold2 = key.threshold2();
    const int c = key0 + ((lane >> 2) & ~1), half = (lane >> 2) & 1;
    KeepBits<NT> bits{};
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
        // this lane's unit: query q0 + half (and + 8), keys c, c + 1, c + 8, c + 9
        const u32 pairs = unit_keep_pairs(dropout_unit(key, bh, query0 + 16 * jj + 2 * (lane & 3) + half, c),
                                          threshold2);
        // bit 4 t + 2 e1 (= 2 w for word w = 2 t + e1) of `own` / `partner`: the element of query + 8 t
        // and key + 8 e1 in this lane's / the partner's half (key c + half / c + 1 - half)
        const u32 own = (pairs >> (16 * half)) & 0x55u, partner = (pairs >> (16 * (half ^ 1))) & 0x55u;
        const u32 from_partner = __shfl_xor_sync(0xffffffffu, partner, 4);  // query q0 + (half ^ 1)'s unit
        // element e = 2 e1 + e0 of n8 tile 2 jj + t: query offset e0 comes from unit half == e0
        const u32 byte = (own << half) | (from_partner << (half ^ 1));
        bits.words[jj / 4] |= byte << (8 * (jj % 4));
    }
    return bits;
}

}  // namespace cuflash
