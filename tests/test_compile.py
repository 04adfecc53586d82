"""Compile-only checks (NVRTC, no GPU): configs agree with the C++ traits and
the kernel sources resolve both from the source tree and from a wheel."""

import dataclasses

import pytest

from cuflash import compile as cf_compile
from cuflash.config import KERNEL_HEADDIMS, BwdConfig, FwdConfig, kernel_headdim
from cuflash.dispatch import HEURISTIC_FWD

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


def _compiles(source: str, arch: str = "compute_80") -> tuple[bool, str]:
    prog = nvrtc.createProgram(source, "check.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [*cf_compile.COMPILE_OPTIONS, f"-arch={arch}"])
        return True, ""
    except nvrtc.NVRTCError:
        return False, nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _traits(cfg: FwdConfig) -> str:
    return (
        f"cuflash::FwdTraits<{cfg.headdim}, {cfg.block_n}, {cfg.warps}, {cfg.m_tiles}, {cfg.stages}, "
        f"{cfg.min_blocks}, {'true' if cfg.q_in_regs else 'false'}, false>"
    )


def test_smem_bytes_match_cpp_traits():
    configs = sorted({cfg for pair in HEURISTIC_FWD.values() for cfg in pair})
    asserts = "\n".join(
        f"static_assert({_traits(c)}::SMEM_BYTES == {c.smem_bytes()}, \"{c.short_name()}\");"
        f"\nstatic_assert({_traits(c)}::BR == {c.block_m}, \"{c.short_name()}\");"
        for c in configs
    )
    ok, log = _compiles(cf_compile.kernel_source("fwd_sm80") + "\n" + asserts)
    assert ok, log


def test_sm90_smem_bytes_match_cpp_traits():
    from cuflash.config import SM90_DTYPES, FwdSm90Config
    from cuflash.dispatch import HEURISTIC_FP8, sm90_table_configs

    pairs = [(c, dt) for c in sm90_table_configs() for dt in ("float16", "bfloat16")]
    pairs += [(c, "float8_e4m3") for c in HEURISTIC_FP8.values()]
    # The tuner's other tile widths.
    pairs += [(FwdSm90Config(d, n, st, stage_o=so), "float16")
              for d, n, st, so in ((128, 176, 2, False), (256, 64, 2, False), (64, 80, 3, True), (128, 128, 2, False))]
    pairs += [(FwdSm90Config(128, n, st), "float8_e4m3") for n, st in ((128, 2), (192, 3))]
    asserts = "\n".join(
        f"static_assert(cuflash::FwdSm90Traits<{c.headdim}, {c.block_n}, {c.stages}, {SM90_DTYPES[dt]}, "
        f"{'true' if c.stage_o else 'false'}>::SMEM_BYTES"
        f" == {c.smem_bytes(dt)}, \"{c.short_name()} {dt}\");"
        for c, dt in pairs
    )
    ok, log = _compiles(cf_compile.kernel_source("fwd_sm90") + "\n" + asserts, "compute_90a")
    assert ok, log


def test_bwd_sm90_smem_bytes_match_cpp_traits():
    from cuflash.dispatch import HEURISTIC_BWD_SM90

    configs = [dataclasses.replace(c, stages=s) for c in HEURISTIC_BWD_SM90.values() for s in (2, 3)]
    assert all(c.is_valid() for c in HEURISTIC_BWD_SM90.values())
    asserts = []
    for cfg in filter(BwdConfig.is_valid, configs):  # 3 stages fit at head dim 128 only
        stages = cfg.stages
        for atomic in (True, False):
            traits = (f"cuflash::BwdSm90Traits<{cfg.headdim}, {cfg.dkdv_block_m}, {stages}, "
                      f"{'true' if atomic else 'false'}>")
            asserts.append(f"static_assert({traits}::SMEM_BYTES == {cfg.dkdv_smem_bytes(atomic)}, \"{traits}\");")
            asserts.append(f"static_assert({traits}::BN == {cfg.dkdv_block_n}, \"{traits}\");")
        dq_traits = f"cuflash::BwdSm90DqTraits<{cfg.headdim}, {cfg.dq_block_n}, {stages}>"
        asserts.append(f"static_assert({dq_traits}::SMEM_BYTES == {cfg.dq_smem_bytes()}, \"{dq_traits}\");")
        asserts.append(f"static_assert({dq_traits}::BM == {cfg.dq_block_m}, \"{dq_traits}\");")
    ok, log = _compiles(cf_compile.kernel_source("bwd_sm90") + "\n" + "\n".join(asserts), "compute_90a")
    assert ok, log


def test_traits_mismatch_is_detected():
    cfg = HEURISTIC_FWD[128][0]
    source = cf_compile.kernel_source("fwd_sm80") + f"\nstatic_assert({_traits(cfg)}::SMEM_BYTES == 1, \"x\");"
    ok, _ = _compiles(source)
    assert not ok


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
    report = cf_compile.compile_report("fwd_sm80", "cuflash::fwd_kernel<48, 64, 4, 1, 2, 1, true, false, false, true, true>", "sm_80")
    assert not report.ok and "head dim" in report.log


def test_source_is_self_contained():
    source = cf_compile.kernel_source("fwd_sm80")
    assert '#include "' not in source
    assert len(cf_compile.source_hash()) == 16
