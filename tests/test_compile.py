"""Compile-only checks (NVRTC, no GPU): the tables' configs, ptxas reports, the kernel sources and the
constants Python reads from them. (Shared-memory layouts: tests/test_smem_layout.py.)"""

import pytest

from cuflash import compile as cf_compile
from cuflash.config import KERNEL_HEADDIMS, kernel_headdim
from cuflash.dispatch import HEURISTIC_FWD

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


def test_every_heuristic_config_is_valid():
    for kd, pair in HEURISTIC_FWD.items():
        for cfg in pair:
            assert cfg.is_valid() and cfg.headdim == kd


def test_kernel_headdim_rounding():
    assert [kernel_headdim(d) for d in (8, 32, 40, 64, 72, 128, 136, 256)] == [32, 32, 64, 64, 96, 128, 160, 256]
    assert set(KERNEL_HEADDIMS) == set(HEURISTIC_FWD)
    with pytest.raises(ValueError):
        kernel_headdim(264)


def test_compile_report_parses_ptxas():
    cfg = HEURISTIC_FWD[64][0]
    report = cf_compile.compile_report(cfg.family, cfg.name_expression("float16", True, True, True), "sm_80")
    assert report.ok, report.log
    assert 0 < report.registers <= 255
    assert report.spills == 0


def test_compile_report_flags_errors():
    report = cf_compile.compile_report("fwd_sm80", "cuflash::fwd_kernel<48, 64, 4, 1, 2, 1, true, false, false, true, true, 0>", "sm_80")
    assert not report.ok and "head dim" in report.log


def test_source_is_self_contained():
    source = cf_compile.kernel_source("fwd_sm80")
    assert '#include "' not in source
    assert len(cf_compile.source_hash()) == 16


def test_cpp_int_constant_reads_its_header():
    assert cf_compile.cpp_int_constant("sm90_tiles.cuh", "SM90_ENTRY_REGS") == 168
    with pytest.raises(RuntimeError, match="NO_SUCH"):
        cf_compile.cpp_int_constant("sm90_tiles.cuh", "NO_SUCH")
