"""Same-run A/B of Hopper forward kernel *source* variants and configs.

Usage (on a GPU):
  PYTHONPATH=. python bench/variant_ab.py --dtype fp8 --headdim 128 --seqlen 8192,16384 \
      --variant base=-:192:2:npp --variant other=path/to/fwd_sm90.cuh:128:2:pp [--rounds N]

A variant is NAME=SOURCE:BLOCK_N:STAGES:pp|npp[:nso][:whole]. SOURCE is "-"
(the tree's kernels), a file that replaces cuda_src/fwd_sm90.cuh (the other
headers stay the tree's), or a directory holding a whole cuda_src/ (e.g. one
of another checkout). nso stores the output from registers (else it is staged
where it fits), and whole keeps the last wave's tiles whole (no tail split,
cuflash/tail_split.py). A variant's kernel must take the tree's parameters:
it is launched by the tree's launch.FwdSm90Launch. Every variant's output is
checked against the first variant's (NaN-poisoned before each check), then
the variants and torch SDPA's cuDNN backend (bf16 inputs of the same shape)
are timed in interleaved rounds in a balanced order (cuflash.timing). fp8
calls include the V transpose, as cuflash.attention's do.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import tempfile
from pathlib import Path

import cupy
from tabulate import tabulate

from cuflash import compile as _compile
from cuflash import dispatch, launch, tail_split, timing
from cuflash.bench.inputs import cupy_dtype
from cuflash.bench.libs import TorchEvents
from cuflash.config import FP8_DTYPE_NAME, FwdSm90Config
from cuflash.fp8 import quantize_e4m3

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp8": FP8_DTYPE_NAME}


def register_variant(name: str, source: str, workdir: Path) -> str:
    """A kernel family built from `source` ("-": the tree's); returns the family name."""
    if source == "-":
        return "fwd_sm90"
    if Path(source).is_dir():
        header = Path(source) / "fwd_sm90.cuh"
    else:
        tree = workdir / name
        shutil.copytree(_compile.cuda_src_dir(), tree)
        shutil.copy(source, tree / "fwd_sm90.cuh")
        header = tree / "fwd_sm90.cuh"
    family = f"fwd_sm90@{name}"
    _compile.FAMILY_HEADERS[family] = str(header.resolve())
    _compile.FAMILY_ARCH[family] = _compile.FAMILY_ARCH["fwd_sm90"]
    return family


def variant_config(family: str, *args, **fields) -> FwdSm90Config:
    """A Hopper config whose kernels come from `family` (FwdSm90Config reads its family from the class)."""
    if family == "fwd_sm90":
        return FwdSm90Config(*args, **fields)
    cls = type(f"FwdSm90Config_{family}", (FwdSm90Config,), {"family": family})
    return cls(*args, **fields)


@contextlib.contextmanager
def whole_tiles():
    """Within the block, prepared launches keep the last wave's tiles whole (no tail split)."""
    plan = tail_split.plan
    tail_split.plan = lambda num_tiles, ctas, key_blocks: tail_split.TailSplit(num_tiles, 0)
    try:
        yield
    finally:
        tail_split.plan = plan


def parse_variant(spec: str):
    name, rest = spec.split("=", 1)
    source, block_n, stages, pp, *options = rest.split(":")
    if pp not in ("pp", "npp") or not set(options) <= {"nso", "whole"}:
        raise SystemExit(f"variant {name}: expected SOURCE:BLOCK_N:STAGES:pp|npp[:nso][:whole], got {rest!r}")
    return name, source, int(block_n), int(stages), pp == "pp", "nso" not in options, "whole" in options


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="fp8", choices=sorted(DTYPES))
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen", default="8192,16384")
    p.add_argument("--causal", default="no,yes", help="no, yes or no,yes")
    p.add_argument("--variant", action="append", required=True)
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timing rounds (default: enough to complete the order design)")
    p.add_argument("--repeats", type=int, default=70, help="timed calls per variant and peer (median)")
    a = p.parse_args()
    dtype_name = DTYPES[a.dtype]
    workdir = Path(tempfile.mkdtemp(prefix="cuflash_ab_"))
    variants = []
    for spec in a.variant:
        name, source, block_n, stages, pp, staged, whole = parse_variant(spec)
        family = register_variant(name, source, workdir)
        cfg = variant_config(family, a.headdim, block_n, stages, pingpong=pp, stage_o=staged)
        if not cfg.supports(dtype_name):
            cfg = variant_config(family, a.headdim, block_n, stages, pingpong=pp, stage_o=False)
        variants.append((name, cfg, whole))

    device_id = cupy.cuda.Device().id
    rows = []
    for n in map(int, a.seqlen.split(",")):
        for causal in [c == "yes" for c in a.causal.split(",")]:
            d = a.headdim
            h, b = 2048 // d, max(1, 16384 // n)
            x = [cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32) for _ in range(3)]
            if dtype_name == FP8_DTYPE_NAME:
                (q, qs), (k, ks), (v, vs) = (quantize_e4m3(t) for t in x)
                descale = (qs, ks, vs)
                out = cupy.empty((b, n, h, d), dtype=cupy.uint16)  # bf16 bits
            else:
                q, k, v = (t.astype(cupy_dtype(dtype_name)) for t in x)
                descale = None
                out = cupy.empty_like(q)
            lse = cupy.empty((b, h, n), dtype=cupy.float32)
            problem = dispatch.FwdProblem(dtype_name, d, causal, n, n, 1, arch=90)
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            tb = [torch.from_dlpack(t).to(torch.bfloat16).transpose(1, 2) for t in x]

            def cudnn(tb=tb, causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(*tb, is_causal=causal)

            entries = {"cudnn-bf16": timing.Calls([cudnn], TorchEvents(torch))}
            ref, errors = None, {}
            for name, cfg, whole in variants:
                out.view(cupy.uint16).fill(0x7FC0)  # NaN in bf16 and fp16
                try:  # compiles, and checks the variant before it is timed
                    with whole_tiles() if whole else contextlib.nullcontext():
                        prepared = launch.FwdSm90Launch(cfg, problem, q, k, v, out, lse, 1 / math.sqrt(d), device_id)

                    def run(prepared=prepared):
                        prepared.run(q, k, v, out, lse, cupy.cuda.get_current_stream().ptr, descale)

                    run()
                except Exception as exc:  # report and go on with the others
                    print(name, "failed:", str(exc)[-600:], flush=True)
                    continue
                if dtype_name == "float16":
                    got = out.astype(cupy.float32)
                else:  # bf16 bits: the high half of a float32
                    got = (out.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
                if ref is None:
                    ref = got.copy()
                errors[name] = float(cupy.nan_to_num(cupy.abs(got - ref), nan=math.inf).max())
                entries[name] = timing.Calls([run])
            timed = timing.time_calls(entries, a.repeats, rounds=a.rounds)
            tflops = {name: flops / t["ms"] / 1e9 for name, t in timed.items() if "ms" in t}
            for name, cfg, _ in variants:
                if name in errors:
                    rows.append([d, n, causal, name, cfg.short_name(), f"{errors[name]:.1e}",
                                 f"{tflops.get(name, math.nan):.0f}", f"{tflops.get('cudnn-bf16', math.nan):.0f}"])
                    print(rows[-1], flush=True)
    print(tabulate(rows, headers=["d", "N", "causal", "variant", "config", "max diff vs first", "TFLOP/s",
                                  "cudnn bf16"]))


if __name__ == "__main__":
    main()
