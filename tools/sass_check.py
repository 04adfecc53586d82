"""SASS of the Hopper fast paths (forward, the backward's dK/dV and dQ kernels, and the
decoding kernel's wgmma tiles): tensor-core and local-memory instructions.

Compiles each kernel with NVRTC, disassembles it with cuobjdump (CUDA
toolkit; on the GPU machine), or where there is none with nvdisasm (the
toolkit's, or the `nvidia-cuda-nvdisasm` wheel's: no GPU or toolkit needed),
and counts HGMMA / QGMMA (wgmma), HMMA (mma.sync) and LDL / STL (local
memory: spills or indexed register arrays). Where cuobjdump cannot read
NVRTC's cubin (an NVRTC newer than the toolkit), the kernels are built by the
toolkit's nvcc instead.
Exits non-zero if a kernel shows no wgmma instruction, or any local memory.
Run: PYTHONPATH=. python tools/sass_check.py [--dump DIR]
     (without a toolkit: pip install nvidia-cuda-nvdisasm)
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from tabulate import tabulate

from cuflash import compile as cf_compile
from cuflash.config import FP8_DTYPE_NAME, SM90_SMEM_LIMIT
from cuflash.dispatch import HEURISTIC_FP8, decode_config, hopper_bwd_plans, sm90_table_configs

OPCODES = ("HGMMA", "QGMMA", "HMMA", "LDL", "STL")


def fast_paths():
    """(family, name expression, dtype name) of each Hopper fast path: forward, backward, and the
    decoding kernel's wgmma tiles (one and two row warpgroups) at head dims 64 and 128."""
    pairs = [(cfg, dt) for cfg in sm90_table_configs() for dt in ("float16", "bfloat16")]
    pairs += [(cfg, FP8_DTYPE_NAME) for cfg in HEURISTIC_FP8.values()]
    paths = [("fwd_sm90", cfg.name_expression(dt, causal, True), dt) for cfg, dt in pairs for causal in (False, True)]
    for cfg, det in hopper_bwd_plans():
        for dt, causal in itertools.product(("float16", "bfloat16"), (False, True)):
            paths.append((cfg.kernel_family, cfg.dkdv_name(dt, causal, True, True, not det), dt))
            if det:
                paths.append((cfg.kernel_family, cfg.dq_name(dt, causal, True, True), dt))
    for headdim, rows, dt in itertools.product((64, 128), (64, 128), ("float16", "bfloat16")):
        cfg = decode_config(headdim, rows, SM90_SMEM_LIMIT, arch=90)
        paths.append((cfg.family, cfg.name_expression(dt, dt == "bfloat16", True), dt))
    return paths


def nvdisasm() -> str | None:
    """nvdisasm on the PATH, else the one the nvidia-cuda-nvdisasm wheel installs, if either."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    wheel = sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/*/bin/nvdisasm"))
    return str(wheel[-1]) if wheel else None


def disassemble(cubin: bytes, family: str, name: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        if not shutil.which("cuobjdump"):
            tool = nvdisasm()
            if tool is None:
                raise SystemExit("tools/sass_check.py: neither cuobjdump nor nvdisasm found "
                                 "(pip install nvidia-cuda-nvdisasm)")
            return subprocess.run([tool, "-c", str(path)], check=True, capture_output=True, text=True).stdout
        done = subprocess.run(["cuobjdump", "--dump-sass", str(path)], capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout
        # Taking the kernel's address instantiates it for nvcc's device pass. NVRTC's -default-device
        # makes the templates' unannotated constexpr helpers device functions; nvcc needs
        # --expt-relaxed-constexpr to call them from device code.
        source = Path(tmp) / "k.cu"
        source.write_text(cf_compile.kernel_source(family) + f"\nstatic const void* instance = (const void*)&{name};\n")
        subprocess.run(["nvcc", "-cubin", "-std=c++17", "--expt-relaxed-constexpr",
                        "-gencode=arch=compute_90a,code=sm_90a", "-o", str(path), str(source)],
                       check=True, capture_output=True, text=True)
        return subprocess.run(["cuobjdump", "--dump-sass", str(path)], check=True, capture_output=True,
                              text=True).stdout


def count_opcodes(sass: str) -> dict:
    return {op: len(re.findall(rf"\b{op}\b", sass)) for op in OPCODES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dump", metavar="DIR", help="also write each kernel's SASS to DIR")
    args = parser.parse_args(argv)
    rows, failed = [], []
    for family, name, dtype_name in fast_paths():
        report = cf_compile.compile_report(family, name, "sm_90a", keep_cubin=True)
        if not report.ok:
            failed.append(name)
            rows.append([name, "compile error"])
            continue
        try:
            sass = disassemble(report.cubin, family, name)
        except subprocess.CalledProcessError as exc:
            print(f"{name}: {' '.join(exc.cmd[:2])} failed:\n{exc.stderr[-2000:]}", file=sys.stderr)
            failed.append(name)
            continue
        if args.dump:
            safe = re.sub(r"[^A-Za-z0-9]+", "_", name)
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            (Path(args.dump) / f"{safe}.sass").write_text(sass)
        counts = count_opcodes(sass)
        wgmma = counts["QGMMA" if dtype_name == FP8_DTYPE_NAME else "HGMMA"]
        if wgmma == 0 or counts["LDL"] or counts["STL"]:
            failed.append(name)
        rows.append([name.removeprefix("cuflash::"), report.registers, *(counts[op] for op in OPCODES)])
    print(tabulate(rows, headers=["kernel", "regs", *OPCODES]))
    if failed:
        print("FAIL (no wgmma, or local memory):", *failed, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
