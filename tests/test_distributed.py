"""Ring attention (cuflash.distributed) on simulated ranks.

On the host: the ring's steps, layouts, merges and gradient travel, with the float64 reference as
each step's local kernel (`host_attention`, `host_backward`), against the float64 reference over
the whole sequence. On a GPU (marker `gpu`): the same with cuflash's kernels, ranks as arrays of
one device, against the float64 reference with the 2x rule.
"""

import contextlib

import numpy as np
import pytest

from cuflash import distributed, reference
from tests.numerics import ATOL, assert_close_2x, randn, ring_rounding


def host_attention(q, k, v, *, causal, softmax_scale, softcap):
    return reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap,
                               return_lse=True)


def host_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, softcap):
    """A shard pair's share of the gradients given the whole rows' out and lse (float64):
    P = e^(S - lse), dS = P (dO V^T - rowsum(dO * out)), through softcap's tanh."""
    batch, nq, nheads, headdim = q.shape
    group = nheads // k.shape[2]
    scale = softmax_scale or 1 / np.sqrt(headdim)
    visible = reference.visible_mask(nq, k.shape[1], causal)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for h in range(nheads):
            qh, kh, vh, doh, oh = q[b, :, h], k[b, :, h // group], v[b, :, h // group], dout[b, :, h], out[b, :, h]
            s = scale * qh @ kh.T
            if softcap:
                tanh = np.tanh(s / softcap)
                s = softcap * tanh
            p = np.where(visible, np.exp(s - lse[b, h][:, None]), 0.0)
            ds = p * (doh @ vh.T - (doh * oh).sum(axis=1, keepdims=True))
            if softcap:
                ds = ds * (1 - tanh * tanh)
            dq[b, :, h] = scale * ds @ kh
            dk[b, :, h // group] += scale * ds.T @ qh
            dv[b, :, h // group] += p.T @ doh
    return dq, dk, dv


def shards(x, world, layout):
    return [distributed.shard(x, r, world, layout) for r in range(world)]


CASES = [  # world, layout, causal, nheads, nheads_kv, softcap
    (1, "zigzag", True, 2, 2, 0.0),
    (2, "zigzag", True, 2, 2, 0.0),
    (3, "zigzag", True, 4, 2, 0.0),
    (4, "zigzag", True, 2, 1, 5.0),
    (2, "zigzag", False, 2, 2, 0.0),
    (3, "contiguous", True, 2, 2, 0.0),
    (4, "contiguous", False, 4, 2, 3.0),
]


@pytest.mark.parametrize("world, layout, causal, nheads, nheads_kv, softcap", CASES)
def test_ring_on_the_host_equals_whole_attention(world, layout, causal, nheads, nheads_kv, softcap):
    rng = np.random.default_rng(world)
    n = 12 * world
    q = rng.standard_normal((2, n, nheads, 16))
    k, v = (rng.standard_normal((2, n, nheads_kv, 16)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    options = dict(causal=causal, softcap=softcap, softmax_scale=0.3)
    transport = distributed.InProcessTransport(world)
    qs, ks, vs, douts = (shards(x, world, layout) for x in (q, k, v, dout))
    outs, lses = distributed.ring_attention(qs, ks, vs, transport=transport, layout=layout, return_lse=True,
                                            local_attention=host_attention, **options)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    np.testing.assert_allclose(distributed.unshard(outs, layout), ref, atol=1e-10)
    np.testing.assert_allclose(distributed.unshard(lses, layout, axis=2), ref_lse, atol=1e-10)

    grads = distributed.ring_attention_backward(douts, qs, ks, vs, outs, lses, transport=transport, layout=layout,
                                                local_backward=host_backward, **options)
    for got, want in zip(grads, reference.attention_backward(dout, q, k, v, **options)):
        np.testing.assert_allclose(distributed.unshard(got, layout), want, atol=1e-10)
    assert all(g.dtype == np.float64 for shards_ in grads for g in shards_)


class Placed(np.ndarray):
    """A host array that knows the rank ("GPU") it lives on, placed as CuPy places device arrays: a
    new array on the current rank (0 outside any `on_rank`), a view on its base's."""

    current = 0

    def __array_finalize__(self, obj):
        self.rank = getattr(obj, "rank", Placed.current) if self.base is not None else Placed.current


def placed(x, rank):
    p = np.array(x).view(Placed)
    p.rank = rank
    return p


@contextlib.contextmanager
def on_rank(x):
    """distributed._on for Placed arrays: x's rank is current inside."""
    previous = Placed.current
    Placed.current = getattr(x, "rank", previous)
    try:
        yield
    finally:
        Placed.current = previous


class PlacementCheckingTransport(distributed.InProcessTransport):
    """Refuses a rank's buffer that lies on another rank, as NcclTransport does."""

    def start(self, buffers):
        for rank, buffer in enumerate(buffers):
            assert [x.rank for x in buffer] == [rank] * len(buffer), f"rank {rank}'s buffers"
        return super().start(buffers)


def test_every_ring_array_lies_on_its_ranks_device(monkeypatch):
    """The ring creates each rank's sums, accumulators and results on that rank's device (the one its q
    shard lies on), never on the device current when the ring was called: over NCCL a buffer on another
    GPU is refused, and the arithmetic on it crosses the link."""
    monkeypatch.setattr(distributed, "_on", on_rank)
    monkeypatch.setattr(distributed, "_contiguous",  # cupy.ascontiguousarray: x itself, or a copy on the current device
                        lambda x: x if x.flags.c_contiguous else placed(x, Placed.current))
    world, layout = 3, "zigzag"
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 12 * world, 2, 8)) for _ in range(4))

    def local_attention(*args, **kwargs):  # results on the current rank, as a kernel's
        return tuple(placed(x, Placed.current) for x in host_attention(*args, **kwargs))

    def local_backward(*args, **kwargs):
        return tuple(placed(x, Placed.current) for x in host_backward(*args, **kwargs))

    qs, ks, vs, douts = ([placed(s, r) for r, s in enumerate(shards(x, world, layout))] for x in (q, k, v, dout))
    transport = PlacementCheckingTransport(world)
    outs, lses = distributed.ring_attention(qs, ks, vs, transport=transport, layout=layout, causal=True,
                                            return_lse=True, local_attention=local_attention)
    grads = distributed.ring_attention_backward(douts, qs, ks, vs, outs, lses, transport=transport, layout=layout,
                                                causal=True, local_backward=local_backward)
    for name, results in zip(("out", "lse", "dq", "dk", "dv"), (outs, lses, *grads)):
        assert [x.rank for x in results] == list(range(world)), name


class RecordingTransport(distributed.InProcessTransport):
    """Logs each rotation ("S" and the arrays a rank sends) and each wait for one ("F")."""

    def __init__(self, world, log):
        super().__init__(world)
        self.log = log

    def start(self, buffers):
        self.log.append(f"S{len(buffers[0])}")
        return super().start(buffers)

    def finish(self, pending):
        self.log.append("F")
        return super().finish(pending)


def test_rotations_queue_after_a_steps_kernels_and_before_its_merges(monkeypatch):
    """The order docs/distributed.md measured: each K/V rotation is queued right after the kernels of
    the step two before its use ("K", one a rank) and ahead of that step's merges ("M"), so that its
    NCCL kernels run beside the next attention kernel instead of after it; the backward sends a
    step's dK, dV sums and the K, V of two steps later in one rotation (4 arrays a rank)."""
    log = []
    merge = distributed._merge
    monkeypatch.setattr(distributed, "_merge", lambda *args: (log.append("M"), merge(*args)))
    world = 4
    rng = np.random.default_rng(9)
    q, k, v, dout = (rng.standard_normal((1, 8 * world, 2, 8)) for _ in range(4))
    qs, ks, vs, douts = (shards(x, world, "zigzag") for x in (q, k, v, dout))
    transport = RecordingTransport(world, log)

    def local_attention(*args, **kwargs):
        log.append("K")
        return host_attention(*args, **kwargs)

    def local_backward(*args, **kwargs):
        log.append("K")
        return host_backward(*args, **kwargs)

    outs, lses = distributed.ring_attention(qs, ks, vs, transport=transport, causal=True, return_lse=True,
                                            local_attention=local_attention)
    assert " ".join(log) == "S2 K K K K S2 F K K K K S2 M M M M F K K K K M M M M F K K K K M M M M"
    log.clear()
    distributed.ring_attention_backward(douts, qs, ks, vs, outs, lses, transport=transport, causal=True,
                                        local_backward=local_backward)
    assert " ".join(log) == "S2 K K K K S4 F K K K K F S4 K K K K F S2 K K K K F S2 F"


def test_shards_hold_chunks_r_and_2r_minus_1_minus_r():
    x = np.arange(16).reshape(1, 16, 1, 1)
    got = [s.ravel().tolist() for s in shards(x, 4, "zigzag")]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert distributed.unshard(shards(x, 4, "zigzag")).ravel().tolist() == list(range(16))


def test_bad_arguments_name_what_is_wrong():
    x = [np.zeros((1, 6, 1, 8))] * 2
    transport = distributed.InProcessTransport(2)
    with pytest.raises(ValueError, match=r"\blayout\b"):
        distributed.ring_attention(x, x, x, transport=transport, layout="striped")
    with pytest.raises(ValueError, match=r"\bwindow_size\b"):
        distributed.ring_attention(x, x, x, transport=transport, window_size=(4, 0))
    with pytest.raises(ValueError, match=r"\bq\b"):
        distributed.ring_attention(x[:1], x, x, transport=transport)
    with pytest.raises(ValueError, match="multiple of 4"):
        distributed.shard(np.zeros((1, 6, 1, 8)), 0, 2)
    odd = [np.zeros((1, 5, 1, 8))] * 2
    with pytest.raises(ValueError, match="even"):
        distributed.ring_attention(odd, odd, odd, transport=transport, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("world, layout, causal", [(2, "zigzag", True), (3, "zigzag", True), (4, "zigzag", True),
                                                   (3, "zigzag", False), (4, "contiguous", True)])
def test_ring_with_cuflash_kernels_on_one_gpu(world, layout, causal):
    import cupy

    rng = np.random.default_rng(world)
    n, dtype = 97 * 2 * world, np.float16
    q = randn(rng, (2, n, 4, 64), dtype)
    k, v = (randn(rng, (2, n, 2, 64), dtype) for _ in range(2))
    dout = randn(rng, q.shape, dtype)
    transport = distributed.InProcessTransport(world)
    qs, ks, vs, douts = ([cupy.asarray(s) for s in shards(x, world, layout)] for x in (q, k, v, dout))
    outs, lses = distributed.ring_attention(qs, ks, vs, transport=transport, layout=layout, causal=causal,
                                            return_lse=True)
    got = distributed.unshard([o.get() for o in outs], layout)
    ref = reference.attention(q, k, v, causal=causal)
    assert_close_2x(got, ref, reference.attention_naive_lowp(q, k, v, causal=causal, dtype=dtype), ATOL[np.dtype(dtype)])
    grads = distributed.ring_attention_backward(douts, qs, ks, vs, outs, lses, transport=transport, layout=layout,
                                                causal=causal)
    refs = reference.attention_backward(dout, q, k, v, causal=causal)
    naives = reference.attention_backward_naive_lowp(dout, q, k, v, causal=causal, dtype=dtype)
    for got_shards, want, naive in zip(grads, refs, naives):
        got = distributed.unshard([g.get() for g in got_shards], layout)
        assert_close_2x(got, want, naive, ATOL[np.dtype(dtype)] + ring_rounding(world, want, dtype))


@pytest.mark.gpu
def test_nccl_transport_on_one_gpu():
    """A one-rank NCCL ring: the backward's homecoming hop sends to and receives from itself."""
    import cupy

    rng = np.random.default_rng(0)
    q, k, v, dout = (randn(rng, (1, 64, 2, 64), np.float16) for _ in range(4))
    transport = distributed.NcclTransport(distributed.communicators([0]), [0])
    dev = [[cupy.asarray(x)] for x in (q, k, v, dout)]
    (out,), (lse,) = distributed.ring_attention(*dev[:3], transport=transport, causal=True, return_lse=True)
    grads = distributed.ring_attention_backward(dev[3], *dev[:3], [out], [lse], transport=transport, causal=True)
    want = reference.attention_backward(dout, q, k, v, causal=True)
    naive = reference.attention_backward_naive_lowp(dout, q, k, v, causal=True, dtype=np.float16)
    for (g,), w, n in zip(grads, want, naive):
        assert_close_2x(g.get(), w, n, ATOL[np.dtype(np.float16)])


@pytest.mark.gpu
def test_one_rank_ring_is_bitwise_single_gpu_cuflash():
    """With one rank the ring's one step is cuflash's call and its merges weigh it by exactly 1: out
    and lse equal single-GPU cuflash bit for bit; the gradients (atomic dQ) agree with its
    deterministic backward to the last bits."""
    import cupy

    import cuflash

    rng = np.random.default_rng(1)
    q, k, v, dout = (cupy.asarray(randn(rng, (2, 130, 4, 64), np.float16)) for _ in range(4))
    transport = distributed.InProcessTransport(1)
    (out,), (lse,) = distributed.ring_attention([q], [k], [v], transport=transport, causal=True, return_lse=True)
    want, want_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert bool((out == want).all()) and bool((lse == want_lse).all())
    grads = distributed.ring_attention_backward([dout], [q], [k], [v], [out], [lse], transport=transport,
                                                causal=True)
    wants = cuflash.attention_backward(dout, q, k, v, want, want_lse, causal=True, deterministic=True)
    for (g,), w in zip(grads, wants):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g.get().astype(np.float32), w.get().astype(np.float32), atol=2e-3)


# --- Several GPUs --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("layout, causal", [("zigzag", True), ("zigzag", False), ("contiguous", True)])
def test_ring_over_nccl_across_gpus(layout, causal):
    """One rank per GPU of the process over NCCL: the 2x rule against the float64 reference, and the
    forward bitwise equal to the same ring simulated on one GPU (same steps, same merge order)."""
    import cupy

    world = cupy.cuda.runtime.getDeviceCount()
    rng = np.random.default_rng(17 * world)
    n, dtype = 97 * 2 * world, np.float16
    q = randn(rng, (2, n, 4, 64), dtype)
    k, v = (randn(rng, (2, n, 2, 64), dtype) for _ in range(2))
    dout = randn(rng, q.shape, dtype)
    devices = list(range(world))
    transport = distributed.NcclTransport(distributed.communicators(devices), devices)

    def on_gpus(x):
        placed = []
        for device, piece in zip(devices, shards(x, world, layout)):
            with cupy.cuda.Device(device):
                placed.append(cupy.asarray(piece))
        return placed

    qs, ks, vs, douts = (on_gpus(x) for x in (q, k, v, dout))
    outs, lses = distributed.ring_attention(qs, ks, vs, transport=transport, layout=layout, causal=causal,
                                            return_lse=True)
    assert [o.device.id for o in outs] == devices
    got = distributed.unshard([o.get() for o in outs], layout)
    ref = reference.attention(q, k, v, causal=causal)
    assert_close_2x(got, ref, reference.attention_naive_lowp(q, k, v, causal=causal, dtype=dtype), ATOL[np.dtype(dtype)])

    one_gpu = [[cupy.asarray(s) for s in shards(x, world, layout)] for x in (q, k, v)]
    sim_outs, sim_lses = distributed.ring_attention(*one_gpu, transport=distributed.InProcessTransport(world),
                                                    layout=layout, causal=causal, return_lse=True)
    for a, b in zip(outs + lses, sim_outs + sim_lses):
        np.testing.assert_array_equal(a.get(), b.get())

    grads = distributed.ring_attention_backward(douts, qs, ks, vs, outs, lses, transport=transport, layout=layout,
                                                causal=causal)
    refs = reference.attention_backward(dout, q, k, v, causal=causal)
    naives = reference.attention_backward_naive_lowp(dout, q, k, v, causal=causal, dtype=dtype)
    for got_shards, want, naive in zip(grads, refs, naives):
        assert [g.device.id for g in got_shards] == devices
        got = distributed.unshard([g.get() for g in got_shards], layout)
        assert_close_2x(got, want, naive, ATOL[np.dtype(dtype)] + ring_rounding(world, want, dtype))


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_ring_over_nccl_one_process_per_gpu():
    """tests/ring_processes_check.py: a process per GPU, communicators from one unique id."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import cupy

    world = cupy.cuda.runtime.getDeviceCount()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(root / "tests" / "ring_processes_check.py"), str(world)], env=env,
                            cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("forward and gradients match") == world, result.stdout


@pytest.mark.gpu
def test_ring_memory_per_rank_does_not_grow_with_the_ring():
    """Each rank's device memory during the forward and the backward (CuPy's pool, emptied before;
    ranks simulated on one GPU, so per rank = total / world) for shards of a fixed size at world 2
    and 4: O(shard) and independent of the world size, as the module docstring promises."""
    import cupy

    pool = cupy.get_default_memory_pool()
    n_local, nheads, headdim = 512, 8, 64
    shard_bytes = n_local * nheads * headdim * 2  # one fp16 q shard
    per_rank = {}
    for world in (2, 4):
        rng = np.random.default_rng(world)
        x = [[cupy.asarray(randn(rng, (1, n_local, nheads, headdim), np.float16)) for _ in range(world)]
             for _ in range(4)]
        qs, ks, vs, douts = x
        transport = distributed.InProcessTransport(world)
        distributed.ring_attention(qs, ks, vs, transport=transport, causal=True)  # compiles outside the count
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        before = pool.used_bytes()
        outs, lses = distributed.ring_attention(qs, ks, vs, transport=transport, causal=True, return_lse=True)
        distributed.ring_attention_backward(douts, qs, ks, vs, outs, lses, transport=transport, causal=True)
        cupy.cuda.Device().synchronize()
        per_rank[world] = (pool.total_bytes() - before) / world
        print(f"world {world}: {per_rank[world] / shard_bytes:.1f} q shards per rank")
    assert per_rank[4] <= 1.15 * per_rank[2] + 2**20, per_rank
    # Forward: K, V held and received, the fp32 accumulator, a step's output; backward: K, V held
    # and received, dQ and the dK, dV sums in fp32, held and in flight, a step's shares, the
    # kernels' workspace: about 25 q shards, with the pool's rounding.
    assert per_rank[4] <= 32 * shard_bytes, per_rank
