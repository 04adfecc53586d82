"""Peak extra device memory of one call: forward, or forward+backward, at batch 1 and growing lengths."""

from __future__ import annotations

import cupy

from cuflash import timing

from .inputs import MiB, cupy_dtype, random_dout, random_qkv
from .libs import Skip, TorchSdpa
from .measure import log
from .tables import cell

MEMORY_SEQLENS = (1024, 4096, 16384)
MEMORY_HEADS = 16
MEMORY_HEADDIM = 128


def peak_extra_bytes(lib, q, k, v, causal=False, dout=None) -> int:
    """Peak device memory one call allocates beyond its inputs.

    A forward call, or with ``dout`` a forward+backward call (``dout`` is an
    input too; the gradients it returns count as its output).

    One warm-up call first, so one-time costs (compilation, cached workspaces)
    are excluded. For CuPy-based libraries the measured call allocates from a
    fresh memory pool: a pool only grows while blocks are in use and keeps
    freed blocks, so its total afterwards is the call's high-water mark (output
    included). For torch, its allocator's peak statistics give the same.
    """
    inputs = (q, k, v) if dout is None else (q, k, v, dout)
    fn = lib.prepare(*inputs, causal)
    with lib.context():
        lib.to_cupy(fn())
    timing.synchronize()
    if isinstance(lib, TorchSdpa):
        torch = lib.torch
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with lib.context():
            out = fn()
        timing.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        torch.cuda.empty_cache()
        return peak
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc), lib.context():
        out = fn()
        timing.synchronize()
    peak = pool.total_bytes()
    del out
    pool.free_all_blocks()
    return peak


def _measure(lib, *inputs, **options) -> dict:
    try:
        return {"extra_mib": peak_extra_bytes(lib, *inputs, **options) / MiB}
    except Skip as exc:
        return {"skipped": str(exc)}
    except Exception as exc:
        return {"error": timing.describe(exc)}
    finally:
        timing.synchronize()


def _entry(seqlen: int, q) -> dict:
    return {"dtype": "float16", "causal": False, "batch": 1, "heads": MEMORY_HEADS, "headdim": MEMORY_HEADDIM,
            "seqlen": seqlen, "inputs_mib": 3 * q.nbytes / MiB, "libs": {}}


def run_memory(libs) -> list[dict]:
    """Peak extra memory of one non-causal fp16 forward call, batch 1."""
    dtype = cupy_dtype("float16")
    entries = []
    for seqlen in MEMORY_SEQLENS:
        q, k, v = random_qkv(1, seqlen, MEMORY_HEADS, MEMORY_HEADDIM, dtype, seed=0)
        entry = _entry(seqlen, q)
        entry["output_mib"] = q.nbytes / MiB
        for lib in libs:
            entry["libs"][lib.name] = _measure(lib, q, k, v)
        log(f"memory N={seqlen}: " + ", ".join(
            f"{name} {cell(r, 'extra_mib', '.0f')}" for name, r in entry["libs"].items()))
        entries.append(entry)
        del q, k, v
    return entries


def run_memory_bwd(libs) -> list[dict]:
    """Peak extra memory of one non-causal fp16 forward+backward call, batch 1.

    Inputs (q, k, v, dout) are excluded; the peak includes what the call
    returns (dq, dk, dv) and the forward's out and lse, recorded separately.
    """
    dtype = cupy_dtype("float16")
    entries = []
    for seqlen in MEMORY_SEQLENS:
        dims = (1, seqlen, MEMORY_HEADS, MEMORY_HEADDIM)
        q, k, v = random_qkv(*dims, dtype, seed=0)
        dout = random_dout(*dims, dtype, seed=0)
        entry = _entry(seqlen, q)
        entry.update(
            dout_mib=dout.nbytes / MiB,
            grads_mib=3 * q.nbytes / MiB,  # dq + dk + dv: the call's output, inside extra_mib
            out_lse_mib=(q.nbytes + 4 * MEMORY_HEADS * seqlen) / MiB,  # fp16 out + fp32 lse
            scores_mib=MEMORY_HEADS * seqlen * seqlen * dtype.itemsize / MiB,  # one N x N, for scale
        )
        for lib in libs:
            result = _measure(lib, q, k, v, causal=False, dout=dout)
            if "extra_mib" in result:
                result["extra_minus_grads_mib"] = result["extra_mib"] - entry["grads_mib"]
            entry["libs"][lib.name] = result
        log(f"memory fwd+bwd N={seqlen}: " + ", ".join(
            f"{name} {cell(r, 'extra_mib', '.0f')}" for name, r in entry["libs"].items()))
        entries.append(entry)
        del q, k, v, dout
    return entries
