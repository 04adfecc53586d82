"""python -m cuflash autotune: tune this GPU's problems and print the cache entries."""

from __future__ import annotations

import argparse
import sys
import time

from tabulate import tabulate

from .. import tune_cache
from ..bench.options import dtype_option, list_option, seqlen_option
from ..bench.variants import window_and_softcap
from ..config import DTYPE_NAMES
from ..tuner import DEFAULT_HEADDIMS, PASSES, DeviceLimits, autotune
from .info import ENTRY_HEADERS, entry_row


def _table(results: dict[str, dict]) -> str:
    rows = [entry_row(key, entry) for key, entry in sorted(results.items())]
    return tabulate(rows, headers=ENTRY_HEADERS, disable_numparse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cuflash autotune",
        description="Find and cache the fastest forward and backward configurations per problem on this GPU.")
    parser.add_argument("--dtype", action="append", metavar="T", help="fp16 and/or bf16 (default: both)")
    parser.add_argument("--headdim", action="append", metavar="D", help="head dims, e.g. 64,128 (default: 64,128)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                        help="only causal (--causal) or only non-causal (--no-causal) problems")
    parser.add_argument("--seqlen", action="append", metavar="N",
                        help="sequence lengths, e.g. 1k,4k (default: 512..16k; --quick: 1k..8k)")
    parser.add_argument("--only", choices=PASSES, help="tune only the forward or only the backward (default: both)")
    parser.add_argument("--window", metavar="LEFT,RIGHT",
                        help="tune calls with this sliding window (W means W,W; -1 leaves a side unbounded)")
    parser.add_argument("--softcap", type=float, default=0.0, metavar="C", help="tune calls with this softcap")
    parser.add_argument("--alibi", action="store_true", help="tune calls with ALiBi slopes")
    parser.add_argument("--quick", action="store_true",
                        help="small candidate space, 10 repeats, seqlens 1k..8k: a few minutes")
    parser.add_argument("--clear", action="store_true", help="remove this device's cached entries first")
    parser.add_argument("--repeats", type=int, help="timed calls per candidate (default: 20; --quick: 10)")
    parser.add_argument("--jobs", type=int, help="compile threads (default: one per CPU)")
    args = parser.parse_args(argv)
    dtypes = list_option(parser, args.dtype, dtype_option, "--dtype") or list(DTYPE_NAMES)
    headdims = list_option(parser, args.headdim, int, "--headdim") or list(DEFAULT_HEADDIMS)
    seqlens = list_option(parser, args.seqlen, seqlen_option, "--seqlen") or None
    causal = (False, True) if args.causal is None else (args.causal,)
    if any(d % 8 or not 8 <= d <= 256 for d in headdims):
        parser.error("--headdim values must be multiples of 8 between 8 and 256")
    if seqlens and any(n <= 0 for n in seqlens):
        parser.error("--seqlen values must be positive")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    window, softcap = window_and_softcap(parser, args.window, args.softcap)

    started = time.perf_counter()
    try:
        passes = (args.only,) if args.only else PASSES
        results = autotune(dtypes=dtypes, headdims=headdims, causal=causal, seqlens=seqlens, passes=passes,
                           window_size=window, softcap=softcap, alibi=args.alibi, quick=args.quick,
                           clear=args.clear, repeats=args.repeats, jobs=args.jobs)
    except Exception as exc:
        print(f"cuflash autotune: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(_table(results))
    print(f"\n{len(results)} problems in {time.perf_counter() - started:.0f} s; "
          f"cache: {tune_cache.cache_path(DeviceLimits.current().device)}")
    return 0
