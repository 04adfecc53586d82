"""cuflash.jax inside jax.jit against JAX's cuDNN attention and cuflash's eager calls, forward+backward.

    PYTHONPATH=. python bench/jax_attention.py [--json PATH]

Each row: batch x seqlen = 16k tokens, hidden 2048, fp16. A step is the
jitted gradient of sum(out * dout) with respect to q, k and v (one forward
and one backward); its time is the wall time of 20 steps launched back to
back, then one block_until_ready, per step. "eager" times cuflash.attention
(return_lse) plus cuflash.attention_backward between CUDA events on CuPy's
stream. TFLOP/s count 3.5 forward passes, halved for causal.
"""

from __future__ import annotations

import argparse
import json
import time

import cupy
import jax
import jax.numpy as jnp
import numpy as np

import cuflash
import cuflash.jax
from cuflash.bench.shapes import HIDDEN, TOKENS

STEPS = 20  # steps per timed batch


def step_time_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(STEPS):
            result = fn(*args)
        jax.block_until_ready(result)
        best = min(best, (time.perf_counter() - start) / STEPS * 1e3)
    return best


def eager_ms(q, k, v, dout, causal) -> float:
    def step():
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    step()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(STEPS):
            step()
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / STEPS)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for headdim in (64, 128):
        for seqlen in (2048, 8192, 16384):
            for causal in (False, True):
                batch, nheads = TOKENS // seqlen, HIDDEN // headdim
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
                row = {"headdim": headdim, "seqlen": seqlen, "causal": causal,
                       "cuflash.jax": step_time_ms(ours, q, k, v), "jax-cudnn": step_time_ms(cudnn, q, k, v),
                       "eager": eager_ms(*(cupy.asarray(x) for x in host), causal)}
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
