"""Environment report: ``python -m cuflash info``.

Prints what matters when a kernel fails to compile or runs slowly: the device
and its limits, the CuPy / CUDA / NVRTC versions, the two on-disk caches
(CuPy's compiled-kernel cache and cuflash's tuning cache, with its entries),
and with --headdim/--seqlen the forward config such a call would use and why.
Works without a GPU: the device section then says "no CUDA device" and the
exit status is still 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..compile import nvrtc_version
from ..device import cuda_version, runtime_problem


def _try(fn, default="unavailable"):
    try:
        return fn()
    except Exception as exc:
        return f"{default} ({type(exc).__name__}: {exc})"


def _cache_dir(env: str, default: str) -> str:
    path = os.environ.get(env) or os.path.expanduser(default)
    if os.path.isdir(path):
        state = f"{sum(1 for _ in os.scandir(path))} entries"
    else:
        state = "not created yet"
    source = f"${env}" if os.environ.get(env) else "default"
    return f"{path} ({source}, {state})"


def _tuning_cache_dir() -> str:
    from ..tune_cache import cache_dir

    path = cache_dir()
    files = sorted(path.glob("*.json")) if path.is_dir() else []
    state = f"{len(files)} device file(s)" if path.is_dir() else "not created yet"
    source = "$CUFLASH_CACHE_DIR" if os.environ.get("CUFLASH_CACHE_DIR") else "default"
    return f"{path} ({source}, {state})"


def software_rows(cupy) -> list[tuple[str, str]]:
    runtime = cupy.cuda.runtime
    return [
        ("Python", sys.version.split()[0]),
        ("CuPy", cupy.__version__),
        ("CUDA runtime", _try(lambda: cuda_version(runtime.runtimeGetVersion()))),
        ("CUDA driver", _try(lambda: cuda_version(runtime.driverGetVersion()))),
        ("NVRTC", _try(nvrtc_version)),
        ("CuPy kernel cache", _cache_dir("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")),
        ("cuflash tuning cache", _tuning_cache_dir()),
    ]


def device_rows(cupy) -> list[tuple[str, str]]:
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a driver older than the runtime
        return [("device", f"no CUDA device: {runtime_problem(exc)}")]
    if count == 0:
        return [("device", "no CUDA device")]
    device = cupy.cuda.Device()
    props = runtime.getDeviceProperties(device.id)
    attrs = device.attributes
    cc = device.compute_capability
    return [
        ("device", f"{device.id} of {count}: {props['name'].decode()}"),
        ("compute capability", f"{cc[:-1]}.{cc[-1]} (sm_{cc})"),
        ("SMs", str(attrs["MultiProcessorCount"])),
        ("shared memory per block (opt-in)", f"{attrs['MaxSharedMemoryPerBlockOptin'] // 1024} KiB"),
        ("L2 cache", f"{attrs['L2CacheSize'] / 2**20:.0f} MiB"),
        ("device memory", f"{props['totalGlobalMem'] / 2**30:.1f} GiB"),
    ]


def _has_device(cupy) -> bool:
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


ENTRY_HEADERS = ["problem", "tuned", "TFLOP/s", "heuristic", "TFLOP/s", "speedup", "timed+rejected", "space",
                 "tuned at"]


def entry_row(key: str, entry: dict) -> list:
    """A tuning cache entry as a table row (ENTRY_HEADERS); tolerates missing fields."""
    heuristic = entry.get("heuristic") or {}
    try:
        speedup = f"{heuristic['ms'] / entry['ms']:.2f}"
    except (KeyError, TypeError, ZeroDivisionError):
        speedup = "?"

    def tflops(e):
        return f"{e['tflops']:.1f}" if isinstance(e.get("tflops"), (int, float)) else "?"

    rejected = entry.get("rejected")
    checked = f"{entry.get('timed', '?')}+{len(rejected) if isinstance(rejected, list) else '?'}"
    return [key, entry.get("config_name", "?"), tflops(entry), heuristic.get("config_name", "?"),
            tflops(heuristic), speedup, checked, entry.get("space", "?"), entry.get("tuned_at", "?")]


def tuning_cache_report(current=None) -> str:
    """Every device file in the tuning cache with its entries; `current` marks this device's file."""
    from tabulate import tabulate

    from .. import compile as _compile
    from .. import tune_cache

    directory = tune_cache.cache_dir()
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if not files:
        return f"tuning cache: nothing tuned yet in {directory}"
    lines = []
    for path in files:
        mark = " (this device)" if current is not None and path == tune_cache.cache_path(current) else ""
        data, problem = tune_cache.read_file(path)
        if data is None:
            lines.append(f"tuning cache {path}{mark}: unusable, {problem}")
            continue
        stale = data.get("source_hash") != _compile.source_hash()
        lines.append(f"tuning cache {path}{mark}: {data.get('device')} sm_{data.get('compute_capability')}, "
                     f"{len(data['entries'])} entries for kernel sources {data.get('source_hash')}"
                     + (" (stale: the kernels changed since; unused)" if stale else ""))
        if data["entries"] and not stale:
            rows = [entry_row(key, entry) for key, entry in sorted(data["entries"].items())]
            lines.append(tabulate(rows, headers=ENTRY_HEADERS, disable_numparse=True))
    return "\n".join(lines)


def choice_report(problem, has_device: bool) -> str:
    """Which forward config a call with `problem` runs, and why."""
    from .. import dispatch
    from ..tune_fwd import FWD

    lines = [f"call: {problem}", f"cache key: {FWD.key(problem)}"]
    if has_device:
        cfg, source = dispatch.fwd_config(problem)
        entry, usable = FWD.cached(problem)
    else:
        cfg, source, entry, usable = dispatch.heuristic_fwd_config(problem), "heuristic", None, None
    lines.append(f"config: {cfg.short_name()}  {cfg}")
    if source == "cache":
        _, _, tflops, heuristic, heuristic_tflops, _, _, space, tuned_at = entry_row(FWD.key(problem), entry)
        lines.append(f"source: cache hit (tuned {tuned_at}, {space} space: {tflops} TFLOP/s vs the "
                     f"heuristic {heuristic} {heuristic_tflops})")
        return "\n".join(lines)
    fast, _ = dispatch.HEURISTIC_FWD[problem.kernel_headdim]
    row = ("fast row: head dim equals the kernel's and the tiles divide the lengths" if cfg == fast
           else "general row")
    if not has_device:
        why = "no CUDA device, so no tuning cache to consult"
    elif entry is None:
        why = "no cache entry for this key"
    elif usable is None:
        why = "the cache entry's config does not fit this version of cuflash"
    else:
        why = "the tuning cache is bypassed"
    lines.append(f"source: heuristic ({why}; {row})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cuflash info",
        description="Print the GPU, CUDA/CuPy/NVRTC versions, cache locations and tuned configurations. "
                    "With --headdim or --seqlen, also the forward config such a call would use and why.",
    )
    parser.add_argument("--headdim", type=int, help="head dim of the call to explain (default 128)")
    parser.add_argument("--seqlen", help="query length of the call to explain, e.g. 4096 or 4k (default 4k)")
    parser.add_argument("--seqlen-k", help="key length (default: --seqlen)")
    parser.add_argument("--dtype", default="fp16", help="fp16 or bf16 (default fp16)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--group", type=int, default=1, help="query heads per kv head (default 1)")
    args = parser.parse_args(argv)
    problem = None
    if args.headdim is not None or args.seqlen is not None:
        from ..bench.options import dtype_option, seqlen_option
        from ..dispatch import FwdProblem

        try:
            seqlen_q = seqlen_option(args.seqlen or "4k")
            seqlen_k = seqlen_option(args.seqlen_k) if args.seqlen_k else seqlen_q
            problem = FwdProblem(dtype_option(args.dtype), args.headdim or 128, args.causal, seqlen_q, seqlen_k,
                                 args.group)
            problem.kernel_headdim  # raises for an unsupported head dim
        except ValueError as exc:
            parser.error(str(exc))
    try:
        import cupy
    except Exception as exc:
        print(f"CuPy: cannot import ({type(exc).__name__}: {exc})")
        return 0
    rows = device_rows(cupy) + software_rows(cupy)
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")

    from .. import tune_cache

    has_device = _has_device(cupy)
    print()
    print(tuning_cache_report(tune_cache.current_device() if has_device else None))
    if problem is not None:
        if has_device:  # the call as this device would see it (shared memory, Hopper kernels)
            from .. import device

            device_id = cupy.cuda.Device().id
            problem = dataclasses.replace(problem, max_smem=device.max_smem_per_block(device_id),
                                          arch=device.compute_capability(device_id))
        print()
        print(choice_report(problem, has_device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
