"""Forward-pass benchmark: ``python -m cuflash bench [options]``.

Shapes follow the FlashAttention papers: hidden size 2048 split into heads of
64 or 128, sequence lengths 512..16k with batch * seqlen = 16k tokens, causal
and not, fp16 and bf16. Each shape is checked for correctness once (cuflash
against torch's flash backend, or against a float32 CuPy reference when torch
is missing), then timed for cuflash and its peers:

* ``naive-cupy``: unfused attention in CuPy, in the input dtype: a batched
  cuBLAS GEMM writes the N x N scores, a row softmax, a second GEMM;
* ``torch-flash`` / ``torch-cudnn``: ``scaled_dot_product_attention`` pinned to
  the FlashAttention-2 or cuDNN backend, on zero-copy views of the same data.

With ``--tuned`` a ``cuflash-tuned`` column shows cuflash with autotuned
configurations next to ``cuflash`` on the heuristic table alone (shapes that
the tuning cache lacks are tuned first, outside the timed calls).

The result is a table of TFLOP/s on stdout (progress goes to stderr), an
optional JSON file with every raw number, and a second table with the peak
extra memory of one forward call. The exit status is non-zero if cuflash
failed or disagreed with the reference on any shape.

With ``--backward`` the timed call is one forward (``return_lse=True``) plus
one backward for a fixed random output gradient, counted as 3.5 forward
passes of FLOPs, on the same shapes:

* ``cuflash`` / ``cuflash-det``: ``cuflash.attention_backward`` with
  ``deterministic=False`` / ``True`` (the ``det cost`` column is the time of
  the second over the first);
* ``torch-flash`` / ``torch-cudnn``: SDPA on that backend, then
  ``torch.autograd.grad`` with respect to leaf-tensor views of the inputs.

There is no naive column in this mode. Each shape is checked once: cuflash's
and cuflash-det's dq, dk, dv against torch-flash's (against a float32 CuPy
backward on one batch entry and a few heads when torch is missing), and two
cuflash-det calls must give bitwise identical gradients. The memory table
then gives the peak extra memory of one forward+backward call.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys

from cuflash import bench_libs
from cuflash.bench_libs import MiB, Skip, describe

HIDDEN = 2048
TOKENS = 16384  # batch * seqlen, constant across shapes
HEADDIMS = (64, 128)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (2048, 8192)
DTYPES = ("float16", "bfloat16")
DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}

# (atol, rtol): pass when |out - ref| <= atol + rtol * |ref| everywhere.
# Two correct bf16 kernels can round a final output near 4 one bf16 ulp
# (2**-6) apart, more than the absolute 2e-2 alone allows; hence the rtol.
TOLERANCE = {"float16": (2e-2, 0.0), "bfloat16": (2e-2, 2.0**-7)}

# Without torch, the float32 reference runs on one batch entry and this many
# heads (attention is independent per (batch, head)) to bound its memory.
REFERENCE_HEADS = 4

# Input sets rotated during timing: enough that their total is at least twice
# the L2 cache, so a call never finds its inputs left in L2 by the previous
# one. Every default shape holds 16k tokens x 2048 x 3 tensors = 192 MiB per
# set, already well above L2, so the floor decides.
MIN_INPUT_SETS = 2

MEMORY_SEQLENS = (1024, 4096, 16384)
MEMORY_HEADS = 16
MEMORY_HEADDIM = 128

LIBS = ("cuflash", "naive-cupy", "torch-flash", "torch-cudnn")
DASH = "\u2013"

# --backward: forward+backward FLOPs per forward FLOP, the FlashAttention
# papers' convention: the forward's 2 GEMMs plus the backward's 5 (S
# recomputed, dP, dV, dQ, dK) = 7 = 3.5 x 2.
BWD_FLOPS_FACTOR = 3.5
BWD_LIBS = ("cuflash", "cuflash-det", "torch-flash", "torch-cudnn")
# Gradient check: max |grad - ref| <= GRAD_REL * max |ref| + GRAD_ATOL, per
# gradient. Gradients are larger than outputs and grow with the sequence
# length (dk, dv sum over all query rows), hence the relative bound.
GRAD_REL = 2e-2
GRAD_ATOL = 1e-3
# Time spent per library and shape before repeats are cut (default 3 s):
# a forward+backward call costs ~3.5 forwards, and the default run stays at
# ~2-3 minutes on an H100.
BWD_BUDGET_MS = 1500.0


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str
    headdim: int
    causal: bool
    seqlen: int

    @property
    def heads(self) -> int:
        return HIDDEN // self.headdim

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def flops(self) -> float:
        """Forward FLOPs."""
        flops = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.headdim
        return flops / 2 if self.causal else flops

    @property
    def bwd_flops(self) -> float:
        """Forward+backward FLOPs."""
        return BWD_FLOPS_FACTOR * self.flops


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Command line


def _seqlen(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def _dtype(text: str) -> str:
    try:
        return DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r}") from None


def _list(parser, values, convert, option):
    """Flatten repeated and comma-separated option values."""
    out = []
    for value in values or ():
        for part in value.split(","):
            if part.strip():
                try:
                    out.append(convert(part))
                except ValueError as exc:
                    parser.error(f"{option}: {exc}")
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m cuflash bench",
        description="Attention benchmark: cuflash vs naive CuPy and torch SDPA (forward), "
                    "or cuflash vs torch SDPA (forward+backward, --backward).",
    )
    parser.add_argument("--backward", action="store_true",
                        help="time forward+backward (one forward with lse + one backward) instead "
                             "of the forward alone; cuflash, cuflash-det (deterministic=True), "
                             "torch-flash and torch-cudnn; gradients are checked against torch-flash "
                             "and cuflash-det for bitwise reproducibility")
    parser.add_argument("--fp8", action="store_true",
                        help="fp8 e4m3 forward (Hopper): cuflash-fp8 next to cuflash and torch-cudnn on "
                             "bf16 inputs, then fp8 and bf16 errors against float64 (cuflash/bench_fp8.py)")
    parser.add_argument("--headdim", action="append", metavar="D",
                        help="head dimension(s), e.g. 64,128 (default: both)")
    parser.add_argument("--seqlen", action="append", metavar="N",
                        help="sequence length(s), e.g. 512,2k,16k (default: 512..16k)")
    parser.add_argument("--dtype", action="append", metavar="T",
                        help="fp16 and/or bf16 (default: both)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                        help="only causal (--causal) or only non-causal (--no-causal) shapes")
    parser.add_argument("--quick", action="store_true",
                        help="seqlen 2k and 8k only (unless --seqlen is given)")
    parser.add_argument("--repeats", type=int, default=30,
                        help="timed calls per library and shape; the median is reported "
                             "(fewer for very slow calls) (default: 30)")
    parser.add_argument("--no-peers", action="store_true",
                        help="time cuflash only (and cuflash-det with --backward); torch-flash is "
                             "still the correctness reference")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory section")
    parser.add_argument("--tuned", action="store_true",
                        help="add a cuflash-tuned column (autotuned configs; shapes missing from the "
                             "tuning cache are tuned first); the cuflash column then uses the heuristic "
                             "table only (forward only: ignored with --backward)")
    parser.add_argument("--json", metavar="PATH", help="write all raw numbers to PATH")
    args = parser.parse_args(argv)

    args.headdims = _list(parser, args.headdim, int, "--headdim") or list(HEADDIMS)
    args.dtypes = _list(parser, args.dtype, _dtype, "--dtype") or list(DTYPES)
    default_seqlens = QUICK_SEQLENS if args.quick else SEQLENS
    args.seqlens = _list(parser, args.seqlen, _seqlen, "--seqlen") or list(default_seqlens)
    args.masks = [False, True] if args.causal is None else [args.causal]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if any(n <= 0 for n in args.seqlens):
        parser.error("--seqlen values must be positive")
    for d in args.headdims:
        if d <= 0 or HIDDEN % d:
            parser.error(f"--headdim {d} does not divide the hidden size {HIDDEN}")
    return args


def build_shapes(args) -> list[Shape]:
    return [
        Shape(dtype, headdim, causal, seqlen)
        for dtype in dict.fromkeys(args.dtypes)
        for headdim in dict.fromkeys(args.headdims)
        for causal in args.masks
        for seqlen in dict.fromkeys(args.seqlens)
    ]


# --------------------------------------------------------------------------
# Running


def device_info() -> dict:
    import cupy

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    return {
        "name": props["name"].decode(),
        "compute_capability": device.compute_capability,
        "sm_count": device.attributes["MultiProcessorCount"],
        "l2_bytes": device.attributes["L2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
    }


def release_memory(torch_libs) -> None:
    import cupy

    bench_libs.synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    if torch_libs:
        torch_libs[0]._torch.cuda.empty_cache()


def check_shape(shape, qkv, cuflash, reference) -> dict:
    """Run cuflash once and compare it with the reference."""
    import cupy

    atol, rtol = TOLERANCE[shape.dtype]
    try:
        with cuflash.context():
            out = cuflash.to_cupy(cuflash.prepare(*qkv, shape.causal)())
    except Exception as exc:
        return {"ok": False, "reference": None, "error": describe(exc)}
    ref = None
    if reference is not None:
        try:
            run = reference.prepare(*qkv, shape.causal)
            with reference.context():
                ref = reference.to_cupy(run())
            bench_libs.synchronize()
            name = reference.name
        except Exception as exc:
            log(f"  {reference.name} reference unavailable ({describe(exc)}); using float32 CuPy")
    if ref is None:
        sub = tuple(x[:1, :, :REFERENCE_HEADS] for x in qkv)
        ref = bench_libs.naive_attention(*sub, shape.causal, dtype=cupy.float32)
        out = out[:1, :, :REFERENCE_HEADS]
        name = "naive-cupy-fp32"
    result = bench_libs.compare(out, ref, atol, rtol)
    result["reference"] = name
    return result


def time_libraries(libs, shape, sets, repeats, flops=None, budget_ms=3000.0) -> dict:
    """Time `libs` on `sets` (tuples of prepare's inputs) in interleaved rounds
    (bench_libs.time_calls); flops default to the forward's. Returns lib name -> result."""
    flops = shape.flops if flops is None else flops
    entries, results = {}, {}
    for lib in libs:
        try:
            entries[lib.name] = (lib, [lib.prepare(*inputs, shape.causal) for inputs in sets])
        except Skip as exc:
            results[lib.name] = {"skipped": str(exc)}
        except Exception as exc:
            results[lib.name] = {"error": describe(exc)}
    try:
        results.update(bench_libs.time_calls(entries, repeats, budget_ms))
    finally:
        entries = None
        bench_libs.synchronize()
    for result in results.values():
        if "ms" in result:
            result["tflops"] = flops / (result["ms"] * 1e-3) / 1e12
    return {lib.name: results[lib.name] for lib in libs}


def run_shape(shape, libs, reference, repeats, l2_bytes, tuned=None) -> dict:
    """Check and time one shape; `tuned`, one of `libs`, is checked too."""
    dtype = bench_libs.cupy_dtype(shape.dtype)
    per_set = 3 * shape.batch * shape.seqlen * shape.heads * shape.headdim * dtype.itemsize
    n_sets = max(MIN_INPUT_SETS, math.ceil(2 * l2_bytes / per_set))
    sets = [
        bench_libs.random_qkv(shape.batch, shape.seqlen, shape.heads, shape.headdim, dtype, seed)
        for seed in range(n_sets)
    ]
    row = dataclasses.asdict(shape)
    row.update(heads=shape.heads, batch=shape.batch, flops=shape.flops, input_sets=n_sets)
    row["check"] = check_shape(shape, sets[0], libs[0], reference)
    if tuned is not None:
        row["check_tuned"] = check_shape(shape, sets[0], tuned, reference)
    row["libs"] = time_libraries(libs, shape, sets, repeats)
    mine = [libs[0]] + ([tuned] if tuned is not None else [])
    row["ok"] = (all(bool(row.get(c, {"ok": True})["ok"]) for c in ("check", "check_tuned"))
                 and all("tflops" in row["libs"][lib.name] for lib in mine))
    return row


def _grads(lib, inputs, causal):
    with lib.context():
        grads = lib.to_cupy(lib.prepare(*inputs, causal)())
    bench_libs.synchronize()
    return grads


def check_shape_bwd(shape, inputs, cuflash, cuflash_det, reference) -> dict:
    """Gradients of cuflash and cuflash-det against the reference, and the
    bitwise reproducibility of cuflash-det. Returns check, check_det, determinism."""
    result = {}
    grads = {}
    try:
        grads["check"] = _grads(cuflash, inputs, shape.causal)
    except Exception as exc:
        result["check"] = {"ok": False, "reference": None, "error": describe(exc)}
    try:
        first = _grads(cuflash_det, inputs, shape.causal)
        second = _grads(cuflash_det, inputs, shape.causal)
        same = all(bench_libs.same_bits(a, b) for a, b in zip(first, second))
        result["determinism"] = "det ok" if same else "NONDET"
        grads["check_det"] = first
        del second
    except Exception as exc:
        result["check_det"] = {"ok": False, "reference": None, "error": describe(exc)}
        result["determinism"] = "error: " + describe(exc)
    if not grads:
        return result

    ref = None
    if reference is not None:
        try:
            ref = _grads(reference, inputs, shape.causal)
            name = reference.name
        except Exception as exc:
            log(f"  {reference.name} reference unavailable ({describe(exc)}); using float32 CuPy")
    if ref is None:
        sub = tuple(x[:1, :, :REFERENCE_HEADS] for x in inputs)
        q, k, v, dout = sub
        ref = bench_libs.naive_attention_backward(dout, q, k, v, shape.causal)
        grads = {key: tuple(g[:1, :, :REFERENCE_HEADS] for g in gs) for key, gs in grads.items()}
        name = "naive-cupy-fp32"
    for key, gs in grads.items():
        result[key] = bench_libs.compare_grads(gs, ref, GRAD_REL, GRAD_ATOL)
        result[key]["reference"] = name
    return result


def run_shape_bwd(shape, libs, reference, repeats, l2_bytes) -> dict:
    """Check and time one shape forward+backward; libs[0] is cuflash, libs[1] cuflash-det."""
    dtype = bench_libs.cupy_dtype(shape.dtype)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.headdim)
    per_set = 4 * math.prod(dims) * dtype.itemsize  # q, k, v, dout
    n_sets = max(MIN_INPUT_SETS, math.ceil(2 * l2_bytes / per_set))
    sets = [
        (*bench_libs.random_qkv(*dims, dtype, seed), bench_libs.random_dout(*dims, dtype, seed))
        for seed in range(n_sets)
    ]
    row = dataclasses.asdict(shape)
    row.update(heads=shape.heads, batch=shape.batch, flops=shape.bwd_flops, fwd_flops=shape.flops,
               input_sets=n_sets)
    row.update(check_shape_bwd(shape, sets[0], libs[0], libs[1], reference))
    row["libs"] = time_libraries(libs, shape, sets, repeats, shape.bwd_flops, BWD_BUDGET_MS)
    row["ok"] = (all(row.get(c, {"ok": True})["ok"] for c in ("check", "check_det"))
                 and row.get("determinism") == "det ok"
                 and all("tflops" in row["libs"][lib.name] for lib in libs[:2]))
    return row


def run_memory(libs) -> list[dict]:
    """Peak extra memory of one non-causal fp16 forward call, batch 1."""
    dtype = bench_libs.cupy_dtype("float16")
    entries = []
    for seqlen in MEMORY_SEQLENS:
        q, k, v = bench_libs.random_qkv(1, seqlen, MEMORY_HEADS, MEMORY_HEADDIM, dtype, seed=0)
        entry = {
            "dtype": "float16", "causal": False, "batch": 1, "heads": MEMORY_HEADS,
            "headdim": MEMORY_HEADDIM, "seqlen": seqlen,
            "inputs_mib": 3 * q.nbytes / MiB, "output_mib": q.nbytes / MiB, "libs": {},
        }
        for lib in libs:
            try:
                entry["libs"][lib.name] = {"extra_mib": bench_libs.peak_extra_bytes(lib, q, k, v) / MiB}
            except Skip as exc:
                entry["libs"][lib.name] = {"skipped": str(exc)}
            except Exception as exc:
                entry["libs"][lib.name] = {"error": describe(exc)}
            bench_libs.synchronize()
        log(f"memory N={seqlen}: " + ", ".join(
            f"{name} {_cell(r, 'extra_mib', '.0f')}" for name, r in entry["libs"].items()))
        entries.append(entry)
        del q, k, v
    return entries


def run_memory_bwd(libs) -> list[dict]:
    """Peak extra memory of one non-causal fp16 forward+backward call, batch 1.

    Inputs (q, k, v, dout) are excluded; the peak includes what the call
    returns (dq, dk, dv) and the forward's out and lse, recorded separately.
    """
    dtype = bench_libs.cupy_dtype("float16")
    entries = []
    for seqlen in MEMORY_SEQLENS:
        dims = (1, seqlen, MEMORY_HEADS, MEMORY_HEADDIM)
        q, k, v = bench_libs.random_qkv(*dims, dtype, seed=0)
        dout = bench_libs.random_dout(*dims, dtype, seed=0)
        entry = {
            "dtype": "float16", "causal": False, "batch": 1, "heads": MEMORY_HEADS,
            "headdim": MEMORY_HEADDIM, "seqlen": seqlen,
            "inputs_mib": 3 * q.nbytes / MiB, "dout_mib": dout.nbytes / MiB,
            "grads_mib": 3 * q.nbytes / MiB,  # dq + dk + dv: the call's output, inside extra_mib
            "out_lse_mib": (q.nbytes + 4 * MEMORY_HEADS * seqlen) / MiB,  # fp16 out + fp32 lse
            "scores_mib": MEMORY_HEADS * seqlen * seqlen * dtype.itemsize / MiB,  # one N x N, for scale
            "libs": {},
        }
        for lib in libs:
            try:
                peak = bench_libs.peak_extra_bytes(lib, q, k, v, causal=False, dout=dout)
                entry["libs"][lib.name] = {"extra_mib": peak / MiB,
                                           "extra_minus_grads_mib": peak / MiB - entry["grads_mib"]}
            except Skip as exc:
                entry["libs"][lib.name] = {"skipped": str(exc)}
            except Exception as exc:
                entry["libs"][lib.name] = {"error": describe(exc)}
            bench_libs.synchronize()
        log(f"memory fwd+bwd N={seqlen}: " + ", ".join(
            f"{name} {_cell(r, 'extra_mib', '.0f')}" for name, r in entry["libs"].items()))
        entries.append(entry)
        del q, k, v, dout
    return entries


# --------------------------------------------------------------------------
# Output


def _cell(result, key="tflops", fmt=".1f", error="ERR") -> str:
    if result is None or key not in result:
        return error if result and "error" in result else DASH
    return format(result[key], fmt)


def _seqlen_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _verdict(check: dict) -> str:
    return ("ok" if check["ok"] else "MISMATCH") + (
        f" (max err {check['max_abs_err']:.2e} vs {check['reference']})"
        if "max_abs_err" in check else f" ({check.get('error')})")


def _mark(cell: str, check: dict) -> str:
    return cell + "!" if not check["ok"] and cell != "ERR" else cell


def _ratio(a, b) -> str:
    if a and b and "tflops" in a and "tflops" in b:
        return f"{a['tflops'] / b['tflops']:.2f}"
    return DASH


def _table(rows, headers, numeric_from) -> str:
    try:
        from tabulate import tabulate
    except ImportError:
        return "\n".join("\t".join(map(str, r)) for r in [headers, *rows])
    align = ["left"] * numeric_from + ["right"] * (len(headers) - numeric_from)
    return tabulate(rows, headers, disable_numparse=True, colalign=align)


def speed_table(results) -> str:
    tuned = any("cuflash-tuned" in r["libs"] for r in results)
    headers = ["dtype", "hdim", "causal", "seqlen", "cuflash",
               *(["cuflash-tuned", "tuned/cuflash"] if tuned else []),
               "naive", "torch-flash", "torch-cudnn", "cuflash/flash", "cuflash/cudnn"]
    rows = []
    for r in results:
        libs = r["libs"]
        mine = libs.get("cuflash")
        cell = _mark(_cell(mine), r["check"])
        extra = []
        if tuned:
            extra = [_mark(_cell(libs.get("cuflash-tuned")), r.get("check_tuned", {"ok": True})),
                     _ratio(libs.get("cuflash-tuned"), mine)]
        rows.append([
            SHORT_DTYPE[r["dtype"]], r["headdim"], "yes" if r["causal"] else "no",
            _seqlen_label(r["seqlen"]), cell, *extra,
            # A peer that fails is shown like one that was skipped; the
            # reason is in the log and the JSON.
            *(_cell(libs.get(name), error=DASH) for name in LIBS[1:]),
            _ratio(mine, libs.get("torch-flash")), _ratio(mine, libs.get("torch-cudnn")),
        ])
    return _table(rows, headers, 4)


def _grad_verdict(check: dict) -> str:
    if "error" in check:
        return f"ERROR ({check['error']})"
    detail = "" if check["ok"] else ", " + ", ".join(
        f"{g} err {check[g]['max_abs_err']:.1e} tol {check[g]['tol']:.1e}" for g in bench_libs.GRAD_NAMES)
    return (("ok" if check["ok"] else "MISMATCH")
            + f" (max err/tol {check['max_err_over_tol']:.2f}{detail} vs {check['reference']})")


def bwd_verdict(row: dict) -> str:
    parts = []
    if "check" in row:
        parts.append("cuflash " + _grad_verdict(row["check"]))
    if "check_det" in row:
        parts.append("cuflash-det " + _grad_verdict(row["check_det"]))
    parts.append(row.get("determinism", "determinism not checked"))
    return "; ".join(parts)


def bwd_speed_table(results) -> str:
    headers = ["dtype", "hdim", "causal", "seqlen", *BWD_LIBS,
               "cuflash/flash", "cuflash/cudnn", "det cost"]
    rows = []
    for r in results:
        libs = r["libs"]
        mine, det = libs.get("cuflash"), libs.get("cuflash-det")
        det_cell = _mark(_cell(det), r.get("check_det", {"ok": True}))
        if r.get("determinism") not in (None, "det ok") and det_cell != "ERR":
            det_cell += " NONDET"
        cost = f"{det['ms'] / mine['ms']:.2f}" if mine and det and "ms" in mine and "ms" in det else DASH
        rows.append([
            SHORT_DTYPE[r["dtype"]], r["headdim"], "yes" if r["causal"] else "no",
            _seqlen_label(r["seqlen"]),
            _mark(_cell(mine), r.get("check", {"ok": True})), det_cell,
            *(_cell(libs.get(name), error=DASH) for name in BWD_LIBS[2:]),
            _ratio(mine, libs.get("torch-flash")), _ratio(mine, libs.get("torch-cudnn")), cost,
        ])
    return _table(rows, headers, 4)


def bwd_memory_table(entries) -> str:
    headers = ["seqlen", "inputs", "grads", "N x N", *BWD_LIBS]
    rows = [
        [_seqlen_label(e["seqlen"]), f"{e['inputs_mib']:.0f}", f"{e['grads_mib']:.0f}",
         f"{e['scores_mib']:.0f}"]
        + [_cell(e["libs"].get(name), "extra_mib", ".0f", error="ERR" if name.startswith("cuflash") else DASH)
           for name in BWD_LIBS]
        for e in entries
    ]
    return _table(rows, headers, 1)


def memory_table(entries) -> str:
    headers = ["seqlen", "inputs", "cuflash", "naive", "torch-flash", "torch-cudnn"]
    rows = [
        [_seqlen_label(e["seqlen"]), f"{e['inputs_mib']:.0f}"]
        + [_cell(e["libs"].get(name), "extra_mib", ".0f", error="ERR" if name == "cuflash" else DASH)
           for name in LIBS]
        for e in entries
    ]
    return _table(rows, headers, 1)


def write_json(path, report) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


# --------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import cupy

        device = device_info()
    except Exception as exc:
        log(f"cuflash bench: no CUDA device ({describe(exc)})")
        return 2
    if args.fp8:
        from cuflash import bench_fp8

        return bench_fp8.main(args, device)
    if args.backward and args.tuned:
        log("cuflash bench: --tuned applies to the forward benchmark only; ignored with --backward")
        args.tuned = False
    try:
        if args.backward:
            cuflash = bench_libs.CuflashFwdBwd(deterministic=False)
            cuflash_det = bench_libs.CuflashFwdBwd(deterministic=True)
        else:
            cuflash = bench_libs.Cuflash("heuristic" if args.tuned else None)
    except Exception as exc:
        log(f"cuflash bench: cannot load cuflash ({describe(exc)})")
        return 2

    # torch is loaded even with --no-peers: its flash backend is the reference.
    torch_libs = bench_libs.load_torch_libs(log, backward=args.backward)
    reference = next((lib for lib in torch_libs if lib.name == "torch-flash"), None)
    tuned = bench_libs.Cuflash("tuned") if args.tuned else None
    if args.backward:
        mine = [cuflash, cuflash_det]
        libs = mine if args.no_peers else [*mine, *torch_libs]
    else:
        mine = [cuflash] + ([tuned] if tuned else [])
        libs = mine if args.no_peers else [*mine, bench_libs.NaiveCupy(), *torch_libs]

    import cuflash as cuflash_module

    torch_version = torch_libs[0]._torch.__version__ if torch_libs else None
    report = {
        "mode": "fwd+bwd" if args.backward else "fwd",
        "device": device,
        "versions": {
            "cuflash": getattr(cuflash_module, "__version__", None),
            "cupy": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "torch": torch_version,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "repeats": args.repeats,
        "libraries": [lib.name for lib in libs],
        "results": [],
        "memory": [],
    }
    if args.backward:
        report["flops_per_forward_flop"] = BWD_FLOPS_FACTOR
        report["grad_tolerance"] = {"rel": GRAD_REL, "atol": GRAD_ATOL}
    log(f"device: {device['name']} (sm_{device['compute_capability']}, "
        f"{device['sm_count']} SMs, L2 {device['l2_bytes'] / MiB:.0f} MiB); "
        f"{report['mode']}; libraries: {', '.join(report['libraries'])}")

    shapes = build_shapes(args)
    for i, shape in enumerate(shapes, 1):
        if args.backward:
            row = run_shape_bwd(shape, libs, reference, args.repeats, device["l2_bytes"])
            verdict = bwd_verdict(row)
        else:
            row = run_shape(shape, libs, reference, args.repeats, device["l2_bytes"], tuned)
            verdict = "; ".join(_verdict(row[c]) + ("" if c == "check" else " (tuned)")
                                for c in ("check", "check_tuned") if c in row)
        release_memory(torch_libs)
        report["results"].append(row)
        write_json(args.json, report)  # keep partial results if the run is cut short
        log(f"[{i}/{len(shapes)}] {SHORT_DTYPE[shape.dtype]} d={shape.headdim} "
            f"{'causal' if shape.causal else 'full'} N={shape.seqlen} B={shape.batch} "
            f"H={shape.heads}: " + ", ".join(
                f"{name} {_cell(r)}" for name, r in row["libs"].items()) + f"; {verdict}")
        for name, r in row["libs"].items():
            if "error" in r or "skipped" in r:
                log(f"    {name}: {r.get('error') or 'skipped: ' + r['skipped']}")

    if not args.no_memory:
        if args.backward:
            report["memory"] = run_memory_bwd([*mine] if args.no_peers else [*mine, *torch_libs])
        else:
            memory_libs = [cuflash] if args.no_peers else [
                cuflash, bench_libs.NaiveCupy(max_seqlen=None), *torch_libs]
            report["memory"] = run_memory(memory_libs)
        release_memory(torch_libs)

    failed = [r for r in report["results"] if not r["ok"]]
    mem_failed = [m for m in report["memory"]
                  if any("error" in m["libs"].get(lib.name, {}) for lib in mine if lib is not tuned)]
    report["ok"] = not failed and not mem_failed
    write_json(args.json, report)

    if args.backward:
        print(f"\nForward+backward TFLOP/s on {device['name']}: median of up to {args.repeats} calls "
              f"(one forward with lse + one backward; FLOPs = {BWD_FLOPS_FACTOR} x forward); "
              f"batch x seqlen = {TOKENS}, hidden {HIDDEN}.  "
              f"'!' gradients mismatch, 'NONDET' cuflash-det not bitwise reproducible, "
              f"'ERR' failed, '{DASH}' not run; det cost = cuflash-det time / cuflash time.")
        print(bwd_speed_table(report["results"]))
    else:
        print(f"\nForward TFLOP/s on {device['name']}: median of up to {args.repeats} calls; "
              f"batch x seqlen = {TOKENS}, hidden {HIDDEN}.  "
              f"'!' cuflash mismatch, 'ERR' cuflash failed, '{DASH}' not run.")
        print(speed_table(report["results"]))
    if report["memory"] and args.backward:
        print(f"\nPeak extra device memory of one forward+backward call, MiB "
              f"(fp16, batch 1, {MEMORY_HEADS} heads, hdim {MEMORY_HEADDIM}, non-causal). "
              f"Inputs q+k+v ('inputs') and dout are excluded; each peak includes the returned "
              f"gradients dq+dk+dv ('grads') and the forward's out and lse. "
              f"'N x N' is the size of one fp16 score matrix per head, for scale:")
        print(bwd_memory_table(report["memory"]))
    elif report["memory"]:
        print(f"\nPeak extra device memory of one forward call, MiB "
              f"(fp16, batch 1, {MEMORY_HEADS} heads, hdim {MEMORY_HEADDIM}, non-causal; "
              f"'inputs' is q+k+v):")
        print(memory_table(report["memory"]))
    if failed or mem_failed:
        print(f"\nFAILED: {len(failed)} cuflash row(s) failed or mismatched"
              + (f", {len(mem_failed)} memory measurement(s) failed" if mem_failed else ""))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
