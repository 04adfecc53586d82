"""The autotuner's on-disk cache: one JSON file per device.

Location: ``$CUFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/cuflash``, else
``~/.cache/cuflash``. A file holds the device's name and compute capability,
the hash of the kernel sources (`compile.source_hash()`) its entries were
measured with, and the entries, keyed by strings the kernel families build
(family, dtype, head dim, mask, sequence-length buckets). Entries measured with
other kernel sources are never returned, and are dropped at the next write.

Reads are memoised per process and file; this process's own writes refresh the
memo, other processes' writes are seen by the next process. Writes take an
exclusive `flock` on a sidecar lock file, re-read the file, merge, and replace
it atomically, so concurrent tuners lose no entry and readers never see half a
file. A file that cannot be parsed, or has another format version, is ignored
with one warning and rewritten by the next write.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

from . import compile as _compile

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: writes stay atomic, only concurrent merges are unguarded
    fcntl = None

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    """What identifies a device's cache file."""

    name: str
    compute_capability: str  # e.g. "90"

    def file_name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "device"
        return f"{slug}-sm{self.compute_capability}.json"


_devices: dict[int, DeviceKey] = {}


def current_device() -> DeviceKey:
    """The DeviceKey of CuPy's current device (memoised per device id)."""
    import cupy

    device_id = cupy.cuda.Device().id
    key = _devices.get(device_id)
    if key is None:
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        key = DeviceKey(props["name"].decode(), str(cupy.cuda.Device(device_id).compute_capability))
        _devices[device_id] = key
    return key


def cache_dir() -> Path:
    return _cache_dir(os.environ.get("CUFLASH_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


def cache_path(device: DeviceKey) -> Path:
    return _cache_path(cache_dir(), device)


# Memoised on the environment they depend on: every attention call looks its
# problem up, and building and hashing the paths anew took ~35 us of host time
# per call (cProfile, H200), more than a 512-token forward kernel runs.
@functools.lru_cache(maxsize=64)
def _cache_dir(explicit: str | None, xdg: str | None, home: str | None) -> Path:
    if explicit:
        return Path(explicit).expanduser()
    base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuflash"


@functools.lru_cache(maxsize=64)
def _cache_path(directory: Path, device: DeviceKey) -> Path:
    return directory / device.file_name()


# ---------------------------------------------------------------- reading

_warned: set[Path] = set()


def _warn_once(path: Path, problem: str) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(f"cuflash: ignoring tuning cache {path}: {problem}; it will be rewritten "
                      f"at the next tuning", RuntimeWarning, stacklevel=2)


def read_file(path: Path) -> tuple[dict | None, str | None]:
    """(the parsed file, None), or (None, what is wrong with it); (None, None) if it does not exist."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except OSError as exc:
        return None, f"cannot read it ({exc})"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, f"not valid JSON ({exc})"
    if not isinstance(data, dict):
        return None, "not a JSON object"
    if data.get("format") != FORMAT:
        return None, f"format {data.get('format')!r}, this version reads format {FORMAT}"
    if not isinstance(data.get("entries"), dict) or not all(isinstance(e, dict) for e in data["entries"].values()):
        return None, "no 'entries' object"
    return data, None


def _current_entries(path: Path, device: DeviceKey) -> dict:
    """The file's entries that are valid for this device and these kernel sources."""
    data, problem = read_file(path)
    if problem:
        _warn_once(path, problem)
    if data is None:
        return {}
    if data.get("device") != device.name or data.get("compute_capability") != device.compute_capability:
        _warn_once(path, f"written for {data.get('device')!r} sm_{data.get('compute_capability')}")
        return {}
    if data.get("source_hash") != _compile.source_hash():
        return {}  # measured with other kernel sources: stale, not an error
    return data["entries"]


_memo: dict[tuple[Path, str], dict] = {}
_memo_lock = threading.Lock()
# Counts this process's changes to the entries: what was decided from them
# before (the entry points' launch plans) is stale once it moves.
_generation = 0


def generation() -> int:
    """How many times this process has changed the entries (it never goes back)."""
    return _generation


def entries(device: DeviceKey) -> dict:
    """The device's current entries, read once per process (treat as read-only)."""
    path = cache_path(device)
    memo_key = (path, _compile.source_hash())
    found = _memo.get(memo_key)
    if found is None:
        with _memo_lock:
            found = _memo.get(memo_key)
            if found is None:
                found = _memo[memo_key] = _current_entries(path, device)
    return found


def get(device: DeviceKey, key: str) -> dict | None:
    return entries(device).get(key)


# ---------------------------------------------------------------- writing


class _FileLock:
    """Exclusive flock on `<file>.lock`, held across read-merge-replace."""

    def __init__(self, path: Path):
        self._path = path.with_name(path.name + ".lock")

    def __enter__(self):
        self._file = open(self._path, "a")
        if fcntl is not None:
            fcntl.flock(self._file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        # Closing the file releases the lock. The lock file stays: removing it
        # would let a waiter lock an unlinked inode while a newcomer locks a new one.
        self._file.close()


def _write_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _update(device: DeviceKey, change) -> None:
    """Apply `change(entries)` to the file under the lock and refresh this process's memo.

    If the file cannot be written the change still holds for this process, so
    a tuned problem is not tuned again on every call.
    """
    global _generation
    path = cache_path(device)
    source_hash = _compile.source_hash()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _FileLock(path):
            merged = dict(_current_entries(path, device))
            change(merged)
            _write_atomic(path, {
                "format": FORMAT,
                "device": device.name,
                "compute_capability": device.compute_capability,
                "source_hash": source_hash,
                "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "entries": merged,
            })
    except OSError as exc:
        warnings.warn(f"cuflash: cannot write tuning cache {path} ({exc}); results are kept "
                      f"for this process only", RuntimeWarning, stacklevel=3)
        merged = dict(entries(device))
        change(merged)
    with _memo_lock:
        _memo[(path, source_hash)] = merged
        _generation += 1


def put(device: DeviceKey, new_entries: dict) -> None:
    """Add or replace entries (key -> JSON-serialisable dict)."""
    _update(device, lambda merged: merged.update(new_entries))


def clear(device: DeviceKey) -> None:
    """Remove every entry of the device."""
    _update(device, lambda merged: merged.clear())
