"""Run-time compilation of the CUDA templates in cuda_src/ with NVRTC.

`get_kernel` compiles one kernel specialisation for the current device through
`cupy.RawModule(name_expressions=...)`, memoised per (device, name) in this
process; CuPy's on-disk kernel cache (keyed on the full source text, which is
why headers are inlined here) spares a second process the compile.

`compile_report` is the compile-only path used by `python -m cuflash check`:
it needs NVRTC but no GPU and returns the ptxas resource report.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import struct
import threading
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

# Kernel family -> entry header in cuda_src/.
FAMILY_HEADERS = {
    "fwd_sm80": "fwd_sm80.cuh",
    "bwd_sm80": "bwd_sm80.cuh",
    "fwd_sm90": "fwd_sm90.cuh",
    "bwd_sm90": "bwd_sm90.cuh",
    "fp8_prep": "fp8_prep.cuh",
    "decode_sm80": "decode_sm80.cuh",
    "decode_sm90": "decode_sm80.cuh",
    "combine": "combine.cuh",
    "dropout_mask": "dropout_mask.cuh",
}

# Families built for one architecture only: wgmma needs the sm_90a target.
FAMILY_ARCH = {"fwd_sm90": "sm_90a", "bwd_sm90": "sm_90a", "decode_sm90": "sm_90a"}

# -default-device: the kernels use local lambdas, which NVRTC otherwise takes for host code.
COMPILE_OPTIONS = ("-std=c++17", "-default-device")


def cuda_src_dir() -> Path:
    """cuda_src/ inside an installed wheel, else beside the package in a source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise RuntimeError(f"cuflash: kernel sources (cuda_src/) not found next to {here}")


def _inline(path: Path, seen: set[Path]) -> str:
    """The file's text with its local #include "..." lines replaced by the headers' text (once each)."""
    if path in seen:
        return ""
    seen.add(path)

    def expand(match: re.Match) -> str:
        return _inline(path.parent / match.group(1), seen)

    return _INCLUDE.sub(expand, path.read_text())


@functools.lru_cache(maxsize=None)
def kernel_source(family: str) -> str:
    """One self-contained translation unit for a kernel family."""
    try:
        header = FAMILY_HEADERS[family]
    except KeyError:
        raise ValueError(f"unknown kernel family {family!r}") from None
    return _inline(cuda_src_dir() / header, set())


_CPP_INT_CONSTANT = r"constexpr\s+int\s+{}\s*=\s*(\d+)\s*;"


@functools.lru_cache(maxsize=None)
def cpp_int_constant(header: str, name: str) -> int:
    """The value of `constexpr int name = ...;` in cuda_src/header: read from its one home."""
    match = re.search(_CPP_INT_CONSTANT.format(re.escape(name)), (cuda_src_dir() / header).read_text())
    if match is None:
        raise RuntimeError(f"cuflash: no constexpr int {name} in cuda_src/{header}")
    return int(match.group(1))


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """Hash of every file in cuda_src/: changes whenever any kernel changes."""
    digest = hashlib.sha256()
    for path in sorted(cuda_src_dir().glob("*.cuh")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def nvrtc_version() -> str:
    """The version of the NVRTC that CuPy loads, e.g. "13.0": the compiler of every kernel here."""
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


# ---------------------------------------------------------------- on a GPU

_modules_lock = threading.Lock()
_functions: dict = {}


def get_kernel(family: str, name_expression: str, smem_bytes: int):
    """The compiled `cupy.RawKernel`-like function for the current device."""
    import cupy

    device = cupy.cuda.Device()
    key = (device.id, family, name_expression)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    if cupy.cuda.get_current_stream().is_capturing():
        # Loading a module is not a stream operation a CUDA graph can record.
        raise RuntimeError(f"cuflash: kernel {name_expression} is not compiled yet, and the current stream is "
                           "capturing a CUDA graph: run the same call once before the capture")
    # Compiled outside the lock so that threads compile different kernels at
    # once (NVRTC releases the GIL; the autotuner relies on it). Two threads
    # asking for the same new kernel both compile it; the first stored wins.
    arch = FAMILY_ARCH.get(family)
    module = cupy.RawModule(
        code=kernel_source(family),
        options=COMPILE_OPTIONS + ((f"-arch={arch}",) if arch else ()),
        name_expressions=[name_expression],
    )
    fn = module.get_function(name_expression)
    if smem_bytes > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem_bytes
    with _modules_lock:
        return _functions.setdefault(key, fn)


# ---------------------------------------------------------------- no GPU needed

_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_WGMMA_SERIALIZED = "(C7520)"


@dataclasses.dataclass
class CompileReport:
    name: str
    arch: str
    ok: bool
    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    log: str = ""
    cubin: bytes = b""

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def serialized_wgmma(self) -> bool:
        """ptxas serialised the kernel's wgmmas (its warning C7520): each then waits for the one before."""
        return _PTXAS_WGMMA_SERIALIZED in self.log


def _elf_end(image: bytes) -> int:
    """Where a 64-bit little-endian ELF image (a cubin) ends by its headers: the furthest of its
    section and program header tables, its sections' contents and its segments' file contents."""
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(shnum):
        # sh_type at 4, sh_offset at 24, sh_size at 32; SHT_NOBITS (8) takes no room in the file
        kind, = struct.unpack_from("<I", image, shoff + i * shentsize + 4)
        offset, size = struct.unpack_from("<QQ", image, shoff + i * shentsize + 24)
        if kind != 8:
            end = max(end, offset + size)
    for i in range(phnum):
        offset, = struct.unpack_from("<Q", image, phoff + i * phentsize + 8)  # p_offset
        filesz, = struct.unpack_from("<Q", image, phoff + i * phentsize + 32)  # p_filesz
        end = max(end, offset + filesz)
    return end


def _whole_elf(cubin: bytes) -> bytes:
    """NVRTC's cubin as NVRTC wrote it. CuPy's `nvrtc.getCUBIN` drops its last byte (it strips a
    text's closing NUL, which a binary image does not have), and nvdisasm ("invalid ELF file") and
    cuobjdump ("does not contain device code") refused the short image. The byte lies in the
    program header table, and is zero."""
    return cubin + bytes(max(0, _elf_end(cubin) - len(cubin)))


def compile_report(family: str, name_expression: str, arch: str, keep_cubin: bool = False) -> CompileReport:
    """Compile one specialisation to a cubin for `arch` (e.g. "sm_90") and parse ptxas -v (and keep the cubin)."""
    from cupy_backends.cuda.libs import nvrtc

    source = kernel_source(family)
    options = [*COMPILE_OPTIONS, f"-arch={arch}", "-Xptxas=-v"]
    prog = nvrtc.createProgram(source, "cuflash.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name_expression)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            return CompileReport(name_expression, arch, ok=False, log=nvrtc.getProgramLog(prog))
        log = nvrtc.getProgramLog(prog)
        cubin = _whole_elf(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    report = CompileReport(name_expression, arch, ok=True, log=log, cubin=cubin if keep_cubin else b"")
    regs = _PTXAS_REGS.search(log)
    stack = _PTXAS_STACK.search(log)
    if regs is None or stack is None:
        report.ok = False
        report.log = "no ptxas report in the NVRTC log:\n" + log
        return report
    report.registers = int(regs.group(1))
    report.stack_bytes, report.spill_stores, report.spill_loads = map(int, stack.groups())
    return report
