"""cuflash.jax_ring on 4 CPU devices: tests/jax_ring_check.py runs in a process of its own, since the
device count (XLA_FLAGS) must be set before JAX starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
ROOT = Path(__file__).resolve().parent.parent


def test_ring_under_shard_map_equals_whole_attention():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "jax_ring_check.py")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("forward and gradients match") == 6, result.stdout
