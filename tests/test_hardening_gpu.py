"""Hardening: threads, streams, synchronisation, non-finite inputs, out-of-memory, bounded caches and
several GPUs.

Accuracy follows the rule of the other GPU tests: the kernels' error against the float64 reference
(cuflash.reference) may be at most twice that of the naive computation in the input dtype, plus a
small atol. Inputs are built on the host in the low-precision dtype and copied to the device, so the
references see exactly the values the kernels see.

Most cases share one shape and the causal mask at head dim 64 (batch 1, 256 queries and keys, 4 query
heads on 2 kv heads), so that they reuse a few compiled kernel specialisations.
"""

import collections
import concurrent.futures
import contextlib
import functools
import gc
import threading
import tracemalloc

import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import compile as cf_compile
from cuflash import forward, kernel_call, launch, plans, reference
from tests.numerics import ATOL, DTYPES, assert_close_2x, randn

pytestmark = pytest.mark.gpu

B, N, H, HKV, D = 1, 256, 4, 2, 64
GROUP = H // HKV


def make_host(rng, dtype, nq=N, nk=N, headdim=D):
    """Host (dout, q, k, v) in dtype."""
    return (
        randn(rng, (B, nq, H, headdim), dtype),
        randn(rng, (B, nq, H, headdim), dtype),
        randn(rng, (B, nk, HKV, headdim), dtype),
        randn(rng, (B, nk, HKV, headdim), dtype),
    )


def grad_atol(ref, dtype):
    """One ulp of the largest reference gradient plus a floor for gradients that are exactly 0
    (as in test_backward_gpu.py)."""
    return float(ml_dtypes.finfo(dtype).eps) * np.abs(ref).max(initial=0.0) + 1e-5


def check_forward(out, lse, host_qkv, **options):
    """Hold host (out, lse) to the 2x rule and the reference's lse."""
    q, k, v = host_qkv
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    naive = reference.attention_naive_lowp(q, k, v, dtype=q.dtype, **options)
    assert_close_2x(out, ref, naive, ATOL[q.dtype])
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


def check_grads(grads, host, where=(..., ..., ...), **options):
    """Hold host (dq, dk, dv) to the 2x rule against host (dout, q, k, v), on the index or boolean
    mask of each in `where`."""
    refs = reference.attention_backward(*host, **options)
    naives = reference.attention_backward_naive_lowp(*host, dtype=host[1].dtype, **options)
    for name, got, ref, naive, region in zip(("dq", "dk", "dv"), grads, refs, naives, where):
        got, ref, naive = np.asarray(got, np.float64)[region], ref[region], naive[region]
        try:
            assert_close_2x(got, ref, naive, grad_atol(ref, host[1].dtype))
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


# A kernel that keeps a stream busy: work queued after it waits for it.
_HOLD_SOURCE = r"""
extern "C" __global__ void hold(const volatile int* release, unsigned long long limit_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        if (*release != 0) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < limit_ns);
}
"""


@functools.cache
def _hold_kernel():
    return cupy.RawKernel(_HOLD_SOURCE, "hold")


def hold(seconds, flag=None):
    """Queue on the current stream a kernel that runs until `seconds` pass or the int32 device
    scalar `flag` turns non-zero."""
    if flag is None:
        flag = cupy.zeros((), cupy.int32)
    _hold_kernel()((1,), (1,), (flag, np.uint64(int(seconds * 1e9))))


def release(flag):
    """Set a hold's flag from a stream of its own, so that the held stream goes on."""
    with cupy.cuda.Stream(non_blocking=True) as other:
        flag.fill(1)
    other.synchronize()


# --- Threads ------------------------------------------------------------------
#
# Every thread runs forward and backward with these options at head dim 96 (the Hopper kernels of
# head dim 128, a combination no other test compiles), each with its own ALiBi slopes.

THREADS = 8
THREAD_OPTIONS = dict(window_size=(40, 8), softcap=5.0)
THREAD_HEADDIM = 96


def thread_inputs(rng):
    """Per thread: host (dout, q, k, v) at both lengths of the test, and ALiBi slopes."""
    return [({n: make_host(rng, np.float16, n, n, THREAD_HEADDIM) for n in (201, 299)},
             rng.uniform(0.01, 0.3, H).astype(np.float32)) for _ in range(THREADS)]


def run_threads(streams, inputs, n):
    """Forward and backward at length n in every thread at once, each on its own stream: per thread
    host (out, lse, dq, dk, dv)."""
    barrier = threading.Barrier(THREADS, timeout=300)

    def task(i):
        host, slopes = inputs[i]
        stream = streams[i]
        with stream:
            dout, q, k, v = (cupy.asarray(x) for x in host[n])
            options = dict(THREAD_OPTIONS, alibi_slopes=cupy.asarray(slopes))
            stream.synchronize()
            barrier.wait()  # every thread makes its first call at the same moment
            out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
            return tuple(x.get() for x in (out, lse, *grads))

    with concurrent.futures.ThreadPoolExecutor(THREADS) as executor:
        return list(executor.map(task, range(THREADS)))


def check_thread_results(results, inputs, n):
    for (out, lse, *grads), (host, slopes) in zip(results, inputs):
        options = dict(THREAD_OPTIONS, alibi_slopes=slopes)
        check_forward(out, lse, host[n][1:], **options)
        check_grads(grads, host[n], **options)


def test_threads_share_one_kernel_per_specialisation(rng, monkeypatch):
    """8 threads on 8 streams need the same new kernels at once. Two may both compile one (compile.py
    compiles outside its lock), but the memo keeps the first stored: every thread is handed the one
    kernel object of each (device, family, name), kernel_call._kernels and compile._functions hold one
    entry per key, and later requests compile nothing. Every result matches the reference, and calls
    that share one launch plan from 8 streams at once give the bits of the first calls."""
    monkeypatch.setattr(cf_compile, "_functions", {})  # every specialisation new to this process's memo
    monkeypatch.setattr(kernel_call, "_kernels", {})
    lock = threading.Lock()
    handed = []  # (key, Kernel) for every kernel a launch asked for
    builds = collections.Counter()  # cupy.RawModule constructions per name expression

    def recording_kernel(family, name, smem_bytes, device_id):
        found = kernel_call.kernel(family, name, smem_bytes, device_id)
        with lock:
            handed.append(((device_id, family, name), found))
        return found

    raw_module = cupy.RawModule

    def counting_raw_module(*args, name_expressions=(), **kwargs):
        with lock:
            builds.update(name_expressions)
        return raw_module(*args, name_expressions=name_expressions, **kwargs)

    monkeypatch.setattr(launch, "kernel", recording_kernel)
    monkeypatch.setattr(cupy, "RawModule", counting_raw_module)
    inputs = thread_inputs(rng)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(THREADS)]

    first_results = run_threads(streams, inputs, 201)
    check_thread_results(first_results, inputs, 201)
    first = {}
    for key, found in handed:
        assert found is first.setdefault(key, found), f"{key[2]}: threads were handed different kernels"
    assert set(first) == set(kernel_call._kernels) == set(cf_compile._functions)
    for key, found in first.items():
        assert kernel_call._kernels[key] is found
        assert cf_compile._functions[key] is found.function
        assert builds[key[2]] >= 1, f"{key[2]} was compiled before the threads asked for it"

    # Another length, the same specialisations: new launch plans, no compile, the same kernels.
    handed.clear()
    builds.clear()
    check_thread_results(run_threads(streams, inputs, 299), inputs, 299)
    assert not builds, f"compiled again: {sorted(builds)}"
    assert handed and all(found is first.get(key) for key, found in handed)

    # The first length again: 8 streams share each launch plan at once.
    handed.clear()
    again = run_threads(streams, inputs, 201)
    assert not handed, "a repeated signature did not take its launch plan"
    for thread, (got, want) in enumerate(zip(again, first_results)):
        for name, a, b in zip(("out", "lse", "dk", "dv"), (got[0], got[1], got[3], got[4]),
                              (want[0], want[1], want[3], want[4])):
            np.testing.assert_array_equal(a, b, err_msg=f"thread {thread}: {name}")
        # dq sums partial products with atomics: its bits may differ
        np.testing.assert_allclose(got[2].astype(np.float32), want[2].astype(np.float32), rtol=1e-2, atol=2e-3)


# --- Streams ------------------------------------------------------------------


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned_q"])
def test_calls_are_ordered_after_earlier_work_on_their_stream(rng, aligned):
    """Inputs written on a stream behind a 0.2 s kernel, then forward and backward on that stream
    without a synchronisation: the calls see the written values (a misaligned q is copied on the
    stream too). Twice: the full path, then the launch plans."""
    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = [(B, N, H, D), (B, N, H, D), (B, N, HKV, D), (B, N, HKV, D)]
    targets = [cupy.empty(shape, cupy.float16) for shape in shapes]
    if not aligned:  # q 2 bytes past a 16-byte boundary
        targets[1] = cupy.empty(np.prod(shapes[1]) + 1, cupy.float16)[1:].reshape(shapes[1])
    dout, q, k, v = targets
    for _ in range(2):
        host = make_host(rng, np.float16)
        sources = [cupy.asarray(x) for x in host]
        for target in targets:
            target.fill(np.nan)
        cupy.cuda.Device().synchronize()
        with stream:
            hold(0.2)
            for target, source in zip(targets, sources):
                target[...] = source
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        stream.synchronize()
        check_forward(out.get(), lse.get(), host[1:], causal=True)
        check_grads([g.get() for g in grads], host, causal=True)


# --- No synchronisation on the hot path ---------------------------------------

# What a Python-level synchronisation would call. cupy.cuda.Device.synchronize cannot be replaced
# (an immutable type): the held stream below catches it, and any wait outside Python.
SYNCHRONISING = [
    (cupy.cuda.runtime, "deviceSynchronize"),
    (cupy.cuda.runtime, "streamSynchronize"),
    (cupy.cuda.runtime, "eventSynchronize"),
    (cupy.cuda.runtime, "memcpy"),
    (cupy.cuda.Stream, "synchronize"),
    (cupy.cuda.Event, "synchronize"),
    (cupy.ndarray, "get"),
    (cupy.ndarray, "item"),
    (cupy.ndarray, "tolist"),
    (cupy.ndarray, "__float__"),
    (cupy.ndarray, "__int__"),
    (cupy.ndarray, "__bool__"),
]


def _forbidden(name):
    def call(*args, **kwargs):
        raise AssertionError(f"a repeated call synchronised: {name}")

    return call


def test_repeated_calls_do_not_synchronise(rng, monkeypatch):
    """Repeated forward and backward calls, with and without given outputs and workspace, call no
    synchronising API and return while their stream is still busy with earlier work."""
    host = make_host(rng, np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        dout, q, k, v = (cupy.asarray(x) for x in host)
        out, lse = cupy.empty_like(q), cupy.empty((B, H, N), cupy.float32)
        dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))
        workspace = cuflash.backward_workspace(q, k, v, causal=True)
        flag = cupy.zeros((), cupy.int32)

        def calls():
            cuflash.attention(q, k, v, causal=True, out=out, lse=lse)
            cuflash.attention(q, k, v, causal=True)
            cuflash.attention(q, k, v, causal=True, return_lse=True)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv,
                                       workspace=workspace)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)

        calls()  # compiles, plans and sizes the stream's buffers
        stream.synchronize()
        hold(10.0, flag)
        held = stream.record()
        try:
            with monkeypatch.context() as patch:
                for owner, name in SYNCHRONISING:
                    patch.setattr(owner, name, _forbidden(name))
                for _ in range(3):
                    calls()
            busy = not held.done
        finally:
            release(flag)
            stream.synchronize()
    assert busy, "the repeated calls waited for the stream's earlier work"
    check_forward(out.get(), lse.get(), host[1:], causal=True)
    check_grads([g.get() for g in (dq, dk, dv)], host, causal=True)


# --- Non-finite inputs --------------------------------------------------------

ROW, HEAD = 150, 1  # q's poisoned row, in the second query block, and its head (kv head 0)
KEY, KV_HEAD = 200, 1  # k's poisoned key (the rows before it do not see it) and its kv head
NEG_ROW, NEG_HEAD = 20, 2  # a q row whose every score is -inf


def nan_in_q(rng, dtype):
    _, q, k, v = make_host(rng, dtype)
    q[0, ROW, HEAD, 3] = np.nan
    return q, k, v


def nan_in_k(rng, dtype):
    _, q, k, v = make_host(rng, dtype)
    k[0, KEY, KV_HEAD, 7] = np.nan
    return q, k, v


def inf_in_q(rng, dtype):
    """q row (ROW, HEAD) is +inf in column 0 and (NEG_ROW, NEG_HEAD) -inf, both 0 elsewhere; column 0
    of k is positive: every score of the first row is +inf, of the second -inf."""
    _, q, k, v = make_host(rng, dtype)
    k[..., 0] = (np.abs(k[..., 0].astype(np.float32)) + 0.25).astype(dtype)
    q[0, ROW, HEAD] = 0
    q[0, ROW, HEAD, 0] = np.inf
    q[0, NEG_ROW, NEG_HEAD] = 0
    q[0, NEG_ROW, NEG_HEAD, 0] = -np.inf
    return q, k, v


def run_causal_forward(host_qkv, **options):
    """The kernel's causal (out, lse) as float64 host arrays, and the reference's (out, lse, naive out)."""
    out, lse = cuflash.attention(*(cupy.asarray(x) for x in host_qkv), causal=True, return_lse=True, **options)
    ref, ref_lse = reference.attention(*host_qkv, causal=True, return_lse=True, **options)
    naive = reference.attention_naive_lowp(*host_qkv, causal=True, dtype=host_qkv[0].dtype, **options)
    return out.get().astype(np.float64), lse.get().astype(np.float64), ref, ref_lse, naive


def assert_matches_reference(dtype, got, got_lse, ref, ref_lse, naive):
    """NaN and inf in out exactly where the reference has them; the 2x rule on the finite entries
    and the reference's lse on its finite rows."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg="NaN entries of out")
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref), err_msg="inf entries of out")
    finite = np.isfinite(ref)
    assert_close_2x(got[finite], ref[finite], naive[finite], ATOL[np.dtype(dtype)])
    rows = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[rows], ref_lse[rows], rtol=1e-3, atol=1e-3)


def nan_rows(out):
    """(batch, seqlen, heads) mask of the output rows that hold a NaN."""
    return np.isnan(out).any(axis=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_nan_in_q_stays_in_its_row(kernel, rng, dtype):
    got, got_lse, ref, ref_lse, naive = run_causal_forward(nan_in_q(rng, dtype))
    expected = np.zeros((B, N, H), bool)
    expected[0, ROW, HEAD] = True
    np.testing.assert_array_equal(nan_rows(got), expected)
    assert np.isnan(got[0, ROW, HEAD]).all()
    assert_matches_reference(dtype, got, got_lse, ref, ref_lse, naive)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_nan_in_k_reaches_the_rows_that_see_it(kernel, rng, dtype):
    # Rows KEY.. of both query heads of KV_HEAD see the key; the rows before it do not, those of the
    # same query block through the causal mask inside a tile.
    got, got_lse, ref, ref_lse, naive = run_causal_forward(nan_in_k(rng, dtype))
    expected = np.zeros((B, N, H), bool)
    expected[0, KEY:, KV_HEAD * GROUP:(KV_HEAD + 1) * GROUP] = True
    np.testing.assert_array_equal(nan_rows(got), expected)
    assert np.isnan(got[expected]).all()
    assert_matches_reference(dtype, got, got_lse, ref, ref_lse, naive)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_inf_in_q_follows_the_reference(kernel, rng, dtype):
    # All scores +inf: NaN (inf - inf), as in the reference. All scores -inf: no key counts, out 0.
    got, got_lse, ref, ref_lse, naive = run_causal_forward(inf_in_q(rng, dtype))
    assert np.isnan(got[0, ROW, HEAD]).all()
    assert np.all(got[0, NEG_ROW, NEG_HEAD] == 0)
    assert_matches_reference(dtype, got, got_lse, ref, ref_lse, naive)


def scale_for_scores(q, k, largest):
    """The softmax_scale that makes the largest |q . k| of any pair a scaled score of `largest`."""
    kq = np.repeat(k.astype(np.float64), q.shape[2] // k.shape[2], axis=2)
    scores = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), kq)
    return float(largest / np.abs(scores).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_large_scores_stay_finite(kernel, rng, dtype):
    _, q, k, v = make_host(rng, dtype)
    scale = scale_for_scores(q, k, 1e4)
    got, got_lse, ref, ref_lse, naive = run_causal_forward((q, k, v), softmax_scale=scale)
    assert np.isfinite(got).all() and np.isfinite(got_lse).all()
    assert_matches_reference(dtype, got, got_lse, ref, ref_lse, naive)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [nan_in_q, nan_in_k, inf_in_q], ids=["nan_in_q", "nan_in_k", "inf_in_q"])
def test_forward_lse_of_non_finite_rows(kernel, rng, dtype, case):
    """lse as the reference has it: NaN where a row's scores hold a NaN, +inf where its largest score
    is +inf, -inf only where every score it sees is -inf (-inf says "no key", which the backward
    reads)."""
    _, got_lse, _, ref_lse, _ = run_causal_forward(case(rng, dtype))
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        np.testing.assert_array_equal(test(got_lse), test(ref_lse), err_msg=f"{name} rows of lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_nan_in_q_stays_in_its_row(kernel, rng, dtype):
    """A NaN in one q row reaches that row's dq and the dk, dv of every key the row sees, and nothing
    else: the other dq rows and the other kv head's gradients match the reference of the clean
    inputs. (The keys of the same tile the row does not see are left open.)"""
    dout, clean, k, v = make_host(rng, dtype)
    q = clean.copy()
    q[0, ROW, HEAD, 3] = np.nan
    clean[0, ROW, HEAD] = 0  # any finite row: the gradients checked below do not depend on it
    dev_dout, dev_q, dev_k, dev_v = (cupy.asarray(x) for x in (dout, q, k, v))
    out, lse = cuflash.attention(dev_q, dev_k, dev_v, causal=True, return_lse=True)
    dq, dk, dv = (g.get().astype(np.float64)
                  for g in cuflash.attention_backward(dev_dout, dev_q, dev_k, dev_v, out, lse, causal=True))
    kv = HEAD // GROUP
    assert np.isnan(dq[0, ROW, HEAD]).all()
    assert np.isnan(dk[0, :ROW + 1, kv]).all() and np.isnan(dv[0, :ROW + 1, kv]).all()
    other_rows = np.ones(dq.shape, bool)
    other_rows[0, ROW, HEAD] = False
    other_kv = np.zeros(dk.shape, bool)
    other_kv[:, :, 1 - kv] = True
    check_grads((dq, dk, dv), (dout, clean, k, v), where=(other_rows, other_kv, other_kv), causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_large_scores_stay_finite(kernel, rng, dtype):
    host = make_host(rng, dtype)
    scale = scale_for_scores(host[1], host[2], 1e4)
    dout, q, k, v = (cupy.asarray(x) for x in host)
    out, lse = cuflash.attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
    grads = [g.get() for g in cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale)]
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert np.isfinite(g.astype(np.float32)).all(), name
    check_grads(grads, host, causal=True, softmax_scale=scale)


# --- Out of memory ------------------------------------------------------------


def round_up(nbytes):
    """CuPy's pool hands out multiples of 512 bytes."""
    return -(-nbytes // 512) * 512


@contextlib.contextmanager
def pool_capped_below(nbytes):
    """The default memory pool limited so that a new allocation of nbytes on the current stream
    fails; the limit restored on exit."""
    pool = cupy.get_default_memory_pool()
    saved = pool.get_limit()
    pool.free_all_blocks()
    pool.set_limit(size=max(1, pool.total_bytes() + round_up(nbytes) - 512))
    try:
        try:
            probe = cupy.empty(nbytes, cupy.uint8)
        except cupy.cuda.memory.OutOfMemoryError:
            pass
        else:  # a free block of this stream serves it: the limit cannot bite
            del probe
            pytest.skip(f"the pool serves {nbytes} bytes from a free block despite the limit")
        yield
    finally:
        pool.set_limit(size=saved)


@pytest.mark.parametrize("planned", [False, True], ids=["first_call", "planned_call"])
def test_forward_out_of_memory_leaves_out_untouched(rng, planned):
    host = make_host(rng, np.float16)[1:]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the stream's pool blocks: these arrays, none free
        q, k, v = (cupy.asarray(x) for x in host)
        out = cupy.full(q.shape, np.nan, cupy.float16)
    stream.synchronize()
    if planned:  # the signatures below once, on the default stream: their launch plans exist
        cuflash.attention(q, k, v, causal=True, out=cupy.empty_like(q), return_lse=True)
        cuflash.attention(q, k, v, causal=True)
        cupy.cuda.Device().synchronize()
    with stream:
        with pool_capped_below(4 * B * H * N):  # lse cannot be allocated, nor out
            with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
                cuflash.attention(q, k, v, causal=True, out=out, return_lse=True)
            with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
                cuflash.attention(q, k, v, causal=True)
        assert np.isnan(out.get().astype(np.float32)).all(), "a call that failed wrote into out"
        got, lse = cuflash.attention(q, k, v, causal=True, out=out, return_lse=True)
        assert got is out
        check_forward(out.get(), lse.get(), host, causal=True)


@pytest.mark.parametrize("planned", [False, True], ids=["first_call", "planned_call"])
def test_backward_out_of_memory_leaves_gradients_untouched(rng, planned):
    host = make_host(rng, np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the stream's pool blocks: these arrays, none free
        dout, q, k, v = (cupy.asarray(x) for x in host)
        dq, dk, dv = (cupy.full(x.shape, np.nan, cupy.float16) for x in (q, k, v))
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    stream.synchronize()
    workspace_bytes = cuflash.backward_workspace(q, k, v, causal=True).buffer.nbytes
    if planned:  # the signatures below once, on the default stream: their launch plans exist
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dq=cupy.empty_like(q))
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dq=cupy.empty_like(q),
                                   dk=cupy.empty_like(k), dv=cupy.empty_like(v))
        cupy.cuda.Device().synchronize()
    with stream:
        with pool_capped_below(k.nbytes):  # dq given; dk and dv cannot be allocated
            with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
                cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq)
        with pool_capped_below(workspace_bytes):  # every gradient given; the workspace cannot be allocated
            with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
                cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
        for name, g in zip(("dq", "dk", "dv"), (dq, dk, dv)):
            assert np.isnan(g.get().astype(np.float32)).all(), f"a call that failed wrote into {name}"
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
        assert all(g is x for g, x in zip(grads, (dq, dk, dv)))
        check_grads([g.get() for g in grads], host, causal=True)


# --- Bounded caches -------------------------------------------------------------


def test_many_signatures_keep_caches_and_memory_bounded(rng):
    """10,000 forward calls over more signatures than the plan cache keeps (lengths 1 to
    MAX_PLANS + 88, in turn, so that every call past the first round misses and replaces a plan): the
    plan cache stays at MAX_PLANS, no kernel or stream state is added per signature, and once every
    signature has run, the pool's used bytes come back to where they were. The Python heap
    (tracemalloc) must stop growing: after 4,000 calls under the trace, which fill the bounded caches
    and CPython's free lists, the next 4,800 calls may grow it by at most 64 KiB (under 14 bytes a
    call; a leak of one small object a call would be 64 bytes or more). Signatures planned again after
    their eviction still compute the right thing."""
    lengths = range(1, plans.MAX_PLANS + 89)
    settle, measured = 4_000, 4_800
    host = [randn(rng, (1, lengths[-1], 1, D), np.float16) for _ in range(3)]
    q, k, v = (cupy.asarray(x) for x in host)
    pool = cupy.get_default_memory_pool()

    def call(i):
        n = lengths[i % len(lengths)]
        return cuflash.attention(q[:, :n], k[:, :n], v[:, :n], causal=True)

    for i in range(len(lengths)):  # every signature once: kernels compiled, buffers at their largest
        call(i)
    used, states, kernels = pool.used_bytes(), len(launch._stream_states), len(kernel_call._kernels)
    own_frames = [tracemalloc.Filter(False, tracemalloc.__file__)]  # the snapshot itself is traced
    tracemalloc.start()
    try:
        first = len(lengths)
        for i in range(first, first + settle):
            call(i)
        gc.collect()  # what waits for the cycle collector is garbage, not growth
        before = tracemalloc.take_snapshot().filter_traces(own_frames)
        for i in range(first + settle, first + settle + measured):
            call(i)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(own_frames)
    finally:
        tracemalloc.stop()
    growth = after.compare_to(before, "lineno")
    host_grown = sum(stat.size_diff for stat in growth)
    grown = pool.used_bytes() - used
    print(f"over {measured} calls after {settle}: Python heap {host_grown:+d} bytes; over "
          f"{settle + measured}: pool used bytes {grown:+d}")
    where = "\n".join(str(stat) for stat in growth[:6])
    assert host_grown < 64 << 10, f"the Python heap grew by {host_grown} bytes over {measured} calls:\n{where}"
    assert len(forward._plans) == plans.MAX_PLANS
    assert grown <= 64 * 1024, (f"pool used bytes {used} -> {used + grown} over {settle + measured} calls "
                                "whose results were freed")
    assert len(launch._stream_states) == states
    assert len(kernel_call._kernels) == kernels
    for n in (1, 97, lengths[-1]):
        out, lse = cuflash.attention(q[:, :n], k[:, :n], v[:, :n], causal=True, return_lse=True)
        check_forward(out.get(), lse.get(), [x[:, :n] for x in host], causal=True)


# --- Several GPUs -----------------------------------------------------------------


@pytest.mark.multi_gpu
def test_arrays_on_another_device_run_there(rng):
    """With device 0 current, arrays on device 1 run on device 1 (the full path, then the launch
    plans), leave device 0 current and match the reference; mixing devices raises."""
    host = make_host(rng, np.float16)
    with cupy.cuda.Device(1):
        dout, q, k, v = (cupy.asarray(x) for x in host)
    with cupy.cuda.Device(0):
        for _ in range(2):
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
            assert cupy.cuda.Device().id == 0
            assert [x.device.id for x in (out, lse, *grads)] == [1] * 5
            check_forward(out.get(), lse.get(), host[1:], causal=True)
            check_grads([g.get() for g in grads], host, causal=True)
        k_here = cupy.asarray(host[2])  # device 0
        with pytest.raises(ValueError, match=r"\bdevice\b"):
            cuflash.attention(q, k_here, v)
        with pytest.raises(ValueError, match=r"\bdevice\b"):
            cuflash.attention(q, k, v, out=cupy.empty(q.shape, cupy.float16))
