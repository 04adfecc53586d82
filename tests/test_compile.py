"""Compile-only checks (NVRTC, no GPU): the tables' configs, ptxas reports, the kernel sources and the
constants Python reads from them. (Shared-memory layouts: tests/test_smem_layout.py.)"""

import pytest

from cuflash import compile as cf_compile
from cuflash import dispatch
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


def test_compile_report_keeps_the_whole_cubin():
    """The kept cubin ends where its ELF headers say (CuPy's getCUBIN drops the last byte, after which
    cuobjdump and nvdisasm refused it), and its last section header table entry and program header
    table lie inside it."""
    import struct

    cfg = HEURISTIC_FWD[64][0]
    report = cf_compile.compile_report(cfg.family, cfg.name_expression("float16", True, True, True), "sm_80",
                                       keep_cubin=True)
    assert report.ok, report.log
    cubin = report.cubin
    assert cubin[:4] == b"\x7fELF"
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    assert len(cubin) >= max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    assert len(cubin) == cf_compile._elf_end(cubin)


def test_compile_report_flags_errors():
    report = cf_compile.compile_report("fwd_sm80", "cuflash::fwd_kernel<48, 64, 4, 1, 2, 1, true, false, false, true, true, 0>", "sm_80")
    assert not report.ok and "head dim" in report.log


def test_compile_report_reads_serialised_wgmmas():
    warning = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized "
               "due to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'")
    assert cf_compile.CompileReport("k", "sm_90a", ok=True, log=warning).serialized_wgmma
    assert not cf_compile.CompileReport("k", "sm_90a", ok=True, log="ptxas info    : Used 168 registers").serialized_wgmma


def test_source_is_self_contained():
    source = cf_compile.kernel_source("fwd_sm80")
    assert '#include "' not in source
    assert len(cf_compile.source_hash()) == 16


def test_cpp_int_constant_reads_its_header():
    assert cf_compile.cpp_int_constant("sm90_tiles.cuh", "SM90_ENTRY_REGS") == 168
    with pytest.raises(RuntimeError, match="NO_SUCH"):
        cf_compile.cpp_int_constant("sm90_tiles.cuh", "NO_SUCH")


@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
def test_check_compiles_sm80_tiles_for_hopper_only_where_dispatch_runs_them(headdim):
    """`cuflash check` leaves out the sm_90 build of an sm_80 forward or dK/dV tile exactly where
    dispatch runs a Hopper kernel instead on an sm_90 device."""
    from cuflash import dispatch
    from cuflash.cli.check import targets

    both = ["sm_80", "sm_90"]
    fwd = dispatch.heuristic_fwd_config(dispatch.FwdProblem("float16", headdim, False, 4096, 4096, 1, arch=90))
    fwd_on_hopper = "sm_90" in targets("fwd_sm80", f"cuflash::fwd_kernel<{headdim}, 0>", headdim, both)
    assert fwd_on_hopper == (fwd.family == "fwd_sm80")
    bwd = dispatch.heuristic_bwd_config(dispatch.BwdProblem("float16", headdim, False, 4096, 4096, 1, False, arch=90))
    for kernel in ("bwd_dkdv_kernel", "bwd_dq_kernel"):
        bwd_on_hopper = "sm_90" in targets("bwd_sm80", f"cuflash::{kernel}<{headdim}, 0>", headdim, both)
        assert bwd_on_hopper == (not bwd.hopper)


def test_check_targets_of_kernels_that_run_everywhere_or_on_one_target():
    from cuflash.cli.check import targets

    both = ["sm_80", "sm_90"]
    assert targets("bwd_sm80", "cuflash::bwd_preprocess_kernel<0, false, 8>", 64, both) == both
    assert targets("decode_sm80", "cuflash::decode_kernel<128, 2, 4, 3, 0, 0, 0, 0, 0>", 128, both) == both
    fp8_cache = dispatch.decode_config(128, 1, 227 * 1024, fp8=True).name_expression("float16", True, False)
    assert targets("decode_sm80", fp8_cache, 128, both) == ["sm_90"]  # e4m3 conversions: sm_89 and later
    assert targets("fwd_sm90", "cuflash::fwd_sm90_kernel<128>", 128, both) == ["sm_90a"]
    wgmma = dispatch.decode_config(128, 128, 227 * 1024, arch=90)
    assert targets(wgmma.family, wgmma.name_expression("float16", False, True), 128, both) == ["sm_90a"]
    assert targets("fwd_sm90", "cuflash::fwd_sm90_kernel<128>", 128, ["sm_80"]) == []


def test_check_reads_score_options_of_every_kernel():
    """The MODS argument is the last but for the decoding kernel, whose WGMMA flag may follow it."""
    from cuflash.cli.check import score_mods_of

    for arch in (80, 90):
        cfg = dispatch.decode_config(128, 128, 227 * 1024, arch=arch)
        assert score_mods_of(cfg.name_expression("bfloat16", True, True, 7)) == 7
        assert score_mods_of(cfg.name_expression("bfloat16", True, True)) == 0
    assert score_mods_of("cuflash::fwd_sm90_kernel<128, 64, 2, 5>") == 5
    assert score_mods_of("cuflash::combine_kernel<0>") == 0


def test_check_spill_rule_of_score_options():
    """Plain fast paths must not spill; with score options only the Hopper forward at head dims 64 and
    128 must, and there with one of window, softcap and ALiBi (packed or not) and no dropout."""
    from cuflash.cli.check import fast_path
    from cuflash.score_mods import MOD_ALIBI, MOD_DROPOUT, MOD_SOFTCAP, MOD_VARLEN, MOD_WINDOW

    for headdim in (64, 128):
        assert fast_path("fwd_sm90", headdim, "sm_90a")
        for one in (MOD_WINDOW, MOD_SOFTCAP, MOD_ALIBI, MOD_ALIBI | MOD_VARLEN, MOD_VARLEN):
            assert fast_path("fwd_sm90", headdim, "sm_90a", one)
        for many in (MOD_SOFTCAP | MOD_ALIBI, MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI | MOD_VARLEN, MOD_DROPOUT,
                     MOD_DROPOUT | MOD_WINDOW):
            assert not fast_path("fwd_sm90", headdim, "sm_90a", many)
        assert fast_path("bwd_sm90", headdim, "sm_90a") and not fast_path("bwd_sm90", headdim, "sm_90a", MOD_ALIBI)
        assert not fast_path("fwd_sm80", headdim, "sm_80", MOD_WINDOW)
    assert fast_path("fwd_sm90", 256, "sm_90a") and not fast_path("fwd_sm90", 256, "sm_90a", MOD_WINDOW)
    assert not fast_path("bwd_sm80", 128, "sm_90")


def test_check_compiles_each_score_option_alone_only_where_a_spill_with_it_fails():
    """Every option combination the spill rule can fail is compiled (each option alone in the Hopper
    forward at head dims 64 and 128); elsewhere only the extremes, every option at once."""
    from cuflash.cli.check import MODS_EXTREMES, fast_path, score_mods_of, shipped_specialisations
    from cuflash.score_mods import MOD_ALIBI, MOD_DROPOUT, MOD_DROPOUT_STATE, MOD_SOFTCAP, MOD_VARLEN, MOD_WINDOW

    compiled = {(family, cfg.headdim, score_mods_of(name)) for family, cfg, name, _ in shipped_specialisations()}
    for headdim in (64, 128):
        for one in (MOD_WINDOW, MOD_SOFTCAP, MOD_ALIBI, MOD_VARLEN):
            assert ("fwd_sm90", headdim, one) in compiled
    dropout = MOD_DROPOUT | MOD_DROPOUT_STATE
    for family, headdim, mods in compiled:
        if mods and not mods & dropout and not fast_path(family, headdim, "sm_90a", mods):
            assert mods in MODS_EXTREMES or family == "fwd_sm90", (family, headdim, mods)


def test_a_fast_path_fails_on_local_memory_of_either_kind():
    """A spill or a stack frame (a register array indexed at run time) fails a fast path; elsewhere both
    are reported, not failed."""
    from cuflash.cli.check import report_failure

    def report(**fields):
        return cf_compile.CompileReport("cuflash::fwd_kernel<64>", "sm_80", ok=True, registers=200, **fields)

    assert report_failure(report(), fast=True) is None
    assert "stack frame" in report_failure(report(stack_bytes=64), fast=True)
    assert "spills" in report_failure(report(stack_bytes=16, spill_stores=8, spill_loads=8), fast=True)
    assert report_failure(report(stack_bytes=64, spill_stores=8), fast=False) is None
    assert "compile error" in report_failure(cf_compile.CompileReport("k", "sm_80", ok=False, log="x"), fast=False)
