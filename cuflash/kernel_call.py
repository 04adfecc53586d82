"""Kernel launches through the driver's cuLaunchKernel, with arguments packed once.

A launch hands the driver an array of pointers, one per kernel parameter, to
the parameter's bytes. `KernelArgs` keeps those bytes in one buffer, so a
repeated call rewrites only what changed (array addresses, tensor maps) and
launches: about 1 us of host time, against ~10 us for CuPy's launch of the
Hopper forward's 26 arguments, which converts every argument on every call.

Argument kinds: a CuPy array (its device address, 8 bytes), a numpy scalar
(int32, int64, float32: its bytes), a tensor map (a 16-word uint64 array from
cuflash.tma: 128 bytes, passed by value), a struct (its bytes as uint64 words).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Callable

import numpy

from . import compile as _compile

# cudaError / CUresult 201: the calling thread has no current context (a
# thread's first CUDA call through the driver API rather than the runtime).
_CUDA_ERROR_INVALID_CONTEXT = 201
_WORD = 8  # bytes: every argument starts on an 8-byte boundary of the buffer


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda's cuLaunchKernel, cuGetErrorName, cuLaunchKernelEx, cuFuncSetAttribute and
    cuOccupancyMaxActiveClusters.

    cuLaunchKernel has no argtypes: its arguments arrive as ready ctypes
    objects (c_void_p, c_uint) or small Python ints, which ctypes passes
    without the per-argument conversion argtypes costs (~3 us a launch).
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(f"cuflash needs the CUDA driver (libcuda.so.1): {exc}") from None
    launch = lib.cuLaunchKernel
    launch.restype = ctypes.c_int
    error_name = lib.cuGetErrorName
    error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    error_name.restype = ctypes.c_int
    launch_ex = lib.cuLaunchKernelEx
    launch_ex.restype = ctypes.c_int
    set_attribute = lib.cuFuncSetAttribute
    set_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    set_attribute.restype = ctypes.c_int
    active_clusters = lib.cuOccupancyMaxActiveClusters
    active_clusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p]
    active_clusters.restype = ctypes.c_int
    return launch, error_name, launch_ex, set_attribute, active_clusters


def _make_current(device_id: int) -> None:
    """Bind the device's primary context to this thread, which never made it current (its first CUDA
    call came through the driver API rather than the runtime)."""
    import cupy

    cupy.cuda.runtime.setDevice(device_id)


def _error_text(code: int) -> str:
    name = ctypes.c_char_p()
    _driver()[1](code, ctypes.byref(name))
    return name.value.decode() if name.value else f"CUresult {code}"


class KernelArgs:
    """A kernel's argument bytes and the pointer array cuLaunchKernel reads; slots rewritten in place.

    The driver copies the bytes before cuLaunchKernel returns, so the buffer may
    be rewritten for the next launch at once. Threads that share one must hold
    a lock from the first rewrite to the launch.
    """

    def __init__(self, values):
        self.words: list[int] = []  # the buffer word where each argument starts
        chunks, offset = [], 0
        for value in values:
            raw = _raw_bytes(value)
            raw += b"\0" * (-len(raw) % _WORD)
            self.words.append(offset // _WORD)
            chunks.append(raw)
            offset += len(raw)
        # One join and one copy: packing argument by argument cost ~100 us for the Hopper forward.
        self.buffer = numpy.frombuffer(bytearray(b"".join(chunks) or bytes(_WORD)), numpy.uint64)
        base = self.buffer.ctypes.data
        self.pointers = numpy.array([base + w * _WORD for w in self.words], numpy.uint64)
        self.address = ctypes.c_void_p(self.pointers.ctypes.data)  # the kernelParams argument

    def __setitem__(self, i: int, value) -> None:
        w = self.words[i]
        if isinstance(value, numpy.ndarray):  # a tensor map's 16 words
            self.buffer[w:w + value.size] = value
        else:  # a CuPy array
            self.buffer[w] = value.data.ptr

    def set_address(self, i: int, address: int, word: int = 0) -> None:
        """Argument i's address, or the one at 8-byte word `word` of a struct argument."""
        self.buffer[self.words[i] + word] = address


def _raw_bytes(value) -> bytes:
    """An argument's bytes as the kernel parameter holds them."""
    if isinstance(value, (numpy.ndarray, numpy.generic)):  # tensor-map words, numpy scalars
        return value.tobytes()
    return struct.pack("<Q", value.data.ptr)  # a CuPy array: its device address


# cuda.h's CUlaunchAttribute (an id, then a 64-byte value union) and CUlaunchConfig, for cuLaunchKernelEx.
class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: its value three unsigned ints (x, y, z)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
# CTAs a cluster may hold on every GPU that has clusters; larger ones (16 on Hopper) must be allowed
# per kernel, and whether a GPU holds enough of them at once depends on its SMs per GPC
# (max_active_clusters).
PORTABLE_CLUSTER_SIZE = 8


def _retry_or_raise(err: int, relaunch: Callable[[], int], device_id: int, what: str) -> None:
    """After a failed launch: on a thread with no current context (a framework's callback thread), make
    the device's current and launch once more; raise if the launch still fails. `what`: the launch's
    shape, for the message."""
    if err == _CUDA_ERROR_INVALID_CONTEXT:
        _make_current(device_id)
        err = relaunch()
    if err != 0:
        raise RuntimeError(f"cuflash: kernel launch failed: {_error_text(err)} ({what})")


class Kernel:
    """One compiled kernel (CuPy's function object) launched through the driver."""

    def __init__(self, function, smem_bytes: int, device_id: int):
        self.function = function  # keeps CuPy's module, and so the handle, alive
        self.handle = ctypes.c_void_p(function.kernel.ptr)
        self.smem_bytes = smem_bytes
        self.device_id = device_id

    def launch(self, grid, block: int, args: KernelArgs, stream) -> None:
        """Launch with `args` on `stream` (a CUDA stream handle, or its c_void_p) and raise on an error."""
        gx, gy, gz = grid
        if not isinstance(stream, ctypes.c_void_p):
            stream = ctypes.c_void_p(stream)
        launch = _driver()[0]
        err = launch(self.handle, gx, gy, gz, block, 1, 1, self.smem_bytes, stream, args.address, None)
        if err != 0:
            _retry_or_raise(err, lambda: launch(self.handle, gx, gy, gz, block, 1, 1, self.smem_bytes, stream,
                                                args.address, None),
                            self.device_id, f"grid {grid}, block {block}, {self.smem_bytes} bytes of shared memory")


class _LaunchWithAttribute:
    """A kernel launched through cuLaunchKernelEx with one launch attribute. Same `launch` as Kernel's;
    the config it fills in is its own, so one launch site uses it at a time (behind the site's lock)."""

    def __init__(self, kernel_: Kernel, attribute_id: int, values: tuple[int, ...], what: str):
        self.kernel = kernel_
        self.attribute = _LaunchAttribute(id=attribute_id)
        for i, value in enumerate(values):
            self.attribute.value[i] = value
        self.config = _LaunchConfig(smem=kernel_.smem_bytes, attrs=ctypes.pointer(self.attribute), num_attrs=1)
        self.what = what

    def configured(self, grid, block: int):
        """The launch config (cuLaunchKernelEx's, and the occupancy queries') for `grid` and `block`."""
        config = self.config
        config.grid[0], config.grid[1], config.grid[2] = grid
        config.block[0], config.block[1], config.block[2] = block, 1, 1
        return config

    def launch(self, grid, block: int, args: KernelArgs, stream) -> None:
        config = self.configured(grid, block)
        config.stream = stream.value if isinstance(stream, ctypes.c_void_p) else stream
        launch_ex = _driver()[2]
        err = launch_ex(ctypes.byref(config), self.kernel.handle, args.address, None)
        if err != 0:
            _retry_or_raise(err, lambda: launch_ex(ctypes.byref(config), self.kernel.handle, args.address, None),
                            self.kernel.device_id, f"grid {grid}, block {block}, {self.kernel.smem_bytes} bytes "
                                                   f"of shared memory, {self.what}")


class LaunchAfterPrior(_LaunchWithAttribute):
    """A kernel launched with programmatic stream serialization (sm_90): it may be scheduled before the
    stream's previous kernel completes, and waits for it in the kernel (common.cuh's wait_prior_grid),
    so that the gap between the two launches is hidden."""

    def __init__(self, kernel_: Kernel):
        super().__init__(kernel_, _PROGRAMMATIC_STREAM_SERIALIZATION, (1,), "after the prior kernel")


class LaunchInClusters(_LaunchWithAttribute):
    """A kernel launched in thread-block clusters of `dims` (x, y, z) CTAs (sm_90), which share their
    shared memory (common.cuh's cluster_sync, ld_cluster). Each grid dimension is a multiple of the
    cluster's."""

    def __init__(self, kernel_: Kernel, dims: tuple[int, int, int]):
        if dims[0] * dims[1] * dims[2] > PORTABLE_CLUSTER_SIZE:
            _allow_large_clusters(kernel_)
        super().__init__(kernel_, _CLUSTER_DIMENSION, dims, f"in clusters of {dims}")


def _allow_large_clusters(kernel_: Kernel) -> None:
    err = _driver()[3](kernel_.handle, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    if err != 0:
        raise RuntimeError(f"cuflash: clusters larger than {PORTABLE_CLUSTER_SIZE} CTAs: {_error_text(err)}")


def max_active_clusters(kernel_: Kernel, block: int, size: int) -> int:
    """How many clusters of `size` CTAs (along x) of `block` threads the device holds at once (0 where
    it cannot launch them)."""
    config = LaunchInClusters(kernel_, (size, 1, 1)).configured((size, 1, 1), block)
    count = ctypes.c_int(0)
    err = _driver()[4](ctypes.byref(count), kernel_.handle, ctypes.byref(config))
    return count.value if err == 0 else 0


_kernels: dict = {}
_kernels_lock = threading.Lock()


def kernel(family: str, name_expression: str, smem_bytes: int, device_id: int) -> Kernel:
    """The launchable kernel of a specialisation on the current device (compiled on first use)."""
    key = (device_id, family, name_expression)
    found = _kernels.get(key)
    if found is not None:
        return found
    made = Kernel(_compile.get_kernel(family, name_expression, smem_bytes), smem_bytes, device_id)
    with _kernels_lock:
        return _kernels.setdefault(key, made)
