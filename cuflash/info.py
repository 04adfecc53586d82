"""Environment report: ``python -m cuflash info``.

Prints what matters when a kernel fails to compile or runs slowly: the device
and its limits, the CuPy / CUDA / NVRTC versions, and the two on-disk caches
(CuPy's compiled-kernel cache and cuflash's tuning cache). Works without a GPU:
the device section then says "no CUDA device" and the exit status is still 0.
"""

from __future__ import annotations

import argparse
import os
import sys


def _cuda_version(encoded: int) -> str:
    # CUDA encodes versions as 1000 * major + 10 * minor (12090 -> 12.9).
    if not encoded:
        return "none found"
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _try(fn, default="unavailable"):
    try:
        return fn()
    except Exception as exc:
        return f"{default} ({type(exc).__name__}: {exc})"


def _nvrtc_version() -> str:
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        from cupy.cuda import nvrtc
    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def _cache_dir(env: str, default: str) -> str:
    path = os.environ.get(env) or os.path.expanduser(default)
    if os.path.isdir(path):
        state = f"{sum(1 for _ in os.scandir(path))} entries"
    else:
        state = "not created yet"
    source = f"${env}" if os.environ.get(env) else "default"
    return f"{path} ({source}, {state})"


def software_rows(cupy) -> list[tuple[str, str]]:
    runtime = cupy.cuda.runtime
    return [
        ("Python", sys.version.split()[0]),
        ("CuPy", cupy.__version__),
        ("CUDA runtime", _try(lambda: _cuda_version(runtime.runtimeGetVersion()))),
        ("CUDA driver", _try(lambda: _cuda_version(runtime.driverGetVersion()))),
        ("NVRTC", _try(_nvrtc_version)),
        ("CuPy kernel cache", _cache_dir("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")),
        ("cuflash tuning cache", _cache_dir("CUFLASH_CACHE_DIR", "~/.cache/cuflash")),
    ]


def device_rows(cupy) -> list[tuple[str, str]]:
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a driver older than the runtime
        return [("device", f"no CUDA device ({type(exc).__name__}: {exc})")]
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


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="python -m cuflash info",
        description="Print the GPU, CUDA/CuPy/NVRTC versions and cache locations.",
    ).parse_args(argv)
    try:
        import cupy
    except Exception as exc:
        print(f"CuPy: cannot import ({type(exc).__name__}: {exc})")
        return 0
    rows = device_rows(cupy) + software_rows(cupy)
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
