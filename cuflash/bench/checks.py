"""Correctness of a benchmarked call: outputs and gradients against a reference (or only finite, with
dropout), bitwise reproducibility."""

from __future__ import annotations

import math

import cupy

GRAD_NAMES = ("dq", "dk", "dv")


def compare(out, ref, atol: float, rtol: float) -> dict:
    """Max-abs error of ``out`` against ``ref``; passes if |d| <= atol + rtol*|ref|.

    NaN or Inf anywhere fails (the comparisons below are False for NaN).
    """
    out32 = out.astype(cupy.float32)
    ref32 = ref.astype(cupy.float32)
    diff = cupy.abs(out32 - ref32)
    max_abs = float(diff.max())
    excess = float((diff - rtol * cupy.abs(ref32)).max())
    ok = bool(excess <= atol) and math.isfinite(max_abs)
    return {"max_abs_err": max_abs, "atol": atol, "rtol": rtol, "ok": ok}


def compare_grads(grads, refs, rel: float, atol: float) -> dict:
    """Max-abs error of each gradient; passes if it is <= rel * max|ref| + atol.

    Gradients are larger than outputs and grow with the sequence length, so
    the tolerance scales with the reference's magnitude. NaN or Inf fails.
    """
    result = {"ok": True, "rel": rel, "atol": atol}
    worst = 0.0
    for name, g, r in zip(GRAD_NAMES, grads, refs):
        g32 = g.astype(cupy.float32)
        r32 = r.astype(cupy.float32)
        max_abs = float(cupy.abs(g32 - r32).max())
        ref_max = float(cupy.abs(r32).max())
        tol = rel * ref_max + atol
        ok = math.isfinite(max_abs) and max_abs <= tol
        result[name] = {"max_abs_err": max_abs, "ref_max_abs": ref_max, "tol": tol, "ok": ok}
        result["ok"] = result["ok"] and ok
        worst = max(worst, max_abs / tol) if math.isfinite(max_abs) else math.inf
    result["max_err_over_tol"] = worst
    return result


def all_finite(arrays) -> dict:
    """The check of outputs that no reference can match (dropout: each library draws its own mask):
    every value finite."""
    ok = all(bool(cupy.isfinite(x).all()) for x in arrays)
    return {"ok": ok, "reference": None, "all_finite": ok}


def same_bits(a, b) -> bool:
    """Bitwise equality of two arrays of one 2-byte dtype (NaN payloads included)."""
    return a.shape == b.shape and bool(cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16)))
