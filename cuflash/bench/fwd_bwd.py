"""The forward+backward benchmark's rows: gradients checked against a reference and for bitwise
reproducibility (cuflash-det), then the libraries timed on one forward plus one backward."""

from __future__ import annotations

import dataclasses
import math

from cuflash.timing import describe, synchronize

from .checks import all_finite, compare_grads, same_bits
from .inputs import cupy_dtype, random_dout, random_qkv
from .measure import BWD_BUDGET_MS, input_sets, log, time_libraries
from .naive import REFERENCE_HEADS, naive_attention_backward
from .shapes import BWD_FLOPS_FACTOR, flops_by_library, variant_fields

# Gradient check: max |grad - ref| <= GRAD_REL * max |ref| + GRAD_ATOL, per
# gradient. Gradients are larger than outputs and grow with the sequence
# length (dk, dv sum over all query rows), hence the relative bound.
GRAD_REL = 2e-2
GRAD_ATOL = 1e-3


def _grads(lib, inputs, causal):
    with lib.context():
        grads = lib.to_cupy(lib.prepare(*inputs, causal)())
    synchronize()
    return grads


def check_shape_bwd(shape, inputs, cuflash, cuflash_det, reference) -> dict:
    """Gradients of cuflash and cuflash-det against the reference (torch-flash, else the float32 CuPy
    backward with cuflash's options; with dropout, which no reference draws alike, only that they are
    finite), and the bitwise reproducibility of cuflash-det. Returns check, check_det, determinism."""
    result = {}
    grads = {}
    try:
        grads["check"] = _grads(cuflash, inputs, shape.causal)
    except Exception as exc:
        result["check"] = {"ok": False, "reference": None, "error": describe(exc)}
    try:
        first = _grads(cuflash_det, inputs, shape.causal)
        second = _grads(cuflash_det, inputs, shape.causal)
        same = all(same_bits(a, b) for a, b in zip(first, second))
        result["determinism"] = "det ok" if same else "NONDET"
        grads["check_det"] = first
        del second
    except Exception as exc:
        result["check_det"] = {"ok": False, "reference": None, "error": describe(exc)}
        result["determinism"] = "error: " + describe(exc)
    if not grads:
        return result
    if cuflash.variant.dropout > 0:
        return result | {key: all_finite(gs) for key, gs in grads.items()}

    ref = None
    if reference is not None:
        try:
            ref = _grads(reference, inputs, shape.causal)
            name = reference.name
        except Exception as exc:
            log(f"  {reference.name} reference unavailable ({describe(exc)}); using float32 CuPy")
    if ref is None:
        q, k, v, dout = (x[:1, :, :REFERENCE_HEADS] for x in inputs)
        ref = naive_attention_backward(dout, q, k, v, shape.causal,
                                       **cuflash.variant.reference_kwargs(shape.heads, REFERENCE_HEADS))
        grads = {key: tuple(g[:1, :, :REFERENCE_HEADS] for g in gs) for key, gs in grads.items()}
        name = "naive-cupy-fp32"
    for key, gs in grads.items():
        result[key] = compare_grads(gs, ref, GRAD_REL, GRAD_ATOL)
        result[key]["reference"] = name
    return result


def run_shape_bwd(shape, libs, reference, repeats, l2_bytes) -> dict:
    """Check and time one shape forward+backward; libs[0] is cuflash, libs[1] cuflash-det (both +opts
    in a run with options: pass reference None)."""
    dtype = cupy_dtype(shape.dtype)
    set_bytes = 4 * dtype.itemsize * math.prod(shape.dims)  # q, k, v, dout
    sets = input_sets(lambda seed: (*random_qkv(*shape.dims, dtype, seed), random_dout(*shape.dims, dtype, seed)),
                      set_bytes, l2_bytes)
    row = dataclasses.asdict(shape)
    row.update(heads=shape.heads, batch=shape.batch, flops=shape.bwd_flops, fwd_flops=shape.flops,
               input_sets=len(sets))
    row.update(variant_fields(shape, libs[0].variant, BWD_FLOPS_FACTOR))
    row.update(check_shape_bwd(shape, sets[0], libs[0], libs[1], reference))
    row["libs"] = time_libraries(libs, shape.causal, sets, repeats, shape.bwd_flops, BWD_BUDGET_MS,
                                 lib_flops=flops_by_library(shape, libs, BWD_FLOPS_FACTOR))
    row["ok"] = (all(row.get(c, {"ok": True})["ok"] for c in ("check", "check_det"))
                 and row.get("determinism") == "det ok"
                 and all("tflops" in row["libs"][lib.name] for lib in libs[:2]))
    return row
