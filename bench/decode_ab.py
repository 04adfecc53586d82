"""The harness of the decoding steps' same-run A/Bs (decode_plans_ab.py, decode_halved_rows_ab.py): each
step planned under every arm, timed as CUDA-graph replays in interleaved rounds (cuflash.timing), next
to torch-cudnn over the same contiguous cache.

A step is (kv heads, batch, cache tokens, queries, e4m3 cache); cuflash.bench.decode's steps: fp16,
head dim 128, 32 query heads, causal where there are several queries. An arm is a name and a context
manager factory under which cuflash plans the step; the first arm is the base. Where an arm plans the
base's launch again, it is not timed twice. With a page size, every 16-bit step runs over a paged copy
of its cache (pages of that many tokens, the table shuffled).
"""

from __future__ import annotations

import argparse

import cupy

from cuflash import kv_cache, timing
from cuflash.bench.decode import GRAPH_STEPS, MAX_INPUT_SETS, Step, _torch_sdpa, cupy_graph, torch_graph
from cuflash.bench.libs import TorchEvents
from cuflash.bench.measure import device_info, optional_torch


def launch_plan(launch) -> tuple:
    """What tells two arms' launches apart: grid, warps, ring stages, CTAs a cluster, whether the combine
    kernel runs."""
    return launch.grid, launch.threads // 32, launch.cfg.stages, launch.cluster, launch.combine is not None


def run(steps: list, arms: dict, page_size: int = 0, rounds: int = 4) -> None:
    """Print, a line per step, each arm's plan, µs per step and largest difference from the base arm's
    output, torch-cudnn's µs, and the last arm's time over the base's."""
    base = next(iter(arms))
    torch = optional_torch()
    device = device_info()
    print(f"device: {device['name']} (NVRTC {device['nvrtc']})", flush=True)
    for nheads_kv, batch, cache, nq, fp8 in steps:
        if page_size and fp8:
            continue
        cache_bytes = batch * nheads_kv * cache * 128 * 2 * (1 if fp8 else 2)
        sets = min(MAX_INPUT_SETS, timing.input_set_count(cache_bytes, device["l2_bytes"]))
        inputs = [Step(batch, cache, nheads_kv, nq, cupy.float16, seed=s) for s in range(sets)]
        plans, outs, entries = {}, {}, {}
        for arm, context in arms.items():
            with context():
                kv_cache._plans.clear()  # the next call plans its launch under this arm
                fns = [s.fp8() if fp8 else s.paged(page_size) if page_size else s.contiguous() for s in inputs]
                fns[0]()
            plans[arm] = launch_plan(next(iter(kv_cache._plans.plans.values())).launch)
            outs[arm] = inputs[0].out.copy()
            if arm == base or plans[arm] != plans[base]:
                entries[arm] = cupy_graph(timing.Calls(fns))
        name = (f"{nheads_kv} kv heads, batch {batch}, cache {cache}, {nq} queries{', e4m3' if fp8 else ''}"
                f"{f', pages of {page_size}' if page_size else ''}")
        if len(entries) == 1:
            print(f"{name}: the same plan {plans[base]}", flush=True)
            continue
        if torch is not None and not fp8:
            runs = [_torch_sdpa(torch, s, "cudnn") for s in inputs]
            entries["torch-cudnn"] = torch_graph(torch, timing.Calls(runs, TorchEvents(torch)))
        results = timing.time_calls(entries, repeats=30, rounds=rounds)
        line = name + ":"
        for subject, r in results.items():
            us = r["ms"] * 1e3 / GRAPH_STEPS
            if subject in plans:
                diff = float(cupy.abs(outs[subject].astype(cupy.float32) - outs[base].astype(cupy.float32)).max())
                line += f" | {subject} {plans[subject]} {us:.2f} us (diff {diff:.0e})"
            else:
                line += f" | {subject} {us:.2f} us"
        last = list(arms)[-1]
        ratio = results[last]["ms"] / results[base]["ms"] if last in results else 1.0
        print(line + f" | {last} / {base} {ratio:.3f}", flush=True)
        del inputs, outs, entries
        cupy.get_default_memory_pool().free_all_blocks()


def parser(doc: str) -> argparse.ArgumentParser:
    """An A/B script's command line: --rounds and --page-size (a script may add its own)."""
    arguments = argparse.ArgumentParser(description=doc.splitlines()[0])
    arguments.add_argument("--rounds", type=int, default=4)
    arguments.add_argument("--page-size", type=int, default=0, help="0: contiguous caches")
    return arguments


def main(doc: str, steps: list, arms: dict) -> None:
    """Run the A/B of `steps` under `arms` with the command line's rounds and page size."""
    args = parser(doc).parse_args()
    run(steps, arms, args.page_size, args.rounds)
