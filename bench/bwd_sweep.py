"""Time backward configurations (forward + backward) against torch SDPA.

Usage (on a GPU): PYTHONPATH=. python bench/bwd_sweep.py [--headdim 64,128] [--seqlen 2048,8192]
Each config's gradients are checked against torch's flash backward first.
"""

import argparse
import dataclasses

import cupy
from sweep import time_ms  # bench/ is the script's directory
from tabulate import tabulate

import cuflash
from cuflash import backward, dispatch
from cuflash.config import BwdConfig

# (config, deterministic). dkdv_chunk_m: queries whose scores the sm_80
# dK/dV kernel holds at once (0: the whole block); hopper: the sm_90a dK/dV
# kernel (cuda_src/bwd_sm90.cuh), in 2 and (head dim 128) 3 stages.
_H64 = backward.HEURISTIC_BWD_SM90[64]
_H128 = dataclasses.replace(backward.HEURISTIC_BWD_SM90[128], stages=2)
CANDIDATES = {
    64: [(_H64, False), (BwdConfig(64, 128, 8, 4, 64), False),
         (BwdConfig(64, 128, 8, 4, 64, dkdv_chunk_m=64), False), (_H64, True), (BwdConfig(64, 128, 8, 4, 64), True)],
    96: [(_H128, False), (BwdConfig(96, 64, 8, 4, 64), False)],
    128: [(_H128, False), (dataclasses.replace(_H128, stages=3), False), (BwdConfig(128, 64, 8, 4, 64), False),
          (BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=32), False), (_H128, True),
          (dataclasses.replace(_H128, stages=3), True), (BwdConfig(128, 64, 8, 4, 64), True)],
}


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--headdim", default="64,128")
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--dtype", default="float16")
    a = p.parse_args()
    rows = []
    for d in map(int, a.headdim.split(",")):
        for n in map(int, a.seqlen.split(",")):
            for causal in (False, True):
                h, b = max(2048 // d, 1), 16384 // n
                tq, tk, tv, tdo = (torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, a.dtype))
                                   for _ in range(4))
                flops = 3.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                tflops = lambda ms: flops / ms / 1e9
                tq_, tk_, tv_ = (x.transpose(1, 2).detach().requires_grad_() for x in (tq, tk, tv))
                peers, ref = {}, None
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel(be):
                        def step():
                            o = F.scaled_dot_product_attention(tq_, tk_, tv_, is_causal=causal)
                            return torch.autograd.grad(o, (tq_, tk_, tv_), tdo.transpose(1, 2))
                        if name == "flash":
                            ref = [g.transpose(1, 2) for g in step()]
                        peers[name] = tflops(time_ms(step))
                q, k, v, do = (cupy.from_dlpack(x) for x in (tq, tk, tv, tdo))
                for cfg, det in CANDIDATES[d]:
                    # The table entries the heuristic reads: the Hopper one first, where present.
                    backward.HEURISTIC_BWD_SM90 = {cfg.headdim: cfg} if cfg.hopper else {}
                    if not cfg.hopper:
                        backward.HEURISTIC_BWD[d] = cfg
                    def run():
                        with dispatch.heuristic_only():  # the table entry above, not a tuned one
                            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                            return cuflash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                              deterministic=det)
                    try:
                        grads = run()
                        err = max(float(cupy.abs(g.astype(cupy.float32) - cupy.from_dlpack(r).astype(cupy.float32)).max())
                                  for g, r in zip(grads, ref))
                        t = tflops(time_ms(run, repeats=10))
                    except Exception as exc:
                        err, t = float("nan"), 0.0
                        print(cfg, "failed:", str(exc)[:400])
                    name = cfg.short_name() + ("_det" if det else "")
                    rows.append([d, n, causal, name, f"{err:.1e}", f"{t:.0f}", f"{peers['flash']:.0f}",
                                 f"{peers['cudnn']:.0f}", f"{t / peers['flash']:.2f}"])
                    print(rows[-1], flush=True)
    print(tabulate(rows, headers=["d", "N", "causal", "config", "maxerr", "cuflash", "flash", "cudnn", "x flash"]))


if __name__ == "__main__":
    main()
