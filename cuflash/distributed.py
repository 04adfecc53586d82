"""Ring attention: exact attention over a sequence sharded across ranks (context parallelism).

Each rank holds a shard of q, k and v along the sequence. The key/value shards travel around the
ring, one hop per step; at every step each rank attends its queries to the shard it holds and
merges the partial result into a running (out, lse) by log-sum-exp:

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b

A running merge keeps one fp32 accumulator per rank, so memory stays O(N / R) per rank (the
split-KV combine, `combine_partials`, would need all R partials at once).

Layouts (`shard` cuts a global array into them):
- "zigzag" (causal load balance): the sequence is cut into 2R chunks and rank r holds chunks r and
  2R - 1 - r. Against the shard of rank s, rank r's queries see all of chunk s's keys when s < r
  (one call: both query chunks against chunk s), chunk 2R - 1 - s's and chunk s's from its second
  chunk only when s > r (its second query chunk against the whole shard), and when s = r its own
  shard causally (local indices are in order). Every step is one kernel call of equal work.
- "contiguous": rank r holds chunk r of R. Causal steps with s > r see nothing and are skipped.

The backward runs the same steps with the global out and lse (`attention_backward` takes them, so
each step's dQ, dK, dV are that shard pair's exact share). dQ stays; the sums of dK and dV follow
their keys and values one hop behind (sent once a step's kernels are done, they cross during the
next step's) and reach their owner after a full turn. That last hop follows the last step, with no
kernel left to hide it.

Transports move the shards: `InProcessTransport` treats arrays of one process (one GPU or the
host) as ranks, which is how the ring is tested on one device; `NcclTransport` sends over NCCL
(`cupy.cuda.nccl`) on a communication stream. Both take lists with one entry per rank this process
drives. The rotation that brings step t + 1's shard is queued as soon as step t - 1's kernels are
(its receive buffers take the blocks those kernels read), ahead of step t - 1's merges, and crosses
during step t's kernel; a rank holds two K/V shards at a time, the one in use and the one arriving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import numpy

from .arrays import dtype_name
from .backward import attention_backward
from .forward import attention

LAYOUTS = ("zigzag", "contiguous")

# CUDA clamps a stream priority outside the device's range to the range's end; lower is higher, so
# this asks for the highest there is (cudaDeviceGetStreamPriorityRange, which CuPy does not expose).
HIGHEST_STREAM_PRIORITY = -(2**31)


def _xp(x):
    """numpy or cupy, whichever holds x."""
    if isinstance(x, numpy.ndarray):
        return numpy
    import cupy

    return cupy


def _on(x):
    """A context in which x's device is current (a GPU array's), or none (a host array)."""
    return contextlib.nullcontext() if isinstance(x, numpy.ndarray) else x.device


def _contiguous(x):
    return _xp(x).ascontiguousarray(x)


def _accumulator_dtype(x):
    """The dtype of sums over x's steps: float32 for 16-bit x, x's dtype where it is wider."""
    return numpy.promote_types(x.dtype, numpy.float32)


def _widened(x):
    """A first step's result as a new sum over steps (a copy in the accumulator's dtype)."""
    return x.astype(_accumulator_dtype(x))


def _each(fn, *lists) -> list:
    """[fn(a, ..., z) for the ranks' entries of the lists], each on the device of its last (an array)."""
    results = []
    for args in zip(*lists):
        with _on(args[-1]):
            results.append(fn(*args))
    return results


# --- Layout ---------------------------------------------------------------------------------


def _chunks(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The sequence chunks rank `rank` holds, in order (of 2R chunks for zigzag, R for contiguous)."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def _chunk_count(layout: str, world: int) -> int:
    return 2 * world if layout == "zigzag" else world


def shard_positions(n: int, rank: int, world: int, layout: str = "zigzag") -> numpy.ndarray:
    """The global sequence positions, in order, of rank `rank`'s shard of a sequence of n."""
    check_layout(layout)
    count = _chunk_count(layout, world)
    if n % count:
        raise ValueError(f"the sequence length ({n}) must be a multiple of {count} for layout {layout!r} "
                         f"over {world} ranks")
    size = n // count
    return numpy.concatenate([numpy.arange(c * size, (c + 1) * size) for c in _chunks(layout, rank, world)])


def shard(x, rank: int, world: int, layout: str = "zigzag", axis: int = 1):
    """Rank `rank`'s shard of a global array x (sequence along `axis`) in `layout`."""
    positions = shard_positions(x.shape[axis], rank, world, layout)
    return x.take(_xp(x).asarray(positions), axis=axis)


def unshard(shards: list, layout: str = "zigzag", axis: int = 1):
    """The global array whose shards (one per rank, in rank order) these are."""
    check_layout(layout)
    world = len(shards)
    xp = _xp(shards[0])
    pieces = {}
    for rank, piece in enumerate(shards):
        chunks = _chunks(layout, rank, world)
        for i, part in enumerate(xp.split(piece, len(chunks), axis=axis)):
            pieces[chunks[i]] = part
    return xp.concatenate([pieces[c] for c in range(_chunk_count(layout, world))], axis=axis)


def check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_shard_length(n_local: int, causal: bool, layout: str) -> None:
    """A causal zigzag shard holds two equal chunks."""
    if layout == "zigzag" and causal and n_local % 2:
        raise ValueError(f"q: a zigzag shard holds two equal chunks; its length must be even, got {n_local}")


# --- Steps -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """What rank r computes against rank s's shard: query rows [q0, q1) of its shard against key
    rows [k0, k1) of the received one, causally (local indices) or not."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def ring_step(rank: int, source: int, n_local: int, causal: bool, layout: str) -> Step | None:
    """The step of `rank` against `source`'s shard (shards of n_local rows), None where the
    source's keys are all masked for the rank's queries (the module docstring has the cases)."""
    if not causal:
        return Step(0, n_local, 0, n_local, False)
    if source == rank:
        return Step(0, n_local, 0, n_local, True)
    if layout == "contiguous":
        return Step(0, n_local, 0, n_local, False) if source < rank else None
    half = n_local // 2
    if source < rank:  # both query chunks see the source's first chunk (a lower index) whole
        return Step(0, n_local, 0, half, False)
    return Step(half, n_local, 0, n_local, False)  # only the second query chunk, the whole shard


def _ring_steps(transport, t: int, n_local: int, causal: bool, layout: str) -> list:
    """The Step (or None) of each rank this process drives at ring step t."""
    return [ring_step(rank, (rank - t) % transport.world, n_local, causal, layout) for rank in transport.ranks]


def _step_attention(local, q, kv, step: Step, softmax_scale, softcap):
    """(out, lse) of one rank's step: its query rows against the held shard's key rows, on q's device."""
    k, v = kv
    with _on(q):
        return local(q[:, step.q0:step.q1], k[:, step.k0:step.k1], v[:, step.k0:step.k1], causal=step.causal,
                     softmax_scale=softmax_scale, softcap=softcap)


def _step_backward(local, dout, q, kv, out, lse, step: Step, softmax_scale, softcap):
    """(dq, dk, dv) of one rank's step, given the whole rows' out and lse, on q's device."""
    k, v = kv
    rows, keys = slice(step.q0, step.q1), slice(step.k0, step.k1)
    with _on(q):
        lse_rows = _xp(lse).ascontiguousarray(lse[:, :, rows])  # a row range of (batch, heads, n)
        return local(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse_rows, causal=step.causal,
                     softmax_scale=softmax_scale, softcap=softcap)


# --- Transports -------------------------------------------------------------------------------


class InProcessTransport:
    """R ranks in one process: rank r's arrays are entry r of every list. A rotation copies each
    rank's buffers into fresh ones on the next rank's device (rank r receives rank r - 1's)."""

    def __init__(self, world: int):
        if world < 1:
            raise ValueError(f"world must be at least 1, got {world}")
        self.world = world
        self.ranks = tuple(range(world))

    def start(self, buffers: list[tuple]) -> list[tuple]:
        received = []
        for r in range(self.world):
            with _on(buffers[r][0]):  # ndarray.copy copies onto the current device
                received.append(tuple(x.copy() for x in buffers[(r - 1) % self.world]))
        return received

    def finish(self, pending: list[tuple]) -> list[tuple]:
        return pending

    def incoming(self, pending: list[tuple]) -> list[tuple]:
        return pending


@dataclasses.dataclass
class _InFlight:
    """A rotation under way: the buffers it fills and, per GPU, the event that marks its end on the
    communication stream (recorded when it starts, so that waiting for it does not also wait for
    the transfers queued after it)."""
    received: list
    arrived: list


class NcclTransport:
    """Ranks over NCCL: `comms` are this process's communicators (one per GPU it drives, in its
    `ranks` order; from `communicators` or `communicator`), `devices` their GPUs. A rotation sends
    to rank + 1 and receives from rank - 1 on a communication stream per GPU, into new buffers,
    after the work already queued on each GPU's current stream; `finish` makes each current stream
    wait for that rotation (and no later one).

    NCCL moves data with kernels of its own, which need SMs while an attention kernel, persistent,
    holds every one it can get: a rotation that is not running when that kernel starts waits for its
    end. The rings therefore queue each rotation ahead of the work that precedes the kernels it
    overlaps (`ring_attention`), and the communication streams take the device's highest priority,
    so that where a rotation and kernels wait at once the block scheduler serves NCCL's CTAs first.
    The order is what the measurements moved (bench/PERFLOG.md, "Ring attention on four GPUs"); the
    priority alone, with the old order, changed nothing measurable."""

    def __init__(self, comms: list, devices: list[int]):
        import cupy

        if len(comms) != len(devices) or not comms:
            raise ValueError("comms and devices must be non-empty lists of the same length")
        for comm, device in zip(comms, devices):
            if comm.device_id() != device:
                raise ValueError(f"devices: communicator {comm.rank_id()} drives GPU {comm.device_id()}, not {device}")
        self.comms = comms
        self.devices = devices
        self.world = comms[0].size()
        self.ranks = tuple(c.rank_id() for c in comms)
        self.streams = []
        for device in devices:
            with cupy.cuda.Device(device):
                self.streams.append(cupy.cuda.Stream(non_blocking=True, priority=HIGHEST_STREAM_PRIORITY))

    def start(self, buffers: list[tuple]) -> list[tuple]:
        import cupy
        from cupy.cuda import nccl

        if not all(x.flags.c_contiguous for buffer in buffers for x in buffer):
            raise ValueError("ring buffers must be C-contiguous")
        for buffer, device in zip(buffers, self.devices):
            if any(x.device.id != device for x in buffer):
                raise ValueError(f"a shard of the rank on GPU {device} lies on GPU "
                                 f"{[x.device.id for x in buffer]}")
        received = []
        for buffer, device, stream in zip(buffers, self.devices, self.streams):
            with cupy.cuda.Device(device):
                stream.wait_event(cupy.cuda.get_current_stream().record())  # the sends see the compute
                received.append(tuple(cupy.empty_like(x) for x in buffer))
        nccl.groupStart()
        for comm, rank, buffer, out, stream in zip(self.comms, self.ranks, buffers, received, self.streams):
            for x, y in zip(buffer, out):
                comm.send(x.data.ptr, x.nbytes, nccl.NCCL_INT8, (rank + 1) % self.world, stream.ptr)
                comm.recv(y.data.ptr, y.nbytes, nccl.NCCL_INT8, (rank - 1) % self.world, stream.ptr)
        nccl.groupEnd()
        arrived = []
        for device, stream in zip(self.devices, self.streams):
            with cupy.cuda.Device(device):
                arrived.append(stream.record())
        return _InFlight(received, arrived)

    def finish(self, pending: _InFlight) -> list[tuple]:
        import cupy

        for device, event in zip(self.devices, pending.arrived):
            with cupy.cuda.Device(device):
                cupy.cuda.get_current_stream().wait_event(event)
        return pending.received

    def incoming(self, pending: _InFlight) -> list[tuple]:
        """The buffers a rotation fills, before it has filled them: a later rotation may send them,
        since the communication stream keeps the two in order; the compute must `finish` first."""
        return pending.received


def unique_id():
    """A NCCL unique id (on rank 0), to hand to every process's `communicator`."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def communicator(world: int, rank: int, uid):
    """This process's communicator, one GPU per process (the current device)."""
    from cupy.cuda import nccl

    return nccl.NcclCommunicator(world, uid, rank)


def communicators(devices: list[int]) -> list:
    """Communicators for the GPUs of one process (rank i drives devices[i])."""
    from cupy.cuda import nccl

    return nccl.NcclCommunicator.initAll(list(devices))


# --- Forward and backward ---------------------------------------------------------------------


def _validated(q, k, v, transport, causal, layout, window_size):
    check_layout(layout)
    if window_size not in (None, (-1, -1), [-1, -1]):
        raise ValueError(f"window_size: ring attention takes no window yet (a shard pair's window needs "
                         f"position offsets), got {window_size!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, (list, tuple)) or len(x) != len(transport.ranks):
            raise ValueError(f"{name} must be a list of one shard per rank this process drives "
                             f"({len(transport.ranks)}), got {type(x).__name__}")
    n_local = q[0].shape[1]
    check_shard_length(n_local, causal, layout)
    for name, shards in (("q", q), ("k", k), ("v", v)):
        if any(x.shape[1] != n_local for x in shards):
            raise ValueError(f"{name}: every shard must hold {n_local} rows (q's), got "
                             f"{[x.shape[1] for x in shards]}")
    return n_local


def lse_merge(xp, out_a, lse_a, out_b, lse_b):
    """(out, lse) of two partial results over disjoint key sets, by log-sum-exp; xp is the arrays'
    module (numpy, cupy or jax.numpy). out (batch, rows, heads, d) in out_a's dtype, lse (batch,
    heads, rows); rows whose two lse are -inf stay 0 and -inf."""
    lse = xp.logaddexp(lse_a, lse_b)
    finite = xp.isfinite(lse)
    safe = xp.where(finite, lse, 0)

    def weight(part):  # e^(part - lse) as out's (batch, rows, heads, 1)
        return xp.where(finite, xp.exp(part - safe), 0).transpose(0, 2, 1)[..., None].astype(out_a.dtype)

    return out_a * weight(lse_a) + out_b.astype(out_a.dtype) * weight(lse_b), lse.astype(lse_a.dtype)


# acc <- (wa acc + wb part) / (wa + wb), wa = e^(lse_a - m), wb = e^(lse_b - m), m = max(lse_a, lse_b):
# lse_merge's formula in one pass over the accumulator and the step's output, where the generic
# form takes about ten: on two H100s the 128k-token causal ring went from 61.7 to 58.5 ms with it
# (bench/PERFLOG.md). Rows with no key on either side (both -inf) stay 0; a NaN lse gives NaN.
_MERGE_BODY = """
    const float m = fmaxf(lse_a, lse_b);
    if (isinf(m) && m < 0.f) {
        acc = 0.f;
    } else {
        const float wa = expf(lse_a - m), wb = expf(lse_b - m);
        acc = (wa * acc + wb * PART) / (wa + wb);
    }
"""


@functools.cache
def _merge_kernel(bf16_bits: bool):
    """The merge as a CuPy elementwise kernel: part float16 or float32, or bfloat16 as its uint16 bits."""
    import cupy

    part = "__uint_as_float(((unsigned int)part) << 16)" if bf16_bits else "(float)part"
    return cupy.ElementwiseKernel("T part, float32 lse_a, float32 lse_b", "float32 acc",
                                  _MERGE_BODY.replace("PART", part), "cuflash_ring_merge")


def _per_row(lse):
    """An lse (batch, heads, rows) as a view (batch, rows, heads, 1), which broadcasts over an output."""
    return lse.transpose(0, 2, 1)[..., None]


def _merge(out_acc, lse_acc, out, lse, q0):
    """out_acc, lse_acc (rows q0...) <- their merge with a step's (out, lse) of those rows."""
    rows = slice(q0, q0 + out.shape[1])
    xp = _xp(out_acc)
    if xp is numpy or out_acc.dtype != numpy.float32 or lse.dtype != numpy.float32:
        out_acc[:, rows], lse_acc[:, :, rows] = lse_merge(xp, out_acc[:, rows], lse_acc[:, :, rows], out, lse)
        return
    bf16_bits = dtype_name(out.dtype) == "bfloat16"
    part = out.view(numpy.uint16) if bf16_bits else out
    acc_lse = lse_acc[:, :, rows]
    _merge_kernel(bf16_bits)(part, _per_row(acc_lse), _per_row(lse), out_acc[:, rows])
    lse_acc[:, :, rows] = xp.logaddexp(acc_lse, lse)


def ring_attention(q, k, v, *, transport, causal=False, softmax_scale=None, layout="zigzag", softcap=0.0,
                   window_size=(-1, -1), return_lse=False, local_attention: Callable | None = None):
    """Exact attention of a sequence sharded over the transport's ranks.

    q, k, v: lists with the shard of each rank this process drives (transport.ranks order), each
    (batch, n_local, heads, headdim) in `layout`; GQA as `attention`. Returns the output shards (q's
    dtype) and, with return_lse, the lse shards (batch, heads, n_local), float32 for 16-bit inputs.
    local_attention(q, k, v, causal=, softmax_scale=, softcap=) -> (out, lse) replaces
    cuflash.attention (tests run the ring on the host with the float64 reference).
    """
    n_local = _validated(q, k, v, transport, causal, layout, window_size)
    local = local_attention or (lambda *a, **kw: attention(*a, return_lse=True, **kw))
    world = transport.world
    outs, lses = [None] * len(q), [None] * len(q)  # from the first step, which covers every row
    held = _each(lambda kk, vv: (_contiguous(kk), _contiguous(vv)), k, v)  # what a transport sends
    arriving = transport.start(held) if world > 1 else None  # step 1's shards, crossing during step 0
    for t in range(world):
        steps = _ring_steps(transport, t, n_local, causal, layout)
        results = [None if step is None else (step.q0, _step_attention(local, q[i], held[i], step, softmax_scale,
                                                                        softcap))
                   for i, step in enumerate(steps)]
        held = None  # its blocks may receive step t + 2's shards once the kernels above are done
        # The rotation that brings step t + 2's shards is queued now, after step t's kernels and
        # before its merges: it becomes ready as those kernels end, so its NCCL kernels take their
        # SMs while the merges run, before step t + 1's attention kernel fills the others.
        upcoming = transport.start(transport.incoming(arriving)) if t + 2 < world else None
        for i, result in enumerate(results):
            if result is None:
                continue
            q0, (out, lse) = result
            with _on(q[i]):
                if t == 0:  # the rank's own shard: every row
                    outs[i], lses[i] = _widened(out), lse
                else:
                    _merge(outs[i], lses[i], out, lse, q0)
        if arriving is not None:
            held = transport.finish(arriving)
            arriving = upcoming
    outs = _each(lambda o, x: o.astype(x.dtype, copy=False), outs, q)
    return (outs, lses) if return_lse else outs


def ring_attention_backward(dout, q, k, v, out, lse, *, transport, causal=False, softmax_scale=None,
                            layout="zigzag", softcap=0.0, window_size=(-1, -1), local_backward: Callable | None = None):
    """dq, dk, dv shards of `ring_attention` (lists as its inputs), from its out and lse shards.

    local_backward(dout, q, k, v, out, lse, causal=, softmax_scale=, softcap=) -> (dq, dk, dv)
    replaces cuflash.attention_backward, which takes the global rows' out and lse.
    """
    n_local = _validated(q, k, v, transport, causal, layout, window_size)
    local = local_backward or attention_backward
    world = transport.world
    dqs = [None] * len(q)
    held = _each(lambda kk, vv: (_contiguous(kk), _contiguous(vv)), k, v)
    # K and V travel as in the forward, leaving two steps before their use. The dK, dV sums of the
    # shards held at a step follow one hop behind: sent after the step's kernels, they cross while
    # the next step's run, and the world-th hop takes them home. One rotation carries a step's sums
    # and the shards of two steps later, so that one NCCL launch, queued ahead of the next step's
    # kernels, overlaps them: a second launch queued behind it would find every SM taken by those
    # kernels and wait for their end.
    arriving = transport.start(held) if world > 1 else None  # step 1's K, V, crossing during step 0
    in_flight = following = None
    for t in range(world):
        steps = _ring_steps(transport, t, n_local, causal, layout)
        grads = [None if step is None else _step_backward(local, dout[i], q[i], held[i], out[i], lse[i], step,
                                                           softmax_scale, softcap)
                 for i, step in enumerate(steps)]
        held = None  # its blocks may receive step t + 2's K, V once the kernels above are done
        for i, (step, grad) in enumerate(zip(steps, grads)):
            if grad is not None:
                with _on(q[i]):
                    if t == 0:  # the rank's own shard: every row
                        dqs[i] = _widened(grad[0])
                    else:
                        dqs[i][:, step.q0:step.q1] += grad[0]
        if t == 0:  # the ranks' own shards, whose steps cover every key: the first sums, on each rank's GPU
            sums = _each(lambda grad, x: (_widened(grad[1]), _widened(grad[2])), grads, q)
        else:
            received = transport.finish(in_flight)
            sums, following = [r[:2] for r in received], [r[2:] for r in received]
            for (dk, dv), step, grad in zip(sums, steps, grads):
                if grad is not None:
                    with _on(dk):
                        dk[:, step.k0:step.k1] += grad[1]
                        dv[:, step.k0:step.k1] += grad[2]
        if t + 2 < world:  # step t + 1's K, V go on, to become step t + 2's
            upcoming = transport.incoming(arriving) if t == 0 else following
            in_flight = transport.start([s + kv for s, kv in zip(sums, upcoming)])
        else:
            in_flight = transport.start(sums)
        if t + 1 < world:
            held = transport.finish(arriving) if t == 0 else following
    sums = [r[:2] for r in transport.finish(in_flight)]
    dq = _each(lambda g, x: g.astype(x.dtype, copy=False), dqs, q)
    dk = _each(lambda g, x: g[0].astype(x.dtype, copy=False), sums, k)
    dv = _each(lambda g, x: g[1].astype(x.dtype, copy=False), sums, v)
    return dq, dk, dv


__all__ = ["LAYOUTS", "InProcessTransport", "NcclTransport", "Step", "check_layout", "check_shard_length",
           "communicator", "communicators", "lse_merge", "ring_attention", "ring_attention_backward", "ring_step",
           "shard", "shard_positions", "unique_id", "unshard"]
