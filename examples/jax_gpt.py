"""A small GPT trained under jax.jit with cuflash attention, against JAX's cuDNN and XLA attention.

    PYTHONPATH=. python examples/jax_gpt.py [--steps 300] [--plot loss.png]

Byte-level language model on the repository's own text (README and docs),
4 layers, model width 512, 8 heads of 64, context 1024, batch 16, fp16
activations with fp32 parameters and Adam. Each attention implementation
trains the same model from the same initialisation on the same batches; the
script prints the loss every 50 steps and the step time (tokens/s) of each.
--plot saves the loss curves (needs matplotlib: pip install cuflash[examples]).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import cuflash.jax

ROOT = Path(__file__).resolve().parent.parent
LAYERS, WIDTH, HEADS, CONTEXT, BATCH = 4, 512, 8, 1024, 16


def corpus() -> np.ndarray:
    text = b"".join(p.read_bytes() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    return np.frombuffer(text, dtype=np.uint8)


def init(key):
    def dense(key, fan_in, fan_out):
        return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)
    keys = iter(jax.random.split(key, 4 * LAYERS + 2))
    layers = [dict(qkv=dense(next(keys), WIDTH, 3 * WIDTH), proj=dense(next(keys), WIDTH, WIDTH),
                   up=dense(next(keys), WIDTH, 4 * WIDTH), down=dense(next(keys), 4 * WIDTH, WIDTH))
              for _ in range(LAYERS)]
    return dict(embed=dense(next(keys), 256, WIDTH), pos=dense(next(keys), CONTEXT, WIDTH) * 0.1, layers=layers)


def attention_of(name):
    if name == "cuflash":
        return lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=name)


def loss_fn(params, tokens, attention):
    def norm(x):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    x = params["embed"][tokens[:, :-1]] + params["pos"]
    for layer in params["layers"]:
        h = norm(x).astype(jnp.float16)
        q, k, v = jnp.split(h @ layer["qkv"].astype(jnp.float16), 3, axis=-1)
        q, k, v = (t.reshape(*t.shape[:2], HEADS, WIDTH // HEADS) for t in (q, k, v))
        a = attention(q, k, v).reshape(*h.shape)
        x = x + (a @ layer["proj"].astype(jnp.float16)).astype(jnp.float32)
        h = norm(x).astype(jnp.float16)
        x = x + (jax.nn.gelu(h @ layer["up"].astype(jnp.float16)) @ layer["down"].astype(jnp.float16)).astype(
            jnp.float32)
    logits = norm(x) @ params["embed"].T
    labels = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))


def train(name, data, steps, seed=0):
    attention = attention_of(name)
    params = init(jax.random.key(seed))
    moments = jax.tree.map(lambda p: (jnp.zeros_like(p), jnp.zeros_like(p)), params)

    @jax.jit
    def step(params, moments, tokens, t):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, attention)
        lr, b1, b2 = 3e-4, 0.9, 0.95

        def update(p, g, m):
            mu, nu = b1 * m[0] + (1 - b1) * g, b2 * m[1] + (1 - b2) * g * g
            return p - lr * (mu / (1 - b1 ** t)) / (jnp.sqrt(nu / (1 - b2 ** t)) + 1e-8), (mu, nu)
        flat = jax.tree.map(update, params, grads, moments, is_leaf=lambda x: isinstance(x, jax.Array))
        new_params = jax.tree.map(lambda pm: pm[0], flat, is_leaf=lambda x: isinstance(x, tuple))
        new_moments = jax.tree.map(lambda pm: pm[1], flat, is_leaf=lambda x: isinstance(x, tuple))
        return new_params, new_moments, loss

    rng = np.random.default_rng(seed)
    losses, start = [], None
    for t in range(1, steps + 1):
        starts = rng.integers(0, len(data) - CONTEXT - 1, BATCH)
        tokens = jnp.asarray(np.stack([data[s:s + CONTEXT + 1] for s in starts]).astype(np.int32))
        params, moments, loss = step(params, moments, tokens, t)
        if t == 10:  # past compilation
            jax.block_until_ready(loss)
            start = time.perf_counter()
        if t % 50 == 0:
            losses.append((t, float(loss)))
            print(f"{name:8s} step {t:4d}  loss {float(loss):.3f}", flush=True)
    jax.block_until_ready(params)
    step_s = (time.perf_counter() - start) / (steps - 10)
    return losses, step_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plot")
    args = parser.parse_args()
    data = corpus()
    results = {name: train(name, data, args.steps) for name in ("cuflash", "cudnn", "xla")}
    for name, (_, step_s) in results.items():
        print(f"{name:8s} {step_s * 1e3:7.2f} ms/step  {BATCH * CONTEXT / step_s:10.0f} tokens/s")
    if args.plot:
        import matplotlib.pyplot as plt

        for name, (losses, _) in results.items():
            plt.plot(*zip(*losses), label=name)
        plt.xlabel("step")
        plt.ylabel("loss")
        plt.legend()
        plt.savefig(args.plot)


if __name__ == "__main__":
    main()
