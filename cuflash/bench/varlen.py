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
* ``torch-flash``: FlashAttention-2's varlen kernels inside torch
  (``torch.ops.aten._flash_attention_forward`` / ``_backward`` with cu_seqlens).

Each row first checks cuflash's output (and gradients) against torch-flash's.
The first ``--dtype`` is used (default fp16); ``--headdim``, ``--causal``,
``--backward``, ``--repeats`` and ``--no-peers`` apply as in the other modes.
"""

from __future__ import annotations

import numpy

import cupy

import cuflash
from cuflash import timing

from .libs import Skip, TorchEvents
from .measure import BUDGET_MS, BWD_BUDGET_MS, device_info, first_dtype, log, optional_torch
from .shapes import HIDDEN
from .tables import write_json

TOKENS = 16 * 1024
BATCHES = ("docs", "equal", "docs64", "equal64")
PADDED = ("docs", "equal")  # padding docs64 to its longest would cost minutes per row
BWD_FLOP_FACTOR = 3.5  # forward + backward of flash attention, in forwards
CHECK_TOL = 2e-2  # max abs difference against torch-flash (outputs of unit-variance inputs)


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
    """One packed batch on the device, its offsets, and its padded (batch, longest, heads, dim) copy."""

    def __init__(self, lengths, nheads: int, headdim: int, dtype, seed: int):
        rng = cupy.random.default_rng(seed)
        total = sum(lengths)
        self.lengths = lengths
        self.q, self.k, self.v, self.dout = (rng.standard_normal((total, nheads, headdim), dtype=cupy.float32)
                                             .astype(dtype) for _ in range(4))
        self.cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32))
        self.longest = max(lengths)
        self.padded = None

    def pad(self):
        """The (batch, longest, heads, dim) copies of q, k, v and dout."""
        nheads, headdim = self.q.shape[1:]
        padded = [cupy.zeros((len(self.lengths), self.longest, nheads, headdim), self.q.dtype) for _ in range(4)]
        start = 0
        for b, n in enumerate(self.lengths):
            for dst, src in zip(padded, (self.q, self.k, self.v, self.dout)):
                dst[b, :n] = src[start:start + n]
            start += n
        self.padded = padded


def _cuflash(x: Inputs, causal: bool, backward: bool):
    args = (x.q, x.k, x.v, x.cu, x.cu, x.longest, x.longest)
    if not backward:
        return lambda: cuflash.attention_varlen(*args, causal=causal)

    def run():
        out, lse = cuflash.attention_varlen(*args, causal=causal, return_lse=True)
        return cuflash.attention_varlen_backward(x.dout, x.q, x.k, x.v, out, lse, *args[3:], causal=causal)
    return run


def _padded(x: Inputs, causal: bool, backward: bool):
    q, k, v, dout = x.padded
    if not backward:
        return lambda: cuflash.attention(q, k, v, causal=causal)

    def run():
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    return run


def _torch_flash(torch, x: Inputs, causal: bool, backward: bool):
    q, k, v, dout = (torch.from_dlpack(t) for t in (x.q, x.k, x.v, x.dout))
    cu = torch.from_dlpack(x.cu)
    aten = torch.ops.aten

    def forward():
        return aten._flash_attention_forward(q, k, v, cu, cu, x.longest, x.longest, 0.0, causal, False)

    def run():
        out, lse, rng_state, unused, _ = forward()
        if not backward:
            return out
        return aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, x.longest, x.longest, 0.0, causal,
                                              rng_state, unused)
    try:
        run()
    except (RuntimeError, AttributeError) as exc:
        raise Skip(str(exc).splitlines()[0]) from exc
    return run


def _check(x: Inputs, causal: bool, backward: bool, torch_run) -> float:
    """Max abs difference of cuflash's output (and gradients) from torch-flash's."""
    ours = _cuflash(x, causal, backward)()
    theirs = torch_run()
    ours = ours if backward else (ours,)
    theirs = theirs[:3] if backward else (theirs,)
    return max(float(cupy.abs(a.astype(cupy.float32) - cupy.from_dlpack(b).astype(cupy.float32)).max())
               for a, b in zip(ours, theirs))


def run(args) -> int:
    torch = optional_torch()
    device = device_info()
    log(f"device: {device['name']} (NVRTC {device['nvrtc']})")
    dtype = first_dtype(args)
    failed = False
    rows = []
    for batch in BATCHES:
        lengths = lengths_of(batch)
        for headdim in args.headdims:
            for causal in args.masks:
                x = Inputs(lengths, HIDDEN // headdim, headdim, dtype, seed=0)
                flops = 4 * pair_count(lengths, causal) * headdim * (HIDDEN // headdim)
                flops *= BWD_FLOP_FACTOR if args.backward else 1
                entries, results = {}, {}
                makers = {"cuflash": _cuflash}
                if batch in PADDED:
                    x.pad()
                    makers["cuflash-padded"] = _padded
                for name, make in makers.items():
                    entries[name] = timing.Calls([make(x, causal, args.backward)])
                if torch is not None and not args.no_peers:
                    try:
                        torch_run = _torch_flash(torch, x, causal, args.backward)
                        entries["torch-flash"] = timing.Calls([torch_run], TorchEvents(torch))
                        diff = _check(x, causal, args.backward, torch_run)
                        if not diff <= CHECK_TOL:
                            failed = True
                            log(f"MISMATCH {batch} d{headdim} causal={causal}: max abs diff {diff:.3e}")
                    except Skip as exc:
                        results["torch-flash"] = {"skipped": str(exc)}
                budget = BWD_BUDGET_MS if args.backward else BUDGET_MS
                results.update(timing.time_calls(entries, args.repeats, budget))
                row = {"batch": batch, "sequences": len(lengths), "longest": x.longest, "headdim": headdim,
                       "causal": causal}
                for name, result in results.items():
                    row[name] = round(flops / (result["ms"] * 1e-3) / 1e12, 1) if "ms" in result else None
                rows.append(row)
                log(str(row))
                del x
                timing.synchronize()
                cupy.get_default_memory_pool().free_all_blocks()
    _print(rows)
    write_json(args.json, {"device": device, "dtype": str(numpy.dtype(dtype)), "backward": args.backward,
                           "rows": rows})
    return 1 if failed else 0


def _print(rows) -> None:
    from tabulate import tabulate

    columns = ["batch", "sequences", "longest", "headdim", "causal", "cuflash", "cuflash-padded", "torch-flash"]
    table = [[row.get(c) for c in columns] for row in rows]
    for row, line in zip(rows, table):
        peer = row.get("torch-flash")
        line.append(round(row["cuflash"] / peer, 2) if peer and row.get("cuflash") else None)
    print(tabulate(table, headers=[*columns, "vs torch-flash"]))
