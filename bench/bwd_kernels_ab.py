"""Same-run A/B of the backward's Hopper table kernels against the sm_80 table kernels at a head dim.

Usage (on a GPU):
  PYTHONPATH=. python bench/bwd_kernels_ab.py --headdim 256 --headdim 192 [--seqlen 2048,8192] [--dtype bf16]

For each shape (16k tokens, hidden 2048, causal and not) both configurations are prepared through
launch.prepare_bwd (with a workspace, so no call allocates), their gradients are compared (largest
difference over the largest value, per gradient), and their device times are taken in interleaved
rounds (cuflash.timing). What it decided: which head dims run the Hopper kernels (dispatch.py's
SM90_BWD_PADDED), bench/results/bwd_wide_ab_h100.txt.
"""

from __future__ import annotations

import argparse

import cupy
import ml_dtypes

import cuflash
from cuflash import dispatch, launch
from cuflash.config import kernel_headdim
from cuflash.timing import Calls, time_calls

DTYPES = {"fp16": ("float16", cupy.float16), "bf16": ("bfloat16", ml_dtypes.bfloat16)}
TOKENS, HIDDEN = 16384, 2048


def compare(headdim: int, dtype: str, seqlen: int, causal: bool, repeats: int) -> str:
    dtype_name, element = DTYPES[dtype]
    kd = kernel_headdim(headdim)
    hopper = dispatch.hopper_bwd_config(kd, 90)
    nheads, batch = HIDDEN // dispatch.hopper_bwd_headdim(kd), TOKENS // seqlen
    q, k, v, dout = (cupy.random.standard_normal((batch, seqlen, nheads, headdim), dtype=cupy.float32).astype(element)
                     for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    problem = dispatch.BwdProblem(dtype_name, headdim, causal, seqlen, seqlen, 1, False, arch=90)
    calls, grads = {}, {}
    for name, cfg in (("hopper", hopper), ("sm80", dispatch.HEURISTIC_BWD[kd])):
        g = [cupy.empty_like(x) for x in (q, k, v)]
        run = launch.prepare_bwd(cfg, problem, headdim ** -0.5, q, k, v, dout, out, lse, *g, cupy.cuda.Device().id)
        workspace = launch.BackwardWorkspace(run.floats, cupy.cuda.Device().id)

        def call(run=run, g=g, workspace=workspace):
            run.run(q, k, v, dout, out, lse, *g, cupy.cuda.get_current_stream().ptr, workspace)

        call()
        grads[name] = [x.astype(cupy.float32) for x in g]
        calls[name] = Calls([call])
    diffs = [float(cupy.abs(a - b).max() / cupy.abs(b).max()) for a, b in zip(grads["hopper"], grads["sm80"])]
    times = time_calls(calls, repeats=repeats)
    flops = 10.0 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
    parts = ", ".join(f"{name} {t['ms'] * 1e3:.0f}us {flops / t['ms'] / 1e9:.0f}TF" for name, t in times.items())
    return (f"d{headdim} {dtype_name} N={seqlen} causal={causal}: {parts}; hopper/sm80 time "
            f"{times['hopper']['ms'] / times['sm80']['ms']:.3f}; max rel diff dq,dk,dv "
            + ", ".join(f"{x:.1e}" for x in diffs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdim", type=int, action="append", required=True)
    parser.add_argument("--seqlen", default="2048,8192", help="comma-separated sequence lengths")
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="default: bf16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for headdim in args.headdim:
        if dispatch.hopper_bwd_config(kernel_headdim(headdim), 90) is None:
            parser.error(f"--headdim {headdim} has no Hopper backward")
        for dtype in args.dtype or ["bf16"]:
            for causal in (False, True):
                for seqlen in (int(n) for n in args.seqlen.split(",")):
                    print(compare(headdim, dtype, seqlen, causal, args.repeats), flush=True)


if __name__ == "__main__":
    main()
