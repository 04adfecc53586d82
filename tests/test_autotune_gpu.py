"""The autotuner on a GPU: cached results reach new processes, wrong candidates never get cached,
tuned backward configs give the heuristic's gradients."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import cupy
import numpy
import pytest

import cuflash
from cuflash import device, dispatch, launch, score_mods, tune_cache, tuner
from cuflash.dispatch import BwdProblem
from cuflash.config import BwdConfig, FwdConfig
from cuflash.dispatch import FwdProblem
from cuflash.tune_bwd import BWD
from cuflash.tune_fwd import FWD
from tests.numerics import randn

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent

TUNE = """
from cuflash import tuner
from cuflash.config import FwdConfig
results = tuner.autotune(dtypes=["float16"], headdims=[64], causal=[False], seqlens=[512], repeats=3,
                         candidates_override=[FwdConfig(64, 32, 4, 1, 2)], progress=False)
(entry,) = results.values()
print(entry["config_name"], entry["tuned_at"], entry["timed"])
"""

USE = """
import cupy, cuflash
from cuflash import device, dispatch, tune_cache, tuner
tuner.run = lambda *args, **kwargs: print("tuned again")  # any tuning would show up here
dev = cupy.cuda.Device().id
problem = dispatch.FwdProblem("float16", 64, False, 512, 512, 1, device.max_smem_per_block(dev),
                              device.compute_capability(dev))
cfg, source = dispatch.fwd_config(problem)
q = cupy.random.standard_normal((2, 512, 4, 64)).astype(cupy.float16)
cuflash.attention(q, q, q, tune=True)
(entry,) = tune_cache.entries(tune_cache.current_device()).values()
print(cfg.short_name(), source, entry["tuned_at"])
"""


def offer_only(monkeypatch, candidate):
    """The tuner tries the heuristic config and `candidate`, nothing else."""
    monkeypatch.setattr(tuner, "candidates", lambda family, problem, limits, quick: [
        family.heuristic(problem), candidate])


def device_problem(*fields):
    """A FwdProblem as cuflash.attention builds it on the current device (its shared memory and arch)."""
    dev = cupy.cuda.Device().id
    return FwdProblem(*fields, device.max_smem_per_block(dev), device.compute_capability(dev))


def _python(code, cache_dir):
    env = {**os.environ, "CUFLASH_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_new_process_uses_the_tuned_entry(tmp_path):
    name, tuned_at, timed = _python(TUNE, tmp_path)
    assert timed == "2"  # the heuristic and the one candidate
    assert name in (FwdConfig(64, 32, 4, 1, 2).short_name(),
                    dispatch.heuristic_fwd_config(device_problem("float16", 64, False, 512, 512, 1)).short_name())
    assert _python(USE, tmp_path) == [name, "cache", tuned_at]


def test_wrong_candidates_are_rejected(cache):
    problem = device_problem("float16", 64, True, 256, 256, 1)
    heuristic = dispatch.heuristic_fwd_config(problem)
    off, nan = FwdConfig(64, 32, 4, 1, 2), FwdConfig(64, 64, 4, 1, 2)

    def launcher(cfg, problem, inputs):
        FWD.launch(cfg, problem, inputs)
        if cfg == off:
            inputs.out[:, 0] += 1
        elif cfg == nan:
            inputs.out[0, -1, 0, 0] = numpy.nan

    results = tuner.autotune(dtypes=["float16"], headdims=[64], causal=[True], seqlens=[256], repeats=3,
                             candidates_override=[off, nan], launcher=launcher, progress=False)
    entry = results[FWD.key(problem)]
    assert sorted(entry["rejected"]) == sorted([off.short_name(), nan.short_name()])
    assert entry["config_name"] == heuristic.short_name() and entry["timed"] == 1
    assert entry["ms"] == entry["heuristic"]["ms"]


def test_tune_keyword_tunes_the_call_shape(cache, monkeypatch):
    candidate = FwdConfig(64, 32, 4, 1, 2)
    offer_only(monkeypatch, candidate)
    gen = cupy.random.default_rng(0)
    q = randn(gen, (1, 300, 4, 64), cupy.float16)
    k, v = (randn(gen, (1, 200, 2, 64), cupy.float16) for _ in range(2))
    with dispatch.heuristic_only():
        expected = cuflash.attention(q, k, v, causal=True)
    out = cuflash.attention(q, k, v, causal=True, tune=True)
    problem = device_problem("float16", 64, True, 300, 200, 2)
    entry = tune_cache.get(tune_cache.current_device(), FWD.key(problem))
    assert entry["shape"] == {**entry["shape"], "batch": 1, "nheads": 4, "nheads_kv": 2, "seqlen_q": 300}
    assert dispatch.fwd_config(problem)[1] == "cache"
    assert float(cupy.abs(out.astype(cupy.float32) - expected.astype(cupy.float32)).max()) < 2e-2


def device_bwd_problem(*fields):
    """A BwdProblem as cuflash.attention_backward builds it on the current device."""
    dev = cupy.cuda.Device().id
    return BwdProblem(*fields, device.max_smem_per_block(dev), device.compute_capability(dev))


def bwd_inputs(batch, nq, nk, nheads, nheads_kv, headdim, causal):
    gen = cupy.random.default_rng(0)
    q, dout = (randn(gen, (batch, nq, nheads, headdim), cupy.float16) for _ in range(2))
    k, v = (randn(gen, (batch, nk, nheads_kv, headdim), cupy.float16) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    return dout, q, k, v, out, lse


def assert_grads_close(grads, expected):
    for g, e in zip(grads, expected):
        g32, e32 = g.astype(cupy.float32), e.astype(cupy.float32)
        assert not bool(cupy.isnan(g32).any())
        assert float(cupy.abs(g32 - e32).max()) <= 2e-2 * float(cupy.abs(e32).max())


def record_configs(monkeypatch):
    """The configs attention_backward launches, in order."""
    used, prepare = [], launch.prepare_bwd

    def recording(cfg, *args):
        used.append(cfg)
        return prepare(cfg, *args)

    monkeypatch.setattr(launch, "prepare_bwd", recording)
    return used


@pytest.mark.parametrize("deterministic", [False, True])
def test_tuned_backward_is_cached_used_and_matches_the_heuristic(cache, monkeypatch, deterministic):
    candidates = [BwdConfig(64, 64, 8, 4, 64, dkdv_chunk_m=32), BwdConfig(64, 128, 8, 8, 32, dkdv_chunk_m=16)]
    results = tuner.autotune(dtypes=["float16"], headdims=[64], causal=[True], seqlens=[512], passes=("backward",),
                             repeats=3, candidates_override=candidates, progress=False)
    problem = device_bwd_problem("float16", 64, True, 512, 512, 1, deterministic)
    entry = results[BWD.key(problem)]
    assert len(results) == 2 and entry["timed"] == 3 and entry["rejected"] == []
    assert tune_cache.get(tune_cache.current_device(), BWD.key(problem)) == entry
    # Make a candidate the winner, so that the cache is seen to override the table.
    tuned = candidates[0]
    tune_cache.put(tune_cache.current_device(), {BWD.key(problem): {**entry, "config": dataclasses.asdict(tuned)}})
    assert dispatch.bwd_config(problem) == (tuned, "cache")

    args = bwd_inputs(2, 512, 512, 4, 4, 64, causal=True)
    used = record_configs(monkeypatch)
    with dispatch.heuristic_only():
        expected = cuflash.attention_backward(*args, causal=True, deterministic=deterministic)
    grads = cuflash.attention_backward(*args, causal=True, deterministic=deterministic)
    assert used == [dispatch.heuristic_bwd_config(problem), tuned]
    assert_grads_close(grads, expected)


def test_backward_tune_keyword_tunes_the_call_shape(cache, monkeypatch):
    candidate = BwdConfig(64, 64, 8, 4, 64, dkdv_chunk_m=16)
    offer_only(monkeypatch, candidate)
    args = bwd_inputs(1, 300, 200, 4, 2, 64, causal=True)
    with dispatch.heuristic_only():
        expected = cuflash.attention_backward(*args, causal=True)
    grads = cuflash.attention_backward(*args, causal=True, tune=True)
    problem = device_bwd_problem("float16", 64, True, 300, 200, 2, False)
    entry = tune_cache.get(tune_cache.current_device(), BWD.key(problem))
    assert entry["shape"] == {**entry["shape"], "batch": 1, "nheads": 4, "nheads_kv": 2, "seqlen_q": 300}
    assert dispatch.bwd_config(problem)[1] == "cache"
    assert_grads_close(grads, expected)


OPTIONS = dict(causal=True, window_size=(64, 0), softcap=20.0)


def _option_problem(problem, seqlen_q, seqlen_k, alibi=True):
    _, mods = score_mods.normalise(True, OPTIONS["window_size"], OPTIONS["softcap"], 0 if alibi else None,
                                   seqlen_q, seqlen_k)
    return dataclasses.replace(problem, mods=mods)


def test_option_calls_are_tuned_under_their_own_key(cache, monkeypatch):
    """attention(..., tune=True) with a window, softcap and ALiBi tunes that problem's kernels and caches them
    under its own key, which the next such call reads; the plain problem stays untuned."""
    candidate = FwdConfig(64, 32, 4, 1, 2)
    offer_only(monkeypatch, candidate)
    gen = cupy.random.default_rng(1)
    q = randn(gen, (1, 300, 4, 64), cupy.float16)
    k, v = (randn(gen, (1, 200, 2, 64), cupy.float16) for _ in range(2))
    slopes = cupy.asarray(score_mods.standard_alibi_slopes(4))
    with dispatch.heuristic_only():
        expected = cuflash.attention(q, k, v, alibi_slopes=slopes, **OPTIONS)
    out = cuflash.attention(q, k, v, alibi_slopes=slopes, tune=True, **OPTIONS)
    plain = device_problem("float16", 64, True, 300, 200, 2)
    problem = _option_problem(plain, 300, 200)
    entry = tune_cache.get(tune_cache.current_device(), FWD.key(problem))
    assert FWD.key(problem).endswith("/w64,0+softcap+alibi") and entry["timed"] >= 1
    assert dispatch.fwd_config(problem)[1] == "cache"
    assert tune_cache.get(tune_cache.current_device(), FWD.key(plain)) is None
    assert float(cupy.abs(out.astype(cupy.float32) - expected.astype(cupy.float32)).max()) < 2e-2


def test_backward_option_calls_are_tuned_under_their_own_key(cache, monkeypatch):
    candidate = BwdConfig(64, 64, 8, 4, 64, dkdv_chunk_m=16)
    offer_only(monkeypatch, candidate)
    gen = cupy.random.default_rng(2)
    q, dout = (randn(gen, (1, 300, 4, 64), cupy.float16) for _ in range(2))
    k, v = (randn(gen, (1, 200, 2, 64), cupy.float16) for _ in range(2))
    slopes = cupy.asarray(score_mods.standard_alibi_slopes(4))
    out, lse = cuflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **OPTIONS)
    args = (dout, q, k, v, out, lse)
    with dispatch.heuristic_only():
        expected = cuflash.attention_backward(*args, alibi_slopes=slopes, **OPTIONS)
    grads = cuflash.attention_backward(*args, alibi_slopes=slopes, tune=True, **OPTIONS)
    problem = _option_problem(device_bwd_problem("float16", 64, True, 300, 200, 2, False), 300, 200)
    entry = tune_cache.get(tune_cache.current_device(), BWD.key(problem))
    assert BWD.key(problem).endswith("/atomic/w64,0+softcap+alibi") and entry["timed"] >= 1
    assert dispatch.bwd_config(problem)[1] == "cache"
    assert_grads_close(grads, expected)


def test_autotune_with_options_times_the_options_kernels(cache):
    results = tuner.autotune(dtypes=["bfloat16"], headdims=[64], causal=[False], seqlens=[512], softcap=30.0,
                             alibi=True, repeats=3, candidates_override=[FwdConfig(64, 32, 4, 1, 2)],
                             progress=False)
    (key, entry), = results.items()
    assert key.endswith("/softcap+alibi") and entry["timed"] == 2 and entry["rejected"] == []
