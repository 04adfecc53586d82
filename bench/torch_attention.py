"""cuflash.torch under torch.compile against SDPA's cuDNN and flash backends, forward+backward.

    PYTHONPATH=. python bench/torch_attention.py [--json PATH]

Each row: batch x seqlen = 16k tokens, hidden 2048, fp16. A step is one
compiled (fullgraph) attention call plus torch.autograd.grad for a fixed
output gradient; the time is CUDA events around 20 steps on torch's stream,
best of 3. TFLOP/s count 3.5 forward passes, halved for causal.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash.torch import flash_attn_func

TOKENS, HIDDEN, STEPS = 16 * 1024, 2048, 20


def step_ms(fn, q, k, v, dout) -> float:
    def step():
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS):
            step()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / STEPS)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for headdim in (64, 128):
        for seqlen in (2048, 8192):
            for causal in (False, True):
                batch, nheads = TOKENS // seqlen, HIDDEN // headdim
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
                row = {"headdim": headdim, "seqlen": seqlen, "causal": causal,
                       "cuflash.torch": step_ms(ours, q, k, v, dout),
                       "sdpa-cudnn": step_ms(sdpa(SDPBackend.CUDNN_ATTENTION), q, k, v, dout),
                       "sdpa-flash": step_ms(sdpa(SDPBackend.FLASH_ATTENTION), q, k, v, dout)}
                for name in ("cuflash.torch", "sdpa-cudnn", "sdpa-flash"):
                    row[name + " TFLOP/s"] = round(flops / row[name] / 1e9, 1)
                row["x cudnn"] = round(row["sdpa-cudnn"] / row["cuflash.torch"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
