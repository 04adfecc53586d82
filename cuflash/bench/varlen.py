"""``python -m cuflash bench --varlen``: packed batches of different lengths, forward and forward+backward.

Hidden size 2048 (heads = 2048 / head dim); lengths drawn once from fixed seeds:

* ``docs``: 16k tokens of documents, log-uniform over 64 .. 8k tokens, the
  last one cut to fill 16k: the packed pre-training batch;
* ``equal``: 8 sequences of 2k, the packed form of a plain batch;
* ``docs64``: 64 sequences, log-uniform over 128 .. 8k tokens;
* ``equal64``: 64 sequences of one length with docs64's total tokens, the
  equal-length batch it is held to.

Columns, in TFLOP/s over the (query, key) pairs that attention computes
(per sequence; causal: the visible pairs):

* ``cuflash``: ``attention_varlen`` (with ``--backward``: its forward with
  lse plus ``attention_varlen_backward``, counted as 3.5 forwards);
* ``cuflash-padded``: ``attention`` on the batch padded to its longest
  sequence, the call a library without varlen makes; its wasted work shows
  as a lower rate over the same real pairs (docs and equal only);
* ``cuflash-jax``: ``cuflash.jax.dot_product_attention`` with jax-cudnn's
  arguments and inputs (the padded batch and its lengths), timed as that is:
  what a JAX port that changes one name gets (ours, not a peer);
* ``torch-flash``: FlashAttention-2's varlen kernels inside torch
  (``torch.ops.aten._flash_attention_forward`` / ``_backward`` with cu_seqlens);
* ``jax-cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on
  the batch padded to its longest sequence, rounded up to a multiple of 64
  (its backward refuses odd lengths), with ``query_seq_lengths`` and
  ``key_value_seq_lengths`` (gradients by ``jax.vjp``), jitted, timed on the
  host (XLA launches on streams of its own) over JAX_STEPS calls launched
  back to back, as a training step's layers run: a single call's time adds the
  launch latency and, for cuflash-jax, its callback's host time (60-370 us on
  the H100 host), which back-to-back calls hide behind the device's work.

torch's SDPA on jagged nested tensors is not a column: with the cuDNN backend
(torch 2.11) its forward ran at 2-80 TFLOP/s and its gradients came out inf or
NaN against cuflash's and FlashAttention-2's; with the flash backend it runs the
kernels of ``torch-flash``.

Each row first checks every peer's output (and gradients) on the real tokens
against cuflash's; a difference above ``CHECK_TOL`` fails the run.
The first ``--dtype`` is used (default fp16); ``--headdim``, ``--causal``,
``--backward``, ``--repeats`` and ``--no-peers`` apply as in the other modes.
"""

from __future__ import annotations

import functools

import numpy

import cupy

import cuflash
from cuflash import timing

from ..tune_common import benchmark_heads
from .libs import TorchEvents, optional_jax
from .measure import BUDGET_MS, BWD_BUDGET_MS, device_info, first_dtype, log, optional_torch
from .tables import write_json

TOKENS = 16 * 1024
BATCHES = ("docs", "equal", "docs64", "equal64")
PADDED = ("docs", "equal")  # the batches cuflash also runs padded (docs64 padded: 6.6x its real pairs)
BWD_FLOP_FACTOR = 3.5  # forward + backward of flash attention, in forwards
PEERS = ("torch-flash", "jax-cudnn")
JAX_LENGTH_MULTIPLE = 64  # JAX's padded length rounds up to this (its cuDNN backward refuses odd ones)
JAX_STEPS = 10  # calls a JAX subject's timed call launches back to back
CHECK_TOL = 2e-2  # largest difference from a peer's result, relative to its largest magnitude above 1


def lengths_of(batch: str) -> list[int]:
    if batch == "equal":
        return [2048] * 8
    if batch in ("docs64", "equal64"):
        rng = numpy.random.default_rng(64)
        lengths = [int(numpy.exp(rng.uniform(numpy.log(128), numpy.log(8192)))) for _ in range(64)]
        return lengths if batch == "docs64" else [round(sum(lengths) / 64)] * 64
    rng = numpy.random.default_rng(20261124)
    lengths, left = [], TOKENS
    while left > 0:
        n = min(left, int(numpy.exp(rng.uniform(numpy.log(64), numpy.log(8192)))))
        lengths.append(n)
        left -= n
    return lengths


def pair_count(lengths, causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


class Inputs:
    """One packed batch on the device, its offsets, and its padded (batch, length, heads, dim) copies."""

    def __init__(self, lengths, nheads: int, headdim: int, dtype, seed: int):
        rng = cupy.random.default_rng(seed)
        total = sum(lengths)
        self.lengths = lengths
        self.q, self.k, self.v, self.dout = (rng.standard_normal((total, nheads, headdim), dtype=cupy.float32)
                                             .astype(dtype) for _ in range(4))
        self.cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32))
        self.longest = max(lengths)
        self._padded = {}

    def padded_to(self, length: int) -> list:
        """(batch, length, heads, dim) copies of q, k, v and dout, zero past each sequence's end."""
        if length not in self._padded:
            nheads, headdim = self.q.shape[1:]
            padded = [cupy.zeros((len(self.lengths), length, nheads, headdim), self.q.dtype) for _ in range(4)]
            start = 0
            for b, n in enumerate(self.lengths):
                for dst, src in zip(padded, (self.q, self.k, self.v, self.dout)):
                    dst[b, :n] = src[start:start + n]
                start += n
            self._padded[length] = padded
        return self._padded[length]


def _cuflash(x: Inputs, causal: bool, backward: bool):
    args = (x.q, x.k, x.v, x.cu, x.cu, x.longest, x.longest)
    if not backward:
        return lambda: cuflash.attention_varlen(*args, causal=causal)

    def run():
        out, lse = cuflash.attention_varlen(*args, causal=causal, return_lse=True)
        return cuflash.attention_varlen_backward(x.dout, x.q, x.k, x.v, out, lse, *args[3:], causal=causal)
    return run


def _padded(x: Inputs, causal: bool, backward: bool):
    q, k, v, dout = x.padded_to(x.longest)
    if not backward:
        return lambda: cuflash.attention(q, k, v, causal=causal)

    def run():
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    return run


class Peer:
    """A timed subject beside cuflash: its call, the events it is timed with, and its result on the real
    tokens as CuPy arrays in the packed (total, heads, dim) layout: the output, or (dq, dk, dv).
    steps: calls of `run` a timed call makes back to back (its time is per call)."""

    def __init__(self, run, events, packed, steps: int = 1):
        self.run, self.events, self.packed, self.steps = run, events, packed, steps

    def calls(self) -> timing.Calls:
        if self.steps == 1:
            return timing.Calls([self.run], self.events)

        def back_to_back():
            for _ in range(self.steps):
                result = self.run()
            return result
        return timing.Calls([back_to_back], self.events)

    def result(self) -> tuple:
        return self.packed(self.run())


def _torch_flash(torch, x: Inputs, causal: bool, backward: bool) -> Peer:
    q, k, v, dout = (torch.from_dlpack(t) for t in (x.q, x.k, x.v, x.dout))
    cu = torch.from_dlpack(x.cu)
    aten = torch.ops.aten

    def run():
        out, lse, rng_state, unused, _ = aten._flash_attention_forward(q, k, v, cu, cu, x.longest, x.longest, 0.0,
                                                                        causal, False)
        if not backward:
            return out
        return aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, x.longest, x.longest, 0.0, causal,
                                              rng_state, unused)

    def packed(result):
        return tuple(cupy.from_dlpack(t) for t in (result[:3] if backward else (result,)))
    return Peer(run, TorchEvents(torch), packed)


def _jax_padded(jax, attend, x: Inputs, causal: bool, backward: bool) -> Peer:
    """A jitted jax.nn.dot_product_attention-style call `attend` on the padded batch with its lengths."""
    length = -(-x.longest // JAX_LENGTH_MULTIPLE) * JAX_LENGTH_MULTIPLE
    padded = x.padded_to(length)
    args = [jax.dlpack.from_dlpack(t) for t in padded[:3]]
    lengths = jax.numpy.asarray(numpy.asarray(x.lengths, numpy.int32))

    def forward(q, k, v, lengths):
        return attend(q, k, v, is_causal=causal, query_seq_lengths=lengths, key_value_seq_lengths=lengths)

    def forward_backward(q, k, v, dout, lengths):
        _, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, lengths), q, k, v)
        return vjp(dout)

    if backward:
        args.append(jax.dlpack.from_dlpack(padded[3]))
    call, args = jax.jit(forward_backward if backward else forward), (*args, lengths)
    # each real token's row in the padded (batch * length) rows
    rows = cupy.asarray(numpy.concatenate([b * length + numpy.arange(n) for b, n in enumerate(x.lengths)]))

    def packed(result):
        arrays = jax.block_until_ready(result) if backward else (jax.block_until_ready(result),)
        return tuple(cupy.from_dlpack(a).reshape(-1, *a.shape[2:])[rows] for a in arrays)
    return Peer(lambda: call(*args), timing.HostEvents(), packed, JAX_STEPS)


def _peers(torch, jax, x: Inputs, causal: bool, backward: bool) -> tuple[dict, dict, dict]:
    """For the peers (and cuflash-jax) that run this row, name -> Peer and name -> its result; for those
    that cannot, name -> {"skipped": why}."""
    makers = {}
    if torch is not None:
        makers["torch-flash"] = functools.partial(_torch_flash, torch)
    if jax is not None:
        import cuflash.jax

        cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
        makers["jax-cudnn"] = functools.partial(_jax_padded, jax, cudnn)
        makers["cuflash-jax"] = functools.partial(_jax_padded, jax, cuflash.jax.dot_product_attention)
    peers, results, skipped = {}, {}, {}
    for name, make in makers.items():
        try:
            peer = make(x, causal, backward)
            results[name] = peer.result()  # an unsupported shape or backend raises here, before any timing
            peers[name] = peer
        except Exception as exc:  # torch's and JAX's refusals come as several exception types
            skipped[name] = {"skipped": timing.describe(exc)}
    return peers, results, skipped


def _max_difference(ours: tuple, theirs: tuple) -> float:
    """Max abs difference of two results (outputs, or the three gradients) in the packed layout, each array's
    in units of its largest magnitude where that exceeds 1 (bf16 gradients of 4-8 differ by its ulp, 2^-5)."""
    def difference(a, b):
        a, b = a.astype(cupy.float32), b.astype(cupy.float32)
        return float(cupy.abs(a - b).max()) / max(1.0, float(cupy.abs(b).max()))
    return max(difference(a, b) for a, b in zip(ours, theirs))


def run(args) -> int:
    torch = None if args.no_peers else optional_torch()
    jax = None if args.no_peers else optional_jax(log)
    device = device_info()
    log(f"device: {device['name']} (NVRTC {device['nvrtc']})")
    dtype = first_dtype(args)
    failed = False
    rows = []
    for batch in BATCHES:
        lengths = lengths_of(batch)
        for headdim in args.headdims:
            for causal in args.masks:
                heads = benchmark_heads(headdim)
                x = Inputs(lengths, heads, headdim, dtype, seed=0)
                flops = 4 * pair_count(lengths, causal) * headdim * heads
                flops *= BWD_FLOP_FACTOR if args.backward else 1
                mine = _cuflash(x, causal, args.backward)
                entries = {"cuflash": timing.Calls([mine])}
                if batch in PADDED:
                    entries["cuflash-padded"] = timing.Calls([_padded(x, causal, args.backward)])
                peers, theirs, results = _peers(torch, jax, x, causal, args.backward)
                ours = mine()
                ours = tuple(ours) if args.backward else (ours,)
                for name, peer in peers.items():
                    diff = _max_difference(ours, theirs[name])
                    if not diff <= CHECK_TOL:
                        failed = True
                        log(f"MISMATCH {name} {batch} d{headdim} causal={causal}: difference {diff:.3e}")
                    entries[name] = peer.calls()
                del ours, theirs
                budget = BWD_BUDGET_MS if args.backward else BUDGET_MS
                results.update(timing.time_calls(entries, args.repeats, budget))
                for name, peer in peers.items():
                    if "ms" in results[name]:
                        results[name]["ms"] /= peer.steps
                row = {"batch": batch, "sequences": len(lengths), "longest": x.longest, "headdim": headdim,
                       "causal": causal}
                for name, result in results.items():
                    row[name] = round(flops / (result["ms"] * 1e-3) / 1e12, 1) if "ms" in result else None
                    if "ms" not in result:
                        log(f"{name}: {result}")
                rows.append(row)
                log(str(row))
                del x, peers, entries
                timing.synchronize()
                cupy.get_default_memory_pool().free_all_blocks()
    _print(rows)
    write_json(args.json, {"device": device, "dtype": str(numpy.dtype(dtype)), "backward": args.backward,
                           "rows": rows})
    return 1 if failed else 0


def _print(rows) -> None:
    from tabulate import tabulate

    columns = ["batch", "sequences", "longest", "headdim", "causal", "cuflash", "cuflash-padded", "cuflash-jax",
               *PEERS]
    table = [[row.get(c) for c in columns] for row in rows]
    for row, line in zip(rows, table):
        peers = [row[name] for name in PEERS if row.get(name)]
        line.append(round(row["cuflash"] / max(peers), 2) if peers and row.get("cuflash") else None)
    print(tabulate(table, headers=[*columns, "vs best peer"]))
