"""Hopper (sm_90a) forward family: the wgmma layout conventions it relies on,
the kernel against the float64 reference with the 2x rule (16-bit inputs,
strided and GQA views through tensor maps), and fp8 e4m3 attention."""

import math

import cupy
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import device, dispatch, launch, reference, tail_split
from cuflash import compile as cf_compile
from cuflash.config import FwdSm90Config
from cuflash.score_mods import MOD_ALIBI, ScoreMods
from tests.numerics import ATOL, assert_close_2x, randn

pytestmark = pytest.mark.gpu

# One warpgroup: S = Q K^T (64 x 64, k = 128: the k steps cross the two
# 64-column panels) through K-major descriptors, then O = P V (64 x 128: n
# crosses both panels) with P (given) in A-fragment registers and V through the
# MN-major descriptor the kernel uses. Tiles in common.cuh's swizzled layout.
PROBE = r"""
using namespace cuflash;
__global__ void probe(const u16* q, const u16* k, const u16* p, const u16* v, float* s_out, float* o_out) {
    constexpr int D = 128;
    extern __shared__ __align__(1024) unsigned char smem[];
    u16* sq = reinterpret_cast<u16*>(smem);
    u16* sk = sq + 64 * D;
    u16* sv = sk + 64 * D;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    load_tile_async<64, D, 128, false, false>(sq, q, D, 64, D, tid);
    load_tile_async<64, D, 128, false, false>(sk, k, D, 64, D, tid);
    load_tile_async<64, D, 128, false, false>(sv, v, D, 64, D, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    fence_proxy_async();
    float s[32], o[64];
    wgmma_fence();
    for (int ks = 0; ks < D / 16; ++ks)
        Wgmma<64, F16>::ss(s, desc_k_major_sw128<64>(smem_addr(sq), 0, ks), desc_k_major_sw128<64>(smem_addr(sk), 0, ks),
                             ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    const int r0 = warp * 16 + (lane >> 2), c0 = 2 * (lane & 3);
    wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
        unsigned a[4];
        const u16* pr = p + r0 * 64 + kk * 16 + c0;
        a[0] = *(const unsigned*)(pr);
        a[1] = *(const unsigned*)(pr + 8 * 64);
        a[2] = *(const unsigned*)(pr + 8);
        a[3] = *(const unsigned*)(pr + 8 * 64 + 8);
        Wgmma<128, F16>::rs<true>(o, a, desc_mn_major_sw128<64 * 128, 1024>(smem_addr(sv), kk));
    }
    wgmma_commit();
    wgmma_wait<0>();
    for (int j = 0; j < 16; ++j)
        for (int e = 0; e < 4; ++e) {
            const int row = r0 + 8 * (e >> 1), col = j * 8 + c0 + (e & 1);
            if (j < 8) s_out[row * 64 + col] = s[j * 4 + e];
            o_out[row * 128 + col] = o[j * 4 + e];
        }
}
"""


@pytest.mark.hopper
def test_wgmma_layouts():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((64, 128)).astype(np.float16) for _ in range(3))
    p = rng.standard_normal((64, 64)).astype(np.float16)
    source = cf_compile.kernel_source("fwd_sm90") + PROBE
    module = cupy.RawModule(code=source, options=(*cf_compile.COMPILE_OPTIONS, "-arch=sm_90a"),
                            name_expressions=["probe"])
    fn = module.get_function("probe")
    fn.max_dynamic_shared_size_bytes = 3 * 64 * 128 * 2
    dq, dk, dp, dv = (cupy.asarray(x) for x in (q, k, p, v))
    s_out = cupy.full((64, 64), np.nan, np.float32)
    o_out = cupy.full((64, 128), np.nan, np.float32)
    fn((1,), (128,), (dq, dk, dp, dv, s_out, o_out), shared_mem=3 * 64 * 128 * 2)
    s_ref = q.astype(np.float64) @ k.astype(np.float64).T
    o_ref = p.astype(np.float64) @ v.astype(np.float64)
    np.testing.assert_allclose(s_out.get(), s_ref, atol=1e-2, rtol=1e-3)
    np.testing.assert_allclose(o_out.get(), o_ref, atol=1e-2, rtol=1e-3)


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(256, 256), (1, 97), (257, 1025), (1025, 97), (384, 512)])
def test_sm90_forward(dtype, headdim, causal, nq, nk, rng):
    np_dtype = np.dtype(dtype)
    batch, nheads, nheads_kv = 2, 4, 2
    q = rng.standard_normal((batch, nq, nheads, headdim)).astype(np_dtype)
    k = rng.standard_normal((batch, nk, nheads_kv, headdim)).astype(np_dtype)
    v = rng.standard_normal((batch, nk, nheads_kv, headdim)).astype(np_dtype)
    dq_, dk_, dv_ = (cupy.asarray(x) for x in (q, k, v))
    out = cupy.full(q.shape, np.nan, dtype=dq_.dtype)
    lse = cupy.full((batch, nheads, nq), np.nan, dtype=cupy.float32)
    cfg = dispatch.HEURISTIC_SM90[headdim]
    scale = 1 / math.sqrt(headdim)
    problem = dispatch.FwdProblem(dtype, headdim, causal, nq, nk, nheads // nheads_kv)
    launch.launch_fwd(cfg, problem, dq_, dk_, dv_, out, lse, scale)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    naive = reference.attention_naive_lowp(q, k, v, causal=causal, dtype=np_dtype)
    assert_close_2x(out.get().astype(np.float64), ref, naive, ATOL[np_dtype])
    got_lse = lse.get()
    finite = np.isfinite(ref_lse)
    assert np.all(np.isneginf(got_lse[~finite]))
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)


@pytest.mark.hopper
@pytest.mark.parametrize("cfg,headdim", [(FwdSm90Config(64, 192, 3), 64), (FwdSm90Config(128, 64, 3), 128),
                                         (FwdSm90Config(128, 128, 2, persistent=False), 128),
                                         (FwdSm90Config(256, 64, 2, persistent=False, stage_o=False), 256),
                                         (FwdSm90Config(64, 192, 3), 32), (FwdSm90Config(128, 128, 2), 96),
                                         (FwdSm90Config(256, 64, 2, stage_o=False), 224),
                                         (FwdSm90Config(192, 112, 2, stage_o=False), 192),
                                         (FwdSm90Config(192, 80, 2), 160),
                                         (FwdSm90Config(192, 64, 3, pingpong=False, stage_o=False), 184),
                                         (FwdSm90Config(128, 176, 2, stage_o=False), 128),
                                         (FwdSm90Config(128, 128, 2, stage_o=False), 96),
                                         (FwdSm90Config(64, 192, 3, stage_o=False), 64),
                                         (dispatch.SM90_SHORT_KEYS[64][0], 64),
                                         (FwdSm90Config(128, 176, 2, pingpong=False, persistent=False, stage_o=False),
                                          128)],
                         ids=lambda x: x.short_name() if isinstance(x, FwdSm90Config) else f"d{x}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1025, 1025), (300, 77), (64, 700)])
def test_sm90_other_configs(cfg, headdim, causal, nq, nk, rng):
    """The tuner's other Hopper tiles (block_n 64, 80, 112, 176 and 192, 3 stages,
    one CTA per tile, no ping-pong, output stored from registers), and head
    dims below the kernel's (columns zero-filled by TMA loads and clipped by
    TMA stores)."""
    batch, nheads, nheads_kv = 2, 6, 2
    q = randn(rng, (batch, nq, nheads, headdim), np.float16)
    k, v = (randn(rng, (batch, nk, nheads_kv, headdim), np.float16) for _ in range(2))
    out = cupy.full(q.shape, np.nan, dtype=cupy.float16)
    lse = cupy.full((batch, nheads, nq), np.nan, dtype=cupy.float32)
    problem = dispatch.FwdProblem("float16", headdim, causal, nq, nk, nheads // nheads_kv, arch=90)
    launch.launch_fwd(cfg, problem, *(cupy.asarray(x) for x in (q, k, v)), out, lse, 1 / math.sqrt(headdim))
    ref = reference.attention(q, k, v, causal=causal)
    naive = reference.attention_naive_lowp(q, k, v, causal=causal, dtype=np.float16)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(np.float16)])


@pytest.mark.hopper
@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize("dtype,headdim", [("float16", 64), ("bfloat16", 128), ("float8_e4m3", 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(700, 300), (300, 700)])
def test_persistent_ctas_take_many_tiles(monkeypatch, ctas, dtype, headdim, causal, nq, nk, rng):
    """With 1 or 3 CTAs for 36-72 work tiles, each CTA runs many tiles: the
    Q and K/V rings' phases, the tile counter and the tiles whose rows see no
    key (causal, nq > nk) carry over from tile to tile."""
    monkeypatch.setattr(launch, "sm_count", lambda device_id: ctas)
    batch, nheads, nheads_kv = 2, 6, 2
    if dtype == "float8_e4m3":
        bits, scales, values = _fp8_inputs(rng, batch, nq, nk, nheads, nheads_kv, headdim)
        got, got_lse = _fp8_attention(bits, scales, causal)
        naive = reference.attention_naive_fp8(*values, causal=causal)
        atol = 1e-2
    else:
        np_dtype = np.dtype(dtype)
        values = [randn(rng, (batch, n, h, headdim), np_dtype)
                  for n, h in ((nq, nheads), (nk, nheads_kv), (nk, nheads_kv))]
        out = cupy.full(values[0].shape, np.nan, dtype=np_dtype)
        _, lse = cuflash.attention(*(cupy.asarray(x) for x in values), causal=causal, out=out, return_lse=True)
        got, got_lse = out.get().astype(np.float64), lse.get()
        naive = reference.attention_naive_lowp(*values, causal=causal, dtype=np_dtype)
        atol = ATOL[np_dtype]
    ref, ref_lse = reference.attention(*values, causal=causal, return_lse=True)
    assert_close_2x(got, ref, naive, atol)
    finite = np.isfinite(ref_lse)
    assert np.all(np.isneginf(got_lse[~finite]))
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)


def _split_of(cfg, ctas, batch, nq, nheads, nk):
    num_tiles = -(-nq // cfg.block_m) * nheads * batch
    return tail_split.plan(num_tiles, ctas, -(-nk // cfg.block_n))


def _check_tail_split(monkeypatch, cfg, dtype, headdim, ctas, nq, nk, rng, alibi=False):
    """The split's output and lse against the reference, on `ctas` CTAs (None: the device's own
    count, about 1.5 waves of tiles), into a strided output; twice, so that the second launch finds
    the counters reset by the first. alibi: random slopes of shape (nheads,)."""
    monkeypatch.setattr(tail_split, "SEGMENT_COST", 0)  # split these short key sequences too
    if ctas is None:
        ctas = device.sm_count(cupy.cuda.Device().id)
        nheads_kv = -(-3 * ctas // 8)  # about 1.5 waves of tiles
    else:
        monkeypatch.setattr(launch, "sm_count", lambda device_id: ctas)
        nheads_kv = 3
    batch, nheads = 1, 2 * nheads_kv
    split = _split_of(cfg, ctas, batch, nq, nheads, nk)
    assert split.items > 0, "the shape must exercise the split"
    np_dtype = np.dtype(dtype)
    values = [randn(rng, (batch, n, h, headdim), np_dtype) for n, h in ((nq, nheads), (nk, nheads_kv), (nk, nheads_kv))]
    slopes = rng.uniform(0.01, 1.0, nheads).astype(np.float32) if alibi else None
    ref, ref_lse = reference.attention(*values, alibi_slopes=slopes, return_lse=True)
    naive = reference.attention_naive_lowp(*values, alibi_slopes=slopes, dtype=np_dtype)
    problem = dispatch.FwdProblem(dtype, headdim, False, nq, nk, 2, arch=90, mods=ScoreMods(alibi=alibi))
    for _ in range(2):
        padded = cupy.full((batch, nq, nheads, headdim + 8), np.nan, dtype=np_dtype)
        out = padded[..., :headdim]
        lse = cupy.full((batch, nheads, nq), np.nan, dtype=cupy.float32)
        launch.launch_fwd(cfg, problem, *(cupy.asarray(x) for x in values), out, lse, 1 / math.sqrt(headdim),
                          slopes=None if slopes is None else cupy.asarray(slopes))
        assert_close_2x(out.get().astype(np.float64), ref, naive, ATOL[np_dtype])
        assert np.all(np.isnan(padded[..., headdim:].get()))
        np.testing.assert_allclose(lse.get(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.hopper
@pytest.mark.parametrize("cfg,dtype,headdim", [(dispatch.HEURISTIC_SM90[64], "float16", 64),
                                               (dispatch.SM90_SHORT_KEYS[64][0], "bfloat16", 64),
                                               (dispatch.HEURISTIC_SM90[128], "bfloat16", 128),
                                               (FwdSm90Config(128, 176, 2, stage_o=False), "float16", 128),
                                               (FwdSm90Config(128, 128, 2, pingpong=False), "float16", 96)],
                         ids=lambda x: x.short_name() if isinstance(x, FwdSm90Config) else str(x))
@pytest.mark.parametrize("ctas,nq,nk", [(5, 300, 2049), (5, 256, 2304), (11, 1000, 3000), (None, 129, 1500)])
def test_tail_split(monkeypatch, cfg, dtype, headdim, ctas, nq, nk, rng):
    """The last wave split along the keys: runs of key blocks over one or two
    tiles (lengths that are and are not multiples of the tiles), partial
    outputs combined by the last run of each tile half, on 5 or
    11 CTAs or the device's own count."""
    _check_tail_split(monkeypatch, cfg, dtype, headdim, ctas, nq, nk, rng)


@pytest.mark.hopper
@pytest.mark.parametrize("cfg,dtype,headdim", [(dispatch.HEURISTIC_SM90[64], "bfloat16", 64),
                                               (dispatch.SM90_SHORT_KEYS[64][0], "float16", 64)],
                         ids=lambda x: x.short_name() if isinstance(x, FwdSm90Config) else str(x))
@pytest.mark.parametrize("ctas,nq,nk", [(5, 300, 2049), (11, 1000, 3000), (None, 129, 1500)])
def test_tail_split_alibi(monkeypatch, cfg, dtype, headdim, ctas, nq, nk, rng):
    """The split under ALiBi's column GEMM (head dim 64; at 128 those kernels do not split): a
    segment takes its own key blocks from the tile's diagonal outwards (KeyOrder), so segments lie
    left of, right of and across the diagonals (nq != nk moves them off the tiles' corners)."""
    assert cfg.alibi_gemm(dtype, MOD_ALIBI)
    _check_tail_split(monkeypatch, cfg, dtype, headdim, ctas, nq, nk, rng, alibi=True)


@pytest.mark.hopper
@pytest.mark.parametrize("ctas,nq,nk", [(5, 300, 2049), (5, 256, 2304), (None, 129, 1500)])
def test_tail_split_fp8(monkeypatch, ctas, nq, nk, rng):
    """The split with fp8 inputs: partial outputs carry v_descale, lse the score descales; twice."""
    monkeypatch.setattr(tail_split, "SEGMENT_COST", 0)
    if ctas is None:
        ctas = device.sm_count(cupy.cuda.Device().id)
        nheads_kv = -(-3 * ctas // 8)
    else:
        monkeypatch.setattr(launch, "sm_count", lambda device_id: ctas)
        nheads_kv = 3
    batch, nheads = 1, 2 * nheads_kv
    assert _split_of(dispatch.HEURISTIC_FP8[128], ctas, batch, nq, nheads, nk).items > 0
    bits, scales, values = _fp8_inputs(rng, batch, nq, nk, nheads, nheads_kv, 128)
    ref, ref_lse = reference.attention(*values, return_lse=True)
    naive = reference.attention_naive_fp8(*values)
    for _ in range(2):
        got, got_lse = _fp8_attention(bits, scales, False)
        assert_close_2x(got, ref, naive, 1e-2)
        np.testing.assert_allclose(got_lse, ref_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.hopper
@pytest.mark.parametrize("layout", ["packed_qkv", "heads_major", "single_row_head"])
def test_sm90_strided_views(layout, rng):
    """Tensor maps over views: q, k, v slices of one packed tensor, a
    (batch, heads, seq, dim) buffer transposed, and extent-1 dims."""
    headdim, causal = 128, True
    if layout == "packed_qkv":
        qkv = cupy.asarray(randn(rng, (2, 300, 3, 4, headdim), np.float16))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    elif layout == "heads_major":
        q, k, v = (cupy.asarray(randn(rng, (2, 4, 257, headdim), np.float16)).transpose(0, 2, 1, 3)
                   for _ in range(3))
    else:
        q = cupy.asarray(randn(rng, (1, 1, 1, headdim), np.float16))
        k, v = (cupy.asarray(randn(rng, (1, 129, 1, headdim), np.float16)) for _ in range(2))
    nq, nk = q.shape[1], k.shape[1]
    out = cupy.full(q.shape, np.nan, dtype=cupy.float16)
    lse = cupy.full((q.shape[0], q.shape[2], nq), np.nan, dtype=cupy.float32)
    cfg = dispatch.HEURISTIC_SM90[headdim]
    problem = dispatch.FwdProblem("float16", headdim, causal, nq, nk, q.shape[2] // k.shape[2], arch=90)
    launch.launch_fwd(cfg, problem, q, k, v, out, lse, 1 / math.sqrt(headdim))
    hq, hk, hv = (x.get() for x in (q, k, v))
    ref = reference.attention(hq, hk, hv, causal=causal)
    naive = reference.attention_naive_lowp(hq, hk, hv, causal=causal, dtype=np.float16)
    assert_close_2x(out.get(), ref, naive, ATOL[np.dtype(np.float16)])


def _fp8_inputs(rng, batch, nq, nk, nheads, nheads_kv, headdim, outliers=False):
    """e4m3 bits of q, k, v with descales per (batch, kv head), and their dequantised float64 values.

    outliers: a few channels of q and k x20, as trained transformers have.
    """
    qf = rng.standard_normal((batch, nq, nheads, headdim))
    kf = rng.standard_normal((batch, nk, nheads_kv, headdim))
    vf = rng.standard_normal((batch, nk, nheads_kv, headdim))
    if outliers:
        channels = rng.choice(headdim, size=max(1, headdim // 32), replace=False)
        qf[..., channels] *= 20.0
        kf[..., channels] *= 20.0
    # q's descale is per kv head too: quantise its heads in groups.
    grouped = qf.reshape(batch, nq, nheads_kv, -1)
    q_bits, q_scale = reference.fp8_quantize(grouped)
    qd = reference.fp8_dequantize(q_bits, q_scale).reshape(qf.shape)
    (k_bits, k_scale), (v_bits, v_scale) = reference.fp8_quantize(kf), reference.fp8_quantize(vf)
    bits = (q_bits.reshape(qf.shape), k_bits, v_bits)
    values = (qd, reference.fp8_dequantize(k_bits, k_scale), reference.fp8_dequantize(v_bits, v_scale))
    return bits, (q_scale, k_scale, v_scale), values


def _fp8_attention(bits, scales, causal):
    out = cupy.full(bits[0].shape, np.nan, dtype=ml_dtypes.bfloat16)
    got, lse = cuflash.attention(*(cupy.asarray(b) for b in bits), causal=causal, out=out, return_lse=True,
                             q_descale=cupy.asarray(scales[0]), k_descale=cupy.asarray(scales[1]),
                             v_descale=cupy.asarray(scales[2]))
    assert got is out and got.dtype == ml_dtypes.bfloat16
    return got.get().astype(np.float64), lse.get()


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", [FwdSm90Config(128, 64, 3), FwdSm90Config(128, 128, 3), FwdSm90Config(128, 192, 3),
                                 FwdSm90Config(128, 192, 3, persistent=False),
                                 FwdSm90Config(128, 192, 4, stage_o=False)], ids=lambda c: c.short_name())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(300, 77), (129, 1000), (64, 193)])
def test_fp8_tile_widths(monkeypatch, cfg, causal, nq, nk, rng):
    """fp8 with K/V tiles of one to three 64-key Vt panels, the last one
    partly or wholly past the keys (the tensor map zero-fills it)."""
    monkeypatch.setitem(dispatch.HEURISTIC_FP8, 128, cfg)
    bits, scales, values = _fp8_inputs(rng, 2, nq, nk, 4, 2, 128)
    got, _ = _fp8_attention(bits, scales, causal)
    ref = reference.attention(*values, causal=causal)
    naive = reference.attention_naive_fp8(*values, causal=causal)
    assert_close_2x(got, ref, naive, 1e-2)


@pytest.mark.hopper
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(256, 256), (1, 97), (257, 1025), (1025, 97)])
def test_fp8_forward(headdim, causal, nq, nk, rng):
    """fp8 e4m3 inputs with per-(batch, kv head) descales against the float64
    reference of the dequantised inputs, with the 2x rule against the naive
    fp8 computation (reference.attention_naive_fp8)."""
    bits, scales, values = _fp8_inputs(rng, 2, nq, nk, 4, 2, headdim)
    got, got_lse = _fp8_attention(bits, scales, causal)
    ref, ref_lse = reference.attention(*values, causal=causal, return_lse=True)
    naive = reference.attention_naive_fp8(*values, causal=causal)
    assert_close_2x(got, ref, naive, 1e-2)
    finite = np.isfinite(ref_lse)
    assert np.all(np.isneginf(got_lse[~finite]))
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-3)


@pytest.mark.hopper
@pytest.mark.parametrize("headdim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_outlier_activations(headdim, causal, rng):
    """With outlier channels the fp8 tensor cores' accumulation (products
    aligned to the largest in each k32 step, about 13 mantissa bits kept)
    perturbs the scores beyond the naive float32 computation; the error stays
    a small fraction of the output: mean below 1% of its RMS, max below 1/2
    of its largest value (bench --fp8 reports both next to bf16's)."""
    bits, scales, values = _fp8_inputs(rng, 1, 1024, 1024, 4, 4, headdim, outliers=True)
    got, _ = _fp8_attention(bits, scales, causal)
    ref = reference.attention(*values, causal=causal)
    err = np.abs(got - ref)
    assert not np.isnan(got).any()
    assert err.mean() <= 1e-2 * np.sqrt((ref ** 2).mean()), (err.mean(), np.sqrt((ref ** 2).mean()))
    assert err.max() <= 0.5 * np.abs(ref).max(), (err.max(), np.abs(ref).max())


@pytest.mark.hopper
def test_fp8_descale_defaults_to_one(rng):
    """Without descales the uint8 bits are the values themselves."""
    shape = (1, 128, 2, 128)
    bits = [rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn).view(np.uint8) for _ in range(3)]
    got = cuflash.attention(*(cupy.asarray(b) for b in bits))
    values = [reference.fp8_dequantize(b, np.ones((1, 2), np.float32)) for b in bits]
    ref = reference.attention(*values)
    naive = reference.attention_naive_fp8(*values)
    assert_close_2x(got.get().astype(np.float64), ref, naive, 1e-2)


@pytest.mark.hopper
@pytest.mark.parametrize("shape", [(2, 97, 3, 80), (1, 600, 2, 128), (1, 1, 1, 256), (2, 300, 2, 192)])
@pytest.mark.parametrize("strided", [False, True])
def test_fp8_transposed_v_layout(rng, shape, strided):
    """Vt holds V transposed with keys permuted per 32 and zero padding (cuda_src/fp8_prep.cuh); the
    shapes cover partial head-dim blocks and key blocks past the padded length, and a strided V (every
    other head of a wider array)."""
    from cuflash import fp8

    batch, nk, heads, d = shape
    nk_pad = -(-nk // 64) * 64
    v = rng.integers(0, 120, size=shape, dtype=np.uint8)
    if strided:
        wide = cupy.zeros((batch, nk, 2 * heads, d), np.uint8)
        wide[:, :, ::2] = cupy.asarray(v)
        v_dev = wide[:, :, ::2]
    else:
        v_dev = cupy.asarray(v)
    vt = fp8.transpose_v(v_dev).get()
    assert vt.shape == (batch, heads, d, nk_pad)
    s = np.arange(nk_pad)
    key = (s & ~15) + 2 * ((s & 15) >> 2) + np.where((s & 3) < 2, s & 3, 8 + (s & 1))
    padded = np.zeros((batch, nk_pad, heads, d), np.uint8)
    padded[:, :nk] = v
    np.testing.assert_array_equal(vt, padded[:, key].transpose(0, 2, 3, 1))


def test_quantize_e4m3_matches_ml_dtypes(rng):
    """cuflash.fp8.quantize_e4m3 (CuPy) rounds as ml_dtypes does, one descale per (batch, head)."""
    from cuflash import fp8

    x = rng.standard_normal((2, 100, 3, 64)) * rng.uniform(0.1, 50, size=(2, 1, 3, 1))
    bits, descale = fp8.quantize_e4m3(cupy.asarray(x, dtype=cupy.float32))
    ref_bits, ref_descale = reference.fp8_quantize(x.astype(np.float32))
    np.testing.assert_allclose(descale.get(), ref_descale, rtol=1e-6)
    np.testing.assert_array_equal(
        reference.fp8_dequantize(bits.get(), descale.get()), reference.fp8_dequantize(ref_bits, descale.get()))
