"""Argument validation of cuflash.attention.

Validation happens before any GPU work, so the tests that pass NumPy arrays
or lists run without a GPU.  The others need a device to allocate CuPy
arrays and are marked `gpu`.
"""

import math

import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import score_mods, validate
from tests.numerics import DTYPES, mentions

B, NQ, NK, H, D = 2, 8, 16, 4, 64


def np_qkv(dtype=np.float16):
    return (
        np.zeros((B, NQ, H, D), dtype),
        np.zeros((B, NK, H, D), dtype),
        np.zeros((B, NK, H, D), dtype),
    )


def cp_qkv(dtype=np.float16, q_shape=(B, NQ, H, D), k_shape=(B, NK, H, D), v_shape=None):
    v_shape = k_shape if v_shape is None else v_shape
    return (
        cupy.zeros(q_shape, dtype),
        cupy.zeros(k_shape, dtype),
        cupy.zeros(v_shape, dtype),
    )


# --- CPU: inputs that are not CuPy arrays ---------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_inputs_rejected(dtype):
    with pytest.raises(TypeError, match=mentions("q")):
        cuflash.attention(*np_qkv(dtype))


def test_list_inputs_rejected():
    q, k, v = (x.tolist() for x in np_qkv())
    with pytest.raises(TypeError, match=mentions("q")):
        cuflash.attention(q, k, v)


# --- GPU: CuPy arrays with bad dtypes, shapes or strides -------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["k", "v"])
def test_numpy_k_or_v_rejected(arg):
    q, k, v = cp_qkv()
    args = {"q": q, "k": k, "v": v}
    args[arg] = args[arg].get()
    with pytest.raises(TypeError, match=mentions(arg)):
        cuflash.attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match=mentions("q")):
        cuflash.attention(*cp_qkv(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["k", "v"])
def test_mixed_dtypes(arg):
    q, k, v = cp_qkv(np.float16)
    args = {"q": q, "k": k, "v": v}
    args[arg] = cupy.zeros(args[arg].shape, ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=mentions(arg)):
        cuflash.attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shapes,arg",
    [
        # ndim != 4
        (dict(q_shape=(NQ, H, D)), "q"),
        (dict(k_shape=(B, NK, H, D, 1)), "k"),
        (dict(v_shape=(NK, H, D)), "v"),
        # batch or headdim of k differs from q
        (dict(k_shape=(B + 1, NK, H, D)), "k"),
        (dict(k_shape=(B, NK, H, D - 8)), "k"),
        # v shape differs from k
        (dict(v_shape=(B, NK + 1, H, D)), "v"),
        (dict(v_shape=(B, NK, H // 2, D)), "v"),
        (dict(v_shape=(B, NK, H, D + 8)), "v"),
    ],
)
def test_shape_mismatch(shapes, arg):
    with pytest.raises(ValueError, match=mentions(arg)):
        cuflash.attention(*cp_qkv(**shapes))


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [4, 20, 63, 264, 512])
def test_unsupported_headdim(headdim):
    shape = (B, NQ, H, headdim)
    with pytest.raises(ValueError, match=r"(?i)head"):
        cuflash.attention(*cp_qkv(q_shape=shape, k_shape=shape))


@pytest.mark.gpu
@pytest.mark.parametrize("nheads,nheads_kv", [(3, 2), (4, 3), (2, 4)])
def test_nheads_not_multiple_of_nheads_kv(nheads, nheads_kv):
    shapes = dict(q_shape=(B, NQ, nheads, D), k_shape=(B, NK, nheads_kv, D))
    with pytest.raises(ValueError, match=r"(?i)head"):
        cuflash.attention(*cp_qkv(**shapes))


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_non_contiguous_last_dim(arg):
    q, k, v = cp_qkv()
    args = {"q": q, "k": k, "v": v}
    # Same shape as before, but consecutive headdim elements are 2 apart.
    wide = cupy.zeros(args[arg].shape[:-1] + (2 * D,), args[arg].dtype)
    args[arg] = wide[..., ::2]
    with pytest.raises(ValueError, match=mentions(arg)):
        cuflash.attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        cuflash.attention(*cp_qkv(), softmax_scale=scale)


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_inputs_on_different_devices():
    q, k, v = cp_qkv()
    with cupy.cuda.Device(1):
        k = cupy.zeros(k.shape, k.dtype)
    with pytest.raises(ValueError, match=mentions("k")):
        cuflash.attention(q, k, v)


# --- GPU: bad `out` ----------------------------------------------------------


@pytest.mark.gpu
def test_out_not_cupy():
    q, k, v = cp_qkv()
    with pytest.raises(TypeError, match=mentions("out")):
        cuflash.attention(q, k, v, out=np.empty(q.shape, q.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_out_wrong_dtype(dtype):
    q, k, v = cp_qkv(np.float16)
    with pytest.raises(TypeError, match=mentions("out")):
        cuflash.attention(q, k, v, out=cupy.empty(q.shape, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(B, NQ, H, D + 8), (B, NK, H, D), (B, NQ, H), (1, B, NQ, H, D)]
)
def test_out_wrong_shape(shape):
    q, k, v = cp_qkv()
    with pytest.raises(ValueError, match=mentions("out")):
        cuflash.attention(q, k, v, out=cupy.empty(shape, q.dtype))


@pytest.mark.gpu
def test_out_non_contiguous_last_dim():
    q, k, v = cp_qkv()
    out = cupy.empty((B, NQ, H, 2 * D), q.dtype)[..., ::2]
    with pytest.raises(ValueError, match=mentions("out")):
        cuflash.attention(q, k, v, out=out)


# --- GPU: fp8 (e4m3 bits in uint8 arrays) -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arg", ["q_descale", "k_descale", "v_descale"])
def test_descale_needs_fp8_inputs(arg):
    q, k, v = cp_qkv(np.float16)
    with pytest.raises(ValueError, match=mentions(arg)):
        cuflash.attention(q, k, v, **{arg: cupy.ones((B, H), cupy.float32)})


@pytest.mark.gpu
@pytest.mark.hopper  # fp8 runs on Hopper only: elsewhere attention() stops before the descales
@pytest.mark.parametrize("arg", ["q_descale", "k_descale", "v_descale"])
@pytest.mark.parametrize("bad", ["shape", "dtype", "numpy"])
def test_bad_descale(arg, bad):
    q, k, v = cp_qkv(np.uint8)
    value = {"shape": cupy.ones((B, H, 1), cupy.float32), "dtype": cupy.ones((B, H), cupy.float16),
             "numpy": np.ones((B, H), np.float32)}[bad]
    with pytest.raises((TypeError, ValueError), match=mentions(arg)):
        cuflash.attention(q, k, v, **{arg: value})


@pytest.mark.gpu
def test_fp8_needs_hopper():
    if cupy.cuda.Device().compute_capability == "90":
        pytest.skip("runs fp8 here")
    with pytest.raises(RuntimeError, match="Hopper"):
        cuflash.attention(*cp_qkv(np.uint8))


@pytest.mark.gpu
def test_fp8_headdim_multiple_of_16():
    q, k, v = cp_qkv(np.uint8, (B, NQ, H, 40), (B, NK, H, 40))
    with pytest.raises(ValueError, match="multiple of 16"):
        cuflash.attention(q, k, v)


@pytest.mark.gpu
def test_fp8_out_must_be_bfloat16():
    q, k, v = cp_qkv(np.uint8)
    with pytest.raises(TypeError, match=mentions("out")):
        cuflash.attention(q, k, v, out=cupy.empty(q.shape, np.uint8))


@pytest.mark.gpu
def test_fp8_backward_rejected():
    q, k, v = cp_qkv(np.uint8)
    with pytest.raises(TypeError, match="fp8"):
        cuflash.attention_vjp(q, k, v)


# --- Score modifications: validate.window_size, softcap, alibi_slopes -------


class _Index:
    """An integer by __index__ alone, as a one-element integer tensor is."""

    def __init__(self, value: int):
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize(
    "value,causal,want",
    [
        (None, False, (-1, -1)),
        (None, True, (-1, 0)),
        ((-1, -1), False, (-1, -1)),
        ((0, 0), False, (0, 0)),
        ([128, 3], False, (128, 3)),
        ((128, 3), True, (128, 0)),
        ((-1, 7), True, (-1, 0)),
        ((np.int64(5), np.int32(-1)), False, (5, -1)),
        (np.array([4, 2]), False, (4, 2)),
        ((_Index(9), _Index(-1)), False, (9, -1)),  # as a torch tensor's elements, flash-attn's tests' windows
    ],
)
def test_window_size_accepted(value, causal, want):
    got = validate.window_size(value, causal)
    assert got == want
    assert all(type(x) is int for x in got)


@pytest.mark.parametrize("value", [(-2, 0), (0, -2), (-5, -5)])
def test_window_size_below_minus_one(value):
    with pytest.raises(ValueError, match=mentions("window_size")) as info:
        validate.window_size(value, causal=False)
    assert ">= -1" in str(info.value) and str(value) in str(info.value)


@pytest.mark.parametrize("value", [3, 2.0, (1,), (1, 2, 3), (1.0, 2), (True, 0), (0, False), (np.bool_(True), 0),
                                   ("1", 2), "ab", np.array([1.0, 2.0])])
def test_window_size_not_a_pair_of_ints(value):
    with pytest.raises(TypeError, match=mentions("window_size")):
        validate.window_size(value, causal=True)


@pytest.mark.parametrize(
    "value,want", [(None, 0.0), (0, 0.0), (0.0, 0.0), (30, 30.0), (np.float32(50.0), 50.0), (np.int64(2), 2.0)]
)
def test_softcap_accepted(value, want):
    got = validate.softcap(value)
    assert got == want and type(got) is float


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, 1e39, 2.0**61, 1e-42, 2.0**-61])
def test_softcap_out_of_range(value):
    with pytest.raises(ValueError, match=mentions("softcap")):
        validate.softcap(value)


@pytest.mark.parametrize("value", [True, "30", (30,), np.ones(1)])
def test_softcap_not_a_number(value):
    with pytest.raises(TypeError, match=mentions("softcap")):
        validate.softcap(value)


def test_alibi_slopes_none():
    assert validate.alibi_slopes(None, B, H) is None


def test_alibi_slopes_numpy_rejected():
    with pytest.raises(TypeError, match=mentions("alibi_slopes")):
        validate.alibi_slopes(np.ones(H, np.float32), B, H)


@pytest.mark.gpu
def test_alibi_slopes_batch_stride():
    assert validate.alibi_slopes(cupy.ones(H, cupy.float32), B, H) == 0
    assert validate.alibi_slopes(cupy.ones((B, H), cupy.float32), B, H) == H
    wide = cupy.ones((B, 3 * H), cupy.float32)
    assert validate.alibi_slopes(wide[:, H:2 * H], B, H) == 3 * H


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_alibi_slopes_wrong_dtype(dtype):
    with pytest.raises(TypeError, match=mentions("alibi_slopes")) as info:
        validate.alibi_slopes(cupy.ones(H, dtype), B, H)
    assert "float32" in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(H + 1,), (B + 1, H), (B, H, 1), (1, H), (H, B), ()])
def test_alibi_slopes_wrong_shape(shape):
    with pytest.raises(ValueError, match=mentions("alibi_slopes")) as info:
        validate.alibi_slopes(cupy.ones(shape, cupy.float32), B, H)
    assert "(nheads,)" in str(info.value)


@pytest.mark.gpu
def test_alibi_slopes_strided_heads():
    slopes = cupy.ones((B, 2 * H), cupy.float32)[:, ::2]
    with pytest.raises(ValueError, match=mentions("alibi_slopes")):
        validate.alibi_slopes(slopes, B, H)


# --- cu_seqlens, max_seqlen and dropout arguments --------------------------


def test_cu_seqlens_host_valid():
    assert validate.cu_seqlens("cu_seqlens_q", np.array([0, 3, 3, 7], np.int32), 7) == 3
    assert validate.cu_seqlens("cu_seqlens_k", np.array([0, 0], np.int32), 0, batch=1) == 1
    assert validate.cu_seqlens("cu_seqlens_k", np.array([0, 5], np.int32)[::1], 5) == 1


@pytest.mark.parametrize("x,total,batch,error,what", [
    (np.array([0, 3, 7], np.int64), 7, None, TypeError, "int32"),
    (np.array([0, 3, 7], np.uint32), 7, None, TypeError, "int32"),
    (np.array([0.0, 3.0, 7.0], np.float32), 7, None, TypeError, "int32"),
    (np.array([0], np.int32), 0, None, ValueError, "batch >= 1"),
    (np.zeros((2, 2), np.int32), 0, None, ValueError, "shape"),
    (np.array(0, np.int32), 0, None, ValueError, "shape"),
    (np.array([0, 3, 7], np.int32), 7, 3, ValueError, r"\(4,\)"),
    (np.array([1, 3, 7], np.int32), 7, None, ValueError, "start at 0"),
    (np.array([0, 3, 2, 7], np.int32), 7, None, ValueError, "non-decreasing"),
    (np.array([0, 3, 7], np.int32), 8, None, ValueError, "total length 8"),
    (np.array([0, 3, 7], np.int32), 6, None, ValueError, "total length 6"),
])
def test_cu_seqlens_host_invalid(x, total, batch, error, what):
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        with pytest.raises(error, match=mentions(name)) as info:
            validate.cu_seqlens(name, x, total, batch)
        assert info.match(what)


@pytest.mark.parametrize("x", [[0, 3, 7], (0, 3, 7), None, 7])
def test_cu_seqlens_not_an_array(x):
    with pytest.raises(TypeError, match=mentions("cu_seqlens_q")):
        validate.cu_seqlens("cu_seqlens_q", x, 7)


@pytest.mark.gpu
def test_cu_seqlens_device_checks_dtype_and_shape_only():
    # Values on the device are the caller's contract: not read, so not checked here.
    assert validate.cu_seqlens("cu_seqlens_q", cupy.array([5, 3, 1], cupy.int32), 7) == 2
    assert validate.cu_seqlens("cu_seqlens_q", cupy.array([0, 3, 7], cupy.int32), 7, batch=2) == 2
    with pytest.raises(TypeError, match=mentions("cu_seqlens_q")):
        validate.cu_seqlens("cu_seqlens_q", cupy.array([0, 3, 7], cupy.int64), 7)
    with pytest.raises(ValueError, match=mentions("cu_seqlens_k")):
        validate.cu_seqlens("cu_seqlens_k", cupy.array([0], cupy.int32), 0)
    with pytest.raises(ValueError, match=mentions("cu_seqlens_k")):
        validate.cu_seqlens("cu_seqlens_k", cupy.array([0, 3, 7], cupy.int32), 7, batch=3)
    with pytest.raises(ValueError, match=mentions("cu_seqlens_k")):
        validate.cu_seqlens("cu_seqlens_k", cupy.zeros((2, 3), cupy.int32), 0)
    with pytest.raises(ValueError, match="contiguous"):
        validate.cu_seqlens("cu_seqlens_k", cupy.arange(8, dtype=cupy.int32)[::2], 6)


def test_max_seqlen_valid():
    assert validate.max_seqlen("max_seqlen_q", 7) == 7
    assert validate.max_seqlen("max_seqlen_q", np.int64(4)) == 4
    assert type(validate.max_seqlen("max_seqlen_q", np.int32(4))) is int
    lengths = np.array([3, 0, 4])
    assert validate.max_seqlen("max_seqlen_k", 4, lengths) == 4
    assert validate.max_seqlen("max_seqlen_k", 100, lengths) == 100
    assert validate.max_seqlen("max_seqlen_k", 1, np.array([0, 0])) == 1


@pytest.mark.parametrize("value,error", [
    (0, ValueError), (-3, ValueError), (2**31, ValueError), (True, TypeError), (4.0, TypeError), ("4", TypeError),
    (None, TypeError),
])
def test_max_seqlen_invalid(value, error):
    with pytest.raises(error, match=mentions("max_seqlen_q")):
        validate.max_seqlen("max_seqlen_q", value)


def test_max_seqlen_below_longest_sequence():
    with pytest.raises(ValueError, match=mentions("max_seqlen_k")) as info:
        validate.max_seqlen("max_seqlen_k", 3, np.array([3, 0, 4]))
    assert info.match(r"longest sequence \(4\)")


def test_dropout_valid():
    assert validate.dropout(0.0, 0, 0) == (0.0, 0, 0)
    assert validate.dropout(0, 1, 2) == (0.0, 1, 2)
    p, seed, offset = validate.dropout(np.float32(0.25), np.uint64(2**64 - 1), np.int64(12))
    assert (p, seed, offset) == (0.25, 2**64 - 1, 12)
    assert type(p) is float and type(seed) is int and type(offset) is int
    p = math.nextafter(score_mods.DROPOUT_P_LIMIT, 0.0)
    assert validate.dropout(p, 0, 0)[0] == p and score_mods.Dropout(p, 0, 0).threshold == 1


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 0, 1, np.int32(1)])
def test_flag_valid(value):
    assert validate.flag("causal", value) is bool(value)


@pytest.mark.parametrize("value", ["False", "", 2, -1, 0.0, None, np.array([True])])
def test_flag_invalid(value):
    with pytest.raises(TypeError, match=mentions("causal")):
        validate.flag("causal", value)


@pytest.mark.parametrize("value", [1e39, 2.0**61, math.inf, 0.0, -1.0, math.nan])
def test_softmax_scale_out_of_range(value):
    with pytest.raises(ValueError, match=mentions("softmax_scale")):
        validate.softmax_scale(value, 64)


@pytest.mark.parametrize("p,error", [
    (1.0, ValueError), (1, ValueError), (-0.1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    (math.nextafter(1.0, 0.0), ValueError), (1.0 - 2.0**-15, ValueError),
    (True, TypeError), (False, TypeError), ("0.1", TypeError), (None, TypeError), (np.array([0.1]), TypeError),
])
def test_dropout_p_invalid(p, error):
    with pytest.raises(error, match=mentions("dropout_p")):
        validate.dropout(p, 0, 0)


@pytest.mark.parametrize("arg", ["seed", "offset"])
@pytest.mark.parametrize("value,error", [
    (-1, ValueError), (2**64, ValueError), (np.int64(-5), ValueError),
    (True, TypeError), (1.0, TypeError), ("3", TypeError), (None, TypeError),
])
def test_dropout_seed_offset_invalid(arg, value, error):
    args = dict(seed=0, offset=0)
    args[arg] = value
    with pytest.raises(error, match=mentions(arg)):
        validate.dropout(0.1, args["seed"], args["offset"])


def test_shifted_copies_meet_is_numpys_shares_memory():
    """validate.shifted_copies_meet, the exact overlap test of two arrays of one layout, against NumPy's
    exact shares_memory on host views: packed layouts with gaps, permuted and negative strides, every
    shift across the span (and a one-byte one); the views of one dqkv array share nothing."""
    rng = np.random.default_rng(1)
    buffer = np.zeros(100_000, np.float16)
    for _ in range(500):
        ndim = int(rng.integers(1, 5))
        shape = [int(x) for x in rng.integers(1, 6, ndim)]
        strides, step = [], 1
        for extent in reversed(shape):
            gap = int(rng.integers(1, 4))
            strides.insert(0, step * gap)
            step *= gap * extent
        strides = [s * (-1 if rng.random() < 0.2 else 1) for s in rng.permutation(strides)]
        span = sum((n - 1) * abs(s) for n, s in zip(shape, strides)) + 1
        shift = int(rng.integers(-span - 2, span + 3))
        view = lambda at: np.lib.stride_tricks.as_strided(buffer[at:], shape, [2 * s for s in strides])  # noqa: E731
        assert validate.shifted_copies_meet(2 * shift, shape, [2 * s for s in strides], 2) == \
            np.shares_memory(view(50_000), view(50_000 + shift)), (shape, strides, shift)
    assert validate.shifted_copies_meet(1, (4, 3), (12, 2), 2)
    dqkv = np.zeros((2, 5, 3, 4, 8), np.float16)
    dq, dk = dqkv[:, :, 0], dqkv[:, :, 1]
    shift = dk.__array_interface__["data"][0] - dq.__array_interface__["data"][0]
    assert not validate.shifted_copies_meet(shift, dq.shape, dq.strides, 2)
    assert validate.shifted_copies_meet(0, dq.shape, dq.strides, 2)


@pytest.mark.parametrize("q, k, v, match", [
    ((2, 9, 4, 64), (2, 9, 2, 32), (2, 9, 2, 32), "head dim"),
    ((2, 9, 4, 64), (2, 9, 2, 64), (2, 8, 2, 64), "v must have k's shape"),
    ((2, 9, 4, 64), (2, 9, 3, 64), (2, 9, 3, 64), "nheads_kv"),
    ((9, 4, 64), (9, 0, 64), (9, 0, 64), "nheads_kv"),
])
def test_head_shapes_named(q, k, v, match):
    """validate.head_shapes, which validate.qkv and cuflash.jax (on traced shapes) share."""
    with pytest.raises(ValueError, match=match):
        validate.head_shapes(q, k, v)
    validate.head_shapes(q, q[:-2] + (q[-2] // 2 or 1, q[-1]), q[:-2] + (q[-2] // 2 or 1, q[-1]))


def test_seqused_host_values():
    spans = np.diff(np.array([0, 3, 3, 7]))
    assert validate.seqused("seqused_q", None, 3) is None
    np.testing.assert_array_equal(validate.seqused("seqused_q", np.array([3, 0, 2], np.int32), 3, spans), [3, 0, 2])
    np.testing.assert_array_equal(validate.seqused("seqused_q", np.array([9, 0, 2], np.int32), 3), [9, 0, 2])
    for used, error in ((np.array([4, 0, 2], np.int32), ValueError), (np.array([3, 0, -1], np.int32), ValueError),
                        (np.array([3, 0], np.int32), ValueError), (np.array([3, 0, 2], np.int64), TypeError),
                        ([3, 0, 2], TypeError)):
        with pytest.raises(error, match=mentions("seqused_q")):
            validate.seqused("seqused_q", used, 3, spans)


def test_mask_alignment():
    assert validate.mask_alignment("top_left") is True
    assert validate.mask_alignment("bottom_right") is False
    for value in ("top-left", None, ["top_left"]):
        with pytest.raises(ValueError, match=mentions("mask_alignment")):
            validate.mask_alignment(value)


def test_normalise_drops_bounds_each_alignment_passes_everywhere():
    """A left bound of 10 over 5 queries on 100 keys passes every pair aligned to the top left (row
    4's bound is key -6), not to the bottom right (row 0's is key 85); a right bound of 10 the reverse."""
    top_left = score_mods.Varlen(1, 5, 100, top_left=True)
    bottom_right = score_mods.Varlen(1, 5, 100)
    assert score_mods.normalise(False, (10, -1), 0.0, None, 5, 100, top_left)[1].window is None
    assert score_mods.normalise(False, (10, -1), 0.0, None, 5, 100, bottom_right)[1].window == (10, -1)
    assert score_mods.normalise(False, (-1, 10), 0.0, None, 5, 100, top_left)[1].window == (-1, 10)
    assert score_mods.normalise(False, (-1, 10), 0.0, None, 5, 100, bottom_right)[1].window is None
