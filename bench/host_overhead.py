"""Host time per repeated call, and per-call speed where host time counts, against torch SDPA.

    PYTHONPATH=. python bench/host_overhead.py [--json PATH]

Host time: 2,000 back-to-back calls of a problem whose GPU time is a few
microseconds (batch 1, 128 tokens, 1 head, head dim 64, fp16), one
synchronise at the end, wall time / 2,000. The GPU never catches up with
the host, so this is the host's cost of a call. The libraries take turns
for ROUNDS rounds, and each row reports the median (and min) of its rounds:
a host's speed drifts over seconds (one pass read 35 us for a call that
another process had read at 13 a minute earlier on the same host), and
alternating spreads the drift over every library alike.

Per-call speed: CUDA events around each single call (the GPU idle before
it, so the call's host time before its launch counts), median of 200, at
512 and 1k tokens, head dim 128, fp16, 16 heads; batch 1 and the
benchmark's 16k tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import cupy

import cuflash

CALLS = 2000
ROUNDS = 7
SINGLE_CALLS = 200


def host_us(fn, calls: int = CALLS) -> float:
    for _ in range(50):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def single_call_ms(fn, calls: int = SINGLE_CALLS) -> float:
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(10):
        fn()
    for _ in range(calls):
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def libraries(q, k, v):
    """name -> (a context to time it in, a call on these inputs)."""
    out = cupy.empty_like(q)
    lse = cupy.empty((q.shape[0], q.shape[2], q.shape[1]), cupy.float32)
    libs = {"cuflash": (contextlib.nullcontext, lambda: cuflash.attention(q, k, v)),
            "cuflash out=": (contextlib.nullcontext, lambda: cuflash.attention(q, k, v, out=out, lse=lse))}
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return libs
    qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # torch launches on its current stream: CuPy's, so that both are timed on one stream.
    stream = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr)
    for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
        @contextlib.contextmanager
        def context(backend=backend):
            with torch.cuda.stream(stream), sdpa_kernel(backend):
                yield
        libs[name] = (context, lambda: sdpa(qt, kt, vt))
    return libs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    gen = cupy.random.default_rng(0)
    with cupy.cuda.Stream(non_blocking=True):
        q, k, v = (gen.standard_normal((1, 128, 1, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
        rounds: dict = {}
        libs = libraries(q, k, v)
        for _ in range(ROUNDS):
            for name, (context, fn) in libs.items():
                with context():
                    rounds.setdefault(name, []).append(host_us(fn))
        for name, times in rounds.items():
            rows.append({"measure": "host us/call", "lib": name, "value": statistics.median(times),
                         "min": min(times)})
        for tokens in (512, 1024):
            for batch in (1, 16384 // tokens):
                q, k, v = (gen.standard_normal((batch, tokens, 16, 128), dtype=cupy.float32).astype(cupy.float16)
                           for _ in range(3))
                flops = 4.0 * batch * 16 * tokens * tokens * 128
                for name, (context, fn) in libraries(q, k, v).items():
                    with context():
                        ms = single_call_ms(fn)
                    rows.append({"measure": f"TFLOP/s single call, {batch}x{tokens}", "lib": name,
                                 "value": flops / ms / 1e9})
    for row in rows:
        least = f"   (min {row['min']:.2f})" if "min" in row else ""
        print(f"{row['measure']:<36} {row['lib']:<14} {row['value']:10.2f}{least}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
