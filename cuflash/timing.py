"""Device time of GPU calls: the one timer behind the benchmark, the autotuner and the sweeps.

How a call is timed:

* warm-up first, touching every input set, so compilation, autotuning and
  workspace allocation happen outside the timed calls;
* each timed call sits between its own pair of CUDA events, with no
  synchronisation between the calls of a batch, and an untimed lead call
  ahead of each batch: the GPU queue stays full and the host's launch
  latency is hidden, as it is in a model;
* the calls rotate over input sets whose total is at least twice the L2 cache
  (`input_set_count`), so a call never finds its inputs left in L2 by the
  call before;
* the result is the median over the timed calls.

Work launched on a stream outside cuflash's and CuPy's reach (XLA's, inside
`jax.jit`) is timed by `HostEvents` instead of CUDA events: host time between
device-wide synchronisations, around batches of calls.

Several subjects (libraries, configurations, kernel variants) are timed in
interleaved rounds whose orders form a Williams design: each subject takes
each place in a round, and follows each other subject, equally often. A
variant timed first in every round measured 5-10% low in A/B runs
(bench/PERFLOG.md, v12). Rotating one order is not enough: each subject then
always follows the same one, and on a GPU at its power limit a call runs
slower after a power-hungry neighbour (jitted JAX read 7% under the same
kernels called eagerly, which always followed cuDNN: PERFLOG, "Orders of
subjects").

This module imports CuPy only when it records events, and nothing from the
rest of the package, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Any, Callable, ContextManager, Protocol, Sequence

WARMUP = 3  # warm-up calls at least; more when there are more input sets
ROUNDS = 5  # interleaved rounds of time_calls at least; more to complete the order design
MIN_REPEATS = 5  # a time budget never cuts a subject below this many timed calls
MIN_INPUT_SETS = 2


class Events(Protocol):
    """CUDA events on the stream that a subject launches on."""

    def record(self) -> Any: ...

    def elapsed_ms(self, start, end) -> float: ...


class CupyEvents:
    """Events recorded on CuPy's current stream."""

    @staticmethod
    def record():
        import cupy

        event = cupy.cuda.Event()
        event.record()
        return event

    @staticmethod
    def elapsed_ms(start, end) -> float:
        import cupy

        return cupy.cuda.get_elapsed_time(start, end)


CUPY_EVENTS = CupyEvents()


@dataclasses.dataclass(frozen=True)
class HostMark:
    seconds: float

    def synchronize(self) -> None:
        """Already synchronised when it was taken."""


class HostEvents:
    """Host clock readings after a device-wide synchronisation, as Events: for calls that launch on
    streams no event can be recorded on from outside (XLA's, under jax.jit). Each reading waits for
    every stream of the device, so the launch latency adds to each timed call: small beside calls of
    a millisecond or more, or a batch of launches (bench/jax_attention.py times 20 steps a call).
    sync: the device-wide wait (`synchronize`; a test passes its own)."""

    def __init__(self, sync: Callable[[], Any] | None = None):
        self._sync = sync

    def record(self) -> HostMark:
        (self._sync or synchronize)()
        return HostMark(time.perf_counter())

    @staticmethod
    def elapsed_ms(start: HostMark, end: HostMark) -> float:
        return (end.seconds - start.seconds) * 1e3


@dataclasses.dataclass(frozen=True)
class Calls:
    """One subject to time.

    fns: zero-argument calls, one per input set, rotated over.
    events: the events of the stream the calls launch on.
    context: entered around every batch of calls (torch's SDPA backend choice, a dispatch mode).
    """

    fns: Sequence[Callable[[], Any]]
    events: Events = CUPY_EVENTS
    context: Callable[[], ContextManager] = contextlib.nullcontext


def synchronize() -> None:
    """Wait for every stream of the device: the one fence that covers CuPy's and torch's streams alike."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


def input_set_count(set_bytes: int, l2_bytes: int, minimum: int = MIN_INPUT_SETS) -> int:
    """Input sets to rotate over so that together they hold at least twice the L2 cache."""
    return max(minimum, math.ceil(2 * l2_bytes / max(set_bytes, 1)))


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def warm_up(calls: Calls, count: int = WARMUP) -> float:
    """max(count, input sets) calls, touching every input set; returns the time of the last one, already warm."""
    fns = calls.fns
    n = max(count, len(fns), 1)
    with calls.context():
        for i in range(n - 1):
            fns[i % len(fns)]()
        start = calls.events.record()
        fns[(n - 1) % len(fns)]()
        end = calls.events.record()
        end.synchronize()
    return calls.events.elapsed_ms(start, end)


def record_calls(calls: Calls, first: int, stop: int) -> list:
    """Run calls first..stop-1 (call i on input set i mod sets), each between its own events; the event pairs.

    An untimed lead call (on the input set before `first`, as the rotation has it) goes ahead, so that
    the GPU is busy when the first timed call starts, as it is in a model: a batch starts after a
    synchronisation, and its first call would otherwise also time its host work up to its first
    kernel. That was 0.2 ms for a torch SDPA forward+backward step and 0.5-0.7 ms for a compiled one,
    on calls of 1.2 ms (bench/PERFLOG.md, "A lead call")."""
    fns, events, marks = calls.fns, calls.events, []
    with calls.context():
        if first < stop:
            fns[(first - 1) % len(fns)]()
        for i in range(first, stop):
            start = events.record()
            fns[i % len(fns)]()
            marks.append((start, events.record()))
    return marks


def repeats_within(repeats: int, call_ms: float, budget_ms: float | None) -> int:
    """Timed calls for a subject whose warm call takes call_ms: `repeats`, cut to fit the budget, never below
    MIN_REPEATS (or `repeats` if that is smaller)."""
    if budget_ms is None:
        return repeats
    return max(min(repeats, MIN_REPEATS), min(repeats, int(budget_ms / max(call_ms, 1e-3))))


def median_ms(fns: Sequence[Callable[[], Any]], repeats: int, warmup: int = WARMUP,
              events: Events = CUPY_EVENTS) -> float:
    """Median device time of one call of a single subject, rotating over `fns` (one per input set).

    Raises whatever a call raises.
    """
    calls = Calls(fns, events)
    warm_up(calls, warmup)
    marks = record_calls(calls, 0, repeats)
    marks[-1][1].synchronize()
    return statistics.median(events.elapsed_ms(s, e) for s, e in marks)


def round_orders(count: int) -> list[list[int]]:
    """A Williams design for `count` subjects: orders in which each subject holds each place, and directly
    follows each other subject, equally often. count orders for an even count (or one subject), 2 * count
    for an odd one."""
    first = [0]
    for j in range(1, count):  # 0, 1, n-1, 2, n-2, ...
        first.append((j + 1) // 2 if j % 2 else count - j // 2)
    orders = [[(s + r) % count for s in first] for r in range(count)]
    if count % 2 and count > 1:
        orders += [order[::-1] for order in orders]
    return orders


def rounds_for(count: int, minimum: int = ROUNDS) -> int:
    """The fewest rounds, at least `minimum`, that complete round_orders(count) a whole number of times."""
    length = max(len(round_orders(count)), 1)  # no subjects: no orders
    return -(-minimum // length) * length


def time_calls(entries: dict[str, Calls], repeats: int, budget_ms: float | None = None, rounds: int | None = None,
               warmup: int = WARMUP) -> dict[str, dict]:
    """Median device time of one call of each subject, timed in interleaved rounds.

    Every subject is warmed up; then each round times a share of every
    subject's calls, in the order of round_orders' next row. rounds: by
    default rounds_for(subjects), which completes the design; a given count
    uses its rows cyclically. budget_ms: time per subject beyond which its repeats are cut (long calls,
    the naive baseline above all). Returns name -> {"ms", "min_ms",
    "repeats"}, or {"error": one line} for a subject that raised; the others
    go on.
    """
    results, plans = {}, {}
    for name, calls in entries.items():
        synchronize()
        try:
            estimate = warm_up(calls, warmup)
        except Exception as exc:
            results[name] = {"error": describe(exc)}
            continue
        plans[name] = (calls, repeats_within(repeats, estimate, budget_ms), [])
    names = list(plans)
    orders = round_orders(len(names)) if names else [[]]
    rounds = rounds or rounds_for(len(names))
    for r in range(rounds):
        for name in (names[i] for i in orders[r % len(orders)]):
            if name in results:  # raised in an earlier round
                continue
            calls, reps, marks = plans[name]
            synchronize()
            try:
                marks += record_calls(calls, reps * r // rounds, reps * (r + 1) // rounds)
                synchronize()
            except Exception as exc:
                results[name] = {"error": describe(exc)}
    for name in names:
        if name not in results:
            calls, reps, marks = plans[name]
            times = [calls.events.elapsed_ms(s, e) for s, e in marks]
            results[name] = {"ms": statistics.median(times), "min_ms": min(times), "repeats": reps}
    synchronize()
    return {name: results[name] for name in entries}
