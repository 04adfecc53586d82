"""Time forward kernel configurations against torch SDPA on the benchmark shapes.

Usage (on a GPU): PYTHONPATH=. python bench/sweep.py [--headdim 64,128] [--seqlen 2048,8192] [--rounds N]
Each config is checked against torch-flash's output before it is timed; then
the configs and both peers are timed in interleaved rounds in a balanced order
(cuflash.timing.time_calls).
"""

import argparse
import math

import cupy
from tabulate import tabulate

from cuflash import dispatch, launch, timing
from cuflash.bench.libs import TorchEvents
from cuflash.config import FwdConfig, FwdSm90Config
from cuflash.tune_common import benchmark_heads


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
    192: [hopper(256, 80, 2), hopper(192, 64, 2), hopper(192, 64, 3), hopper(192, 80, 2),
          hopper(192, 80, 2, stage_o=False), hopper(192, 96, 2), hopper(192, 112, 2),
          hopper(192, 112, 2, pingpong=False)],
    # Head dims without a Hopper kernel of their own: the sm_80 kernel the
    # dispatcher picks, or a larger Hopper kernel, against the next larger
    # Hopper kernel (columns past the head dim zero-filled by the tensor-map copies).
    32: [FwdConfig(32, 64, 4, 2, 2), hopper(64, 192, 3)],
    96: [FwdConfig(96, 64, 4, 1, 2), hopper(128, 128, 2)],
    160: [hopper(256, 80, 2), hopper(192, 80, 2), hopper(192, 112, 2)],
}


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--headdim", default="64,128")
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--only", default="", help="run only configs whose name contains this text")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timing rounds (default: enough to complete the order design)")
    p.add_argument("--repeats", type=int, default=70, help="timed calls per config and peer (median)")
    a = p.parse_args()
    rows = []
    for d in map(int, a.headdim.split(",")):
        for n in map(int, a.seqlen.split(",")):
            for causal in (False, True):
                h, b = benchmark_heads(d), 16384 // n
                tq = torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, a.dtype))
                tk, tv = torch.randn_like(tq), torch.randn_like(tq)
                q, k, v = (cupy.from_dlpack(x) for x in (tq, tk, tv))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                args = [x.transpose(1, 2) for x in (tq, tk, tv)]

                def peer(backend, args=args, causal=causal):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(*args, is_causal=causal)

                peers = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
                events = TorchEvents(torch)
                entries = {name: timing.Calls([lambda be=be: peer(be)], events) for name, be in peers.items()}
                ref = cupy.from_dlpack(peer(peers["flash"]).transpose(1, 2).contiguous()).astype(cupy.float32)
                problem = dispatch.FwdProblem(a.dtype, d, causal, n, n, 1)
                out = cupy.empty_like(q)
                lse = cupy.empty((b, h, n), dtype=cupy.float32)
                errors = {}
                for cfg in [c for c in CANDIDATES[d] if a.only in c.short_name()]:
                    run = lambda cfg=cfg: launch.launch_fwd(cfg, problem, q, k, v, out, lse, 1 / math.sqrt(d))
                    try:  # compiles, and checks the config before it is timed
                        out.fill(float("nan"))
                        run()
                        errors[cfg.short_name()] = float(cupy.abs(out.astype(cupy.float32) - ref).max())
                        entries[cfg.short_name()] = timing.Calls([run])
                    except Exception as exc:  # report and keep sweeping
                        print(cfg.short_name(), "failed:", str(exc)[:300])
                timed = timing.time_calls(entries, a.repeats, rounds=a.rounds)
                tflops = {name: flops / t["ms"] / 1e9 for name, t in timed.items() if "ms" in t}
                for name, err in errors.items():
                    mine, flash, cudnn = (tflops.get(x, math.nan) for x in (name, "flash", "cudnn"))
                    rows.append([d, n, causal, name, f"{err:.1e}", f"{mine:.0f}", f"{flash:.0f}", f"{cudnn:.0f}",
                                 f"{mine / flash:.2f}", f"{mine / cudnn:.2f}"])
                    print(rows[-1], flush=True)
    print(tabulate(rows, headers=["d", "N", "causal", "config", "maxerr", "cuflash", "flash", "cudnn", "x flash",
                                  "x cudnn"]))


if __name__ == "__main__":
    main()
