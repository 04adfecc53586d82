"""The SASS check of `python -m cuflash check --sass`: each Hopper fast path (forward, the backward's
dK/dV and dQ kernels, the decoding kernel's wgmma tiles) must issue wgmma (HGMMA, or QGMMA for fp8)
and touch no local memory (LDL / STL: spills, or register arrays indexed at run time, which ptxas's
spill count does not show).

The cubins that check compiles are disassembled with cuobjdump (CUDA toolkit) where there is one, else
with nvdisasm: the toolkit's, or the one the `nvidia-cuda-nvdisasm` wheel installs (the `test` extra),
so that the check needs neither a GPU nor a toolkit.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from ..config import FP8_DTYPE_NAME, SM90_SMEM_LIMIT
from ..dispatch import HEURISTIC_FP8, decode_config, hopper_bwd_plans, sm90_table_configs

OPCODES = ("HGMMA", "QGMMA", "HMMA", "LDL", "STL")


def hopper_fast_paths() -> dict[str, str]:
    """Name expression -> dtype name of each Hopper fast path: the tables' forward configs (16-bit
    and fp8, causal or not), the backward plans' dK/dV kernels (and dQ kernels where they run),
    and the decoding kernel's wgmma tiles (one and two row warpgroups) at head dims 64 and 128."""
    pairs = [(cfg, dt) for cfg in sm90_table_configs() for dt in ("float16", "bfloat16")]
    pairs += [(cfg, FP8_DTYPE_NAME) for cfg in HEURISTIC_FP8.values()]
    paths = {cfg.name_expression(dt, causal, True): dt for (cfg, dt), causal in itertools.product(pairs, (False, True))}
    for cfg, det in hopper_bwd_plans():
        atomic_dq = cfg.atomic_dq(det)
        for dt, causal in itertools.product(("float16", "bfloat16"), (False, True)):
            paths[cfg.dkdv_name(dt, causal, True, True, atomic_dq)] = dt
            if not atomic_dq:
                paths[cfg.dq_name(dt, causal, True, True)] = dt
    for headdim, rows, dt in itertools.product((64, 128), (64, 128), ("float16", "bfloat16")):
        cfg = decode_config(headdim, rows, SM90_SMEM_LIMIT, arch=90)
        paths[cfg.name_expression(dt, dt == "bfloat16", True)] = dt
    return paths


def disassembler() -> list[str] | None:
    """The command that prints a cubin's SASS (its path appended), or None where there is no tool."""
    if shutil.which("cuobjdump"):
        return ["cuobjdump", "--dump-sass"]
    found = shutil.which("nvdisasm")
    if found is None:
        wheel = sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/*/bin/nvdisasm"))
        found = str(wheel[-1]) if wheel else None
    return None if found is None else [found, "-c"]


def sass(cubin: bytes, command: list[str]) -> str:
    """The SASS of a cubin; raises CalledProcessError where the tool refuses it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([*command, str(path)], check=True, capture_output=True, text=True).stdout


def opcode_counts(text: str) -> dict[str, int]:
    return {op: len(re.findall(rf"\b{op}\b", text)) for op in OPCODES}


def failure(dtype_name: str, counts: dict[str, int]) -> str | None:
    """What is wrong with a fast path's SASS, if anything."""
    wgmma = "QGMMA" if dtype_name == FP8_DTYPE_NAME else "HGMMA"
    if counts[wgmma] == 0:
        return f"no {wgmma} (wgmma) instruction"
    if counts["LDL"] or counts["STL"]:
        return f"local memory: {counts['LDL']} LDL, {counts['STL']} STL"
    return None
