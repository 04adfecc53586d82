"""Time forward kernel configurations against torch SDPA on the benchmark shapes.

Usage (on a GPU): PYTHONPATH=. python bench/sweep.py [--headdim 64,128] [--seqlen 2048,8192] [--rounds 7]
Each config is checked against torch-flash's output before it is timed; then
the configs and both peers are timed in interleaved rounds (interleaved_ms).
"""

import argparse
import math

import cupy
import numpy
from tabulate import tabulate

from cuflash import api, dispatch
from cuflash.config import FwdConfig, FwdSm90Config



def hopper(*args, **fields) -> FwdSm90Config:
    """A Hopper config; unless stage_o is given, its output tile staged in shared memory where that fits
    (as the tuner's)."""
    cfg = FwdSm90Config(*args, **fields)
    return cfg if "stage_o" in fields else cfg.staged_if_fits()


CANDIDATES = {
    64: [FwdConfig(64, 64, 4, 2, 2), hopper(64, 128, 3), hopper(64, 128, 3, pingpong=False),
         hopper(64, 176, 2), hopper(64, 192, 3), hopper(64, 192, 3, stage_o=False),
         hopper(64, 192, 3, pingpong=False)],
    128: [hopper(128, 128, 2), hopper(128, 128, 2, stage_o=False), hopper(128, 128, 2, pingpong=False),
          hopper(128, 176, 2), hopper(128, 176, 2, pingpong=False), hopper(128, 128, 2, persistent=False)],
    256: [FwdConfig(256, 64, 4, 1, 2, q_in_regs=False), hopper(256, 64, 2), hopper(256, 80, 2),
          hopper(256, 64, 2, pingpong=False), hopper(256, 80, 2, pingpong=False)],
    # Head dims without a Hopper kernel of their own: the sm_80 kernel the
    # dispatcher picks against the next larger Hopper kernel (columns past the
    # head dim zero-filled by the tensor-map copies).
    32: [FwdConfig(32, 64, 4, 2, 2), hopper(64, 192, 3)],
    96: [FwdConfig(96, 64, 4, 1, 2), hopper(128, 128, 2)],
    160: [FwdConfig(160, 64, 4, 1, 2, q_in_regs=False), hopper(256, 80, 2)],
    192: [FwdConfig(192, 32, 4, 1, 2, q_in_regs=False), hopper(256, 80, 2)],
}


def time_ms(fn, repeats=20):
    """Median of single calls, each between its own event pair (bench/bwd_sweep.py's timer)."""
    for _ in range(10):  # warm-up: clocks settle after a compile
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(numpy.median(times))


def back_to_back_ms(fn, calls=20):
    """Mean time of `calls` calls queued back to back between one event pair (host launch time hidden)."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / calls


def interleaved_ms(fns: dict, rounds: int) -> dict:
    """Median over rounds of each function's back-to-back time. Every round times
    every function once, starting one place further along the list: a variant
    timed first in every round measured 5-10% low in A/B runs (bench/PERFLOG.md)."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(back_to_back_ms(fns[name]))
    return {name: float(numpy.median(t)) for name, t in times.items()}


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--headdim", default="64,128")
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--only", default="", help="run only configs whose name contains this text")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median)")
    a = p.parse_args()
    rows = []
    for d in map(int, a.headdim.split(",")):
        for n in map(int, a.seqlen.split(",")):
            for causal in (False, True):
                h, b = 2048 // d, 16384 // n
                tq = torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, a.dtype))
                tk, tv = torch.randn_like(tq), torch.randn_like(tq)
                q, k, v = (cupy.from_dlpack(x) for x in (tq, tk, tv))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                args = [x.transpose(1, 2) for x in (tq, tk, tv)]

                def peer(backend, args=args, causal=causal):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(*args, is_causal=causal)

                fns = {"flash": lambda: peer(SDPBackend.FLASH_ATTENTION),
                       "cudnn": lambda: peer(SDPBackend.CUDNN_ATTENTION)}
                ref = cupy.from_dlpack(fns["flash"]().transpose(1, 2).contiguous()).astype(cupy.float32)
                problem = dispatch.FwdProblem(a.dtype, d, causal, n, n, 1)
                out = cupy.empty_like(q)
                lse = cupy.empty((b, h, n), dtype=cupy.float32)
                errors = {}
                for cfg in [c for c in CANDIDATES[d] if a.only in c.short_name()]:
                    run = lambda cfg=cfg: api.launch_fwd(cfg, problem, q, k, v, out, lse, 1 / math.sqrt(d))
                    try:  # compiles, and checks the config before it is timed
                        out.fill(float("nan"))
                        run()
                        errors[cfg.short_name()] = float(cupy.abs(out.astype(cupy.float32) - ref).max())
                        fns[cfg.short_name()] = run
                    except Exception as exc:  # report and keep sweeping
                        print(cfg.short_name(), "failed:", str(exc)[:300])
                ms = interleaved_ms(fns, a.rounds)
                tflops = {name: flops / t / 1e9 for name, t in ms.items()}
                for name, err in errors.items():
                    t = tflops[name]
                    rows.append([d, n, causal, name, f"{err:.1e}", f"{t:.0f}", f"{tflops['flash']:.0f}",
                                 f"{tflops['cudnn']:.0f}", f"{t / tflops['flash']:.2f}", f"{t / tflops['cudnn']:.2f}"])
                    print(rows[-1], flush=True)
    print(tabulate(rows, headers=["d", "N", "causal", "config", "maxerr", "cuflash", "flash", "cudnn", "x flash",
                                  "x cudnn"]))


if __name__ == "__main__":
    main()
