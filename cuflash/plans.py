"""Launch plans of repeated calls, shared by the entry points.

An entry point keys a call by everything its validation and dispatch read
(the arrays' types, shapes, strides, dtypes, devices and base-pointer
alignment, the options, dispatch's cache state) and keeps what they decided
(a prepared launch) under that key. A later call with the same key skips
validation and dispatch: a lookup plus one prepared launch. Plans are stored
only after a launch, so an argument that fails validation never has one.
The environment (CUFLASH_AUTOTUNE, the tuning cache's location) is read when
a signature is first planned, not per call: reading it cost ~5 us a call.
"""

from __future__ import annotations

import functools
import threading

from .arrays import ALIGN_BYTES
from .device import cupy

# Distinct signatures kept per entry point; the oldest goes first.
MAX_PLANS = 512


class PlanCache:
    def __init__(self):
        self.plans: dict = {}
        self._lock = threading.Lock()

    def get(self, key):
        return self.plans.get(key)

    def store(self, key, plan) -> None:
        with self._lock:  # two threads may evict at once
            if len(self.plans) >= MAX_PLANS:
                del self.plans[next(iter(self.plans))]  # the first stored (hits do not refresh a plan)
            self.plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self.plans.clear()

    def __len__(self) -> int:
        return len(self.plans)


@functools.lru_cache(maxsize=1)
def ndarray_type():
    return cupy().ndarray


def layout(x) -> tuple:
    """What validation reads of an array: shape, strides, dtype, device, base-pointer alignment."""
    data = x.data
    return x.shape, x.strides, x.dtype, data.device_id, data.ptr % ALIGN_BYTES


def option_key(window_size, softcap, softmax_scale):
    """The scalar options as a plan key's part, or None for spellings only the full path reads (a list,
    a numpy scalar): (-1, -1), 0.0 and None are the defaults."""
    if softmax_scale is not None and type(softmax_scale) is not float:
        return None
    if type(window_size) is not tuple or any(type(x) is not int for x in window_size):
        return None
    if type(softcap) is not float and type(softcap) is not int:
        return None
    return window_size, softcap, softmax_scale


def optional_layout(x):
    """layout(x) for an optional array argument; None when absent; raises LookupError where the
    argument is not a CuPy array (such calls take the full path)."""
    if x is None:
        return None
    if type(x) is not ndarray_type():
        raise LookupError
    return layout(x)
