"""The shared-memory layout of every shipped kernel specialisation, as the C++
traits define it (OFF_* constants and SMEM_BYTES), agrees region for region
with its Python mirror in cuflash/config.py. Compile-only: NVRTC, no GPU."""

import re

import pytest

from cuflash import compile as cf_compile
from cuflash.cli.check import score_mods_of, shipped_specialisations
from cuflash.config import FP8_DTYPE_NAME, SM90_DTYPES, SM90_SMEM_LIMIT, BwdConfig, DecodeConfig, FwdConfig, FwdSm90Config

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

_DTYPE_OF_SM90 = {str(v): k for k, v in SM90_DTYPES.items()}


def _nvrtc_available() -> bool:
    try:
        nvrtc.getVersion()
        return True
    except Exception:  # no NVRTC library on this machine
        return False


def _template_args(name: str) -> list[str]:
    args = re.search(r"<(.*)>", name)
    return [a.strip() for a in args.group(1).split(",")] if args else []


def _traits_and_layout(cfg, name: str):
    """(C++ traits type, Python layout) of the kernel `name`, or None for one without a layout."""
    kernel = name.split("<")[0].removeprefix("cuflash::")
    args = _template_args(name)
    if kernel == "fwd_kernel":
        assert isinstance(cfg, FwdConfig)
        dtype = "bfloat16" if args[7] == "true" else "float16"
        return cfg.traits(dtype), cfg.smem_layout()
    if kernel == "fwd_sm90_kernel":
        assert isinstance(cfg, FwdSm90Config)
        dtype, mods = _DTYPE_OF_SM90[args[3]], score_mods_of(name)
        return cfg.traits(dtype, mods), cfg.smem_layout(dtype, mods)
    if kernel in ("bwd_dkdv_kernel", "bwd_sm90_kernel", "bwd_sm90_wide_kernel"):
        assert isinstance(cfg, BwdConfig)
        atomic_dq = args[-2] == "true"  # before MODS
        return cfg.dkdv_traits(atomic_dq), cfg.dkdv_smem_layout(atomic_dq)
    if kernel in ("bwd_dq_kernel", "bwd_sm90_dq_kernel"):
        assert isinstance(cfg, BwdConfig)
        return cfg.dq_traits(), cfg.dq_smem_layout()
    if kernel == "decode_kernel":
        assert isinstance(cfg, DecodeConfig)
        return cfg.traits(), cfg.smem_layout()
    return None  # row-wise helpers, the combine and the fp8 V transpose: no dynamic shared memory


def _layout_checks():
    """Family -> {traits type: layout}, and the (name, launch smem, layout bytes) of each specialisation."""
    per_family, launches = {}, []
    for family, cfg, name, smem in shipped_specialisations():
        found = _traits_and_layout(cfg, name)
        if found is None:
            launches.append((name, smem, 0))
            continue
        traits, layout = found
        per_family.setdefault(family, {})[traits] = layout
        launches.append((name, smem, layout["SMEM_BYTES"]))
    return per_family, launches


def test_launch_smem_is_the_layout_size():
    _, launches = _layout_checks()
    for name, smem, layout_bytes in launches:
        assert smem == layout_bytes, name


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC is not available")
@pytest.mark.parametrize("family", ["fwd_sm80", "fwd_sm90", "bwd_sm80", "bwd_sm90", "decode_sm80", "decode_sm90"])
def test_cpp_layout_matches_python(family):
    per_family, _ = _layout_checks()
    layouts = per_family[family]
    assert layouts, f"no shipped specialisation of {family}"
    asserts = [
        f'static_assert({traits}::{field} == {value}, "{traits}::{field} != {value} (cuflash/config.py)");'
        for traits, layout in sorted(layouts.items())
        for field, value in layout.items()
    ]
    asserts.append(f'static_assert(cuflash::SMEM_LIMIT == {SM90_SMEM_LIMIT}, "SMEM_LIMIT != config.SM90_SMEM_LIMIT");')
    arch = cf_compile.FAMILY_ARCH.get(family, "sm_80").replace("sm_", "compute_")
    source = cf_compile.kernel_source(family) + "\n" + "\n".join(asserts) + "\n"
    prog = nvrtc.createProgram(source, "smem_layout.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*cf_compile.COMPILE_OPTIONS, f"-arch={arch}"])
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            log = log.decode() if isinstance(log, bytes) else log
            pytest.fail("C++ traits and cuflash/config.py disagree:\n" + "\n".join(
                line for line in log.splitlines() if "error" in line or "static assertion" in line))
    finally:
        nvrtc.destroyProgram(prog)


def test_a_disagreement_fails_to_compile():
    """The check has teeth: a wrong offset is a compile error."""
    if not _nvrtc_available():
        pytest.skip("NVRTC is not available")
    cfg = FwdSm90Config(128, 128, 2)
    traits = cfg.traits(FP8_DTYPE_NAME)
    wrong = cfg.smem_layout(FP8_DTYPE_NAME)["OFF_BARS"] + 8
    source = cf_compile.kernel_source("fwd_sm90") + f"\nstatic_assert({traits}::OFF_BARS == {wrong}, \"x\");\n"
    prog = nvrtc.createProgram(source, "smem_layout.cu", [], [])
    try:
        with pytest.raises(nvrtc.NVRTCError):
            nvrtc.compileProgram(prog, [*cf_compile.COMPILE_OPTIONS, "-arch=compute_90a"])
    finally:
        nvrtc.destroyProgram(prog)
