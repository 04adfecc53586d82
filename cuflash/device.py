"""The GPU a call runs on: CuPy's import, device facts (memoised) and the check that cuflash runs there.

The lowest layer with launch and compile: nothing here imports another cuflash module.
"""

from __future__ import annotations

import functools

import numpy

# The oldest GPU generation cuflash runs on (Ampere, cp.async and mma.sync).
MIN_COMPUTE_CAPABILITY = 80
# Compute capability of the Hopper kernels (wgmma and TMA need exactly sm_90a).
HOPPER = 90


def cupy():
    """The cupy module, imported on first use with a hint where it is missing."""
    try:
        import cupy as module
    except ImportError:
        raise ImportError(
            "cuflash needs CuPy: pip install 'cuflash[cuda12]' (or [cuda13]) to get CuPy and NVRTC"
        ) from None
    return module


# Where a failed device check points the user.
INFO_HINT = "(`python -m cuflash info` shows what was found)"


def cuda_version(encoded: int) -> str:
    """A CUDA version as CUDA encodes it, 1000 * major + 10 * minor (12090 -> "12.9"); 0: none."""
    if not encoded:
        return "none found"
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def runtime_problem(exc: Exception) -> str:
    """What a failed CUDA runtime query says about the machine, in words. CUDA reports a missing
    driver and a driver older than the runtime alike (cudaErrorInsufficientDriver); the driver's
    version tells them apart (0: none)."""
    runtime = cupy().cuda.runtime
    try:
        driver = runtime.driverGetVersion()
    except Exception:
        driver = 0
    text = str(exc)
    if driver == 0:
        return "no NVIDIA driver was found"
    if "InsufficientDriver" in text:
        return (f"the NVIDIA driver (CUDA {cuda_version(driver)}) is older than CuPy's CUDA runtime "
                f"({cuda_version(runtime.runtimeGetVersion())}): update the driver, or install the extra of "
                "an older CUDA (cuflash[cuda12])")
    if "NoDevice" in text:
        return "the NVIDIA driver sees no CUDA device"
    return f"the CUDA runtime failed: {text}"


@functools.lru_cache(maxsize=None)
def require_device(device_id: int) -> None:
    """Raises unless device_id is a GPU cuflash runs on (a pass is memoised: it is asked on every call)."""
    cp = cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, a driver too old, no device
        raise RuntimeError(f"cuflash needs a CUDA GPU: {runtime_problem(exc)} {INFO_HINT}") from None
    if count == 0:
        raise RuntimeError(f"cuflash needs a CUDA GPU: the NVIDIA driver sees no CUDA device {INFO_HINT}")
    cc = compute_capability(device_id)
    if cc < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"cuflash needs compute capability 8.0 (Ampere) or newer; device {device_id} has "
                           f"{cc // 10}.{cc % 10} {INFO_HINT}")


@functools.lru_cache(maxsize=None)
def max_smem_per_block(device_id: int) -> int:
    """Opt-in dynamic shared memory per block of a device, in bytes."""
    return int(cupy().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


# Shared memory the system keeps per resident block (sm_80 and sm_90), on top of the kernel's.
SMEM_RESERVED_PER_CTA = 1024


@functools.lru_cache(maxsize=None)
def max_smem_per_sm(device_id: int) -> int:
    """Shared memory per streaming multiprocessor, in bytes (what resident blocks share)."""
    return int(cupy().cuda.Device(device_id).attributes["MaxSharedMemoryPerMultiprocessor"])


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a device."""
    return int(cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    """Compute capability of a device as major * 10 + minor (90 for H100/H200)."""
    return int(cupy().cuda.Device(device_id).compute_capability)


class _StreamHandle:
    """A raw CUDA stream pointer under the CUDA stream protocol (what CuPy's Stream.from_external reads)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


def external_stream(ptr: int):
    """A CuPy stream over another library's CUDA stream (XLA's, torch's) on the current device: `with`
    it, cuflash launches there. Memoised on the pointer and the device (a CuPy stream belongs to the
    device current at its making, and torch's default stream is 0 on every device): a framework calls
    on the same few streams every time."""
    return _external_stream(ptr, cupy().cuda.runtime.getDevice())


class OnExternalStream:
    """`with OnExternalStream(device, ptr):` `device` (a CuPy Device) current, and the stream at `ptr`
    (external_stream, made on that device) CuPy's current stream; both restored on exit. The framework
    bindings run their calls so (cuflash.torch on torch's stream, cuflash.jax_callbacks on XLA's). A
    class rather than a generator context manager, which costs a generator and its wrapper a call."""

    __slots__ = ("device", "ptr", "stream")

    def __init__(self, device, ptr: int):
        self.device, self.ptr = device, ptr

    def __enter__(self):
        self.device.__enter__()
        try:
            self.stream = external_stream(self.ptr)
            self.stream.__enter__()
        except BaseException:
            self.device.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


@functools.lru_cache(maxsize=64)
def _external_stream(ptr: int, device_id: int):
    stream = cupy().cuda.Stream
    if hasattr(stream, "from_external"):
        return stream.from_external(_StreamHandle(ptr))
    return cupy().cuda.ExternalStream(ptr)  # CuPy < 14


def external_array(address: int, shape: tuple, strides: tuple, dtype, device_id: int, owner=None):
    """A CuPy array over another library's device memory (no copy): `strides` in elements, as torch
    reports them; `owner`, if given, is kept alive with the view (without one, the view is only
    valid while the caller holds the memory)."""
    cp = cupy()
    itemsize = numpy.dtype(dtype).itemsize
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    memory = cp.cuda.UnownedMemory(address, extent * itemsize, owner, device_id)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0), strides=tuple(s * itemsize for s in strides))


@functools.lru_cache(maxsize=4096)
def memoised_external_array(address: int, shape: tuple, strides: tuple | None, dtype, device_id: int):
    """external_array without an owner, memoised on its arguments: a framework that hands the same
    buffers on every step (a training loop's tensors, XLA's buffer assignment) gets its views back for
    a lookup. strides None: row-major, worked out only on a miss (worked out with numpy on every call,
    they took cuflash.jax's forward callback from 53 to 124 us of host time). The views own nothing:
    a caller uses one only while it holds the memory. 4,096 views cover the buffers of a few hundred
    attention calls a step."""
    if strides is None:
        row_major, step = [], 1
        for n in reversed(shape):
            row_major.append(step)
            step *= n
        strides = tuple(reversed(row_major))
    return external_array(address, shape, strides, dtype, device_id)


def stream_is_capturing() -> bool:
    """Whether CuPy's current stream is recording a CUDA graph (cupy.cuda.Stream.begin_capture)."""
    return cupy().cuda.get_current_stream().is_capturing()
