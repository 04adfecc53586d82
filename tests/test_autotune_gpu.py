"""The autotuner on a GPU: cached results reach new processes, wrong candidates never get cached."""

import os
import subprocess
import sys
from pathlib import Path

import cupy
import numpy
import pytest

import cuflash
from cuflash import api, dispatch, tune_cache, tuner
from cuflash.config import FwdConfig
from cuflash.dispatch import FwdProblem
from cuflash.tune_fwd import FWD

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
from cuflash import api, dispatch, tune_cache, tuner
tuner.run = lambda *args, **kwargs: print("tuned again")  # any tuning would show up here
dev = cupy.cuda.Device().id
problem = dispatch.FwdProblem("float16", 64, False, 512, 512, 1, api.max_smem_per_block(dev),
                              api.compute_capability(dev))
cfg, source = dispatch.fwd_config(problem)
q = cupy.random.standard_normal((2, 512, 4, 64)).astype(cupy.float16)
cuflash.attention(q, q, q, tune=True)
(entry,) = tune_cache.entries(tune_cache.current_device()).values()
print(cfg.short_name(), source, entry["tuned_at"])
"""


def device_problem(*fields):
    """A FwdProblem as cuflash.attention builds it on the current device (its shared memory and arch)."""
    dev = cupy.cuda.Device().id
    return FwdProblem(*fields, api.max_smem_per_block(dev), api.compute_capability(dev))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune_cache, "_memo", {})
    return tmp_path


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
    monkeypatch.setattr(tuner, "candidates", lambda family, problem, limits, quick: [
        family.heuristic(problem), candidate])
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((1, 300, 4, 64), dtype=cupy.float32).astype(cupy.float16)
    k, v = (rng.standard_normal((1, 200, 2, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(2))
    with dispatch.heuristic_only():
        expected = cuflash.attention(q, k, v, causal=True)
    out = cuflash.attention(q, k, v, causal=True, tune=True)
    problem = device_problem("float16", 64, True, 300, 200, 2)
    entry = tune_cache.get(tune_cache.current_device(), FWD.key(problem))
    assert entry["shape"] == {**entry["shape"], "batch": 1, "nheads": 4, "nheads_kv": 2, "seqlen_q": 300}
    assert dispatch.fwd_config(problem)[1] == "cache"
    assert float(cupy.abs(out.astype(cupy.float32) - expected.astype(cupy.float32)).max()) < 2e-2
