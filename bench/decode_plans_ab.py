"""Same-run A/B of the decoding steps' cluster plans: the tree's dispatch.decode_cluster_plan against
another checkout's (a dispatch.py given with --base), on the same steps (bench/decode_ab.py: device time
of CUDA-graph replays next to torch-cudnn; fp16, head dim 128, 32 query heads).

Usage (on a GPU):  PYTHONPATH=. python bench/decode_plans_ab.py --base OLD/cuflash/dispatch.py [--rounds 4]
                                                                 [--page-size N] [--steps I,J,...]

Prints each arm's plan (grid, warps, ring stages, CTAs a cluster, whether the combine kernel runs), µs per step,
the largest difference from the base plan's output, and the tree's time over the base's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from unittest import mock

from cuflash import dispatch

from decode_ab import parser, run

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
    arguments = parser(__doc__)
    arguments.add_argument("--base", required=True, help="the dispatch.py whose decode_cluster_plan is the base")
    arguments.add_argument("--steps", default=None, help="comma-separated indices into STEPS (default: all)")
    args = arguments.parse_args()
    steps = STEPS if args.steps is None else [STEPS[int(i)] for i in args.steps.split(",")]
    base = base_rule(args.base)
    arms = {"base": lambda: mock.patch.object(dispatch, "decode_cluster_plan", base), "tree": contextlib.nullcontext}
    run(steps, arms, args.page_size, args.rounds)


if __name__ == "__main__":
    main()
