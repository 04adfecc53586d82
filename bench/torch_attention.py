"""cuflash.torch under torch.compile against SDPA's cuDNN (eager and compiled) and flash backends, forward+backward.

    PYTHONPATH=. python bench/torch_attention.py [--headdim 64,128] [--seqlen 2048,8192] [--json PATH]

Each row: batch x seqlen = 16k tokens, hidden 2048, fp16. A step is one
compiled (fullgraph) attention call plus torch.autograd.grad for a fixed
output gradient; the subjects are timed by cuflash.timing (CUDA events
around each step on torch's stream, interleaved rounds, median of 40).
SDPA cuDNN runs eager and compiled: torch.compile adds about 0.4 ms of host
time to a step (bench/PERFLOG.md), which the GPU waits for where a step is
short. TFLOP/s count 3.5 forward passes, halved for causal.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash import timing
from cuflash.bench.libs import TorchEvents
from cuflash.bench.shapes import TOKENS
from cuflash.tune_common import benchmark_heads
from cuflash.torch import flash_attn_func

STEPS = 40  # timed steps per subject: 5 a round, so one slow moment of the host moves few of them


def step_calls(fn, q, k, v, dout) -> timing.Calls:
    """One forward+backward step of `fn` as a subject for cuflash.timing."""
    def step():
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)
    return timing.Calls([step], TorchEvents(torch))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", default="64,128")
    parser.add_argument("--seqlen", default="2048,8192")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for headdim in map(int, args.headdim.split(",")):
        for seqlen in map(int, args.seqlen.split(",")):
            for causal in (False, True):
                batch, nheads = TOKENS // seqlen, benchmark_heads(headdim)
                q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.float16)
                                 for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                ours = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), fullgraph=True)

                def sdpa(backend):
                    def call(q, k, v):
                        with sdpa_kernel(backend):
                            out = torch.nn.functional.scaled_dot_product_attention(
                                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
                        return out.transpose(1, 2)
                    return call
                flops = 3.5 * 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
                subjects = {"cuflash.torch": ours, "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                            "sdpa-cudnn compiled": torch.compile(sdpa(SDPBackend.CUDNN_ATTENTION), fullgraph=True),
                            "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION)}
                times = timing.time_calls({name: step_calls(fn, q, k, v, dout) for name, fn in subjects.items()},
                                          repeats=STEPS)
                failed = {name: t["error"] for name, t in times.items() if "error" in t}
                if failed:
                    raise RuntimeError(f"headdim {headdim} seqlen {seqlen} causal {causal}: {failed}")
                row = {"headdim": headdim, "seqlen": seqlen, "causal": causal,
                       **{name: t["ms"] for name, t in times.items()}}
                for name in subjects:
                    row[name + " TFLOP/s"] = round(flops / row[name] / 1e9, 1)
                row["x cudnn"] = round(row["sdpa-cudnn"] / row["cuflash.torch"], 3)
                row["x cudnn compiled"] = round(row["sdpa-cudnn compiled"] / row["cuflash.torch"], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
