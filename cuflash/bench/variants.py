"""Attention options the benchmark can switch on (--window, --softcap, --alibi, --dropout), with flash-attn's
semantics.

Imports nothing heavier than NumPy, so the command line and CPU tests use it freely.
"""

from __future__ import annotations

import dataclasses

import numpy

from ..score_mods import dropout_probability, softcap as checked_softcap, standard_alibi_slopes
from ..score_mods import window_size as checked_window_size

NO_WINDOW = (-1, -1)
# Every dropout call draws its mask from this seed and offset: the mask's values do not change its cost.
DROPOUT_SEED = 1234
DROPOUT_OFFSET = 0


def parse_window(text: str) -> tuple[int, int]:
    """--window's value: "LEFT,RIGHT", or "W" for (W, W); -1 leaves a side unbounded. ValueError if invalid."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        raise ValueError(f"expected W or LEFT,RIGHT, got {text!r}")
    left, right = checked_window_size([int(p) for p in parts], False)
    if (left, right) == NO_WINDOW:
        raise ValueError("a window needs a bound on at least one side")
    return left, right


def window_and_softcap(parser, window: str | None, softcap: float) -> tuple[tuple[int, int], float]:
    """The values of a command's --window (text or None) and --softcap; a usage error where invalid."""
    try:
        parsed = NO_WINDOW if window is None else parse_window(window)
    except ValueError as exc:
        parser.error(f"--window: {exc}")
    try:
        return parsed, checked_softcap(softcap)
    except ValueError as exc:
        parser.error(f"--softcap: {exc}")


def dropout_option(parser, value: float | None) -> float:
    """--dropout's probability (0.0 without the switch); a usage error unless 0 < P < 1."""
    if value is None:
        return 0.0
    try:
        prob = dropout_probability(value)
    except ValueError as exc:
        parser.error(f"--dropout: {exc}")
    if prob == 0:
        parser.error("--dropout: 0 is no dropout; give 0 < P < 1 or leave the switch out")
    return prob


def effective_window(window: tuple[int, int], causal: bool) -> tuple[int, int]:
    """The (left, right) window a call runs with: causal forces right = 0."""
    return (window[0], 0) if causal else window


def visible_entries(nq: int, nk: int, causal: bool, window: tuple[int, int] = NO_WINDOW) -> int:
    """Exact count of the (query, key) pairs the mask lets through, for one head.

    Query i sees key j iff (left < 0 or j >= i + nk - nq - left) and
    (right < 0 or j <= i + nk - nq + right); causal forces right = 0.
    """
    left, right = effective_window(window, causal)
    diagonal = numpy.arange(nq, dtype=numpy.int64) + (nk - nq)
    first = numpy.maximum(diagonal - left, 0) if left >= 0 else numpy.zeros(nq, numpy.int64)
    last = numpy.minimum(diagonal + right, nk - 1) if right >= 0 else numpy.full(nq, nk - 1, numpy.int64)
    return int(numpy.maximum(last - first + 1, 0).sum())


@dataclasses.dataclass(frozen=True)
class Variant:
    """The options of one benchmark run: a sliding window, a logit soft cap, ALiBi biases, dropout on the
    probabilities."""

    window: tuple[int, int] = NO_WINDOW
    softcap: float = 0.0
    alibi: bool = False
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.has_score_options or self.dropout > 0

    @property
    def has_score_options(self) -> bool:
        """A window, a soft cap or ALiBi: the options that change the scores (no torch peer takes them)."""
        return self.has_window or self.softcap > 0 or self.alibi

    @property
    def has_window(self) -> bool:
        return self.window != NO_WINDOW

    def describe(self) -> str:
        """E.g. "window (4096, 0), softcap 30, alibi, dropout 0.1"."""
        parts = [f"window ({self.window[0]}, {self.window[1]})"] if self.has_window else []
        parts += [f"softcap {self.softcap:g}"] if self.softcap > 0 else []
        parts += ["alibi"] if self.alibi else []
        return ", ".join(parts + ([f"dropout {self.dropout:g}"] if self.dropout > 0 else []))

    def kwargs(self, heads: int, causal: bool) -> dict:
        """cuflash.attention's keywords for these options on `heads` query heads (slopes as NumPy);
        only those that are set, so a plain Variant adds none."""
        kwargs = {}
        if self.has_window:
            kwargs["window_size"] = effective_window(self.window, causal)
        if self.softcap > 0:
            kwargs["softcap"] = self.softcap
        if self.alibi:
            kwargs["alibi_slopes"] = standard_alibi_slopes(heads)
        if self.dropout > 0:
            kwargs.update(dropout_p=self.dropout, seed=DROPOUT_SEED, offset=DROPOUT_OFFSET)
        return kwargs

    def reference_kwargs(self, heads: int, keep: int) -> dict:
        """naive_attention's (and its backward's) keywords for these options on the first `keep`
        of `heads` query heads (dropout aside: the reference draws no mask)."""
        return {"window": self.window, "softcap": self.softcap,
                "alibi_slopes": standard_alibi_slopes(heads)[:keep] if self.alibi else None}

    def to_json(self) -> dict:
        return {"window": list(self.window), "softcap": self.softcap, "alibi": self.alibi, "dropout": self.dropout}
