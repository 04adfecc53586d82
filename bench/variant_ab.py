"""Same-run A/B of Hopper forward kernel *source* variants and configs.

Usage (on a GPU):
  PYTHONPATH=. python bench/variant_ab.py --dtype fp8 --headdim 128 --seqlen 8192,16384 \
      --variant base=-:192:2:npp --variant other=path/to/fwd_sm90.cuh:128:2:pp [--rounds 7]

A variant is NAME=HEADER:BLOCK_N:STAGES:pp|npp[:nso][:whole], where HEADER
replaces cuda_src/fwd_sm90.cuh (the other headers stay the tree's) and "-"
means the tree's own, nso stores the output from registers (else it is staged
where it fits), and whole keeps the last wave's tiles whole (no tail split,
cuflash/tail_split.py). A HEADER must take the tree's kernel parameters (the
launch is the tree's api.launch_fwd). Every variant's output is checked against the first variant's
(NaN-poisoned before each check), then the variants and torch SDPA's cuDNN
backend (bf16 inputs of the same shape) are timed in interleaved rounds with
rotating order (bench/sweep.py's timer). fp8 calls include the V transpose,
as cuflash.attention's do.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

import cupy
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import interleaved_ms  # noqa: E402

from cuflash import api, bench_libs, dispatch, tail_split  # noqa: E402
from cuflash import compile as _compile  # noqa: E402
from cuflash.config import FP8_DTYPE_NAME, FwdSm90Config  # noqa: E402
from cuflash.fp8 import quantize_e4m3  # noqa: E402

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp8": FP8_DTYPE_NAME}


def register_variant(name: str, header: str, workdir: Path) -> str:
    """A kernel family whose fwd_sm90.cuh is `header` ("-": the tree's): returns the family name."""
    if header == "-":
        return "fwd_sm90"
    src = workdir / name
    shutil.copytree(_compile.cuda_src_dir(), src)
    shutil.copy(header, src / "fwd_sm90.cuh")
    family = f"fwd_sm90@{name}"
    _compile.FAMILY_HEADERS[family] = str(src / "fwd_sm90.cuh")
    _compile.FAMILY_ARCH[family] = _compile.FAMILY_ARCH["fwd_sm90"]
    return family


def parse_variant(spec: str):
    name, rest = spec.split("=", 1)
    header, block_n, stages, pp, *options = rest.split(":")
    if pp not in ("pp", "npp") or not set(options) <= {"nso", "whole"}:
        raise SystemExit(f"variant {name}: expected HEADER:BLOCK_N:STAGES:pp|npp[:nso][:whole], got {rest!r}")
    return name, header, int(block_n), int(stages), pp == "pp", "nso" not in options, "whole" in options


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
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    dtype_name = DTYPES[a.dtype]
    workdir = Path(tempfile.mkdtemp(prefix="cuflash_ab_"))
    current = ["fwd_sm90"]
    get_kernel = _compile.get_kernel
    split_plan = tail_split.plan

    def whole_plan(num_tiles, ctas, key_blocks):
        return tail_split.TailSplit(num_tiles, 0)

    def variant_kernel(family, name, smem):
        return get_kernel(current[0] if family == "fwd_sm90" else family, name, smem)

    _compile.get_kernel = variant_kernel
    variants = []
    for spec in a.variant:
        name, header, block_n, stages, pp, staged, whole = parse_variant(spec)
        cfg = FwdSm90Config(a.headdim, block_n, stages, pingpong=pp, stage_o=staged)
        if not cfg.supports(dtype_name):
            cfg = FwdSm90Config(a.headdim, block_n, stages, pingpong=pp, stage_o=False)
        variants.append((name, register_variant(name, header, workdir), cfg, whole_plan if whole else split_plan))

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
                q, k, v = (t.astype(bench_libs.cupy_dtype(dtype_name)) for t in x)
                descale = None
                out = cupy.empty_like(q)
            lse = cupy.empty((b, h, n), dtype=cupy.float32)
            problem = dispatch.FwdProblem(dtype_name, d, causal, n, n, 1, arch=90)
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            tb = [torch.from_dlpack(t).to(torch.bfloat16).transpose(1, 2) for t in x]

            def cudnn(tb=tb, causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(*tb, is_causal=causal)

            fns = {"cudnn-bf16": cudnn}
            ref, errors = None, {}
            for name, family, cfg, plan in variants:
                def run(family=family, cfg=cfg, plan=plan):
                    current[0] = family
                    tail_split.plan = plan
                    api.launch_fwd(cfg, problem, q, k, v, out, lse, 1 / math.sqrt(d), descale)

                out.view(cupy.uint16).fill(0x7FC0)  # NaN in bf16 and fp16
                try:  # compiles, and checks the variant before it is timed
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
                fns[name] = run
            ms = interleaved_ms(fns, a.rounds)
            for name, _, cfg, _ in variants:
                if name not in ms:
                    continue
                tf = flops / ms[name] / 1e9
                rows.append([d, n, causal, name, cfg.short_name(), f"{errors[name]:.1e}", f"{tf:.0f}",
                             f"{flops / ms['cudnn-bf16'] / 1e9:.0f}"])
                print(rows[-1], flush=True)
    tail_split.plan = split_plan
    print(tabulate(rows, headers=["d", "N", "causal", "variant", "config", "max diff vs first", "TFLOP/s",
                                  "cudnn bf16"]))


if __name__ == "__main__":
    main()
