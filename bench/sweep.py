"""Time forward kernel configurations against torch SDPA on the benchmark shapes.

Usage (on a GPU): PYTHONPATH=. python bench/sweep.py [--headdim 64,128] [--seqlen 2048,8192]
Each config is checked against a float32 torch reference before it is timed.
"""

import argparse
import math

import cupy
import numpy
from tabulate import tabulate

from cuflash import api, dispatch
from cuflash.config import FwdConfig, FwdSm90Config

CANDIDATES = {
    64: [FwdConfig(64, 64, 4, 2, 2), FwdSm90Config(64, 128, 3), FwdSm90Config(64, 128, 3, pingpong=False),
         FwdSm90Config(64, 176, 2), FwdSm90Config(64, 192, 3), FwdSm90Config(64, 192, 3, pingpong=False)],
    128: [FwdSm90Config(128, 128, 2), FwdSm90Config(128, 128, 2, pingpong=False), FwdSm90Config(128, 176, 2),
          FwdSm90Config(128, 176, 2, pingpong=False), FwdSm90Config(128, 128, 2, persistent=False)],
    256: [FwdConfig(256, 64, 4, 1, 2, q_in_regs=False), FwdSm90Config(256, 64, 2), FwdSm90Config(256, 80, 2),
          FwdSm90Config(256, 64, 2, pingpong=False), FwdSm90Config(256, 80, 2, pingpong=False)],
    # Head dims without a Hopper kernel of their own: the sm_80 kernel the
    # dispatcher picks against the next larger Hopper kernel (columns past the
    # head dim zero-filled by the tensor-map copies).
    32: [FwdConfig(32, 64, 4, 2, 2), FwdSm90Config(64, 192, 3)],
    96: [FwdConfig(96, 64, 4, 1, 2), FwdSm90Config(128, 128, 2)],
    160: [FwdConfig(160, 64, 4, 1, 2, q_in_regs=False), FwdSm90Config(256, 80, 2)],
    192: [FwdConfig(192, 32, 4, 1, 2, q_in_regs=False), FwdSm90Config(256, 80, 2)],
}


def time_ms(fn, repeats=20):
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


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--headdim", default="64,128")
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--only", default="", help="run only configs whose name contains this text")
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
                tflops = lambda ms: flops / ms / 1e9
                args = [x.transpose(1, 2) for x in (tq, tk, tv)]
                peers = {}
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel(be):
                        peers[name] = tflops(time_ms(lambda: F.scaled_dot_product_attention(*args, is_causal=causal)))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ref = F.scaled_dot_product_attention(*args, is_causal=causal).transpose(1, 2)
                problem = dispatch.FwdProblem(a.dtype, d, causal, n, n, 1)
                out = cupy.empty_like(q)
                lse = cupy.empty((b, h, n), dtype=cupy.float32)
                for cfg in [c for c in CANDIDATES[d] if a.only in c.short_name()]:
                    run = lambda: api.launch_fwd(cfg, problem, q, k, v, out, lse, 1 / math.sqrt(d))
                    try:
                        out.fill(float("nan"))
                        run()
                        err = float(cupy.abs(out.astype(cupy.float32) - cupy.from_dlpack(ref).astype(cupy.float32)).max())
                        t = tflops(time_ms(run))
                    except Exception as exc:  # report and keep sweeping
                        err, t = float("nan"), 0.0
                        print(cfg.short_name(), "failed:", str(exc)[:300])
                    rows.append([d, n, causal, cfg.short_name(), f"{err:.1e}", f"{t:.0f}",
                                 f"{peers['flash']:.0f}", f"{peers['cudnn']:.0f}", f"{t / peers['flash']:.2f}",
                                 f"{t / peers['cudnn']:.2f}"])
                    print(rows[-1], flush=True)
    print(tabulate(rows, headers=["d", "N", "causal", "config", "maxerr", "cuflash", "flash", "cudnn", "x flash", "x cudnn"]))


if __name__ == "__main__":
    main()
