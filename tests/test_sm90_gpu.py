"""Hopper (sm_90a) forward family: the wgmma layout conventions it relies on,
and the kernel against the float64 reference with the 2x rule."""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from cuflash import api, dispatch, reference  # noqa: E402
from cuflash import compile as cf_compile  # noqa: E402

from .numerics import assert_close_2x  # noqa: E402


def _is_hopper():
    try:
        return cupy.cuda.Device().compute_capability == "90"
    except Exception:
        return False


hopper = pytest.mark.skipif(not _is_hopper(), reason="needs an sm_90 GPU")

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
        Wgmma<64, false>::ss(s, desc_k_major_sw128<64>(smem_addr(sq), 0, ks), desc_k_major_sw128<64>(smem_addr(sk), 0, ks),
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
        Wgmma<128, false>::rs<true>(o, a, desc_mn_major_sw128<64 * 128, 1024>(smem_addr(sv), kk));
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


@hopper
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


@hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(256, 256), (1, 97), (257, 1025), (1025, 97), (384, 512)])
def test_sm90_forward(dtype, headdim, causal, nq, nk):
    import ml_dtypes

    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(hash((dtype, headdim, causal, nq, nk)) % 2**32)
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
    api.launch_fwd(cfg, problem, dq_, dk_, dv_, out, lse, scale)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    naive = reference.attention_naive_lowp(q, k, v, causal=causal, dtype=np_dtype)
    atol = 1e-3 if dtype == "float16" else 5e-3
    assert_close_2x(out.get().astype(np.float64), ref, naive, atol)
    got_lse = lse.get()
    finite = np.isfinite(ref_lse)
    assert np.all(np.isneginf(got_lse[~finite]))
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)
