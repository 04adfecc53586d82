"""Device time of each launch of one backward, against torch SDPA cuDNN's whole backward.

Usage (on a GPU): PYTHONPATH=. python bench/bwd_pieces.py [--headdim 128] [--seqlen 2048,8192]

fp16, 16k tokens, hidden 2048, causal and not. The pieces are the launches of
launch.BwdLaunch.run (its `stages`; the heuristic's config, atomic dQ): the
preprocess (Delta, lse2, the dQ accumulator's zeroing), the dK/dV kernel, the
dQ convert ("dq"), and the whole backward; cuDNN's is the autograd backward of SDPA
with the cuDNN backend. All are timed in interleaved rounds (cuflash.timing).
"""

import argparse
import math

import cupy

import cuflash
from cuflash import dispatch, launch, timing
from cuflash.bench.libs import TorchEvents


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = argparse.ArgumentParser()
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen", default="2048,8192")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    d = a.headdim
    h = 2048 // d
    for n in map(int, a.seqlen.split(",")):
        for causal in (False, True):
            b = 16384 // n
            tq, tk, tv, tdo = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
            q, k, v, dout = (cupy.from_dlpack(x) for x in (tq, tk, tv, tdo))
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))
            device = cupy.cuda.Device().id
            problem = dispatch.BwdProblem("float16", d, causal, n, n, 1, False, arch=90)
            cfg = dispatch.bwd_tiles(d, dispatch.SM90_SMEM_LIMIT, 90, False)
            run = launch.prepare_bwd(cfg, problem, 1 / math.sqrt(d), q, k, v, dout, out, lse, dq, dk, dv, device)
            workspace = launch.BackwardWorkspace(run.floats, device)
            stream = cupy.cuda.get_current_stream().ptr

            def whole():
                run.run(q, k, v, dout, out, lse, dq, dk, dv, stream, workspace)

            whole()  # points the three launches' arguments at this call's arrays
            entries = {name: timing.Calls([lambda name=name: run.launch_stage(name, stream)]) for name in run.stages}
            entries["whole"] = timing.Calls([whole])
            tq_, tk_, tv_ = (x.transpose(1, 2).detach().requires_grad_() for x in (tq, tk, tv))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(tq_, tk_, tv_, is_causal=causal)
            entries["cudnn_backward"] = timing.Calls(
                [lambda o=o, tq_=tq_, tk_=tk_, tv_=tv_, tdo=tdo:
                 torch.autograd.grad(o, (tq_, tk_, tv_), tdo.transpose(1, 2), retain_graph=True)],
                TorchEvents(torch))
            results = timing.time_calls(entries, repeats=a.repeats)
            print(f"seqlen {n} causal {causal} batch {b}: "
                  + ", ".join(f"{name} {r['ms'] * 1000:.1f} us" if "ms" in r else f"{name} {r['error']}"
                              for name, r in results.items()), flush=True)


if __name__ == "__main__":
    main()
