"""The forward benchmark's rows: each shape checked once against a reference, then its libraries timed."""

from __future__ import annotations

import dataclasses
import math

import cupy

from cuflash.timing import describe, synchronize

from .checks import all_finite, compare
from .inputs import cupy_dtype, random_qkv
from .measure import input_sets, log, time_libraries
from .naive import REFERENCE_HEADS, naive_attention
from .shapes import flops_by_library, variant_fields

# (atol, rtol): pass when |out - ref| <= atol + rtol * |ref| everywhere.
# Two correct bf16 kernels can round a final output near 4 one bf16 ulp
# (2**-6) apart, more than the absolute 2e-2 alone allows; hence the rtol.
TOLERANCE = {"float16": (2e-2, 0.0), "bfloat16": (2e-2, 2.0**-7)}


def check_shape(shape, qkv, cuflash, reference) -> dict:
    """Run cuflash once and compare it with the reference (torch-flash, else float32 naive CuPy
    with cuflash's options); with dropout, which no reference draws alike, check only that it is finite."""
    atol, rtol = TOLERANCE[shape.dtype]
    try:
        with cuflash.context():
            out = cuflash.to_cupy(cuflash.prepare(*qkv, shape.causal)())
    except Exception as exc:
        return {"ok": False, "reference": None, "error": describe(exc)}
    if cuflash.variant.dropout > 0:
        return all_finite([out])
    ref = None
    if reference is not None:
        try:
            run = reference.prepare(*qkv, shape.causal)
            with reference.context():
                ref = reference.to_cupy(run())
            synchronize()
            name = reference.name
        except Exception as exc:
            log(f"  {reference.name} reference unavailable ({describe(exc)}); using float32 CuPy")
    if ref is None:
        sub = tuple(x[:1, :, :REFERENCE_HEADS] for x in qkv)
        ref = naive_attention(*sub, shape.causal, dtype=cupy.float32,
                              **cuflash.variant.reference_kwargs(shape.heads, REFERENCE_HEADS))
        out = out[:1, :, :REFERENCE_HEADS]
        name = "naive-cupy-fp32"
    result = compare(out, ref, atol, rtol)
    result["reference"] = name
    return result


def run_shape(shape, libs, reference, repeats, l2_bytes, tuned=None) -> dict:
    """Check and time one shape; libs[0] is cuflash (cuflash+opts in a run with options, checked against
    the float32 CuPy reference with them: pass reference None); `tuned`, one of `libs`, is checked too."""
    dtype = cupy_dtype(shape.dtype)
    set_bytes = 3 * dtype.itemsize * math.prod(shape.dims)  # q, k, v
    sets = input_sets(lambda seed: random_qkv(*shape.dims, dtype, seed), set_bytes, l2_bytes)
    row = dataclasses.asdict(shape)
    row.update(heads=shape.heads, batch=shape.batch, flops=shape.flops, input_sets=len(sets))
    row.update(variant_fields(shape, libs[0].variant))
    row["check"] = check_shape(shape, sets[0], libs[0], reference)
    if tuned is not None:
        row["check_tuned"] = check_shape(shape, sets[0], tuned, reference)
    row["libs"] = time_libraries(libs, shape.causal, sets, repeats, shape.flops,
                                 lib_flops=flops_by_library(shape, libs))
    mine = [libs[0]] + ([tuned] if tuned is not None else [])
    row["ok"] = (all(bool(row.get(c, {"ok": True})["ok"]) for c in ("check", "check_tuned"))
                 and all("tflops" in row["libs"][lib.name] for lib in mine))
    return row
