"""The benchmark's problems, after the FlashAttention papers: hidden size 2048 split into heads of 64 or 128,
sequence lengths 512..16k with batch * seqlen = 16k tokens, causal and not, fp16 and bf16."""

from __future__ import annotations

import dataclasses

from ..tune_common import TOKENS, benchmark_heads  # the workload the tuner times on too
from .variants import effective_window, visible_entries

HEADDIMS = (64, 128)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (2048, 8192)
DTYPES = ("float16", "bfloat16")
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}

# Forward+backward FLOPs per forward FLOP, the FlashAttention papers'
# convention: the forward's 2 GEMMs plus the backward's 5 (S recomputed, dP,
# dV, dQ, dK) = 7 = 3.5 x 2.
BWD_FLOPS_FACTOR = 3.5


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str
    headdim: int
    causal: bool
    seqlen: int

    @property
    def heads(self) -> int:
        return benchmark_heads(self.headdim)

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(batch, seqlen, heads, headdim): the (B, N, H, D) shape of q, k, v and out."""
        return self.batch, self.seqlen, self.heads, self.headdim

    @property
    def flops(self) -> float:
        """Forward FLOPs: 4 B H N^2 D, halved with the causal mask."""
        flops = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.headdim
        return flops / 2 if self.causal else flops

    @property
    def bwd_flops(self) -> float:
        """Forward+backward FLOPs."""
        return BWD_FLOPS_FACTOR * self.flops

    def variant_flops(self, variant) -> float:
        """Forward FLOPs under a Variant's options: 4 B H D times the exact count of visible
        (query, key) pairs with a window; the same as `flops` without one (a soft cap or ALiBi
        masks nothing, and `flops` keeps the papers' N^2 / 2 for the causal mask)."""
        if not variant.has_window:
            return self.flops
        visible = visible_entries(self.seqlen, self.seqlen, self.causal, variant.window)
        return 4.0 * self.batch * self.heads * self.headdim * visible


def variant_fields(shape: Shape, variant, per_forward: float = 1.0) -> dict:
    """A row's fields for a run with options (none without): the window it ran with, the share of the
    N x N scores its mask lets through, and cuflash+opts's FLOPs per call."""
    if not variant.enabled:
        return {}
    visible = visible_entries(shape.seqlen, shape.seqlen, shape.causal, variant.window)
    return {"window": list(effective_window(variant.window, shape.causal)) if variant.has_window else None,
            "visible": visible / shape.seqlen ** 2,
            "opts_flops": per_forward * shape.variant_flops(variant)}


def flops_by_library(shape: Shape, libs, per_forward: float = 1.0) -> dict:
    """FLOPs per call of each library that takes options (a `variant`), counted under its options;
    per_forward: FLOPs per forward FLOP (BWD_FLOPS_FACTOR for forward+backward)."""
    return {lib.name: per_forward * shape.variant_flops(lib.variant) for lib in libs if hasattr(lib, "variant")}


def build_shapes(dtypes, headdims, masks, seqlens) -> list[Shape]:
    """Every combination, in this nesting order, duplicates dropped."""
    return [
        Shape(dtype, headdim, causal, seqlen)
        for dtype in dict.fromkeys(dtypes)
        for headdim in dict.fromkeys(headdims)
        for causal in dict.fromkeys(masks)
        for seqlen in dict.fromkeys(seqlens)
    ]


def seqlen_label(n: int) -> str:
    """2048 -> "2k"; lengths that are not whole multiples of 1024 as they are."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
