"""`python -m cuflash check`: compile every shipped kernel specialisation with
NVRTC (no GPU needed) and report registers, shared memory and spills.

Exits non-zero on any compile error, or on any spill in a head-dim 64/128
kernel (the fast paths).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys

from tabulate import tabulate

from . import compile as _compile
from .config import DTYPE_NAMES
from .dispatch import HEURISTIC_FWD

FAST_PATH_HEADDIMS = (64, 128)


def shipped_specialisations():
    """(family, config, name expression) of every kernel the dispatcher can launch."""
    specs = []
    for fast, general in HEURISTIC_FWD.values():
        for dtype_name, causal in itertools.product(DTYPE_NAMES, (False, True)):
            # The fast config runs only on even lengths with d equal to its head dim.
            specs.append((fast, fast.name_expression(dtype_name, causal, True, True)))
            for even_n, even_d in itertools.product((True, False), repeat=2):
                specs.append((general, general.name_expression(dtype_name, causal, even_n, even_d)))
    unique = {name: cfg for cfg, name in specs}
    return [(cfg.family, cfg, name) for name, cfg in unique.items()]


def _compile_one(job):
    family, name, arch = job
    return _compile.compile_report(family, name, arch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash check", description=__doc__)
    parser.add_argument("--arch", action="append", help="target, e.g. sm_80 or sm_90 (repeatable; default sm_80, sm_90)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    parser.add_argument("--verbose", action="store_true", help="print every kernel, not only a summary per config")
    args = parser.parse_args(argv)
    archs = args.arch or ["sm_80", "sm_90"]

    specs = shipped_specialisations()
    jobs = [(family, name, arch) for arch in archs for family, _, name in specs]
    print(f"compiling {len(jobs)} kernel specialisations for {', '.join(archs)} with {args.jobs} processes ...",
          flush=True)
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        reports = pool.map(_compile_one, jobs, chunksize=1)

    cfg_of = {name: cfg for _, cfg, name in specs}
    rows, failures = [], []
    for report in reports:
        cfg = cfg_of[report.name]
        fast = cfg.headdim in FAST_PATH_HEADDIMS
        if not report.ok:
            failures.append(f"compile error: {report.name} ({report.arch})\n{report.log}")
        elif report.spills and fast:
            failures.append(f"spills on a fast path: {report.name} ({report.arch}): {report.spills} bytes")
        if args.verbose or not report.ok or report.spills:
            rows.append([report.arch, report.name, report.registers, cfg.smem_bytes(), report.stack_bytes,
                         report.spills, "fast" if fast else ""])
    summary = {}
    for report in reports:
        key = (report.arch, cfg_of[report.name].short_name())
        regs, spills, count = summary.get(key, (0, 0, 0))
        summary[key] = (max(regs, report.registers), max(spills, report.spills), count + 1)
    print(tabulate([[a, c, n, r, s] for (a, c), (r, s, n) in sorted(summary.items())],
                   headers=["arch", "config", "kernels", "max registers", "max spill bytes"]))
    if rows:
        print()
        print(tabulate(rows, headers=["arch", "kernel", "registers", "smem bytes", "stack", "spill bytes", "path"]))
    print()
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    print(f"{len(reports)} kernels compiled, {sum(r.ok for r in reports)} ok, {len(failures)} failures")
    return 1 if failures else 0
