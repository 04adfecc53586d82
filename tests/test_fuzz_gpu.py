"""Seeded fuzz tests: random calls of cuflash.attention and cuflash.attention_backward over the inputs
the API accepts, each held to cuflash.reference with the 2x rule (tests/numerics.py).

Case i is drawn from numpy.random.default_rng(SEED + i) alone, its parameters first (`draw_case`) and
then its data, so a failing case reruns from its id:

    python -m pytest -q tests/test_fuzz_gpu.py                          # 200 cases (the default)
    CUFLASH_FUZZ_CASES=5000 python -m pytest -q tests/test_fuzz_gpu.py  # long mode
    CUFLASH_FUZZ_SEED=7 python -m pytest -q tests/test_fuzz_gpu.py      # another base seed
    CUFLASH_FUZZ_SHARD=2/8 python -m pytest -q tests/test_fuzz_gpu.py   # cases 2, 10, 18, ...: one of 8 processes
    CUFLASH_FUZZ_FROM=1000 python -m pytest -q tests/test_fuzz_gpu.py   # cases 1000 and up: a run taken up again
    python -m pytest "tests/test_fuzz_gpu.py::test_fuzz[17]"            # one case (same seed and case count)

A failure message starts with the case's parameters, the base seed and the command that reruns it.

What a case draws:
- dtype: float16 or bfloat16 (46% each), fp8 e4m3 (8%: forward only, Hopper only; descales from
  cuflash.fp8.quantize_e4m3, each one sometimes left out with the bits holding the values themselves);
- head dim: 64 (30%), 128 (30%), else any other multiple of 8 from 8 to 256 (fp8: rounded up to 16);
- batch 1-3, nheads_kv 1-4, group (nheads / nheads_kv) 1-4;
- seqlen_q and seqlen_k independently: the awkward values of AWKWARD (45%), tile multiples and their
  neighbours of ROUND (15%), 1-299 (15%), 300-1100 (25%);
- layouts of q, k, v (and dout) independently: contiguous, (batch, heads, seq, dim) storage transposed,
  a slice of the heads of a wider array (non-zero offset), every other head, a slice of a wider head
  dim (aligned), a misaligned slice of a wider head dim, a misaligned base pointer, reversed heads
  (negative stride), heads broadcast from one (zero stride); or k and v interleaved in one array;
- options: causal (35%), window_size (35%; left and right each -1, 0, 1-32 or 33 to beyond the longer
  sequence), softcap (30%; 1-50, log-uniform), alibi_slopes (30% of 16-bit cases; float32 (nheads,),
  (batch, nheads) or a (batch, nheads) slice of a wider array; 2^-10 to 1), softmax_scale (35%;
  1/8 to 8 times 1/sqrt(headdim), fp8 1/2 to 2), each also spelled the other ways the API takes
  (a list or NumPy ints for window_size, None for the defaults, a NumPy float32 scale);
- outputs: out= pre-filled with NaN (35%; contiguous or a strided view), lse= NaN-filled (30%),
  return_lse (always for the backward, else 80%), the same call repeated (20%: the launch-plan path),
  a non-default stream (10%);
- dropout (15% of 16-bit cases with batch * nheads * seqlen_q * seqlen_k <= 3e6): dropout_p 0.01-0.5
  (log-uniform), seed and offset anywhere in [0, 2**64); the reference is given the keep mask that
  cuflash.reference.dropout_keep_mask draws. Drawn from a generator of its own, so that adding it left
  every earlier case's parameters and data as they were;
- backward (35% of 16-bit cases): attention(..., return_lse=True) then attention_backward with the
  same options; deterministic (50%: called twice, bitwise equal), dq/dk/dv= NaN-filled (35%),
  workspace= (20%), dout set to 100 on the rows that see no key, where there are any (50%).

Sizes: batch * nheads * seqlen_q * seqlen_k is cut to at most 8e6 (3e6 with the backward) by lowering
batch, group or nheads_kv, so that the float64 reference on the host stays fast. Every case asks for
the heuristic kernel choice (no tuning cache), so that its outcome depends on its id only.
The references take about 0.07 s a case on average on a 2-core host; the first run also compiles
every kernel specialisation the cases reach (CuPy caches them on disk).
"""

import contextlib
import dataclasses
import math
import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import dispatch, fp8, reference
from tests.numerics import ATOL, FUZZ_CASES, FUZZ_SEED, assert_close_2x, fuzz_indices, randn

pytestmark = pytest.mark.gpu

SEED = FUZZ_SEED
CASES = FUZZ_CASES

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_NAN = 0x7F  # an e4m3 NaN: what the storage around a uint8 view holds
FP8_ATOL = 1e-2  # as tests/test_sm90_gpu.py

# Sequence lengths just off the kernels' tiles (64 and 128 queries, 64-192 keys) and tiny ones.
AWKWARD = (1, 2, 17, 63, 64, 65, 97, 127, 128, 129, 257)
# Tile multiples (the fast configurations) and their neighbours, in the longer range.
ROUND = (192, 255, 256, 383, 384, 511, 512, 513, 640, 767, 768, 1023, 1024, 1025)
LONGEST = 1100
CAP_FORWARD = 8_000_000  # batch * nheads * seqlen_q * seqlen_k
CAP_BACKWARD = 3_000_000
CAP_DROPOUT = 3_000_000  # the host draws the keep mask element by element
DROPOUT_STREAM = 0xD20F  # the second word of the dropout draws' generator seed

INPUT_LAYOUTS = {  # name: weight
    "contiguous": 0.45, "bhnd": 0.15, "head_slice": 0.08, "every_other_head": 0.08, "dim_slice": 0.08,
    "dim_slice_misaligned": 0.04, "misaligned": 0.04, "reversed_heads": 0.04, "broadcast_heads": 0.04,
}
OUTPUT_LAYOUTS = ("contiguous", "every_other_head", "bhnd", "dim_slice")


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    seed: int
    dtype: str  # "float16", "bfloat16" or "fp8"
    batch: int
    nheads_kv: int
    group: int  # nheads // nheads_kv
    seqlen_q: int
    seqlen_k: int
    headdim: int
    layouts: tuple  # of q, k, v, dout (INPUT_LAYOUTS, or "packed_kv" for k and v together)
    causal: bool
    window: tuple | None  # (left, right), or None for no window
    window_spelling: str  # "tuple", "list", "numpy" (a window); "absent", "none", "unbounded" (none)
    softcap: float  # 0: off
    softcap_spelling: str  # "value"; for 0 also "absent" or "none"
    alibi: str | None  # "h", "bh", "bh_strided"
    softmax_scale: float | None
    scale_spelling: str  # "float", "float32"; for None "absent" or "none"
    return_lse: bool
    out_layout: str | None  # out= given, NaN-filled, in this layout
    lse_given: bool  # lse= given, NaN-filled
    repeat: bool  # the forward called twice (the second call takes the launch plan)
    stream: bool  # on a non-default stream
    descales: tuple  # fp8: whether q_descale, k_descale, v_descale are passed
    backward: bool
    deterministic: bool
    grads_layout: str | None  # dq=, dk=, dv= given, NaN-filled, in this layout
    workspace: bool
    loud_empty_rows: bool  # dout = 100 on the rows that see no key
    dropout: tuple | None  # (dropout_p, seed, offset), or None for no dropout

    @property
    def nheads(self):
        return self.nheads_kv * self.group

    @property
    def fp8(self):
        return self.dtype == "fp8"

    def describe(self):
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)[2:])
        return (f"fuzz case {self.index} of base seed {self.seed}: {fields}\n"
                f"rerun: CUFLASH_FUZZ_SEED={self.seed} CUFLASH_FUZZ_CASES={max(CASES, self.index + 1)} "
                f"python -m pytest 'tests/test_fuzz_gpu.py::test_fuzz[{self.index}]'")


# --- Drawing a case -----------------------------------------------------------


def chance(rng, p):
    return bool(rng.random() < p)


def pick(rng, options, weights=None):
    """One of `options` (a sequence, or a dict of option: weight)."""
    if isinstance(options, dict):
        options, weights = list(options), list(options.values())
    p = None if weights is None else np.asarray(weights, dtype=np.float64) / sum(weights)
    return options[int(rng.choice(len(options), p=p))]


def log_uniform(rng, low, high):
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_seqlen(rng):
    r = rng.random()
    if r < 0.45:
        return int(pick(rng, AWKWARD))
    if r < 0.60:
        return int(pick(rng, ROUND))
    if r < 0.75:
        return int(rng.integers(1, 300))
    return int(rng.integers(300, LONGEST + 1))


def draw_headdim(rng, is_fp8):
    r = rng.random()
    if r < 0.3:
        d = 64
    elif r < 0.6:
        d = 128
    else:
        d = int(pick(rng, [d for d in range(8, 257, 8) if d not in (64, 128)]))
    return d + 8 if is_fp8 and d % 16 else d  # fp8 rows must be 16 bytes


def draw_bound(rng, longest):
    """One side of a window: unbounded, 0, small or large (possibly beyond the sequences)."""
    r = rng.random()
    if r < 0.25:
        return -1
    if r < 0.40:
        return 0
    if r < 0.75:
        return int(rng.integers(1, 33))
    return int(rng.integers(33, longest + 65))


def draw_case(seed, index):
    """The parameters of case `index`, and the generator (left where the parameters end) its data come from."""
    rng = np.random.default_rng(seed + index)
    r = rng.random()
    dtype = "fp8" if r < 0.08 else "float16" if r < 0.54 else "bfloat16"
    is_fp8 = dtype == "fp8"
    batch, nheads_kv, group = (int(rng.integers(1, n + 1)) for n in (3, 4, 4))
    seqlen_q, seqlen_k = draw_seqlen(rng), draw_seqlen(rng)
    headdim = draw_headdim(rng, is_fp8)
    backward = not is_fp8 and chance(rng, 0.35)
    cap = CAP_BACKWARD if backward else CAP_FORWARD
    while batch * nheads_kv * group * seqlen_q * seqlen_k > cap:  # seqlens <= LONGEST: ends at 1 x 1 heads
        sizes = {"batch": batch, "group": group, "nheads_kv": nheads_kv}
        name = pick(rng, [n for n, size in sizes.items() if size > 1])
        batch, group, nheads_kv = (size - (n == name) for n, size in sizes.items())

    layouts = [pick(rng, INPUT_LAYOUTS) for _ in "qkvd"]
    if chance(rng, 0.1):
        layouts[1] = layouts[2] = "packed_kv"

    causal = chance(rng, 0.35)
    longest = max(seqlen_q, seqlen_k)
    if chance(rng, 0.35):
        window = (draw_bound(rng, longest), draw_bound(rng, longest))
        window_spelling = pick(rng, ["tuple", "list", "numpy"], [0.8, 0.1, 0.1])
    else:
        window = None
        window_spelling = pick(rng, ["absent", "none", "unbounded"], [0.8, 0.1, 0.1])
    if chance(rng, 0.3):
        softcap, softcap_spelling = log_uniform(rng, 1.0, 50.0), "value"
    else:
        softcap, softcap_spelling = 0.0, pick(rng, ["absent", "value", "none"], [0.8, 0.1, 0.1])
    alibi = None
    if not is_fp8 and chance(rng, 0.3):
        alibi = pick(rng, ["h", "bh", "bh_strided"], [0.45, 0.4, 0.15])
    if chance(rng, 0.35):
        factor = log_uniform(rng, 0.5, 2.0) if is_fp8 else log_uniform(rng, 0.125, 8.0)
        softmax_scale = factor / math.sqrt(headdim)
        scale_spelling = pick(rng, ["float", "float32"], [0.8, 0.2])
        if scale_spelling == "float32":
            softmax_scale = float(np.float32(softmax_scale))
    else:
        softmax_scale, scale_spelling = None, pick(rng, ["absent", "none"], [0.8, 0.2])

    return_lse = backward or chance(rng, 0.8)
    out_layout = pick(rng, OUTPUT_LAYOUTS) if chance(rng, 0.35) else None
    lse_given = chance(rng, 0.3)
    repeat = chance(rng, 0.2)
    stream = chance(rng, 0.1)
    descales = tuple(not chance(rng, 0.15) for _ in "qkv") if is_fp8 else (False, False, False)
    deterministic = backward and chance(rng, 0.5)
    grads_layout = pick(rng, OUTPUT_LAYOUTS) if backward and chance(rng, 0.35) else None
    workspace = backward and chance(rng, 0.2)
    loud_empty_rows = backward and chance(rng, 0.5)
    dropout = draw_dropout(np.random.default_rng((seed + index, DROPOUT_STREAM)), is_fp8,
                           batch * nheads_kv * group * seqlen_q * seqlen_k)
    case = Case(index, seed, dtype, batch, nheads_kv, group, seqlen_q, seqlen_k, headdim, tuple(layouts),
                causal, window, window_spelling, softcap, softcap_spelling, alibi, softmax_scale, scale_spelling,
                return_lse, out_layout, lse_given, repeat, stream, descales, backward, deterministic,
                grads_layout, workspace, loud_empty_rows, dropout)
    return case, rng


def draw_dropout(rng, is_fp8, size):
    """(dropout_p, seed, offset) or None."""
    if is_fp8 or size > CAP_DROPOUT or not chance(rng, 0.15):
        return None
    return log_uniform(rng, 0.01, 0.5), int(rng.integers(0, 2**64, dtype=np.uint64)), \
        int(rng.integers(0, 2**64, dtype=np.uint64))


# --- Building the arrays --------------------------------------------------------


def place(x, layout, rng, fill):
    """(host values, device view holding them) of the host array x (batch, seqlen, heads, headdim) in
    `layout`; storage around the view holds `fill` (NaN), so that a read outside the view shows.
    Only "broadcast_heads" changes the values (every head a copy of the first)."""
    batch, seqlen, heads, headdim = x.shape
    align = 16 // x.itemsize  # elements per 16 bytes
    if layout == "contiguous":
        return x, cupy.asarray(x)
    if layout == "bhnd":
        return x, cupy.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    if layout == "reversed_heads":
        return x, cupy.asarray(np.ascontiguousarray(x[:, :, ::-1]))[:, :, ::-1]
    if layout == "broadcast_heads":
        first = np.ascontiguousarray(x[:, :, :1])
        return np.ascontiguousarray(np.broadcast_to(first, x.shape)), cupy.broadcast_to(cupy.asarray(first), x.shape)
    if layout == "misaligned":
        flat = np.full(x.size + 1, fill, x.dtype)
        flat[1:] = x.ravel()
        return x, cupy.asarray(flat)[1:].reshape(x.shape)
    if layout in ("head_slice", "every_other_head"):
        extra, start, step = (int(rng.integers(1, 4)), None, 1) if layout == "head_slice" else (heads, 0, 2)
        if start is None:
            start = int(rng.integers(1, extra + 1))
        index = (slice(None), slice(None), slice(start, start + step * heads, step))
        base = np.full((batch, seqlen, heads + extra, headdim), fill, x.dtype)
        base[index] = x
        return x, cupy.asarray(base)[index]
    if layout in ("dim_slice", "dim_slice_misaligned"):
        if layout == "dim_slice":
            start, pad = 0, align * int(rng.integers(1, 3))
        else:
            pad = int(rng.integers(1, align))
            start = int(rng.integers(0, pad + 1))
        index = (Ellipsis, slice(start, start + headdim))
        base = np.full((batch, seqlen, heads, headdim + pad), fill, x.dtype)
        base[index] = x
        return x, cupy.asarray(base)[index]
    raise ValueError(layout)


def place_all(arrays, layouts, rng, fill):
    """Host values and device views of q, k, v (and dout) in their layouts; k and v packed together
    into one (batch, seqlen_k, 2, nheads_kv, headdim) array for "packed_kv"."""
    host, dev = [], []
    for i, (x, layout) in enumerate(zip(arrays, layouts)):
        if layout == "packed_kv":
            if i == 1:
                packed = np.stack([arrays[1], arrays[2]], axis=2)
                packed_dev = cupy.asarray(packed)
            host.append(arrays[i])
            dev.append(packed_dev[:, :, i - 1])
        else:
            h, d = place(x, layout, rng, fill)
            host.append(h)
            dev.append(d)
    return host, dev


def poisoned(shape, dtype, layout, rng):
    """(view, storage): a NaN-filled output view of `shape` in `layout` (16-byte aligned, strides
    multiples of 16 bytes, as outputs must be) and the storage under it."""
    batch, seqlen, heads, headdim = shape
    if layout == "contiguous":
        storage_shape, view = shape, lambda s: s
    elif layout == "every_other_head":
        storage_shape, view = (batch, seqlen, 2 * heads, headdim), lambda s: s[:, :, ::2]
    elif layout == "bhnd":
        storage_shape, view = (batch, heads, seqlen, headdim), lambda s: s.transpose(0, 2, 1, 3)
    else:  # dim_slice
        pad = 16 // dtype.itemsize * int(rng.integers(1, 3))
        storage_shape, view = (batch, seqlen, heads, headdim + pad), lambda s: s[..., :headdim]
    storage = cupy.asarray(np.full(storage_shape, np.nan, dtype))
    return view(storage), storage


def check_storage(name, view, storage):
    """Every element of the view written (no NaN), none of the storage around it."""
    values = cupy.asnumpy(storage).astype(np.float32)
    written = cupy.asnumpy(view).astype(np.float32)
    n_nan = int(np.isnan(written).sum())
    assert n_nan == 0, f"{name}: {n_nan} elements not written (still NaN)"
    outside = values.size - written.size
    assert int(np.isnan(values).sum()) == outside, f"{name}: elements outside the view were written"


def lowp_inputs(case, rng):
    """Host values (in the dtype) and device views of q, k, v, and the call's extra keyword arguments."""
    dtype = DTYPES[case.dtype]
    shapes = [(case.batch, case.seqlen_q, case.nheads, case.headdim)] + \
        [(case.batch, case.seqlen_k, case.nheads_kv, case.headdim)] * 2
    host, dev = place_all([randn(rng, s, dtype) for s in shapes], case.layouts[:3], rng, np.nan)
    return host, dev, {}


def fp8_inputs(case, rng):
    """Dequantised float64 values and device e4m3 views of q, k, v, and the descale arguments.

    Each (batch, head) gets its own magnitude: v's within e^-1.5..e^1.5; q's and k's within
    e^-0.25..e^0.25 only, since larger scores bring out the fp8 tensor cores' truncated accumulation,
    which the naive yardstick does not model (tests/test_sm90_gpu.py: test_fp8_outlier_activations).
    Quantised by cuflash.fp8.quantize_e4m3 with one descale per (batch, kv head) (q's heads grouped
    per kv head); where a descale is left out, the bits hold the values themselves (rounded to e4m3
    by ml_dtypes).
    """
    b, hkv = case.batch, case.nheads_kv
    host_bits, host_descales, kwargs = [], [], {}
    for name, n, heads, given, spread in zip("qkv", (case.seqlen_q, case.seqlen_k, case.seqlen_k),
                                             (case.nheads, case.nheads_kv, case.nheads_kv), case.descales,
                                             (0.25, 0.25, 1.5)):
        magnitude = np.exp(rng.uniform(-spread, spread, (b, 1, heads, 1)))
        x = rng.standard_normal((b, n, heads, case.headdim)) * magnitude
        grouped = x.reshape(b, n, hkv, -1)
        if given:
            bits, descale = fp8.quantize_e4m3(cupy.asarray(grouped, dtype=cupy.float32))
            kwargs[f"{name}_descale"] = descale
            bits, descale = cupy.asnumpy(bits), cupy.asnumpy(descale)
        else:
            bits = grouped.astype(np.float32).astype(E4M3).view(np.uint8)
            descale = np.ones((b, hkv), np.float32)
        host_bits.append(bits.reshape(x.shape))
        host_descales.append(descale)
    bits, dev = place_all(host_bits, case.layouts[:3], rng, FP8_NAN)
    values = [reference.fp8_dequantize(x.reshape(b, x.shape[1], hkv, -1), s).reshape(x.shape)
              for x, s in zip(bits, host_descales)]
    return values, dev, kwargs


def options(case, rng):
    """(reference keyword arguments, cuflash keyword arguments) of the case's score options."""
    host = dict(causal=case.causal, window_size=case.window or (-1, -1), softcap=case.softcap,
                softmax_scale=case.softmax_scale)
    dev = dict(causal=case.causal)
    if case.window is not None:
        dev["window_size"] = {"tuple": tuple(case.window), "list": list(case.window),
                              "numpy": tuple(np.int64(x) for x in case.window)}[case.window_spelling]
    elif case.window_spelling != "absent":
        dev["window_size"] = None if case.window_spelling == "none" else (-1, -1)
    if case.softcap_spelling != "absent":
        dev["softcap"] = None if case.softcap_spelling == "none" else case.softcap
    if case.scale_spelling != "absent":
        dev["softmax_scale"] = {"float": case.softmax_scale, "float32": np.float32(case.softmax_scale),
                                "none": None}[case.scale_spelling]
    if case.alibi is not None:
        shape = (case.nheads,) if case.alibi == "h" else (case.batch, case.nheads)
        slopes = np.exp2(rng.uniform(-10, 0, shape)).astype(np.float32)
        host["alibi_slopes"] = slopes
        if case.alibi == "bh_strided":
            extra = int(rng.integers(1, 5))
            start = int(rng.integers(0, extra + 1))
            storage = np.full((case.batch, case.nheads + extra), np.nan, np.float32)
            storage[:, start:start + case.nheads] = slopes
            dev["alibi_slopes"] = cupy.asarray(storage)[:, start:start + case.nheads]
        else:
            dev["alibi_slopes"] = cupy.asarray(slopes)
    if case.dropout is not None:
        p, seed, offset = case.dropout
        host["dropout_p"] = p
        host["dropout_mask"] = reference.dropout_keep_mask(seed, offset, case.batch, case.nheads, case.seqlen_q,
                                                           case.seqlen_k, p)
        dev.update(dropout_p=p, seed=seed, offset=offset)
    return host, dev


# --- Checks -------------------------------------------------------------------


def check_lse(lse, ref_lse, atol):
    lse = cupy.asnumpy(lse).astype(np.float64)
    assert lse.shape == ref_lse.shape, f"lse shape {lse.shape} != {ref_lse.shape}"
    # Exactly -inf for rows that see no key, finite and close elsewhere.
    masked = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), masked, err_msg="lse: -inf where the reference's is")
    np.testing.assert_allclose(lse[~masked], ref_lse[~masked], rtol=1e-3, atol=atol, err_msg="lse")


def bits(x):
    """Host copy of a 16-bit device array as raw integers."""
    return cupy.asnumpy(x).view(np.uint16)


def grad_atol(ref, dtype):
    """numerics.ATOL, or one ulp of the largest reference gradient where that is larger
    (gradient magnitudes move with the shape; tests/test_backward_gpu.py)."""
    return max(ATOL[dtype], float(ml_dtypes.finfo(dtype).eps) * np.abs(ref).max(initial=0.0) + 1e-5)


def run_forward(case, rng, dev, dev_kw, descales, ref, ref_lse, naive, empty_rows):
    """One forward call with the case's outputs, checked; returns (out, lse) as the backward takes them."""
    out_dtype = BF16 if case.fp8 else DTYPES[case.dtype]
    shape = dev[0].shape
    lse_shape = (case.batch, case.nheads, case.seqlen_q)
    given = {}
    if case.out_layout is not None:
        out_view, out_storage = poisoned(shape, out_dtype, case.out_layout, rng)
        given["out"] = out_view
    if case.lse_given:
        given["lse"] = cupy.full(lse_shape, np.nan, cupy.float32)
    result = cuflash.attention(*dev, return_lse=case.return_lse, **dev_kw, **descales, **given)
    out, lse = result if case.return_lse else (result, given.get("lse"))
    assert isinstance(out, cupy.ndarray) and out.shape == shape and out.dtype == out_dtype, \
        f"out: {type(out).__name__} {getattr(out, 'shape', None)} {getattr(out, 'dtype', None)}"
    if "out" in given:
        assert out is given["out"], "out= not returned"
        check_storage("out", out, out_storage)
    if "lse" in given:
        assert lse is given["lse"], "lse= not returned"
    got = cupy.asnumpy(out).astype(np.float64)
    assert_close_2x(got, ref, naive, FP8_ATOL if case.fp8 else ATOL[out_dtype])
    assert np.all(got[:, empty_rows] == 0), "out: rows that see no key must be 0"
    if lse is not None:
        check_lse(lse, ref_lse, 2e-3 if case.fp8 else 1e-3)
    return out, lse


def run_backward(case, rng, host, dev, host_kw, dev_kw, out, lse, empty_rows):
    dtype = DTYPES[case.dtype]
    dout = randn(rng, dev[0].shape, dtype)
    if case.loud_empty_rows:
        dout[:, empty_rows] = 100  # must not leak into dk or dv
    (dout_host,), (dout_dev,) = place_all([dout], case.layouts[3:], rng, np.nan)
    given, storages = {}, {}
    if case.grads_layout is not None:
        for name, x in zip(("dq", "dk", "dv"), dev):
            given[name], storages[name] = poisoned(x.shape, dtype, case.grads_layout, rng)
    if case.workspace:
        ws_kw = {k: v for k, v in dev_kw.items() if k not in ("softmax_scale", "seed", "offset")}
        given["workspace"] = cuflash.backward_workspace(*dev, deterministic=case.deterministic, **ws_kw)

    def call():
        return cuflash.attention_backward(dout_dev, *dev, out, lse, deterministic=case.deterministic,
                                          **dev_kw, **given)

    grads = call()
    first = [bits(g) for g in grads] if case.deterministic else None
    refs = reference.attention_backward(dout_host, *host, **host_kw)
    naives = reference.attention_backward_naive_lowp(dout_host, *host, dtype=dtype, **host_kw)
    for name, g, x, ref, naive in zip(("dq", "dk", "dv"), grads, dev, refs, naives):
        assert isinstance(g, cupy.ndarray) and g.shape == x.shape and g.dtype == dtype, \
            f"{name}: {type(g).__name__} {getattr(g, 'shape', None)} {getattr(g, 'dtype', None)}"
        if name in storages:
            assert g is given[name], f"{name}= not returned"
            check_storage(name, g, storages[name])
        try:
            assert_close_2x(cupy.asnumpy(g), ref, naive, grad_atol(ref, dtype))
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    assert np.all(cupy.asnumpy(grads[0])[:, empty_rows].astype(np.float32) == 0), \
        "dq: rows that see no key must be 0"
    if case.deterministic:
        second = call()
        for name, a, b in zip(("dq", "dk", "dv"), first, second):
            np.testing.assert_array_equal(a, bits(b), err_msg=f"{name}: deterministic=True, second call differs")


def run_case(case, rng):
    host, dev, descales = (fp8_inputs if case.fp8 else lowp_inputs)(case, rng)
    host_kw, dev_kw = options(case, rng)
    if case.fp8:
        ref, ref_lse = reference.attention(*host, return_lse=True, **host_kw)
        naive = reference.attention_naive_fp8(*host, **host_kw)  # no ALiBi with fp8
    else:
        ref, ref_lse = reference.attention(*host, return_lse=True, **host_kw)
        naive = reference.attention_naive_lowp(*host, dtype=DTYPES[case.dtype], **host_kw)
    empty_rows = ~reference.visible_mask(case.seqlen_q, case.seqlen_k, case.causal, host_kw["window_size"]).any(axis=1)
    for _ in range(2 if case.repeat else 1):
        out, lse = run_forward(case, rng, dev, dev_kw, descales, ref, ref_lse, naive, empty_rows)
    if case.backward:
        run_backward(case, rng, host, dev, host_kw, dev_kw, out, lse, empty_rows)


def is_hopper():
    return cupy.cuda.Device().compute_capability == "90"


@pytest.mark.parametrize("index", fuzz_indices(CASES))
def test_fuzz(index):
    case, rng = draw_case(SEED, index)
    print(case.describe())
    if case.fp8 and not is_hopper():
        pytest.skip("fp8 attention needs an sm_90 GPU")
    stream = cupy.cuda.Stream(non_blocking=True) if case.stream else contextlib.nullcontext()
    try:
        with stream, dispatch.heuristic_only():
            run_case(case, rng)
    except AssertionError as exc:
        raise AssertionError(f"{case.describe()}\n{exc}") from None
