"""Time backward configurations (forward + backward) against torch SDPA.

Usage (on a GPU): PYTHONPATH=. python bench/bwd_sweep.py [--headdim 64,128] [--seqlen 2048,8192] [--rounds N]
Each config's gradients are checked against torch's flash backward first;
then the configs and both peers are timed in interleaved rounds in a balanced
order (cuflash.timing.time_calls). A config's call is cuflash's forward (the
heuristic table's) plus that config's backward launched directly.
"""

import argparse
import dataclasses
import math

import cupy
from tabulate import tabulate

import cuflash
from cuflash import dispatch, launch, timing
from cuflash.bench.libs import TorchEvents
from cuflash.config import BwdConfig
from cuflash.tune_common import benchmark_heads

# (config, deterministic). dkdv_chunk_m: queries whose scores the sm_80
# dK/dV kernel holds at once (0: the whole block); hopper: the sm_90a dK/dV
# kernel (cuda_src/bwd_sm90.cuh), in 2 and (head dim 128) 3 stages; at 160-256
# the wide one (bwd_sm90_wide.cuh) at 192 (dQ steps of 32 and 64 keys) and 256,
# against the sm_80 table's tiles: what SM90_PADDED's choice for the backward rests on.
_H64 = dispatch.HEURISTIC_BWD_SM90[64]
_H128 = dataclasses.replace(dispatch.HEURISTIC_BWD_SM90[128], stages=2)
_H192 = dispatch.HEURISTIC_BWD_SM90[192]
_H192_DQ32 = dataclasses.replace(_H192, dq_block_n=32)
_H256 = dispatch.HEURISTIC_BWD_SM90[256]
CANDIDATES = {
    64: [(_H64, False), (BwdConfig(64, 128, 8, 4, 64), False),
         (BwdConfig(64, 128, 8, 4, 64, dkdv_chunk_m=64), False), (_H64, True), (BwdConfig(64, 128, 8, 4, 64), True)],
    96: [(_H128, False), (BwdConfig(96, 64, 8, 4, 64), False)],
    128: [(_H128, False), (dataclasses.replace(_H128, stages=3), False), (BwdConfig(128, 64, 8, 4, 64), False),
          (BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=32), False), (_H128, True),
          (dataclasses.replace(_H128, stages=3), True), (BwdConfig(128, 64, 8, 4, 64), True)],
    **{kd: [(_H192, False), (_H192, True), (_H192_DQ32, False), (_H256, False), (dispatch.HEURISTIC_BWD[kd], False)]
       for kd in (160, 192)},
    **{kd: [(_H256, False), (_H256, True), (dispatch.HEURISTIC_BWD[kd], False)] for kd in (224, 256)},
}


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--headdim", default="64,128")
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timing rounds (default: enough to complete the order design)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per config and peer (median)")
    a = p.parse_args()
    rows = []
    for d in map(int, a.headdim.split(",")):
        for n in map(int, a.seqlen.split(",")):
            for causal in (False, True):
                h, b = benchmark_heads(d), 16384 // n
                tq, tk, tv, tdo = (torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, a.dtype))
                                   for _ in range(4))
                flops = 3.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                tq_, tk_, tv_ = (x.transpose(1, 2).detach().requires_grad_() for x in (tq, tk, tv))

                def peer(backend, causal=causal, tq_=tq_, tk_=tk_, tv_=tv_, tdo=tdo):
                    with sdpa_kernel(backend):
                        o = F.scaled_dot_product_attention(tq_, tk_, tv_, is_causal=causal)
                        return torch.autograd.grad(o, (tq_, tk_, tv_), tdo.transpose(1, 2))

                peers = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
                events = TorchEvents(torch)
                entries = {name: timing.Calls([lambda be=be: peer(be)], events) for name, be in peers.items()}
                ref = [cupy.from_dlpack(g.transpose(1, 2)).astype(cupy.float32) for g in peer(peers["flash"])]
                q, k, v, do = (cupy.from_dlpack(x) for x in (tq, tk, tv, tdo))
                grads = tuple(cupy.empty_like(x) for x in (q, k, v))
                errors = {}
                for cfg, det in CANDIDATES[d]:
                    problem = dispatch.BwdProblem(a.dtype, d, causal, n, n, 1, det, arch=90)

                    def run(cfg=cfg, problem=problem):
                        with dispatch.heuristic_only():  # the table's forward, not a tuned one
                            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                        launch.launch_bwd(cfg, problem, 1 / math.sqrt(d), q, k, v, do, out, lse, *grads)

                    name = cfg.short_name() + ("_det" if det else "")
                    try:  # compiles, and checks the config before it is timed
                        for g in grads:
                            g.fill(float("nan"))
                        run()
                        errors[name] = max(float(cupy.abs(g.astype(cupy.float32) - r).max())
                                           for g, r in zip(grads, ref))
                        entries[name] = timing.Calls([run])
                    except Exception as exc:  # report and keep sweeping
                        print(name, "failed:", str(exc)[:400])
                timed = timing.time_calls(entries, a.repeats, rounds=a.rounds)
                tflops = {name: flops / t["ms"] / 1e9 for name, t in timed.items() if "ms" in t}
                for name, err in errors.items():
                    mine, flash, cudnn = (tflops.get(x, math.nan) for x in (name, "flash", "cudnn"))
                    rows.append([d, n, causal, name, f"{err:.1e}", f"{mine:.0f}", f"{flash:.0f}", f"{cudnn:.0f}",
                                 f"{mine / flash:.2f}"])
                    print(rows[-1], flush=True)
    print(tabulate(rows, headers=["d", "N", "causal", "config", "maxerr", "cuflash", "flash", "cudnn", "x flash"]))


if __name__ == "__main__":
    main()
