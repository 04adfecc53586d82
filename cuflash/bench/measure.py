"""Timing a row's libraries with cuflash.timing, and what every mode needs around it: the device's facts,
input sets that outgrow L2, freeing memory between rows, progress on stderr."""

from __future__ import annotations

import sys

import cupy
import ml_dtypes
import numpy

from cuflash import timing
from cuflash.compile import nvrtc_version

from .libs import Skip

# Time spent per library and shape before repeats are cut: the forward's
# default, and forward+backward's (a call costs ~3.5 forwards; the default
# run stays at ~2-3 minutes on an H100).
BUDGET_MS = 3000.0
BWD_BUDGET_MS = 1500.0


def optional_torch():
    """torch where it is installed (the peers' library), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def first_dtype(args):
    """The NumPy dtype of the first --dtype (fp16 without one)."""
    return ml_dtypes.bfloat16 if args.dtypes[0] == "bfloat16" else numpy.float16


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def device_info() -> dict:
    """The GPU's facts, and the NVRTC that compiled the kernels (its releases' code differs: PERFLOG,
    "ALiBi's column GEMM under NVRTC 13.5")."""
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    return {
        "name": props["name"].decode(),
        "compute_capability": device.compute_capability,
        "sm_count": device.attributes["MultiProcessorCount"],
        "l2_bytes": device.attributes["L2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
        "nvrtc": nvrtc_version(),
    }


def input_sets(make, set_bytes: int, l2_bytes: int) -> list:
    """make(seed) for seeds 0, 1, ...: enough input sets to rotate over that L2 never holds the next call's."""
    return [make(seed) for seed in range(timing.input_set_count(set_bytes, l2_bytes))]


def release_memory(torch_libs) -> None:
    timing.synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    if torch_libs:
        torch_libs[0].torch.cuda.empty_cache()


def time_libraries(libs, causal: bool, sets, repeats: int, flops: float, budget_ms: float = BUDGET_MS,
                   lib_flops: dict | None = None) -> dict:
    """Time `libs` on `sets` (tuples of prepare's inputs) in interleaved rounds (cuflash.timing.time_calls).

    lib_flops: the FLOPs of libraries whose calls count other than `flops` (a window's visible entries), by name.
    Returns lib name -> {"ms", "min_ms", "repeats", "tflops"}, {"skipped": why} or {"error": one line}.
    """
    entries, results = {}, {}
    for lib in libs:
        try:
            fns = [lib.prepare(*inputs, causal) for inputs in sets]
            entries[lib.name] = timing.Calls(fns, lib.events, lib.context)
        except Skip as exc:
            results[lib.name] = {"skipped": str(exc)}
        except Exception as exc:
            results[lib.name] = {"error": timing.describe(exc)}
    try:
        results.update(timing.time_calls(entries, repeats, budget_ms))
    finally:
        entries = None
        timing.synchronize()
    for name, result in results.items():
        if "ms" in result:
            result["tflops"] = (lib_flops or {}).get(name, flops) / (result["ms"] * 1e-3) / 1e12
    return {lib.name: results[lib.name] for lib in libs}
