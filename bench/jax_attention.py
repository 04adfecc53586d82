"""cuflash.jax inside jax.jit against JAX's cuDNN attention and cuflash's eager calls, forward+backward.

    PYTHONPATH=. python bench/jax_attention.py [--json PATH]

Each row: batch x seqlen = 16k tokens, hidden 2048, fp16. A step is the
jitted gradient of sum(out * dout) with respect to q, k and v (one forward
and one backward). The jitted steps run on XLA's stream, so they are timed by
cuflash.timing's HostEvents: a timed call is STEPS steps launched back to back,
between device-wide synchronisations, and a step's time is the call's over
STEPS. "eager" times STEPS calls of cuflash.attention (return_lse) plus
cuflash.attention_backward between CUDA events on CuPy's stream. The three are
timed in cuflash.timing's interleaved rounds. TFLOP/s count 3.5 forward
passes, halved for causal.
"""

from __future__ import annotations

import argparse
import json

import cupy
import jax
import jax.numpy as jnp
import numpy as np

import cuflash
import cuflash.jax
from cuflash import timing
from cuflash.bench.shapes import TOKENS
from cuflash.tune_common import benchmark_heads

STEPS = 20  # jitted steps per timed call
REPEATS = 6  # timed calls per subject: one per round of the order design


def steps(fn, *args):
    """A timed call: STEPS calls of fn launched back to back."""
    def call():
        for _ in range(STEPS):
            fn(*args)
    return call


def eager_step(q, k, v, dout, causal):
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)


def row_subjects(headdim: int, seqlen: int, causal: bool) -> tuple[dict[str, timing.Calls], float]:
    """The three subjects of one row, and the row's forward+backward FLOP count."""
    batch, nheads = TOKENS // seqlen, benchmark_heads(headdim)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((batch, seqlen, nheads, headdim), dtype=np.float32).astype(np.float16)
            for _ in range(4)]
    q, k, v, dout = (jnp.asarray(x) for x in host)

    def grad_of(attn):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    ours = grad_of(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=causal))
    cudnn = grad_of(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                 implementation="cudnn"))
    flops = 3.5 * 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
    host_clock = timing.HostEvents()
    entries = {"cuflash.jax": timing.Calls([steps(ours, q, k, v)], host_clock),
               "jax-cudnn": timing.Calls([steps(cudnn, q, k, v)], host_clock),
               "eager": timing.Calls([steps(eager_step, *(cupy.asarray(x) for x in host), causal)])}
    return entries, flops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for headdim in (64, 128):
        for seqlen in (2048, 8192, 16384):
            for causal in (False, True):
                entries, flops = row_subjects(headdim, seqlen, causal)
                results = timing.time_calls(entries, REPEATS)
                failed = {name: result["error"] for name, result in results.items() if "error" in result}
                if failed:
                    print(json.dumps({"headdim": headdim, "seqlen": seqlen, "causal": causal, "errors": failed}),
                          flush=True)
                    continue
                row = {"headdim": headdim, "seqlen": seqlen, "causal": causal,
                       **{name: result["ms"] / STEPS for name, result in results.items()}}
                for name in ("cuflash.jax", "jax-cudnn", "eager"):
                    row[name + " TFLOP/s"] = round(flops / row[name] / 1e9, 1)
                row["jit/eager"] = round(row["cuflash.jax"] / row["eager"], 3)
                row["x cudnn"] = round(row["jax-cudnn"] / row["cuflash.jax"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
