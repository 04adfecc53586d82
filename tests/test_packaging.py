"""The wheel a user installs: it carries the kernel sources and the LICENSE, and its metadata the license."""

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
    return zipfile.ZipFile(path)


def test_wheel_carries_kernels_and_license(wheel):
    names = wheel.namelist()
    kernels = {Path(n).name for n in names if n.startswith("cuflash/cuda_src/") and n.endswith(".cuh")}
    assert kernels == {p.name for p in (ROOT / "cuda_src").glob("*.cuh")}
    assert any(n.endswith("LICENSE") for n in names)
    metadata = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: BSD-3-Clause" in metadata
