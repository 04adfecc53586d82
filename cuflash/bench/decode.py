"""``python -m cuflash bench --decode``: one decoding step over a KV cache.

A step attends seqlen_q new queries (1 by default, ``--decode-nq``; causal
when more than 1) to a cache of N keys per sequence, 32 query heads of head
dim 128 on 32 (MHA), 8 (GQA) or 1 (MQA) kv heads. The grid: batch 1, 8, 64
by caches of 1k, 8k, 32k, 128k tokens (``--quick``: batch 1 and 8 by 1k and
8k), skipping caches over 8 GiB (the paged copies sit next to the contiguous one).

Columns: the cache's bytes (K and V), then per implementation GB/s of cache
read (bytes / time) and microseconds per call:

* ``cuflash``: ``attention_with_kvcache`` on the contiguous cache;
* ``paged16`` / ``paged64`` / ``paged256``: the same on a paged cache with
  pages of that many tokens, the page table shuffled;
* ``append+rotary``: the same step as ``cuflash`` (over the same N keys) with
  its last seqlen_q keys and values new: rotated (half-split rotary over the
  whole head dim) and appended in place by the same call;
* ``fp8``: the same step over an e4m3 cache of the same shape (half the
  bytes; its GB/s count those bytes), on GPUs of compute capability 8.9 and later;
* ``torch-flash`` / ``torch-cudnn``: torch SDPA's backends on the same
  contiguous cache (``enable_gqa``), the call a torch model makes;
* ``copy``: the device's copy rate (bytes read + written per second of a
  512 MiB device-to-device copy), the ceiling of a step that reads its cache.

Every row first checks cuflash's output against torch-flash's (or the
math backend's). ``--dtype`` picks fp16 (default) or bf16.

Timing: each call between CUDA events (cuflash.timing). A short step's events
then hold the host's launch of it too, the GPU having caught up with the host
(MQA batch 8 at 8k read 22-81 us across runs for 22 us of device time).
``--graphs`` times device time instead, as a generation loop that replays its
steps from CUDA graphs sees it: each implementation's GRAPH_STEPS calls
(rotating over the input sets) captured in one graph (CuPy's stream capture;
torch.cuda.graph for torch), a replay timed between events, the time divided
by GRAPH_STEPS.
"""

from __future__ import annotations

import numpy

import cupy

import cuflash
from cuflash import timing
from cuflash.device import compute_capability
from cuflash.kv_cache import FP8_MIN_CAPABILITY

from .libs import Skip, TorchEvents
from .measure import device_info, first_dtype, log, optional_torch
from .tables import write_json

GiB = 1 << 30
NHEADS, HEADDIM = 32, 128
KV_HEADS = {"MHA": 32, "GQA": 8, "MQA": 1}
BATCHES, CACHES = (1, 8, 64), (1024, 8192, 32768, 131072)
QUICK_BATCHES, QUICK_CACHES = (1, 8), (1024, 8192)
PAGE_SIZES = (16, 64, 256)
MAX_CACHE_BYTES = 8 * GiB
CHECK_TOL = 2e-2
MAX_INPUT_SETS = 64  # small caches rotate over copies so that L2 does not hold the next call's (MQA 1k: 0.5 MB)
GRAPH_STEPS = 20  # calls a --graphs replay holds


def copy_rate_gbs(repeats: int) -> float:
    """GB/s (read + written) of a 512 MiB device copy."""
    src = cupy.empty(GiB // 2, numpy.uint8)
    dst = cupy.empty_like(src)
    ms = timing.median_ms([lambda: dst.__setitem__(slice(None), src)], repeats)
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


class Step:
    """One batch's cache (contiguous, and paged copies on demand) and its new query."""

    def __init__(self, batch: int, cache: int, nheads_kv: int, seqlen_q: int, dtype, seed: int):
        rng = cupy.random.default_rng(seed)
        shape = (batch, cache, nheads_kv, HEADDIM)
        self.k, self.v = (rng.standard_normal(shape, dtype=cupy.float32).astype(dtype) for _ in range(2))
        self.q = rng.standard_normal((batch, seqlen_q, NHEADS, HEADDIM), dtype=cupy.float32).astype(dtype)
        self.seqlens = cupy.full(batch, cache, cupy.int32)
        self.causal = seqlen_q > 1
        self.out = cupy.empty_like(self.q)
        self.bytes = 2 * self.k.nbytes
        # The new keys of append(): the last seqlen_q positions, rotated at their positions.
        new_shape = (batch, seqlen_q, nheads_kv, HEADDIM)
        self.k_new, self.v_new = (rng.standard_normal(new_shape, dtype=cupy.float32).astype(dtype) for _ in range(2))
        angles = cupy.arange(cache)[:, None] * 10000.0 ** (-cupy.arange(HEADDIM // 2) / (HEADDIM // 2))
        self.cos, self.sin = cupy.cos(angles).astype(dtype), cupy.sin(angles).astype(dtype)
        self.old_seqlens = cupy.full(batch, cache - seqlen_q, cupy.int32)

    def fp8(self):
        """The step over an e4m3 cache of the same shape: the high bytes of the fp16 cache's values as
        e4m3 codes (finite: no fp16 value here has an all-ones exponent), descales 1/16."""
        batch, nheads_kv = self.k.shape[0], self.k.shape[2]
        k8, v8 = ((x.view(cupy.uint16) >> 8).astype(cupy.uint8) for x in (self.k, self.v))
        k_descale, v_descale = (cupy.full((batch, nheads_kv), 1 / 16, cupy.float32) for _ in range(2))
        return lambda: cuflash.attention_with_kvcache(self.q, k8, v8, cache_seqlens=self.seqlens, causal=self.causal,
                                                      k_descale=k_descale, v_descale=v_descale, out=self.out)

    def contiguous(self):
        return lambda: cuflash.attention_with_kvcache(self.q, self.k, self.v, cache_seqlens=self.seqlens,
                                                      causal=self.causal, out=self.out)

    def append(self):
        return lambda: cuflash.attention_with_kvcache(self.q, self.k, self.v, self.k_new, self.v_new,
                                                      cache_seqlens=self.old_seqlens, rotary_cos=self.cos,
                                                      rotary_sin=self.sin, rotary_interleaved=False,
                                                      causal=self.causal, out=self.out)

    def paged(self, page_size: int):
        batch, cache, nheads_kv, _ = self.k.shape
        pages = -(-cache // page_size)
        order = cupy.asarray(numpy.random.default_rng(page_size).permutation(batch * pages).astype(numpy.int32))
        table = order.reshape(batch, pages)
        k_pages, v_pages = (cupy.zeros((batch * pages, page_size, nheads_kv, HEADDIM), x.dtype) for x in (self.k, self.v))
        for src, dst in ((self.k, k_pages), (self.v, v_pages)):
            padded = cupy.zeros((batch, pages * page_size, nheads_kv, HEADDIM), src.dtype)
            padded[:, :cache] = src
            dst[order.ravel()] = padded.reshape(batch * pages, page_size, nheads_kv, HEADDIM)
        return lambda: cuflash.attention_with_kvcache(self.q, k_pages, v_pages, cache_seqlens=self.seqlens,
                                                      block_table=table, causal=self.causal, out=self.out)


def _torch_sdpa(torch, step: Step, backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "math": SDPBackend.MATH}[backend_name]
    q = torch.from_dlpack(step.q).transpose(1, 2)
    k = torch.from_dlpack(step.k).transpose(1, 2)
    v = torch.from_dlpack(step.v).transpose(1, 2)
    gqa = k.shape[1] != q.shape[1]
    attention = torch.nn.functional.scaled_dot_product_attention
    # Bottom-right causal alignment for several new queries: an explicit mask (SDPA's is_causal is top-left).
    mask = None
    if step.causal:
        nq, nk = q.shape[2], k.shape[2]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)

    def run():
        with sdpa_kernel(backend):
            return attention(q, k, v, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)
    try:
        run()
        torch.cuda.synchronize()
    except (RuntimeError, TypeError) as exc:
        raise Skip(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    return run


class Replay:
    """A captured graph as a zero-argument call on the current stream. It holds the calls it captured:
    the graph reads the arrays they hold (a paged copy of a cache and its block table exist nowhere
    else), which must outlive it rather than go back to the memory pool for the next subject's arrays."""

    def __init__(self, launch, captured):
        self._launch = launch
        self._captured = captured

    def __call__(self):
        self._launch(cupy.cuda.get_current_stream())


def cupy_graph(calls: timing.Calls, steps: int = GRAPH_STEPS) -> timing.Calls:
    """`steps` of the subject's calls (rotating over its input sets) captured in one CUDA graph, as one
    call that replays it on the current stream. Each input set is called once on the capturing stream
    first: a plan's workspaces are made per stream, outside the capture."""
    stream = cupy.cuda.Stream(non_blocking=True)
    # After the work already queued on the current stream: a non-blocking stream does not wait for it,
    # and the calls below may write what that work still reads (a caller's copy of an output).
    stream.wait_event(cupy.cuda.get_current_stream().record())
    with stream:
        for fn in calls.fns:
            fn()
        stream.synchronize()
        stream.begin_capture()
        for i in range(steps):
            calls.fns[i % len(calls.fns)]()
        graph = stream.end_capture()
    return timing.Calls([Replay(graph.launch, calls.fns)], calls.events, calls.context)


def torch_graph(torch, calls: timing.Calls, steps: int = GRAPH_STEPS) -> timing.Calls:
    """cupy_graph for calls that launch on torch's streams (torch.cuda.graph, warmed up on a side stream
    as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), calls.context():
        for fn in calls.fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with calls.context(), torch.cuda.graph(graph):
        for i in range(steps):
            calls.fns[i % len(calls.fns)]()
    return timing.Calls([Replay(lambda stream: graph.replay(), calls.fns)], calls.events, calls.context)


def run(args) -> int:
    torch = optional_torch()
    device = device_info()
    log(f"device: {device['name']} (NVRTC {device['nvrtc']})")
    dtype = first_dtype(args)
    copy_gbs = copy_rate_gbs(args.repeats)
    log(f"device copy rate: {copy_gbs:.0f} GB/s")
    l2_bytes = device["l2_bytes"]
    batches, caches = (QUICK_BATCHES, QUICK_CACHES) if args.quick else (BATCHES, CACHES)
    fp8_cache = compute_capability(cupy.cuda.Device().id) >= FP8_MIN_CAPABILITY
    rows, failed = [], False
    for kind, nheads_kv in KV_HEADS.items():
        for batch in batches:
            for cache in caches:
                step_bytes = 2 * batch * cache * nheads_kv * HEADDIM * 2
                if step_bytes > MAX_CACHE_BYTES:
                    continue
                sets = min(MAX_INPUT_SETS, timing.input_set_count(step_bytes, l2_bytes))
                steps = [Step(batch, cache, nheads_kv, args.decode_nq, dtype, seed=s) for s in range(sets)]
                step = steps[0]
                entries = {"cuflash": timing.Calls([s.contiguous() for s in steps]),
                           "append+rotary": timing.Calls([s.append() for s in steps])}
                for page_size in PAGE_SIZES:
                    entries[f"paged{page_size}"] = timing.Calls([s.paged(page_size) for s in steps])
                if fp8_cache:
                    entries["fp8"] = timing.Calls([s.fp8() for s in steps])
                results = {}
                if torch is not None and not args.no_peers:
                    for backend in ("flash", "cudnn"):
                        try:
                            entries[f"torch-{backend}"] = timing.Calls(
                                [_torch_sdpa(torch, s, backend) for s in steps], TorchEvents(torch))
                        except Skip as exc:
                            results[f"torch-{backend}"] = {"skipped": str(exc)}
                    failed |= not _check(torch, step, entries, kind, batch, cache)
                per_call = 1
                if args.graphs:
                    entries = {name: torch_graph(torch, calls) if isinstance(calls.events, TorchEvents)
                               else cupy_graph(calls) for name, calls in entries.items()}
                    per_call = GRAPH_STEPS
                results.update(timing.time_calls(entries, args.repeats))
                row = {"kv": kind, "batch": batch, "cache": cache, "MB": round(step.bytes / 1e6)}
                for name, result in results.items():
                    if "ms" in result:
                        read = step.bytes // 2 if name == "fp8" else step.bytes
                        ms = result["ms"] / per_call
                        row[name] = (round(read / (ms * 1e-3) / 1e9), round(ms * 1e3, 1))
                    else:
                        row[name] = None
                row["copy"] = round(copy_gbs)
                rows.append(row)
                log(str(row))
                del step, steps, entries
                timing.synchronize()
                cupy.get_default_memory_pool().free_all_blocks()
    _print(rows, args.graphs)
    write_json(args.json, {"device": device, "copy_gbs": round(copy_gbs), "dtype": str(numpy.dtype(dtype)),
                           "timing": f"CUDA-graph replays of {GRAPH_STEPS} steps" if args.graphs else "eager calls",
                           "rows": rows})
    return 1 if failed else 0


def _check(torch, step: Step, entries, kind, batch, cache) -> bool:
    reference = entries.get("torch-flash")
    run_reference = reference.fns[0] if reference else _torch_sdpa(torch, step, "math")
    ours = entries["cuflash"].fns[0]().astype(cupy.float32)
    theirs = cupy.from_dlpack(run_reference().contiguous()).astype(cupy.float32)
    diff = float(cupy.abs(ours - theirs).max())
    paged = entries["paged16"].fns[0]().astype(cupy.float32)
    diff = max(diff, float(cupy.abs(paged - theirs).max()))
    if not diff <= CHECK_TOL:
        log(f"MISMATCH {kind} batch {batch} cache {cache}: max abs diff {diff:.3e}")
        return False
    return True


def _print(rows, graphs: bool) -> None:
    from tabulate import tabulate

    names = ["cuflash", "append+rotary", "paged16", "paged64", "paged256", "fp8", "torch-flash", "torch-cudnn"]
    table = []
    for row in rows:
        line = [row["kv"], row["batch"], row["cache"], row["MB"]]
        for name in names:
            cell = row.get(name)
            line.append("-" if cell is None else f"{cell[0]} / {cell[1]}")
        best_peer = max((row[n][0] for n in ("torch-flash", "torch-cudnn") if row.get(n)), default=None)
        ours = row.get("cuflash")
        line.append(round(ours[0] / best_peer, 2) if ours and best_peer else "-")
        line.append(round(ours[0] / row["copy"], 2) if ours else "-")
        table.append(line)
    print("GB/s of cache read / us per call" + (" (device time, CUDA-graph replays)" if graphs else ""))
    print(tabulate(table, headers=["kv", "batch", "cache", "MB", *names, "vs best peer", "of copy"]))
