"""What the tuning of every kernel family shares.

The cache key's layout, the shape a problem is timed on, random inputs, and
the lookup of a problem's tuned configuration (`TunedFamily.cached`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy

from . import tune_cache
from .arrays import numpy_dtype
from .score_mods import standard_alibi_slopes

# Lengths that are multiples of this run the even-length kernels of every
# candidate whose tile sides divide it, so the cache keeps those problems apart
# from the ragged ones, whose kernels carry boundary predicates. (The Hopper
# kernel's 192-key tiles do not divide it: both of their variants may run.)
TILE_ALIGN = 128

# The benchmark's shapes (cuflash/bench/shapes.py), which the tuner times on too: batch * seqlen
# tokens (constant across sequence lengths), hidden size.
TOKENS = 16384
HIDDEN = 2048


def benchmark_heads(headdim: int) -> int:
    """Heads of the benchmark's shapes: the hidden size over the head dim, rounded to the nearest
    (head dims 80, 96, 160 and 192 do not divide 2048; 192 gets 11 heads, 2112 columns)."""
    return max(1, round(HIDDEN / headdim))


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel a candidate config may launch for a problem's key."""

    family: str  # compile.FAMILY_HEADERS key
    name: str  # name expression
    smem_bytes: int  # dynamic shared memory at launch
    threads: int
    runs: bool = True  # launched by the problem itself (else only by other calls under its key)


def seqlen_bucket(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def aligned(problem) -> bool:
    return problem.seqlen_q % TILE_ALIGN == 0 and problem.seqlen_k % TILE_ALIGN == 0


def length_variants(problem, block_m: int, block_n: int) -> list[bool]:
    """The even_n values a kernel with these tiles may run under `problem`'s key; `problem`'s own first.

    A ragged key's calls may run either length variant.
    """
    even_n = problem.seqlen_q % block_m == 0 and problem.seqlen_k % block_n == 0
    tiles_divide = TILE_ALIGN % block_m == 0 and TILE_ALIGN % block_n == 0
    return [even_n] if aligned(problem) and tiles_divide else [even_n, not even_n]


def options_tag(mods) -> str | None:
    """The cache key's part for a problem's score options (None for plain attention).

    A window's sides are bucketed like the lengths (`w<left>,<right>`, inf where
    unbounded): its width decides how many key blocks a tile visits, which moves
    the best tile shape. Softcap and ALiBi are flags: their values and the
    slopes' layout change no kernel's work.
    """
    parts = []
    if mods.window is not None:
        parts.append("w" + ",".join("inf" if side < 0 else str(seqlen_bucket(side) if side else 0)
                                    for side in mods.window))
    if mods.softcap:
        parts.append("softcap")
    if mods.alibi:
        parts.append("alibi")
    return "+".join(parts) or None


def problem_key(family_name: str, problem, *extra: str) -> str:
    """`family/dtype/d<headdim>/<mask>/q<bucket>/k<bucket>/<even|ragged>[/extra...][/options]`.

    The user's head dim, not the kernel's: it decides whether the zero-padded
    variant runs. Left out: the GQA ratio (query heads only pick which K/V
    head a CTA reads; the tile trade-offs are the same), and batch and head
    counts (the benchmark's 16k tokens give every bucket several waves of CTAs).
    Problems with score options (`options_tag`) have keys of their own: their
    kernels are other specialisations, with other registers and spills.
    """
    tag = options_tag(problem.mods)
    return "/".join([
        family_name,
        problem.dtype_name,
        f"d{problem.headdim}",
        "causal" if problem.causal else "full",
        f"q{seqlen_bucket(problem.seqlen_q)}",
        f"k{seqlen_bucket(problem.seqlen_k)}",
        "even" if aligned(problem) else "ragged",
        *extra,
        *([tag] if tag else []),
    ])


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The rest of a call's shape: what the timing runs on, not part of the key."""

    batch: int
    nheads: int
    nheads_kv: int

    @classmethod
    def benchmark(cls, problem) -> CallShape:
        heads = benchmark_heads(problem.headdim)
        return cls(max(1, TOKENS // problem.seqlen_q), heads, heads)

    def shapes(self, problem) -> tuple[tuple, tuple]:
        """(q's shape, k's and v's shape)."""
        return ((self.batch, problem.seqlen_q, self.nheads, problem.headdim),
                (self.batch, problem.seqlen_k, self.nheads_kv, problem.headdim))


def randn(rng, shape, dtype_name: str):
    """Standard normal values in the problem's 16-bit dtype."""
    return rng.standard_normal(shape, dtype=numpy.float32).astype(numpy_dtype(dtype_name))


def poison(*arrays) -> None:
    """NaN in every element, so that a kernel that skips one is caught."""
    for x in arrays:
        if x.dtype == numpy.float32:
            x.fill(numpy.nan)
        else:
            x.view(numpy.uint16).fill(0x7FFF)  # a NaN in float16 and in bfloat16 alike


def default_scale(problem) -> float:
    return 1.0 / math.sqrt(problem.headdim)


def alibi_slopes(problem, nheads: int):
    """The standard ALiBi slopes for `nheads` heads on the current device, or None without ALiBi."""
    if not problem.mods.alibi:
        return None
    import cupy

    return cupy.asarray(standard_alibi_slopes(nheads))


class TunedFamily:
    """The cache lookup of a tuning family; subclasses give key() and config_from_dict()."""

    def key(self, problem) -> str:
        raise NotImplementedError

    def config_from_dict(self, fields: dict, problem):
        raise NotImplementedError

    def cached(self, problem) -> tuple[dict | None, object | None]:
        """(the cache entry for `problem` on the current device, its usable config)."""
        entry = tune_cache.get(tune_cache.current_device(), self.key(problem))
        if entry is None or not isinstance(entry.get("config"), dict):
            return entry, None
        return entry, self.config_from_dict(entry["config"], problem)
