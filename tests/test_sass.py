"""The SASS check of `python -m cuflash check --sass` (cuflash/cli/sass.py): what it covers and what
it fails on, and, where a disassembler is installed (the test extra's nvdisasm), a compiled fast
path read through it. No GPU."""

import subprocess

import pytest

from cuflash import compile as cf_compile
from cuflash.cli import sass
from cuflash.cli.check import shipped_specialisations
from cuflash.config import FP8_DTYPE_NAME

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


def test_every_hopper_fast_path_is_a_shipped_specialisation():
    shipped = {name for _, _, name, _ in shipped_specialisations()}
    paths = sass.hopper_fast_paths()
    assert len(paths) >= 40
    assert set(paths) <= shipped, sorted(set(paths) - shipped)


def test_failure_names_what_is_wrong():
    clean = dict.fromkeys(sass.OPCODES, 0)
    assert sass.failure("float16", {**clean, "HGMMA": 32}) is None
    assert "HGMMA" in sass.failure("float16", {**clean, "HMMA": 32})
    assert "QGMMA" in sass.failure(FP8_DTYPE_NAME, {**clean, "HGMMA": 32})
    assert "local memory" in sass.failure("bfloat16", {**clean, "HGMMA": 32, "STL": 2, "LDL": 2})


@pytest.mark.skipif(sass.disassembler() is None, reason="no cuobjdump or nvdisasm (pip install nvidia-cuda-nvdisasm)")
def test_a_fast_path_reads_through_the_disassembler():
    """A Hopper backward fast path: wgmma and no local memory; one byte short (as CuPy's getCUBIN
    returns it) the tool refuses the image."""
    name = next(n for n in sass.hopper_fast_paths() if n.startswith("cuflash::bwd_sm90_kernel<128"))
    report = cf_compile.compile_report("bwd_sm90", name, "sm_90a", keep_cubin=True)
    assert report.ok, report.log
    command = sass.disassembler()
    counts = sass.opcode_counts(sass.sass(report.cubin, command))
    assert counts["HGMMA"] > 0 and sass.failure("float16", counts) is None, counts
    with pytest.raises(subprocess.CalledProcessError):
        sass.sass(report.cubin[:-1], command)
