"""``python -m cuflash bench --ring``: ring attention on the GPUs present against one GPU.

Batch 1, 16 heads of head dim 128 (fp16 by default, ``--dtype``), sequences of 32k, 128k and
512k tokens (``--seqlen``), causal and not, zigzag layout. With ``--backward`` every timed call
is a forward (with lse) and a backward. Per row:

* ``1 GPU ms``: ``cuflash.attention`` over the whole sequence on device 0 (empty where it does
  not fit);
* ``ring ms``: ``cuflash.distributed.ring_attention`` over every GPU of the process
  (``NcclTransport``), and ``ring / 1 GPU``, its time over the one-GPU time;
* ``steps ms``: the same ring's R steps of kernels with no transfer (each rank keeps its own
  shard: the compute alone); ``comm ms``: the ring's transfers with no kernel (the forward's R - 1
  rotations of K and V; with ``--backward`` also the backward's, which carry its R hops of the dK, dV
  sums);
* ``hidden``: the share of the transfers the ring hides, 1 - (ring - steps) / comm.

``--nccl-channels N`` caps NCCL's channels for the run (docs/distributed.md has why). Each time is
the median of ``--repeats`` calls that end by synchronising every device (wall time
between CUDA events on device 0), the ring, its steps and its transfers timed in interleaved
rounds (cuflash.timing). With one GPU there is no ring to time and the command says so.
"""

from __future__ import annotations

import os

import cupy
import numpy
from tabulate import tabulate

import cuflash
from cuflash import distributed, timing

from .measure import device_info, first_dtype, log
from .tables import write_json

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


def _synced(call, devices):
    """call, then wait for every device: one timed call of a subject."""
    def run():
        call()
        _sync_all(devices)

    return timing.Calls([run])


def _shards(x, world: int, devices):
    """Rank r's shard of x (a global array on devices[0]) on devices[r]."""
    shards = []
    for rank, device in enumerate(devices):
        with cupy.cuda.Device(devices[0]):
            piece = distributed.shard(x, rank, world)
        with cupy.cuda.Device(device):
            shards.append(piece.copy())  # ndarray.copy() lands on the current device
    return shards


def _one_gpu_ms(q, k, v, dout, causal: bool, backward: bool, device: int, repeats: int) -> float | None:
    """cuflash.attention (and its backward) over the whole sequence (arrays on `device`); None, with
    the reason logged, where it fails (out of memory at the longest lengths)."""
    def call():
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        if backward:
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)

    with cupy.cuda.Device(device):
        timed = timing.time_calls({"1 GPU": _synced(call, [device])}, repeats)["1 GPU"]
    if "error" in timed:
        log(f"bench --ring: one GPU, {q.shape[1]} tokens: {timed['error']}")
    return timed.get("ms")


def _ring_call(qs, ks, vs, douts, transport, causal: bool, backward: bool):
    def call():
        outs, lses = distributed.ring_attention(qs, ks, vs, transport=transport, causal=causal, return_lse=True)
        if backward:
            distributed.ring_attention_backward(douts, qs, ks, vs, outs, lses, transport=transport, causal=causal)

    return call


def _transfers_call(ks, vs, transport, backward: bool):
    """The ring's transfers alone, in its rotations (module docstring): the forward's R - 1 of K and V;
    the backward's first of K and V, then R hops of the dK, dV sums, the first R - 2 with K and V."""
    world = transport.world
    sums = []  # the backward's fp32 dK, dV sums, one pair per rank on its GPU
    for k, v in zip(ks, vs) if backward else ():
        with k.device:
            sums.append((cupy.empty(k.shape, cupy.float32), cupy.empty(v.shape, cupy.float32)))

    def call():
        held = list(zip(ks, vs))
        for _ in range(world - 1):
            held = transport.finish(transport.start(held))
        if backward:
            held = transport.finish(transport.start(list(zip(ks, vs))))
            for t in range(world):
                payload = [s + kv for s, kv in zip(sums, held)] if t + 2 < world else sums
                transport.finish(transport.start(payload))

    return call


def _row(n: int, causal: bool, backward: bool, dtype, devices, transport, repeats: int) -> dict:
    world = len(devices)
    with cupy.cuda.Device(devices[0]):  # drawn on the GPU: 512k tokens are 4 GiB of float32 a tensor
        rng = cupy.random.default_rng(n)
        q, k, v, dout = (rng.standard_normal((1, n, NHEADS, HEADDIM), dtype=cupy.float32).astype(dtype)
                         for _ in range(4))
    row = {"seqlen": n, "causal": causal,
           "1 GPU ms": _one_gpu_ms(q, k, v, dout, causal, backward, devices[0], repeats)}
    qs, ks, vs, douts = (_shards(x, world, devices) for x in (q, k, v, dout))
    with cupy.cuda.Device(devices[0]):
        timed = timing.time_calls({
            "ring": _synced(_ring_call(qs, ks, vs, douts, transport, causal, backward), devices),
            "steps": _synced(_ring_call(qs, ks, vs, douts, _Stay(world), causal, backward), devices),
            "comm": _synced(_transfers_call(ks, vs, transport, backward), devices),
        }, repeats)
    for name in ("ring", "steps", "comm"):
        if "error" in timed[name]:
            raise RuntimeError(f"bench --ring: {name}: {timed[name]['error']}")
        row[f"{name} ms"] = timed[name]["ms"]
    row["ring / 1 GPU"] = row["ring ms"] / row["1 GPU ms"] if row["1 GPU ms"] else None
    overhead = max(row["ring ms"] - row["steps ms"], 0.0)
    row["hidden"] = max(0.0, 1.0 - overhead / row["comm ms"]) if row["comm ms"] > 0 else None
    return row


def run(args) -> int:
    devices = list(range(cupy.cuda.runtime.getDeviceCount()))
    if len(devices) < 2:
        log("bench --ring: one GPU present; ring attention over NCCL needs two or more")
        return 1
    if args.nccl_channels is not None:
        # NCCL reads its environment when the first communicator is made, which is below.
        for name in ("NCCL_MAX_NCHANNELS", "NCCL_MAX_P2P_NCHANNELS"):
            os.environ[name] = str(args.nccl_channels)
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
            rows.append(_row(n, causal, args.backward, dtype, devices, transport, args.repeats))
    what = "forward+backward" if args.backward else "forward"
    print(f"\nRing attention {what} on {len(devices)} GPUs (zigzag, {NHEADS} heads of {HEADDIM}, batch 1), ms:")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    write_json(args.json, {"device": device_info(), "gpus": len(devices), "dtype": str(numpy.dtype(dtype)),
                           "backward": args.backward, "rows": rows})
    return 0
