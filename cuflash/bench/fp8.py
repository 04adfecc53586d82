"""fp8 benchmark: ``python -m cuflash bench --fp8 [--headdim D] [--seqlen N] [--causal] [--quick] [--json PATH]``.

Speed, on the forward benchmark's shapes (16k tokens, hidden 2048): cuflash on
fp8 e4m3 inputs with descales per (batch, kv head), its V transpose counted
in its time, next to cuflash and torch SDPA's cuDNN backend on bf16 inputs of
the same shape, in TFLOP/s from the same run.

Accuracy, at seqlen 2k on activations with outlier channels (x20 on 1/32 of
the channels of q and k, as trained transformers have): the error of fp8
cuflash against a float64 reference of its dequantised inputs, next to the
error of bf16 cuflash against a float64 reference of its bf16 inputs.
"""

from __future__ import annotations

import contextlib
import math

import cupy
import numpy

import cuflash
from cuflash.fp8 import dequantize_e4m3, quantize_e4m3
from cuflash.timing import CUPY_EVENTS, synchronize

from ..tune_common import HIDDEN
from .inputs import cupy_dtype, random_qkv
from .libs import Cuflash, load_torch_libs
from .measure import input_sets, log, time_libraries
from .shapes import TOKENS, build_shapes, seqlen_label
from .tables import cell, table, write_json

ACCURACY_SEQLEN = 2048
ACCURACY_HEADS = 4  # heads of one batch entry checked against float64
OUTLIER_FRACTION = 32
OUTLIER_SCALE = 20.0


def activations(rng, shape, outliers: bool):
    x = rng.standard_normal(shape, dtype=numpy.float32)
    if outliers:
        channels = numpy.arange(0, shape[-1], OUTLIER_FRACTION)
        x[..., channels] *= OUTLIER_SCALE
    return x


class CuflashFp8:
    """cuflash.attention on e4m3 bits with descales (the prepare inputs are float32 values)."""

    name = "cuflash-fp8"
    events = CUPY_EVENTS

    def prepare(self, q, k, v, causal):
        (qb, qs), (kb, ks), (vb, vs) = (quantize_e4m3(x) for x in (q, k, v))
        attention = cuflash.attention
        return lambda: attention(qb, kb, vb, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)

    @staticmethod
    def context():
        return contextlib.nullcontext()


class Bf16Of:
    """A bf16 library fed the same float32 inputs rounded to bf16."""

    def __init__(self, lib):
        self.lib, self.name, self.events = lib, lib.name + "-bf16", lib.events

    def prepare(self, q, k, v, causal):
        dtype = cupy_dtype("bfloat16")
        return self.lib.prepare(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal)

    def context(self):
        return self.lib.context()


def run_speed(shape, libs, repeats, l2_bytes) -> dict:
    """Time each library on float32 input sets of its own (each converts them in prepare, outside the timing)."""
    set_bytes = 3 * 4 * math.prod(shape.dims)  # float32 q, k, v
    row = {"headdim": shape.headdim, "causal": shape.causal, "seqlen": shape.seqlen, "batch": shape.batch,
           "heads": shape.heads, "flops": shape.flops, "libs": {}}
    for lib in libs:
        sets = input_sets(lambda seed: random_qkv(*shape.dims, cupy.float32, seed), set_bytes, l2_bytes)
        row["libs"].update(time_libraries([lib], shape.causal, sets, repeats, shape.flops))
        sets = None
        synchronize()
    return row


def run_accuracy(headdim: int, causal: bool) -> dict:
    """Max and mean abs error of fp8 and bf16 cuflash against float64, on ACCURACY_HEADS heads."""
    rng = numpy.random.default_rng(headdim * 2 + causal)
    shape = (1, ACCURACY_SEQLEN, ACCURACY_HEADS, headdim)
    q, k = (cupy.asarray(activations(rng, shape, outliers=True)) for _ in range(2))
    v = cupy.asarray(activations(rng, shape, outliers=False))
    (qb, qs), (kb, ks), (vb, vs) = (quantize_e4m3(x) for x in (q, k, v))
    fp8_out = cuflash.attention(qb, kb, vb, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
    bf16 = cupy_dtype("bfloat16")
    qh, kh, vh = (x.astype(bf16) for x in (q, k, v))
    bf16_out = cuflash.attention(qh, kh, vh, causal=causal)
    errors = {}
    for name, out, inputs in (("fp8", fp8_out, [dequantize_e4m3(b, s) for b, s in ((qb, qs), (kb, ks), (vb, vs))]),
                              ("bf16", bf16_out, [x.astype(cupy.float64) for x in (qh, kh, vh)])):
        ref = _reference(*inputs, causal)
        err = cupy.abs(out.astype(cupy.float64) - ref)
        errors[name] = {"max_abs": float(err.max()), "mean_abs": float(err.mean()),
                        "ref_rms": float(cupy.sqrt((ref * ref).mean()))}
    return {"headdim": headdim, "causal": causal, "seqlen": ACCURACY_SEQLEN, "errors": errors}


def _reference(q, k, v, causal):
    """float64 attention on the GPU, one head at a time ((1, N, H, D) inputs, Nq == Nk)."""
    n, heads, d = q.shape[1], q.shape[2], q.shape[3]
    out = cupy.empty(q.shape, cupy.float64)
    mask = cupy.tril(cupy.ones((n, n), bool)) if causal else None
    for h in range(heads):
        s = q[0, :, h] @ k[0, :, h].T / math.sqrt(d)
        if mask is not None:
            s = cupy.where(mask, s, -cupy.inf)
        p = cupy.exp(s - s.max(axis=1, keepdims=True))
        out[0, :, h] = (p / p.sum(axis=1, keepdims=True)) @ v[0, :, h]
    return out


def main(args, device) -> int:
    """The --fp8 run on cli's parsed options; non-zero if cuflash-fp8 failed on any shape."""
    libs = [CuflashFp8(), Bf16Of(Cuflash())]
    torch_libs = [] if args.no_peers else load_torch_libs(log, backward=False)
    libs += [Bf16Of(lib) for lib in torch_libs if lib.name == "torch-cudnn"]
    shapes = build_shapes(["bfloat16"], args.headdims, args.masks, args.seqlens)
    report = {"mode": "fp8", "device": device, "libraries": [lib.name for lib in libs], "results": [],
              "accuracy": []}
    for i, shape in enumerate(shapes, 1):
        row = run_speed(shape, libs, args.repeats, device["l2_bytes"])
        report["results"].append(row)
        write_json(args.json, report)
        log(f"[{i}/{len(shapes)}] fp8 d={shape.headdim} {'causal' if shape.causal else 'full'} "
            f"N={shape.seqlen}: " + ", ".join(f"{n} {cell(r)}" for n, r in row["libs"].items()))
    for d in dict.fromkeys(args.headdims):
        for causal in args.masks:
            report["accuracy"].append(run_accuracy(d, causal))
    write_json(args.json, report)

    names = [lib.name for lib in libs]
    rows = []
    for r in report["results"]:
        cells = [cell(r["libs"][n]) for n in names]
        fp8 = r["libs"][names[0]].get("tflops")
        ratios = [f"{fp8 / r['libs'][n]['tflops']:.2f}" if fp8 and r["libs"][n].get("tflops") else "-"
                  for n in names[1:]]
        rows.append([r["headdim"], "causal" if r["causal"] else "full", seqlen_label(r["seqlen"]), *cells, *ratios])
    print(f"\nfp8 e4m3 forward TFLOP/s on {device['name']} (bf16 output; peers on bf16 inputs), "
          f"batch x seqlen = {TOKENS}, hidden {HIDDEN}:")
    print(table(rows, ["hdim", "mask", "seqlen", *names, *(f"fp8/{n}" for n in names[1:])], 3))
    acc_rows = [[a["headdim"], "causal" if a["causal"] else "full",
                 f"{a['errors']['fp8']['max_abs']:.2e}", f"{a['errors']['fp8']['mean_abs']:.2e}",
                 f"{a['errors']['bf16']['max_abs']:.2e}", f"{a['errors']['bf16']['mean_abs']:.2e}",
                 f"{a['errors']['fp8']['ref_rms']:.2e}"] for a in report["accuracy"]]
    print(f"\nAccuracy at seqlen {ACCURACY_SEQLEN} (q, k with outlier channels), abs error against float64 "
          f"of each run's own (dequantised / bf16) inputs:")
    print(table(acc_rows, ["hdim", "mask", "fp8 max", "fp8 mean", "bf16 max", "bf16 mean", "ref rms"], 2))
    ok = all("tflops" in r["libs"][names[0]] for r in report["results"])
    return 0 if ok else 1

