"""Kernel launches: argument packing, grids, streams and workspaces.

`prepare_fwd` and `prepare_bwd` turn a validated call and its chosen config
into a launch object that holds everything the call's shapes decide (kernel
handles, grids, packed arguments); its `run` rewrites the array addresses and
tensor maps and launches on a stream. The entry points keep these objects as
the launch plans of repeated calls, so a repeat is a lookup plus `run`.

Workspaces: the Hopper forward's tile counters and last-wave partial outputs
live per (device, stream) and grow on demand (`StreamState`); the backward's
row statistics and dQ accumulator come from a `BackwardWorkspace`, given by
the caller or allocated per call. Nothing here allocates while the stream
captures a CUDA graph: a buffer that would have to grow raises instead.
"""

from __future__ import annotations

import itertools
import math
import threading

import numpy

from . import fp8, tail_split, tma
from .arrays import aligned_copy, contiguous_strides, elem_strides
from .config import BWD_ROW_PAD, FP8_DTYPE_NAME, BwdConfig, preprocess_row_lanes
from .device import cupy, sm_count, stream_is_capturing
from .kernel_call import KernelArgs, LaunchAfterPrior, kernel
from .score_mods import ALIBI_SLOPES_WORD, CU_SEQLENS_K_WORD, CU_SEQLENS_Q_WORD, SEQUSED_K_WORD, SEQUSED_Q_WORD

# A tensor-map argument before run() writes the call's maps.
UNSET_MAP = numpy.zeros(tma.TMA_DESC_WORDS, numpy.uint64)
# Threads per CTA of the backward's row-wise kernels: the preprocess gives a
# query row 4-16 lanes (config.preprocess_row_lanes), the sm_80 dQ convert a
# warp, the Hopper dQ convert a CTA per block of the dK/dV kernel's query rows.
ROW_KERNEL_THREADS = 256


def _strides(*arrays) -> list:
    return [numpy.int64(s) for x in arrays for s in elem_strides(x)[:3]]


def _address(x) -> int:
    """An optional array argument's device address (0 where absent)."""
    return 0 if x is None else x.data.ptr


def _option_addresses(slopes, cu_seqlens) -> tuple[int, ...]:
    """The addresses a call's options point the kernels at: ALiBi slopes, then varlen's cu_seqlens_q,
    cu_seqlens_k and the optional seqused_q and seqused_k (cu_seqlens: those arrays, 2 or 4)."""
    if cu_seqlens is None:
        return (_address(slopes),)
    return (_address(slopes), *map(_address, cu_seqlens))


def _point_options(args: KernelArgs, addresses: tuple[int, ...]) -> None:
    """Those addresses into the ScoreModArgs argument, every kernel's last; varlen's absent ones 0."""
    words = (ALIBI_SLOPES_WORD, CU_SEQLENS_Q_WORD, CU_SEQLENS_K_WORD, SEQUSED_Q_WORD, SEQUSED_K_WORD)
    for word, address in itertools.zip_longest(words, addresses, fillvalue=0):
        args.set_address(-1, address, word)


def _lengths(problem, q, k) -> tuple[int, int, int]:
    """(batch, seqlen_q, seqlen_k) of the grids: varlen's sequences and longest lengths, else q's and k's."""
    varlen = problem.mods.varlen
    if varlen is not None:
        return varlen.num_seqs, problem.seqlen_q, problem.seqlen_k
    return q.shape[0], q.shape[1], k.shape[1]


def require_not_capturing(what: str, stream=None) -> None:
    """Raise if `stream` (default: CuPy's current one, which a caller may pass to save a lookup)
    is capturing a CUDA graph."""
    if stream.is_capturing() if stream is not None else stream_is_capturing():
        raise RuntimeError(f"cuflash: {what} would allocate device memory while the current stream captures a "
                           "CUDA graph: pass the outputs and workspaces, and run the call once on this stream "
                           "before the capture")


# ---------------------------------------------------------------- per-stream state

class StreamState:
    """The forward's buffers on one stream: the Hopper kernel's tile counters and last-wave partial
    outputs, and the lse of calls that do not return it.

    Counters (int32): ticket, then two per split tile (one per consumer
    warpgroup): CTAs past the first wave draw tiles from the ticket, and the
    tail counts each split tile's finished key runs (cuda_src/tail_split.cuh).
    The kernel resets all of them to 0 before it exits (the last ticket's
    holder, each tile half's combiner), so one launch after another on the
    stream, or a CUDA graph's replays, start from zeros without a memset.

    Buffers only grow, and a replaced one stays allocated: prepared launches
    and captured graphs keep its address, and launches on one stream run in
    order, so sharing is safe. Growth doubles, so what is kept is at most
    twice the largest buffer. A stream's state lives as long as the process
    (a program that makes many short-lived streams keeps each one's buffers).
    """

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.buffers: dict = {}  # name -> array: "counters", "partials", "discarded_lse", "splits_done"
        self.replaced: list = []
        # Threads that share a stream (the null stream, say) grow its buffers one at a time:
        # two growing at once would each allocate, and one's buffer would be freed while a
        # prepared launch still points at it.
        self._lock = threading.Lock()

    def _grown(self, name: str, size: int, dtype, zeroed: bool, what: str):
        old = self.buffers.get(name)
        if old is not None and old.size >= size:
            return old
        with self._lock:
            old = self.buffers.get(name)
            if old is not None and old.size >= size:
                return old
            require_not_capturing(what)
            size = max(size, 2 * old.size) if old is not None else size
            with cupy().cuda.Device(self.device_id):
                new = cupy().zeros(size, dtype) if zeroed else cupy().empty(size, dtype)
            if old is not None:
                self.replaced.append(old)
            self.buffers[name] = new
            return new

    def counters_for(self, split_tiles: int) -> tuple[int, int]:
        """(ticket address, tail address) with room for `split_tiles` split tiles."""
        needed = 1 + 2 * max(split_tiles, sm_count(self.device_id))
        ptr = self._grown("counters", needed, numpy.int32, True, "the first Hopper forward on this stream").data.ptr
        return ptr, ptr + 4

    def bwd_ticket(self) -> int:
        """Address of the Hopper dK/dV kernel's tile ticket (int32, 0 between launches: its last holder
        resets it)."""
        return self._grown("bwd_ticket", 1, numpy.int32, True, "the first Hopper backward on this stream").data.ptr

    def discarded_lse_for(self, floats: int):
        """A float32 array of at least `floats` values the forward may write an unwanted lse into."""
        return self._grown("discarded_lse", floats, numpy.float32, False,
                           "a forward that returns no lse, larger than this stream has run")

    def splits_done_for(self, row_blocks: int) -> int:
        """Address of at least `row_blocks` int32 counts, 0 between launches: the decoding kernel's
        finished split CTAs per row block (the last one merges the splits and resets its count)."""
        return self._grown("splits_done", row_blocks, numpy.int32, True,
                           "a decoding step with more split row blocks than this stream has run").data.ptr

    def partials_for(self, floats: int) -> int:
        """Address of at least `floats` float32 values for partial outputs (partial outputs, then
        their logsumexps)."""
        return self._grown("partials", floats, numpy.float32, False,
                           "a larger last-wave split than this stream has run").data.ptr


_stream_states: dict = {}
_stream_states_lock = threading.Lock()


def stream_state(device_id: int, stream: int) -> StreamState:
    key = (device_id, stream)
    state = _stream_states.get(key)
    if state is None:
        with _stream_states_lock:
            state = _stream_states.setdefault(key, StreamState(device_id))
    return state


# ---------------------------------------------------------------- forward

class FwdSm80Launch:
    """The sm_80 forward (cuda_src/fwd_sm80.cuh): one CTA per block_m query rows of a head."""

    def __init__(self, cfg, problem, q, k, v, out, lse, scale: float, device_id: int):
        nheads, headdim = q.shape[2:]
        batch, seqlen_q, seqlen_k = _lengths(problem, q, k)
        mods = problem.mods
        even_n = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0 and mods.varlen is None
        name = cfg.name_expression(problem.dtype_name, problem.causal, even_n, headdim == cfg.headdim, mods.bits)
        self.kernel = kernel(cfg.family, name, cfg.smem_bytes(), device_id)
        self.grid = (-(-seqlen_q // cfg.block_m), nheads, batch)
        self.threads = cfg.threads
        self.args = KernelArgs([q, k, v, out, lse, numpy.int32(seqlen_q), numpy.int32(seqlen_k),
                                numpy.int32(headdim), numpy.int32(problem.group), *_strides(q, k, v, out),
                                numpy.float32(mods.score_log2(scale)), mods.kernel_args(seqlen_q, seqlen_k, scale)])
        self.last_addresses = None
        self.lock = threading.Lock()

    def run(self, q, k, v, out, lse, stream: int, descale=None, slopes=None, cu_seqlens=None) -> None:
        addresses = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
                     _option_addresses(slopes, cu_seqlens))
        with self.lock:
            args = self.args
            if addresses != self.last_addresses:  # else the packed arguments stand as they are
                for slot, address in enumerate(addresses[:-1]):
                    args.set_address(slot, address)
                _point_options(args, addresses[-1])
                self.last_addresses = addresses
            self.kernel.launch(self.grid, self.threads, args, stream)


class FwdSm90Launch:
    """The Hopper forward (cuda_src/fwd_sm90.cuh): Q, K, V (fp8: Vt) and O reach it as tensor maps."""

    # Argument slots rewritten per call (the order of fwd_sm90_kernel's parameters).
    MAP_Q, MAP_K, MAP_V, MAP_O, OUT, LSE, DESCALE_Q, DESCALE_K, DESCALE_V, TICKET, WS_O, WS_LSE, TAIL = range(13)

    def __init__(self, cfg, problem, q, k, v, out, lse, scale: float, device_id: int):
        nheads, headdim = q.shape[2:]
        batch, seqlen_q, seqlen_k = _lengths(problem, q, k)
        self.cfg = cfg
        self.threads = cfg.threads
        self.fp8 = problem.dtype_name == FP8_DTYPE_NAME
        self.mods, self.seqlen_k = problem.mods, seqlen_k  # fp8's V transpose (varlen: per sequence)
        # Tensor maps need 16-byte multiples for every stride they step over (not only alignment).
        self.copies = tuple(not tma.usable(x) for x in (q, k, v))
        mods = problem.mods
        even_n = seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0 and mods.varlen is None
        smem = cfg.smem_bytes(problem.dtype_name, mods.bits)
        self.kernel = kernel(cfg.family, cfg.name_expression(problem.dtype_name, problem.causal, even_n,
                                                             mods=mods.bits), smem, device_id)
        self.device_id = device_id
        num_tiles = -(-seqlen_q // cfg.block_m) * nheads * batch
        split = tail_split.TailSplit(num_tiles, 0)
        if mods.varlen is not None:
            # Items over slots of block_m packed query rows per head (varlen_tile_at,
            # cuda_src/fwd_sm90_scheduler.cuh); num_tiles stays the bound of the tile indices.
            split = tail_split.TailSplit(nheads * (mods.varlen.total_q // cfg.block_m + batch), 0)
        ctas = sm_count(device_id) if cfg.persistent else split.full_tiles
        if cfg.tail_split(problem.dtype_name, problem.causal, mods.bits):
            split = tail_split.plan(num_tiles, ctas, -(-seqlen_k // cfg.block_n))
        self.grid = (min(split.full_tiles + split.items, ctas), 1, 1)
        self.split_tiles = split.split_tiles(num_tiles) if split.items else 0
        slots = split.slots(num_tiles)
        self.partial_o_floats = slots * cfg.block_m * cfg.headdim
        self.partial_floats = self.partial_o_floats + slots * cfg.block_m
        self.args = KernelArgs([*[UNSET_MAP] * 4, out, lse, lse, lse, lse, lse, lse, lse, lse,
                                numpy.int32(split.full_tiles), numpy.int32(split.items), numpy.int32(seqlen_q),
                                numpy.int32(seqlen_k), numpy.int32(headdim), numpy.int32(problem.group),
                                numpy.int32(nheads), numpy.int32(k.shape[2]), numpy.int32(num_tiles),
                                *_strides(out), numpy.float32(mods.score_log2(scale)),
                                mods.kernel_args(seqlen_q, seqlen_k, scale)])
        self.last_addresses = None
        self.lock = threading.Lock()

    def _maps(self, q, k, v, out):
        cfg = self.cfg
        map_q = tma.seq_major_map(q, cfg.block_m)
        if self.fp8:
            map_v = tma.keys_major_map(v, cfg.headdim)  # v is Vt here
        else:
            map_v = tma.seq_major_map(v, cfg.block_n)
        # Each consumer warpgroup stores its 64 rows of a tile (out is 16-byte aligned: validated).
        map_o = tma.seq_major_map(out, cfg.block_m // 2) if cfg.stage_o else map_q  # map_q: not read
        return map_q, tma.seq_major_map(k, cfg.block_n), map_v, map_o

    def run(self, q, k, v, out, lse, stream: int, descale=None, slopes=None, cu_seqlens=None) -> None:
        if self.copies != (False, False, False):
            q, k, v = (aligned_copy(x) if copy else x for x, copy in zip((q, k, v), self.copies))
        if self.fp8:
            v = fp8.transpose_v(v, self.mods, cu_seqlens, self.seqlen_k)
        # v (fp8: Vt) and any copies are freed when this returns, before the
        # kernel has run: safe because CuPy's memory pool hands a freed block
        # out again only in stream order (to later work on this stream).
        addresses = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, stream,
                     None if descale is None else tuple(x.data.ptr for x in descale),
                     _option_addresses(slopes, cu_seqlens))
        with self.lock:
            args = self.args
            # A loop that reuses its buffers calls with the last call's
            # addresses: then the packed arguments stand as they are.
            if addresses != self.last_addresses:
                self._point(args, q, k, v, out, lse, stream, descale)
                _point_options(args, addresses[-1])
                self.last_addresses = addresses
            self.kernel.launch(self.grid, self.threads, args, stream)

    def _point(self, args: KernelArgs, q, k, v, out, lse, stream: int, descale) -> None:
        """Write the call's tensor maps and addresses into the packed arguments."""
        state = stream_state(self.device_id, stream)
        ticket, tail = state.counters_for(self.split_tiles)
        partials = state.partials_for(self.partial_floats) if self.partial_floats else lse.data.ptr
        args[self.MAP_Q], args[self.MAP_K], args[self.MAP_V], args[self.MAP_O] = self._maps(q, k, v, out)
        args[self.OUT], args[self.LSE] = out, lse
        if descale is not None:  # fp8; the 16-bit kernels never read these slots
            args[self.DESCALE_Q], args[self.DESCALE_K], args[self.DESCALE_V] = descale
        args.set_address(self.TICKET, ticket)
        args.set_address(self.TAIL, tail)
        args.set_address(self.WS_O, partials)
        args.set_address(self.WS_LSE, partials + 4 * self.partial_o_floats)


def prepare_fwd(cfg, problem, q, k, v, out, lse, scale: float, device_id: int):
    """The forward launch of `cfg` for arrays shaped and strided as these (validated, 16-byte aligned)."""
    launch = FwdSm90Launch if cfg.family == "fwd_sm90" else FwdSm80Launch
    return launch(cfg, problem, q, k, v, out, lse, scale, device_id)


def launch_fwd(cfg, problem, q, k, v, out, lse, scale: float, descale=None, slopes=None) -> None:
    """Prepare and run a forward on CuPy's current device and stream (the tuner's path)."""
    cp = cupy()
    device_id = cp.cuda.Device().id
    prepare_fwd(cfg, problem, q, k, v, out, lse, scale, device_id).run(
        q, k, v, out, lse, cp.cuda.get_current_stream().ptr, descale, slopes)


# ---------------------------------------------------------------- backward

def padded_rows(seqlen_q: int) -> int:
    """Query rows of the backward's per-row buffers: a multiple of every kernel's row tile."""
    return -(-seqlen_q // BWD_ROW_PAD) * BWD_ROW_PAD


def buffer_rows(problem, q_shape) -> tuple[int, int]:
    """(rows per head, rows in all) of the backward's per-row buffers (cuda_src/seq_span.cuh):
    padded rows per (batch, head), or varlen every sequence's padded rows per head."""
    varlen, nheads = problem.mods.varlen, q_shape[2]
    if varlen is not None:
        per_head = padded_rows(varlen.total_q) + varlen.num_seqs * BWD_ROW_PAD  # each head's rows start aligned
        return per_head, nheads * per_head
    per_head = padded_rows(q_shape[1])
    return per_head, q_shape[0] * nheads * per_head


class BackwardWorkspace:
    """The backward's scratch for calls up to a size: lse * log2(e) and rowsum(dO * O) per query row
    (float32, padded rows), and the float32 dQ accumulator of the atomic (non-deterministic) mode.

    Given to `attention_backward(..., workspace=)`, no call allocates: what a
    CUDA graph capture needs. `floats` is the capacity in float32 values.
    """

    def __init__(self, floats: int, device_id: int, buffer=None):
        """A new buffer of `floats` values, or `buffer` (float32, 1-D, on device_id) used in place."""
        if buffer is None:
            with cupy().cuda.Device(device_id):
                buffer = cupy().empty(max(floats, 1), dtype=numpy.float32)
        self.buffer = buffer
        self.device_id = device_id

    @staticmethod
    def floats_for(cfg: BwdConfig, rows: int, deterministic: bool) -> int:
        """The floats for a call whose per-row buffers have `rows` rows (buffer_rows)."""
        return 2 * rows + (rows * cfg.headdim if cfg.atomic_dq(deterministic) else 0)


def hopper_bwd_persistent(cfg: BwdConfig, problem) -> bool:
    """Whether the Hopper dK/dV kernel of `cfg` and `problem` is persistent: cuda_src/bwd_sm90.cuh's
    bwd_sm90_persistent (the atomic dQ, no window or packed batch); the wide kernel never is."""
    mods = problem.mods
    return cfg.atomic_dq(problem.deterministic) and mods.window is None and mods.varlen is None


class BwdLaunch:
    """The backward of one config: preprocess, dK/dV (with an atomic dQ) and the dQ convert or dQ kernel."""

    def __init__(self, cfg: BwdConfig, problem, scale: float, q, k, v, dout, out, lse, dq, dk, dv, device_id: int):
        dtype_name, causal = problem.dtype_name, problem.causal
        self.cfg, self.device_id = cfg, device_id
        nheads, headdim = q.shape[2:]
        nheads_kv = k.shape[2]
        batch, seqlen_q, seqlen_k = _lengths(problem, q, k)
        self.atomic_dq = cfg.atomic_dq(problem.deterministic)
        mods = problem.mods
        varlen = mods.varlen is not None
        nq_pad, self.rows = buffer_rows(problem, q.shape)
        self.floats = BackwardWorkspace.floats_for(cfg, self.rows, problem.deterministic)
        self.copies = tuple(cfg.hopper and not tma.usable(x) for x in (q, k, v, dout))
        ints = (numpy.int32(seqlen_q), numpy.int32(seqlen_k), numpy.int32(headdim), numpy.int32(problem.group),
                numpy.int32(nq_pad))
        # the exponent factor, the gradients' scale, and the score options (every kernel's last three arguments)
        scales = (numpy.float32(mods.score_log2(scale)), numpy.float32(scale),
                  mods.kernel_args(seqlen_q, seqlen_k, scale))
        even_d = headdim == cfg.headdim
        # lse2, delta, dq_accum: placeholders until run() points them at the workspace.
        scratch = lse

        # Delta = rowsum(dO o O); lse2 = lse * log2(e) (+inf where a row saw no key)
        pre = kernel(cfg.family, cfg.preprocess_name(dtype_name, varlen), 0, device_id)
        pre_rows_per_cta = ROW_KERNEL_THREADS // preprocess_row_lanes(cfg.headdim)
        pre_grid = (-(-padded_rows(seqlen_q) // pre_rows_per_cta), nheads, batch)
        # The preprocess reads the dout the Hopper kernels read: the aligned copy where run() makes one.
        # It zeroes dq_accum's rows (cfg.headdim floats each) for the atomic dQ; 0 floats without.
        dout_strides = [numpy.int64(s) for s in contiguous_strides(dout.shape)[:3]] if self.copies[3] else _strides(dout)
        accum_row = numpy.int32(cfg.headdim if self.atomic_dq else 0)
        self.pre_args = KernelArgs([out, dout, lse, scratch, scratch, scratch, numpy.int32(seqlen_q),
                                    numpy.int32(nq_pad), numpy.int32(headdim), accum_row, *_strides(out),
                                    *dout_strides, scales[-1]])

        even_n = seqlen_q % cfg.dkdv_block_m == 0 and seqlen_k % cfg.dkdv_block_n == 0 and not varlen
        dkdv = kernel(cfg.kernel_family, cfg.dkdv_name(dtype_name, causal, even_n, even_d, self.atomic_dq, mods.bits),
                      cfg.dkdv_smem_bytes(self.atomic_dq), device_id)
        dkdv_grid = (-(-seqlen_k // cfg.dkdv_block_n), nheads_kv, batch)
        if cfg.hopper:
            # One CTA a tile, in a 1-D grid; or, where the kernel is persistent, one an SM that takes the
            # tiles in turn (cuda_src/bwd_sm90.cuh, kv_tile_at and bwd_sm90_persistent).
            tiles = math.prod(dkdv_grid)
            dkdv_grid = (min(tiles, sm_count(device_id)) if hopper_bwd_persistent(cfg, problem) else tiles, 1, 1)
            # The tile ticket: a placeholder until run() points it at the stream's.
            self.dkdv_args = KernelArgs([*[UNSET_MAP] * 4, scratch, scratch, scratch, dk, dv, scratch, *ints,
                                         numpy.int32(nheads_kv), numpy.int32(batch), *_strides(dk, dv), *scales])
        else:
            self.dkdv_args = KernelArgs([q, k, v, dout, scratch, scratch, scratch, dk, dv, *ints,
                                         *_strides(q, k, v, dout, dk, dv), *scales])

        if self.atomic_dq:
            last = kernel(cfg.kernel_family, cfg.dq_accum_convert_name(dtype_name, varlen), 0, device_id)
            rows_per_cta = cfg.dkdv_block_m if cfg.hopper else ROW_KERNEL_THREADS // 32
            last_grid = (-(-seqlen_q // rows_per_cta), nheads, batch)
            last_threads = ROW_KERNEL_THREADS
            sizes = (numpy.int32(seqlen_q), numpy.int32(nq_pad), numpy.int32(headdim))
            if not cfg.hopper:
                sizes += (numpy.int32(cfg.headdim),)  # the row length of dq_accum
            self.last_args = KernelArgs([scratch, dq, *sizes, *_strides(dq), numpy.float32(scale), scales[-1]])
        else:
            even_n = seqlen_q % cfg.dq_block_m == 0 and seqlen_k % cfg.dq_block_n == 0 and not varlen
            last = kernel(cfg.kernel_family, cfg.dq_name(dtype_name, causal, even_n, even_d, mods.bits),
                          cfg.dq_smem_bytes(), device_id)
            last_grid = (-(-seqlen_q // cfg.dq_block_m), nheads, batch)
            last_threads = cfg.dq_threads
            if cfg.hopper:
                self.last_args = KernelArgs([*[UNSET_MAP] * 4, scratch, scratch, dq, *ints, *_strides(dq), *scales])
            else:
                self.last_args = KernelArgs([q, k, v, dout, scratch, scratch, dq, *ints,
                                             *_strides(q, k, v, dout, dq), *scales])
        if cfg.hopper:
            # Each Hopper kernel settles in while the one before it finishes, and waits for its results in
            # the kernel (programmatic dependent launch): the launch gaps between the three are hidden.
            dkdv, last = LaunchAfterPrior(dkdv), LaunchAfterPrior(last)
        # run()'s launches in order: (kernel, grid, threads, packed arguments) by name.
        self.stages = {"preprocess": (pre, pre_grid, ROW_KERNEL_THREADS, self.pre_args),
                       "dkdv": (dkdv, dkdv_grid, cfg.dkdv_threads, self.dkdv_args),
                       "dq": (last, last_grid, last_threads, self.last_args)}
        self.last_addresses = None
        self.lock = threading.Lock()

    def launch_stage(self, name: str, stream: int) -> None:
        """One of run()'s launches alone, on the arrays of the last run() (to time it)."""
        kernel_, grid, threads, args = self.stages[name]
        kernel_.launch(grid, threads, args, stream)

    @staticmethod
    def _maps(q, k, v, dout, block_m: int, block_n: int):
        return (tma.seq_major_map(q, block_m), tma.seq_major_map(k, block_n), tma.seq_major_map(v, block_n),
                tma.seq_major_map(dout, block_m))

    def run(self, q, k, v, dout, out, lse, dq, dk, dv, stream: int, workspace: BackwardWorkspace | None,
            slopes=None, cu_seqlens=None) -> None:
        if workspace is None:
            require_not_capturing("attention_backward without workspace=")
            workspace = BackwardWorkspace(self.floats, self.device_id)
        elif workspace.buffer.size < self.floats:
            raise ValueError(f"workspace holds {workspace.buffer.size} float32 values; this call needs "
                             f"{self.floats} (cuflash.backward_workspace sizes one for a call)")
        lse2 = workspace.buffer.data.ptr
        delta = lse2 + 4 * self.rows
        dq_accum = delta + 4 * self.rows
        q, k, v, dout = (aligned_copy(x) if copy else x for x, copy in zip((q, k, v, dout), self.copies))
        options = _option_addresses(slopes, cu_seqlens)
        addresses = tuple(x.data.ptr for x in (q, k, v, dout, out, lse, dq, dk, dv)) + (lse2, options, stream)
        with self.lock:
            # A loop that reuses its buffers calls with the last call's
            # addresses: then the packed arguments stand as they are.
            if addresses != self.last_addresses:
                self._point(q, k, v, dout, out, lse, dq, dk, dv, lse2, delta, dq_accum, stream)
                for args in (self.pre_args, self.dkdv_args, self.last_args):
                    _point_options(args, options)
                self.last_addresses = addresses
            for kernel_, grid, threads, args in self.stages.values():
                kernel_.launch(grid, threads, args, stream)

    def _point(self, q, k, v, dout, out, lse, dq, dk, dv, lse2: int, delta: int, dq_accum: int,
               stream: int) -> None:
        """Write the call's tensor maps and addresses into the three kernels' packed arguments."""
        cfg = self.cfg
        pre = self.pre_args
        pre[0], pre[1], pre[2] = out, dout, lse
        pre.set_address(3, lse2)
        pre.set_address(4, delta)
        pre.set_address(5, dq_accum if self.atomic_dq else lse2)  # lse2: not written without atomics

        args = self.dkdv_args
        self._set_inputs(args, q, k, v, dout, cfg.dkdv_block_m, cfg.dkdv_block_n)
        args.set_address(4, lse2)
        args.set_address(5, delta)
        args.set_address(6, dq_accum if self.atomic_dq else lse2)  # lse2: not read without atomics
        args[7], args[8] = dk, dv
        if cfg.hopper:  # the stream's tile ticket (one int that never grows)
            args.set_address(9, stream_state(self.device_id, stream).bwd_ticket())

        args = self.last_args
        if self.atomic_dq:
            args.set_address(0, dq_accum)
            args[1] = dq
        else:
            self._set_inputs(args, q, k, v, dout, cfg.dq_block_m, cfg.dq_block_n)
            args.set_address(4, lse2)
            args.set_address(5, delta)
            args[6] = dq

    def _set_inputs(self, args: KernelArgs, q, k, v, dout, block_m: int, block_n: int) -> None:
        if self.cfg.hopper:
            args[0], args[1], args[2], args[3] = self._maps(q, k, v, dout, block_m, block_n)
        else:
            args[0], args[1], args[2], args[3] = q, k, v, dout


def prepare_bwd(cfg: BwdConfig, problem, scale: float, q, k, v, dout, out, lse, dq, dk, dv,
                device_id: int) -> BwdLaunch:
    """The backward launch of `cfg` for arrays shaped and strided as these (validated, 16-byte aligned)."""
    return BwdLaunch(cfg, problem, scale, q, k, v, dout, out, lse, dq, dk, dv, device_id)


def launch_bwd(cfg: BwdConfig, problem, scale: float, q, k, v, dout, out, lse, dq, dk, dv, slopes=None) -> None:
    """Prepare and run a backward on CuPy's current device and stream (the tuner's path)."""
    cp = cupy()
    device_id = cp.cuda.Device().id
    prepare_bwd(cfg, problem, scale, q, k, v, dout, out, lse, dq, dk, dv, device_id).run(
        q, k, v, dout, out, lse, dq, dk, dv, cp.cuda.get_current_stream().ptr, None, slopes)
