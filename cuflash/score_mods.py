"""The score options beyond softmax(Q K^T * scale): sliding window, softcap, ALiBi, the
block-diagonal mask of a packed batch of sequences (varlen), and dropout on P.

`ScoreMods` is what a call asked for, normalised, as dispatch and launch read
it: the kernels' MODS template bits and their `ScoreModArgs` parameter
(cuda_src/score_mods.cuh, where the semantics and the kernels' score units are
written down). `normalise` turns the entry points' arguments into one.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import numpy

from .compile import cpp_int_constant

# The MODS bits, read from their one home in the kernel sources.
MOD_WINDOW = cpp_int_constant("score_mods.cuh", "MOD_WINDOW")
MOD_SOFTCAP = cpp_int_constant("score_mods.cuh", "MOD_SOFTCAP")
MOD_ALIBI = cpp_int_constant("score_mods.cuh", "MOD_ALIBI")
MOD_VARLEN = cpp_int_constant("score_mods.cuh", "MOD_VARLEN")
MOD_DROPOUT = cpp_int_constant("score_mods.cuh", "MOD_DROPOUT")
MOD_DROPOUT_STATE = cpp_int_constant("score_mods.cuh", "MOD_DROPOUT_STATE")

LOG2E = math.log2(math.e)

# ScoreModArgs field for field (C++ layout: 8-byte aligned pointer and stride).
KERNEL_ARGS_DTYPE = numpy.dtype([
    ("window_left", "<i4"), ("window_right", "<i4"), ("tanh_scale", "<f4"), ("inv_score_log2", "<f4"),
    ("alibi_unit", "<f4"), ("alibi_slopes", "<u8"), ("alibi_batch_stride", "<i8"),
    ("cu_seqlens_q", "<u8"), ("cu_seqlens_k", "<u8"), ("total_q", "<i4"), ("total_k", "<i4"), ("num_seqs", "<i4"),
    ("dropout_seed_lo", "<u4"), ("dropout_seed_hi", "<u4"), ("dropout_offset_lo", "<u4"), ("dropout_offset_hi", "<u4"),
    ("dropout_threshold", "<u4"), ("dropout_scale", "<f4"), ("dropout_state", "<u8"),
    ("seqused_q", "<u8"), ("seqused_k", "<u8"), ("top_left", "<i4"),
], align=True)
# The 8-byte words of the packed struct that hold addresses (rewritten per call).
ALIBI_SLOPES_WORD = KERNEL_ARGS_DTYPE.fields["alibi_slopes"][1] // 8
CU_SEQLENS_Q_WORD = KERNEL_ARGS_DTYPE.fields["cu_seqlens_q"][1] // 8
CU_SEQLENS_K_WORD = KERNEL_ARGS_DTYPE.fields["cu_seqlens_k"][1] // 8
SEQUSED_Q_WORD = KERNEL_ARGS_DTYPE.fields["seqused_q"][1] // 8
SEQUSED_K_WORD = KERNEL_ARGS_DTYPE.fields["seqused_k"][1] // 8


@dataclasses.dataclass(frozen=True)
class Varlen:
    """A packed batch (cuda_src/seq_span.cuh): num_seqs sequences in total_q query and total_k key rows.
    top_left: every sequence's masks align to its top-left corner (query i's diagonal key is i: jax.nn's),
    not to its bottom-right one (i + nk - nq of its used lengths: flash-attn's)."""

    num_seqs: int
    total_q: int
    total_k: int
    top_left: bool = False


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Dropout with keep mask M of (seed, offset) (cuda_src/dropout.cuh): P o M / (1 - p). state: the
    device address of DROPOUT_STATE_WORDS uint32 words that hold the seed and offset instead (0: none),
    which the kernels read when they start."""

    p: float
    seed: int
    offset: int
    state: int = 0

    @property
    def threshold(self) -> int:
        """Draws (DROPOUT_DRAW_BITS bits) below this are kept."""
        return round((1.0 - self.p) * (1 << DROPOUT_DRAW_BITS))

    @property
    def words(self) -> tuple[int, int, int, int]:
        """The kernel arguments' four uint32 words: seed low, seed high, offset low, offset high."""
        return tuple(x >> shift & 0xFFFFFFFF for x in (self.seed, self.offset) for shift in (0, 32))

    @property
    def philox_words(self) -> tuple[int, int, int]:
        """(seed low, seed high ^ offset high, offset low): Philox's key and the counter's last word, as
        cuda_src/dropout.cuh's dropout_key forms them from the four words."""
        seed_lo, seed_hi, offset_lo, offset_hi = self.words
        return seed_lo, seed_hi ^ offset_hi, offset_lo


# A seed and offset held on the device: seed low, seed high, offset low, offset high (uint32).
DROPOUT_STATE_WORDS = 4

# Bits of each element's uniform draw, the low bits of a 16-bit half of a Philox output word (eight
# draws per call). 14: two draws compare as fp16 values at once (cuda_src/dropout.cuh), and the
# keep rate stays within 2^-15 of 1 - p, inside 4 sigma up to about 10^9 elements at p = 0.1
# (8 bits, as flash-attn draws, would leave it up to 1/512 off, beyond 4 sigma of a million).
DROPOUT_DRAW_BITS = 14
# dropout_p below this: its keep threshold (1 - p) 2^DROPOUT_DRAW_BITS rounds to one draw at least (from
# it up, every element would be dropped).
DROPOUT_P_LIMIT = 1.0 - 2.0 ** -(DROPOUT_DRAW_BITS + 1)
# softmax_scale at most MAX_FACTOR, softcap 0 or within a factor MAX_FACTOR of 1: the kernels take the
# scale (and scale / softcap) as float32 factors of the scores, where 1e39 overflowed to inf and gave NaN.
MAX_FACTOR_LOG2 = 60
MAX_FACTOR = 2.0 ** MAX_FACTOR_LOG2


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """window: (left, right) key offsets from a query's diagonal, -1 unbounded, None without a
    window (a causal mask is the call's `causal`, with right = 0); softcap: 0 = off; alibi: slopes
    given, their batch stride in elements (0 for shape (nheads,)); varlen: the packed batch's
    sequence count and total query and key rows, None for a batch of equal lengths."""

    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: bool = False
    alibi_batch_stride: int = 0
    varlen: Varlen | None = None
    dropout: Dropout | None = None

    @property
    def bits(self) -> int:
        """The kernels' MODS template argument."""
        return ((MOD_WINDOW if self.window is not None else 0) | (MOD_SOFTCAP if self.softcap else 0)
                | (MOD_ALIBI if self.alibi else 0) | (MOD_VARLEN if self.varlen is not None else 0)
                | (MOD_DROPOUT if self.dropout is not None else 0)
                | (MOD_DROPOUT_STATE if self.dropout is not None and self.dropout.state else 0))

    @property
    def tuned(self) -> bool:
        """Whether the autotuner measures calls with these options and its cache serves them: plain
        attention, windows, softcap and ALiBi do; varlen and dropout calls take dispatch's tables."""
        return self.varlen is None and self.dropout is None

    def score_log2(self, scale: float) -> float:
        """c, the kernels' exponent factor: P = 2^(u c - m c) for a score u in the kernels' units."""
        return (self.softcap if self.softcap else scale) * LOG2E

    def kernel_args(self, seqlen_q: int, seqlen_k: int, scale: float) -> numpy.ndarray:
        """ScoreModArgs as 8-byte words (the slopes' address left 0: launch points it per call)."""
        args = numpy.zeros((), KERNEL_ARGS_DTYPE)
        unbounded = seqlen_q + seqlen_k
        left, right = self.window if self.window is not None else (-1, -1)
        args["window_left"] = left if left >= 0 else unbounded
        args["window_right"] = right if right >= 0 else unbounded
        c = self.score_log2(scale)
        if self.softcap:
            args["tanh_scale"] = scale / self.softcap
            args["inv_score_log2"] = 1.0 / c
        args["alibi_unit"] = LOG2E / c
        args["alibi_batch_stride"] = self.alibi_batch_stride
        if self.varlen is not None:
            args["total_q"], args["total_k"], args["num_seqs"] = (self.varlen.total_q, self.varlen.total_k,
                                                                  self.varlen.num_seqs)
            args["top_left"] = self.varlen.top_left
        if self.dropout is not None:
            d = self.dropout
            (args["dropout_seed_lo"], args["dropout_seed_hi"], args["dropout_offset_lo"],
             args["dropout_offset_hi"]) = d.words
            args["dropout_threshold"] = d.threshold
            args["dropout_scale"] = 1.0 / (1.0 - d.p)
            args["dropout_state"] = d.state
        return numpy.frombuffer(args.tobytes(), numpy.uint64).copy()


NONE = ScoreMods()


def standard_alibi_slopes(heads: int) -> numpy.ndarray:
    """The standard ALiBi slopes 2^(-8 (h+1) / H), float32, shape (H,) (what the benchmark and the
    autotuner run ALiBi with)."""
    return (2.0 ** (-8.0 * numpy.arange(1, heads + 1) / heads)).astype(numpy.float32)


def window_size(value, causal: bool) -> tuple[int, int]:
    """(left, right) of a sliding window: None or a pair of ints >= -1, -1 meaning unbounded.
    An int is anything with __index__ but a bool: NumPy integers, and one-element integer tensors,
    which flash-attn's own tests pass (`torch.randint(0, seqlen_k, (2,))`).

    Query i sees key j iff j >= i + seqlen_k - seqlen_q - left (left >= 0) and
    j <= i + seqlen_k - seqlen_q + right (right >= 0); causal forces right = 0.
    """
    expected = "window_size must be a pair of ints >= -1 (-1: unbounded)"
    if value is None:
        left, right = -1, -1
    else:
        try:
            pair = tuple(value)
        except TypeError:
            raise TypeError(f"{expected}, got {type(value).__name__}") from None
        if len(pair) != 2 or any(isinstance(x, (bool, numpy.bool_)) for x in pair):
            raise TypeError(f"{expected}, got {value!r}")
        try:
            left, right = (operator.index(x) for x in pair)
        except TypeError:
            raise TypeError(f"{expected}, got {value!r}") from None
        if left < -1 or right < -1:
            raise ValueError(f"{expected}, got {value!r}")
    return left, 0 if causal else right


def softcap(value) -> float:
    """The softcap of a call: None, 0 (off), or a number in [1 / MAX_FACTOR, MAX_FACTOR]."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float, numpy.floating, numpy.integer)):
        raise TypeError(f"softcap must be a float >= 0 (0: off) or None, got {type(value).__name__}")
    cap = float(value)
    if not (cap == 0 or 1 / MAX_FACTOR <= cap <= MAX_FACTOR):  # also rejects NaN
        raise ValueError(f"softcap must be 0 (off) or a number in [2^-{MAX_FACTOR_LOG2}, 2^{MAX_FACTOR_LOG2}], "
                         f"got {value!r}")
    return cap


def dropout_probability(value) -> float:
    """The dropout_p of a call: a real in [0, DROPOUT_P_LIMIT); 0.0 means off."""
    if isinstance(value, bool) or not isinstance(value, (int, float, numpy.floating, numpy.integer)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(value).__name__}")
    prob = float(value)
    if not 0.0 <= prob < DROPOUT_P_LIMIT:  # also rejects NaN
        raise ValueError(f"dropout_p must be in [0, 1 - 2^-{DROPOUT_DRAW_BITS + 1}) (the keep masks draw "
                         f"{DROPOUT_DRAW_BITS}-bit numbers), got {value!r}")
    return prob


def from_top_left(seqlen_q: int, seqlen_k: int, causal: bool, window) -> tuple[int, tuple[int, int]]:
    """A mask aligned to the top-left corner (jax.nn.dot_product_attention's: query i sees key j <= i
    under causal, and i - left <= j <= i + right under a (left, right) window) in cuflash's terms,
    whose diagonal is bottom-right (i + seqlen_k - seqlen_q): (the keys to attend, a prefix of
    seqlen_k, and window_size over them). Keys past the last row's upper bound are cut, so that the
    two diagonals meet or the upper bound stays non-negative. window: None or a pair of ints >= 0
    (checked by the caller).
    Raises NotImplementedError where the lower bound would pass the last key for some rows (no key
    seen: jax.nn averages every value there, cuflash writes 0)."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0
    keys = seqlen_k if right < 0 else min(seqlen_k, seqlen_q + right)
    shift = keys - seqlen_q  # the bottom-right diagonal's offset from the top-left one
    if left >= 0 and left + shift < 0:
        raise NotImplementedError(f"local_window_size: with {seqlen_q} queries on {seqlen_k} keys a left window "
                                  f"of {left} leaves the last queries without a key")
    return keys, (-1 if left < 0 else left + shift, -1 if right < 0 else right - shift)


def queries_rotate_apart(causal: bool, window: tuple[int, int], capacity: int) -> bool:
    """Whether a KV-cache step's query row i takes its rotary angles at position cache_seqlens + i
    (True) or every row at cache_seqlens (False), flash-attn's convention for `flash_attn_with_kvcache`:
    apart where the step is causal or local, a bound of the (left, right) window in [0, capacity)
    (bounds at or past the cache's capacity count as unbounded)."""
    return bool(causal) or any(0 <= bound < capacity for bound in window)


def normalise(causal: bool, window: tuple[int, int], softcap: float, alibi_batch_stride: int | None,
              seqlen_q: int, seqlen_k: int, varlen: Varlen | None = None,
              dropout: Dropout | None = None) -> tuple[bool, ScoreMods]:
    """(causal, ScoreMods) for validated options at these lengths (varlen: the longest sequence's).

    A bound that every (query, key) pair passes is dropped (left >= seqlen_k - 1,
    right >= seqlen_q - 1; aligned to the top-left corner, left >= seqlen_q - 1 and
    right >= seqlen_k - 1), so such a window runs the plain kernel; a window
    whose right bound is 0 and left unbounded is the causal mask.
    """
    left, right = window
    if causal:
        right = 0
    top_left = varlen is not None and varlen.top_left
    if left >= (seqlen_q if top_left else seqlen_k) - 1:
        left = -1
    if right >= (seqlen_k if top_left else seqlen_q) - 1:
        right = -1
    if right == 0:
        causal = True
    window = None if left < 0 and (right < 0 or causal) else (left, right)
    alibi = alibi_batch_stride is not None
    return causal, ScoreMods(window, float(softcap), alibi, alibi_batch_stride or 0, varlen, dropout)
