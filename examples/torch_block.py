"""A transformer block under torch.compile(fullgraph=True): cuflash's flash_attn_func next to SDPA.

One pre-norm block (LayerNorm, QKV projection, causal attention, output projection, LayerNorm, GELU
MLP), bf16, hidden 2048 in heads of --headdim, batch x seqlen = 16k tokens. Each variant is compiled
with fullgraph=True (a graph break fails the compile), checked against the eager cuflash block
(outputs and gradients), then timed by cuflash.timing: forward+backward ms per step between CUDA
events, the blocks in interleaved rounds (each one first, and after each other one, equally often),
the median of --steps; the SDPA blocks pinned to their backend inside the block (a context around
a compiled call does not reach its traced graph); the cuflash and SDPA cuDNN blocks also eager.

    python examples/torch_block.py [--seqlen 2048] [--headdim 128] [--steps 40]
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash import timing
from cuflash.bench.libs import TorchEvents
from cuflash.torch import flash_attn_func

HIDDEN, TOKENS = 2048, 16 * 1024


# SDPA's backends by name; pinned inside the block, so that a compiled block traces the pinned one.
BACKENDS = {"SDPA flash": SDPBackend.FLASH_ATTENTION, "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION}


class Block(torch.nn.Module):
    def __init__(self, headdim: int, attention: str):
        super().__init__()
        self.heads, self.headdim, self.attention = HIDDEN // headdim, headdim, attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def attend(self, q, k, v):  # (batch, seqlen, heads, headdim)
        if self.attention == "cuflash":
            return flash_attn_func(q, k, v, causal=True)
        with sdpa_kernel(BACKENDS[self.attention]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
        return out.transpose(1, 2)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seqlen, 3, self.heads, self.headdim).unbind(2)
        x = x + self.proj(self.attend(q, k, v).reshape(batch, seqlen, HIDDEN))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def step(model, x):
    out = model(x)
    out.float().square().mean().backward()
    return out


def step_calls(model, x) -> timing.Calls:
    """Forward+backward steps of `model` as a subject for cuflash.timing."""
    return timing.Calls([lambda: step(model, x)], TorchEvents(torch))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(TOKENS // args.seqlen, args.seqlen, HIDDEN, device="cuda", dtype=torch.bfloat16)

    reference = Block(args.headdim, "cuflash").cuda().bfloat16()
    eager_out = step(reference, x)
    eager_grads = [p.grad.clone() for p in reference.parameters()]

    subjects, compiled = {}, {}
    for name in ("cuflash", *BACKENDS):
        model = Block(args.headdim, name).cuda().bfloat16()
        model.load_state_dict(reference.state_dict())
        compiled[name] = model, torch.compile(model, fullgraph=True)
        subjects[name] = step_calls(compiled[name][1], x)
    # The cuflash and SDPA cuDNN blocks uncompiled too: what torch.compile does to the rest of the block.
    for name in ("cuflash", "SDPA cuDNN"):
        model = Block(args.headdim, name).cuda().bfloat16()
        model.load_state_dict(reference.state_dict())
        subjects[name + " eager"] = step_calls(model, x)
    times = timing.time_calls(subjects, repeats=args.steps)
    results = {}
    for name, t in times.items():
        if "error" in t:  # a backend that does not take this shape
            print(f"{name:16s} skipped: {t['error']}")
        else:
            results[name] = t["ms"]
    model, compiled_block = compiled["cuflash"]  # the compiled cuflash block against the eager one
    for p in model.parameters():
        p.grad = None
    out = step(compiled_block, x)
    worst = max([(out - eager_out).abs().max().item()] +
                [(p.grad - g).abs().max().item() for p, g in zip(model.parameters(), eager_grads)])
    print(f"cuflash compiled (fullgraph) against eager: max abs difference {worst:.3e}")
    print(f"batch {TOKENS // args.seqlen} x seqlen {args.seqlen}, hidden {HIDDEN}, head dim {args.headdim}, bf16, "
          "causal; forward+backward ms per step (median):")
    for name, ms in results.items():
        print(f"{name:18s} {ms:8.3f} ms")
    # Speed ratios: compiled against compiled, eager against eager, and against the fastest SDPA block.
    best_sdpa = min((ms for name, ms in results.items() if name.startswith("SDPA")), default=None)
    for ours, peer in (("cuflash", "SDPA cuDNN"), ("cuflash eager", "SDPA cuDNN eager")):
        if ours in results and peer in results:
            print(f"{ours} over {peer}: {results[peer] / results[ours]:.3f}x")
    if best_sdpa and "cuflash" in results:
        print(f"cuflash over the fastest SDPA block: {best_sdpa / results['cuflash']:.3f}x")


if __name__ == "__main__":
    main()
