"""The wheel a user installs: it carries the kernel sources and the LICENSE, its metadata the license,
and installed into a fresh virtual environment it imports and compiles a kernel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"pip could not build the wheel here: {result.stderr.strip().splitlines()[-1:]}")
    (path,) = out.glob("cuflash-*.whl")
    return path


def test_wheel_carries_kernels_and_license(wheel):
    wheel = zipfile.ZipFile(wheel)
    names = wheel.namelist()
    kernels = {Path(n).name for n in names if n.startswith("cuflash/cuda_src/") and n.endswith(".cuh")}
    assert kernels == {p.name for p in (ROOT / "cuda_src").glob("*.cuh")}
    assert any(n.endswith("LICENSE") for n in names)
    metadata = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: BSD-3-Clause" in metadata


# Run inside the fresh environment, from a directory outside the source tree.
_COMPILE_ONE = """
import cuflash, cuflash.compile as c
assert "site-packages" in cuflash.__file__, cuflash.__file__
report = c.compile_report("decode_sm80", "cuflash::decode_kernel<128, 1, 4, 3, false, false, false, false, 0>", "sm_80")
assert report.ok, report.log
print("compiled", report.registers, "registers")
"""


def test_wheel_installs_into_a_fresh_venv_and_compiles(wheel, tmp_path):
    """pip install of the wheel (its dependencies from this environment) into a new venv, then an NVRTC compile."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("no NVRTC library on this machine")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    result = subprocess.run([str(python), "-c", _COMPILE_ONE], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "compiled" in result.stdout
