"""Same-run A/B of the decoding steps' cluster plans: the tree's dispatch.decode_cluster_plan against
another checkout's (a dispatch.py given with --base), on the same steps, device time of CUDA-graph
replays (cuflash.bench.decode's steps: fp16, head dim 128, 32 query heads).

Usage (on a GPU):  PYTHONPATH=. python bench/decode_plans_ab.py --base OLD/cuflash/dispatch.py [--rounds 4]
                                                                 [--page-size N]

Each step is planned with either rule; where the plans differ both are captured in a graph of
GRAPH_STEPS calls (rotating over input sets that together hold twice the L2 cache) and timed with
torch-cudnn over the same contiguous cache (16-bit steps) in interleaved rounds (cuflash.timing); with
--page-size, over a paged copy of each cache (pages of N tokens, the table shuffled; 16-bit steps only).
Prints each plan (splits, CTAs a cluster, whether the combine kernel runs), µs per step, the largest
difference from the base plan's output, and the tree's time over the base's.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys

import cupy

from cuflash import dispatch, kv_cache, timing
from cuflash.bench.decode import GRAPH_STEPS, MAX_INPUT_SETS, Step, _torch_sdpa, cupy_graph, torch_graph
from cuflash.bench.libs import TorchEvents
from cuflash.bench.measure import device_info, optional_torch

# (kv heads, batch, cache tokens, queries, e4m3 cache)
STEPS = [(1, b, c, 1, False) for b in (1, 2, 4, 8, 16) for c in (1024, 4096, 8192, 16384, 32768)]
STEPS += [(1, b, c, 1, False) for b in (1, 2) for c in (65536, 131072)]
STEPS += [(hk, b, c, 1, False) for hk in (2, 4) for b in (1, 2, 4) for c in (4096, 8192, 16384, 32768, 65536)]
STEPS += [(hk, b, c, 1, False) for hk, b, c in ((2, 1, 131072), (8, 1, 32768), (8, 4, 8192), (8, 8, 4096),
                                                 (4, 16, 4096), (2, 8, 16384), (4, 8, 8192), (2, 16, 8192))]
STEPS += [(1, 1, 1024, 8, False), (1, 1, 8192, 8, False), (1, 2, 4096, 8, False), (1, 32, 1024, 1, False)]
STEPS += [(1, 1, 8192, 1, True), (1, 4, 8192, 1, True), (4, 1, 8192, 1, True), (2, 2, 8192, 1, True),
          (1, 1, 32768, 1, True)]


def base_rule(path: str):
    """decode_cluster_plan of the dispatch module at `path`, imported as a sibling of cuflash.dispatch."""
    spec = importlib.util.spec_from_file_location("cuflash._base_dispatch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rule = module.decode_cluster_plan
    if "paged" in inspect.signature(rule).parameters:
        return rule
    return lambda *a, paged=False: rule(*a[:7])  # a rule from before the plan took the cache's layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the dispatch.py whose decode_cluster_plan is the base")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", default=None, help="comma-separated indices into STEPS (default: all)")
    parser.add_argument("--page-size", type=int, default=0, help="0: contiguous caches")
    args = parser.parse_args()
    steps_to_run = STEPS if args.steps is None else [STEPS[int(i)] for i in args.steps.split(",")]
    if args.page_size:
        steps_to_run = [step for step in steps_to_run if not step[4]]
    rules = {"base": base_rule(args.base), "tree": dispatch.decode_cluster_plan}
    chosen = {"rule": "tree", "plan": None}

    def planned(*a, **k):
        chosen["plan"] = rules[chosen["rule"]](*a, **k)
        return chosen["plan"]

    dispatch.decode_cluster_plan = planned
    torch = optional_torch()
    device = device_info()
    print(f"device: {device['name']} (NVRTC {device['nvrtc']})", flush=True)
    for nheads_kv, batch, cache, nq, fp8 in steps_to_run:
        cache_bytes = batch * nheads_kv * cache * 128 * 2 * (1 if fp8 else 2)
        sets = min(MAX_INPUT_SETS, timing.input_set_count(cache_bytes, device["l2_bytes"]))
        steps = [Step(batch, cache, nheads_kv, nq, cupy.float16, seed=s) for s in range(sets)]
        plans, outs, entries = {}, {}, {}
        for rule in rules:
            chosen["rule"] = rule
            kv_cache._plans.clear()  # the next call plans its launch with this rule
            fns = [s.fp8() if fp8 else s.paged(args.page_size) if args.page_size else s.contiguous() for s in steps]
            fns[0]()
            launch = next(iter(kv_cache._plans.plans.values())).launch
            plans[rule] = (launch.num_splits, chosen["plan"][1], launch.combine is not None)
            outs[rule] = steps[0].out.copy()
            if rule == "base" or plans[rule] != plans["base"]:
                entries[rule] = cupy_graph(timing.Calls(fns))
        chosen["rule"] = "tree"
        name = (f"{nheads_kv} kv heads, batch {batch}, cache {cache}, {nq} queries{', e4m3' if fp8 else ''}"
                f"{f', pages of {args.page_size}' if args.page_size else ''}")
        if len(entries) == 1:
            print(f"{name}: the same plan {plans['base']}", flush=True)
            continue
        if torch is not None and not fp8:
            runs = [_torch_sdpa(torch, s, "cudnn") for s in steps]
            entries["torch-cudnn"] = torch_graph(torch, timing.Calls(runs, TorchEvents(torch)))
        results = timing.time_calls(entries, repeats=30, rounds=args.rounds)
        line = name + ":"
        for subject, r in results.items():
            us = r["ms"] * 1e3 / GRAPH_STEPS
            if subject in plans:
                diff = float(cupy.abs(outs[subject].astype(cupy.float32) - outs["base"].astype(cupy.float32)).max())
                line += f" | {subject} {plans[subject]} {us:.2f} us (diff {diff:.0e})"
            else:
                line += f" | {subject} {us:.2f} us"
        print(line + f" | tree / base {results['tree']['ms'] / results['base']['ms']:.3f}", flush=True)
        del steps, outs, entries
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
