"""``python -m cuflash bench --ring``: ring attention on the GPUs present against one GPU.

Batch 1, 16 heads of head dim 128 (fp16 by default, ``--dtype``), sequences of 32k, 128k and
512k tokens (``--seqlen``), causal and not, zigzag layout. Per row:

* ``1 GPU ms``: ``cuflash.attention`` over the whole sequence on device 0 (empty where it does
  not fit);
* ``ring ms``: ``cuflash.distributed.ring_attention`` over every GPU of the process
  (``NcclTransport``), and ``ring / 1 GPU``, its time over the one-GPU time;
* ``steps ms``: the same ring's R steps of kernels with no transfer (each rank keeps its own
  shard: the compute alone); ``comm ms``: its R - 1 transfers with no kernel;
* ``hidden``: the share of the transfers the ring hides, 1 - (ring - steps) / comm.

Each time is the median of ``--repeats`` calls that end by synchronising every device (host
wall time between CUDA events on device 0, cuflash.timing). With one GPU there is no ring to
time and the command says so.
"""

from __future__ import annotations

import cupy
import numpy
from tabulate import tabulate

import cuflash
from cuflash import distributed, timing

from .measure import first_dtype, log

SEQLENS = (32768, 131072, 524288)
NHEADS, HEADDIM = 16, 128


class _Stay(distributed.InProcessTransport):
    """A transport whose ranks keep their own shards: the ring's kernels without its transfers."""

    def start(self, buffers):
        return buffers


def _sync_all(devices) -> None:
    for device in devices:
        with cupy.cuda.Device(device):
            cupy.cuda.get_current_stream().synchronize()


def _timed(call, devices, repeats: int) -> float:
    def run():
        call()
        _sync_all(devices)

    with cupy.cuda.Device(devices[0]):
        return timing.median_ms([run], repeats)


def _shards(x_global_on_host, world: int, devices):
    shards = []
    for rank, device in enumerate(devices):
        with cupy.cuda.Device(device):
            shards.append(cupy.asarray(distributed.shard(x_global_on_host, rank, world)))
    return shards


def _one_gpu_ms(q, k, v, causal: bool, device: int, repeats: int) -> float | None:
    """cuflash.attention over the whole sequence on one GPU; None where it does not fit."""
    try:
        with cupy.cuda.Device(device):
            qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
            return _timed(lambda: cuflash.attention(qd, kd, vd, causal=causal), [device], repeats)
    except cupy.cuda.memory.OutOfMemoryError:
        return None


def _row(n: int, causal: bool, dtype, devices, transport, repeats: int) -> dict:
    world = len(devices)
    rng = numpy.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, n, NHEADS, HEADDIM), dtype=numpy.float32).astype(dtype) for _ in range(3))
    row = {"seqlen": n, "causal": causal, "1 GPU ms": _one_gpu_ms(q, k, v, causal, devices[0], repeats)}
    qs, ks, vs = (_shards(x, world, devices) for x in (q, k, v))
    ring = dict(causal=causal)
    row["ring ms"] = _timed(lambda: distributed.ring_attention(qs, ks, vs, transport=transport, **ring), devices,
                            repeats)
    row["steps ms"] = _timed(lambda: distributed.ring_attention(qs, ks, vs, transport=_Stay(world), **ring), devices,
                             repeats)

    def transfers():
        held = list(zip(ks, vs))
        for _ in range(world - 1):
            held = transport.finish(transport.start(held))

    row["comm ms"] = _timed(transfers, devices, repeats)
    row["ring / 1 GPU"] = row["ring ms"] / row["1 GPU ms"] if row["1 GPU ms"] else None
    overhead = max(row["ring ms"] - row["steps ms"], 0.0)
    row["hidden"] = max(0.0, 1.0 - overhead / row["comm ms"]) if row["comm ms"] > 0 else None
    return row


def run(args) -> int:
    devices = list(range(cupy.cuda.runtime.getDeviceCount()))
    if len(devices) < 2:
        log("bench --ring: one GPU present; ring attention over NCCL needs two or more")
        return 1
    dtype = first_dtype(args)
    transport = distributed.NcclTransport(distributed.communicators(devices), devices)
    seqlens = args.seqlens if args.seqlen else SEQLENS
    rows = []
    for n in seqlens:
        for causal in args.masks:
            if n % (2 * len(devices)):
                log(f"bench --ring: skipping {n} tokens (not a multiple of {2 * len(devices)})")
                continue
            log(f"ring: {n} tokens, causal={causal}, {len(devices)} GPUs")
            rows.append(_row(n, causal, dtype, devices, transport, args.repeats))
    print(f"\nRing attention on {len(devices)} GPUs (zigzag, {NHEADS} heads of {HEADDIM}, batch 1), ms:")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    return 0
