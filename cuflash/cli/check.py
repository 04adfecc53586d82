"""`python -m cuflash check`: compile every shipped kernel specialisation with
NVRTC (no GPU needed) and report registers, shared memory and spills.

Exits non-zero on any compile error, on any kernel whose wgmmas ptxas
serialised (its warning C7520: each then waits for the one before), or on any
spill or stack frame (local memory) in a kernel of a fast path: the forward
kernels at head dims 64 and 128, the Hopper forward at 192 and 256 too, the Hopper
backward (192 and 256 too), the sm_80 backward built for sm_80, and the decoding kernel at head
dims 64 and 128. Other spills are reported.

Template flags that only add code compile as their extremes, whose code holds every other
combination's, except where a combination can fail the check: score options each alone where a spill
with one of them fails (SPILL_FREE_ONE_OPTION; score_option_cases), dtype and cache layout in full at
the fast-path head dims (DECODE_FLAGS).

Each specialisation compiles for the targets dispatch's tables run it on: the
sm_80 forward and backward tiles of a head dim that a Hopper kernel serves
(`hopper_replaces`) compile for sm_80 alone. (The autotuner may still try
such a tile on Hopper: it compiles its own candidates and drops any that fail
or spill.)

With --sass it also reads the SASS of the Hopper fast paths (cuflash/cli/sass.py) and fails on one
without wgmma or with local memory.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate
from tqdm import tqdm

from .. import compile as _compile
from ..config import (COMBINE_OUT, DTYPE_NAMES, FP8_DTYPE_NAME, KERNEL_HEADDIMS, SM90_SMEM_LIMIT, BwdConfig,
                      DecodeConfig, combine_name)
from ..dispatch import (HEURISTIC_BWD, HEURISTIC_FP8, HEURISTIC_FWD, bwd_fallbacks, decode_config, hopper_bwd_headdim,
                        hopper_bwd_plans, sm90_headdim, sm90_table_configs, small_fwd_configs)
from ..dropout_mask import KERNEL_NAME as DROPOUT_MASK_KERNEL
from ..fp8 import TRANSPOSE_V_KERNEL, TRANSPOSE_V_VARLEN_KERNEL
from ..score_mods import MOD_ALIBI, MOD_DROPOUT, MOD_DROPOUT_STATE, MOD_SOFTCAP, MOD_VARLEN, MOD_WINDOW
from . import sass as _sass

FAST_PATH_HEADDIMS = (64, 128)
# The Hopper kernels' register split (setmaxnreg) assumes this allocation at
# entry; with another, a consumer warpgroup could wait forever for registers.
SM90_ENTRY_REGISTERS = _compile.cpp_int_constant("sm90_tiles.cuh", "SM90_ENTRY_REGS")
SM90_KERNELS = ("fwd_sm90_kernel", "bwd_sm90_kernel", "bwd_sm90_wide_kernel", "bwd_sm90_dq_kernel")
# Family -> the fast-path head dims whose kernels must compile without spills,
# and the targets where that holds (all where not listed).
SPILL_FREE = {"fwd_sm80": (64, 128), "fwd_sm90": (64, 128, 192, 256), "bwd_sm90": (64, 128, 192, 256),
              "bwd_sm80": (64, 128), "decode_sm80": (64, 128), "decode_sm90": (64, 128)}
SPILL_FREE_ARCHS = {"bwd_sm80": ("sm_80",)}
# Family -> the head dims whose kernels must stay spill-free with one of window, softcap and ALiBi
# too (packed or not; not with dropout): a spill there cost ALiBi half its speed under one NVRTC
# release (bench/PERFLOG.md, "ALiBi's column GEMM under NVRTC 13.5").
SPILL_FREE_ONE_OPTION = {"fwd_sm90": FAST_PATH_HEADDIMS}
# Score options compiled for every table config, in two length variants (dtype and head-dim
# evenness do not change what the options add: score_option_cases compiles the second for ALiBi
# and all options at once only). fp8 takes no ALiBi (score_option_cases masks it out).
MODS_VARIANTS = (MOD_WINDOW, MOD_SOFTCAP, MOD_ALIBI, MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI)
MODS_LENGTHS = (("bfloat16", False), ("float16", True))  # (dtype, even_n)
# Packed batches, alone and with every option (fp8: but ALiBi); their lengths are never even.
VARLEN_VARIANTS = (MOD_VARLEN, MOD_VARLEN | MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI)
# Dropout (16-bit) on every 16-bit family, as (causal, MODS): alone, and causal packed with every
# option (the one template's two extremes; each variant compiled costs CI seconds).
DROPOUT_CASES = ((False, MOD_DROPOUT), (True, MOD_DROPOUT | MOD_VARLEN | MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI),
                 (True, MOD_DROPOUT | MOD_DROPOUT_STATE))
# Score options multiply the count of specialisations (CI compiles each). Every variant above
# compiles where a spill with one option fails the check (SPILL_FREE_ONE_OPTION); elsewhere only the
# extremes do (every option at once, packed or not, and dropout's two), whose code holds every other
# variant's: there a variant could only fail to compile on its tile's shape, which the extremes share,
# and its spills would be reported, not failed (fast_path).
MODS_EXTREMES = (MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI, MOD_VARLEN | MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI)
# Kernels with score options -> the position of their MODS template argument (the decoding kernel's
# WGMMA flag follows it).
MODS_ARGUMENT = {"fwd_kernel": -1, "fwd_sm90_kernel": -1, "bwd_dkdv_kernel": -1, "bwd_dq_kernel": -1,
                 "bwd_sm90_kernel": -1, "bwd_sm90_wide_kernel": -1, "bwd_sm90_dq_kernel": -1, "decode_kernel": 8}
# (packed (query, head) rows per kv head, compute capability) that pick each decoding tile
# (decode_config): 1, 2 and 4 row warps on mma.sync; on sm_90 the wgmma tiles of 4 and 8 row warps.
DECODE_TILES = ((1, 80), (32, 80), (64, 80), (64, 90), (128, 90))
# Head dims whose decoding kernels compile with score options, every option at once (the others:
# plain and causal, the options' code being the same template at every head dim): CI's compile time
# stays in bounds.
DECODE_MODS_HEADDIMS = (64, 128, 256)
# (dtype, paged, causal) of the plain decoding kernels (CI's compile time stays in bounds: the
# kernel at head dims 64 and 128 takes 2-3.5 s a compile). At the fast-path head dims each dtype
# with one cache layout (the dtype changes conversions only, not what paging adds), causal or
# not; elsewhere the flags' two extremes, which hold each flag's code.
DECODE_FLAGS = tuple((dtype_name, paged, causal) for (dtype_name, paged), causal
                     in itertools.product((("bfloat16", True), ("float16", False)), (False, True)))
DECODE_FLAG_EXTREMES = (("bfloat16", True, True), ("float16", False, False))
# Head dims of the decoding kernels over an fp8 (e4m3) cache, which compile for sm_90 alone (the
# e4m3 conversions need sm_89): every tile with the flags of DECODE_FLAGS; the
# score options with bf16 and a paged cache at DECODE_FP8_MODS_HEADDIM (the options' code is the
# 16-bit kernels' template; CI's compile time stays in bounds).
DECODE_FP8_HEADDIMS = (64, 128)
DECODE_FP8_MODS_HEADDIM = 128


def shipped_specialisations():
    """(family, config, name expression, dynamic shared-memory bytes) of every kernel the dispatcher can launch."""
    specs = {}

    def add(cfg, name, smem, family=None):
        specs[name] = (family or cfg.family, cfg, name, smem)

    for fast, general in HEURISTIC_FWD.values():
        for dtype_name, causal in itertools.product(DTYPE_NAMES, (False, True)):
            # The fast config runs only on even lengths with d equal to its head dim.
            add(fast, fast.name_expression(dtype_name, causal, True, True), fast.smem_bytes())
            for even_n, even_d in itertools.product((True, False), repeat=2):
                add(general, general.name_expression(dtype_name, causal, even_n, even_d), general.smem_bytes())
    for cfg in HEURISTIC_BWD.values():
        # Every length/head-dim variant for the fast paths, the even ones elsewhere.
        variants = (
            list(itertools.product((True, False), repeat=2)) if cfg.headdim in FAST_PATH_HEADDIMS else [(True, True)]
        )
        for dtype_name, causal in itertools.product(DTYPE_NAMES, (False, True)):
            for even_n, even_d in variants:
                for atomic_dq in (True, False):
                    add(cfg, cfg.dkdv_name(dtype_name, causal, even_n, even_d, atomic_dq),
                        cfg.dkdv_smem_bytes(atomic_dq))
                add(cfg, cfg.dq_name(dtype_name, causal, even_n, even_d), cfg.dq_smem_bytes())
    for cfg, deterministic in hopper_bwd_plans():
        atomic_dq = cfg.atomic_dq(deterministic)
        for dtype_name, causal, even_n in itertools.product(DTYPE_NAMES, (False, True), (True, False)):
            add(cfg, cfg.dkdv_name(dtype_name, causal, even_n, True, atomic_dq),
                cfg.dkdv_smem_bytes(atomic_dq), family=cfg.kernel_family)
            if not atomic_dq:
                add(cfg, cfg.dq_name(dtype_name, causal, even_n, True), cfg.dq_smem_bytes(), family=cfg.kernel_family)
            else:
                add(cfg, cfg.dq_accum_convert_name(dtype_name), 0, family=cfg.kernel_family)
    # Fallbacks for GPUs with less shared memory: one representative variant each.
    for kd in HEURISTIC_FWD:
        for cfg in small_fwd_configs(kd):
            add(cfg, cfg.name_expression("float16", True, False, False), cfg.smem_bytes())
        for cfg in bwd_fallbacks(kd):
            add(cfg, cfg.dkdv_name("float16", True, False, False, True), cfg.dkdv_smem_bytes(True))
            add(cfg, cfg.dq_name("float16", True, False, False), cfg.dq_smem_bytes())
    sm90 = [(cfg, dtype_name) for cfg in sm90_table_configs() for dtype_name in DTYPE_NAMES]
    sm90 += [(cfg, FP8_DTYPE_NAME) for cfg in HEURISTIC_FP8.values()]
    for cfg, dtype_name in sm90:
        for causal, even_n in itertools.product((False, True), (True, False)):
            add(cfg, cfg.name_expression(dtype_name, causal, even_n), cfg.smem_bytes(dtype_name))
    for cfg, dtype_name in sm90:
        fp8 = dtype_name == FP8_DTYPE_NAME
        for causal, case_dtype_name, even_n, mods in score_option_cases(cfg.family, cfg.headdim, fp8):
            if fp8 or case_dtype_name == dtype_name:
                add(cfg, cfg.name_expression(dtype_name, causal, even_n, mods=mods),
                    cfg.smem_bytes(dtype_name, mods))
    _add_score_option_variants(add)
    _add_decode_variants(add)
    add(HEURISTIC_FP8[128], TRANSPOSE_V_KERNEL, 0, family="fp8_prep")
    add(HEURISTIC_FP8[128], TRANSPOSE_V_VARLEN_KERNEL, 0, family="fp8_prep")
    add(HEURISTIC_FP8[128], DROPOUT_MASK_KERNEL, 0, family="dropout_mask")
    any_bwd = next(iter(HEURISTIC_BWD.values()))
    for dtype_name, varlen in itertools.product(DTYPE_NAMES, (False, True)):  # row-wise helpers: no dynamic smem
        for cfg in HEURISTIC_BWD.values():  # the preprocess's lanes per row follow the head dim
            add(cfg, cfg.preprocess_name(dtype_name, varlen), 0)
        add(any_bwd, BwdConfig.convert_dq_name(dtype_name, varlen), 0)
    for cfg, deterministic in hopper_bwd_plans():
        if cfg.atomic_dq(deterministic):
            for dtype_name in DTYPE_NAMES:
                add(cfg, cfg.dq_accum_convert_name(dtype_name, True), 0, family=cfg.kernel_family)
    return list(specs.values())


def score_option_cases(family: str, headdim: int, fp8: bool = False) -> list[tuple[bool, str, bool, int]]:
    """(causal, dtype name, even_n, MODS) of the score-option specialisations compiled for a family
    at a head dim: each option, packed batches and dropout's variants where a spill with one option
    fails the check (SPILL_FREE_ONE_OPTION), elsewhere the extremes (MODS_EXTREMES). fp8 (its dtype
    is the kernel's, not the case's): the same without ALiBi and dropout, which it does not take."""
    if headdim in SPILL_FREE_ONE_OPTION.get(family, ()):
        # Each option alone in the first length variant; in both, all of them at once and ALiBi alone
        # (the Hopper forward's column GEMM, an fp16 k step beside either input dtype's).
        variants = [(MODS_LENGTHS[0], mods) for mods in MODS_VARIANTS]
        variants += [(length, mods) for length in MODS_LENGTHS[1:] for mods in (MOD_ALIBI, MODS_VARIANTS[-1])]
        variants += [(("bfloat16", False), mods) for mods in VARLEN_VARIANTS]
        dropout = DROPOUT_CASES
    else:
        variants = [(("bfloat16", False), mods) for mods in MODS_EXTREMES]
        dropout = DROPOUT_CASES[1:]
    cases = [(causal, dtype_name, even_n, mods)
             for causal, ((dtype_name, even_n), mods) in itertools.product((False, True), variants)]
    if fp8:  # ALiBi masked out; what is left of ALiBi alone is the plain kernel
        return list(dict.fromkeys((causal, dtype_name, even_n, mods & ~MOD_ALIBI)
                                  for causal, dtype_name, even_n, mods in cases if mods & ~MOD_ALIBI))
    return cases + [(causal, "float16", False, mods) for causal, mods in dropout]


def _add_score_option_variants(add) -> None:
    """The 16-bit kernels dispatch runs with score options (varlen's and dropout among them): the
    general sm_80 forward tiles, the backward tables (sm_80 and Hopper)."""
    for _, general in HEURISTIC_FWD.values():
        for causal, dtype_name, even_n, mods in score_option_cases(general.family, general.headdim):
            add(general, general.name_expression(dtype_name, causal, even_n, True, mods), general.smem_bytes())
    for cfg in HEURISTIC_BWD.values():
        for causal, dtype_name, even_n, mods in score_option_cases(cfg.family, cfg.headdim):
            add(cfg, cfg.dkdv_name(dtype_name, causal, even_n, True, True, mods), cfg.dkdv_smem_bytes(True))
            add(cfg, cfg.dq_name(dtype_name, causal, even_n, True, mods), cfg.dq_smem_bytes())
    for cfg, deterministic in hopper_bwd_plans():
        atomic_dq = cfg.atomic_dq(deterministic)
        for causal, dtype_name, even_n, mods in score_option_cases(cfg.kernel_family, cfg.headdim):
            add(cfg, cfg.dkdv_name(dtype_name, causal, even_n, True, atomic_dq, mods),
                cfg.dkdv_smem_bytes(atomic_dq), family=cfg.kernel_family)
            if not atomic_dq:
                add(cfg, cfg.dq_name(dtype_name, causal, even_n, True, mods), cfg.dq_smem_bytes(),
                    family=cfg.kernel_family)


def _add_decode_variants(add) -> None:
    """The decoding kernel at every head dim and row tile, with the flags of DECODE_FLAGS at the
    fast-path head dims and their extremes elsewhere; with every score option at once for one dtype and
    the paged cache (DECODE_MODS_HEADDIMS); over an fp8 cache (DECODE_FP8_HEADDIMS); the combine kernels."""
    for kd, (rows, arch), fp8 in itertools.product(KERNEL_HEADDIMS, DECODE_TILES, (False, True)):
        if fp8 and kd not in DECODE_FP8_HEADDIMS:
            continue
        cfg = decode_config(kd, rows, SM90_SMEM_LIMIT, fp8, arch)
        full = kd in FAST_PATH_HEADDIMS
        flags = DECODE_FLAGS if full else DECODE_FLAG_EXTREMES
        for dtype_name, paged, causal in flags:
            add(cfg, cfg.name_expression(dtype_name, paged, causal), cfg.smem_bytes())
        if kd in DECODE_MODS_HEADDIMS and (not fp8 or kd == DECODE_FP8_MODS_HEADDIM):
            for causal in (False, True):
                add(cfg, cfg.name_expression("bfloat16", True, causal, MODS_EXTREMES[0]), cfg.smem_bytes())
    for out_dtype_name in COMBINE_OUT:
        for prefetch in (False, True):
            add(cfg, combine_name(out_dtype_name, prefetch), 0, family="combine")


def score_mods_of(name: str) -> int:
    """The MODS template argument of a kernel with score options, else 0."""
    position = MODS_ARGUMENT.get(name.split("<")[0].removeprefix("cuflash::"))
    if position is None:
        return 0
    return int(name[name.index("<") + 1:name.rindex(">")].split(",")[position])


# sm_80 kernels -> the Hopper kernel head dim that replaces them on sm_90 at a kernel head dim (None: none).
HOPPER_REPLACES = {"fwd_kernel": sm90_headdim, "bwd_dkdv_kernel": hopper_bwd_headdim,
                   "bwd_dq_kernel": hopper_bwd_headdim}


def hopper_replaces(name: str, headdim: int) -> bool:
    """Whether dispatch's tables run a Hopper kernel instead of this sm_80 specialisation on sm_90 (only
    a tuned config could run it there). The sm_80 backward's row-wise kernels and the decoding
    kernel run on every target."""
    replacement = HOPPER_REPLACES.get(name.split("<")[0].removeprefix("cuflash::"))
    return replacement is not None and replacement(headdim) is not None


def targets(family: str, name: str, headdim: int, archs: list[str]) -> list[str]:
    """The targets among `archs` to compile a specialisation for."""
    tied = _compile.FAMILY_ARCH.get(family)
    if tied is not None:  # the Hopper families: sm_90a, when sm_90 is asked for
        return [tied] if any(tied.startswith(arch) for arch in archs) else []
    if DecodeConfig.reads_fp8(name):  # runs where e4m3 converts: of the targets built here, sm_90
        return [arch for arch in archs if arch.startswith("sm_90")]
    return [arch for arch in archs if not (arch.startswith("sm_90") and hopper_replaces(name, headdim))]


def fast_path(family: str, headdim: int, arch: str, mods: int = 0) -> bool:
    """Whether a kernel of this family, head dim, target and score options must be spill-free.
    Kernels with score options may spill (listed, not failed): the Hopper backward's accumulators and
    the head-dim-256 forward's leave no room for the tanh's and ALiBi's registers (docs/design.md);
    but those of SPILL_FREE_ONE_OPTION with a single one may not."""
    archs = SPILL_FREE_ARCHS.get(family)
    if headdim not in SPILL_FREE.get(family, ()) or not (archs is None or arch in archs):
        return False
    if headdim in SPILL_FREE_ONE_OPTION.get(family, ()) and not mods & (MOD_DROPOUT | MOD_DROPOUT_STATE):
        return (mods & (MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI)).bit_count() <= 1
    return not mods


def report_failure(report, fast: bool) -> str | None:
    """What fails the check in one compile report (fast: the kernel is on a fast path), if anything. A
    fast path may use no local memory: no spill, and no stack frame (a register array indexed at run
    time lives there too, and ptxas does not count it as a spill)."""
    if not report.ok:
        return f"compile error: {report.name} ({report.arch})\n{report.log}"
    if fast and (report.spills or report.stack_bytes):
        return (f"local memory on a fast path: {report.name} ({report.arch}): {report.spills} bytes of spills, "
                f"a {report.stack_bytes}-byte stack frame")
    if report.serialized_wgmma:
        return f"wgmmas serialised by ptxas (C7520): {report.name} ({report.arch})"
    if any(k in report.name for k in SM90_KERNELS) and report.registers != SM90_ENTRY_REGISTERS:
        return (f"{report.name}: {report.registers} registers at entry, the register split assumes "
                f"{SM90_ENTRY_REGISTERS}")
    return None


def _compile_one(job):
    family, name, arch, keep_cubin = job
    return _compile.compile_report(family, name, arch, keep_cubin)


def _sass_failures(reports, fast_paths: dict[str, str], command: list[str], dump: str | None) -> list[str]:
    """Each kept cubin's SASS checked (sass.failure); a table of the opcode counts; the failures."""
    rows, failures = [], []
    for report in reports:
        if not report.cubin:
            continue
        try:
            text = _sass.sass(report.cubin, command)
        except subprocess.CalledProcessError as exc:
            failures.append(f"{command[0]} could not read {report.name}: {exc.stderr.strip()[-500:]}")
            continue
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / (re.sub(r"[^A-Za-z0-9]+", "_", report.name) + ".sass")).write_text(text)
        counts = _sass.opcode_counts(text)
        wrong = _sass.failure(fast_paths[report.name], counts)
        if wrong:
            failures.append(f"SASS of {report.name}: {wrong}")
        rows.append([report.name.removeprefix("cuflash::"), report.registers, *(counts[op] for op in _sass.OPCODES)])
    print(tabulate(rows, headers=["Hopper fast path", "registers", *_sass.OPCODES]))
    print()
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash check", description=__doc__)
    parser.add_argument("--arch", action="append", help="target, e.g. sm_80 or sm_90 (repeatable; default sm_80, sm_90)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    parser.add_argument("--verbose", action="store_true", help="print every kernel, not only a summary per config")
    parser.add_argument("--sass", action="store_true",
                        help="also check the Hopper fast paths' SASS: wgmma, and no local memory (cuobjdump, or "
                             "nvdisasm: pip install nvidia-cuda-nvdisasm)")
    parser.add_argument("--sass-dump", metavar="DIR", help="with --sass, write each fast path's SASS to DIR")
    args = parser.parse_args(argv)
    archs = args.arch or ["sm_80", "sm_90"]
    command = _sass.disassembler() if args.sass else None
    if args.sass and command is None:
        parser.error("--sass needs cuobjdump or nvdisasm (pip install nvidia-cuda-nvdisasm)")
    fast_paths = _sass.hopper_fast_paths() if args.sass else {}

    specs = shipped_specialisations()
    # (family, name, target, whether to keep the cubin for the SASS check)
    jobs = sorted({(family, name, arch, name in fast_paths and arch.startswith("sm_90"))
                   for family, cfg, name, _ in specs for arch in targets(family, name, cfg.headdim, archs)})
    print(f"compiling {len(jobs)} kernel specialisations for {', '.join(archs)} with {args.jobs} processes ...",
          flush=True)
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        # imap keeps the jobs' order; the bar goes to stderr (the tables to stdout).
        reports = list(tqdm(pool.imap(_compile_one, jobs, chunksize=1), total=len(jobs), desc="compiling",
                            unit="kernel", file=sys.stderr, mininterval=5.0))

    cfg_of = {name: cfg for _, cfg, name, _ in specs}
    family_of = {name: family for family, _, name, _ in specs}
    smem_of = {name: smem for _, _, name, smem in specs}
    rows, failures = [], []
    for report in reports:
        cfg = cfg_of[report.name]
        fast = fast_path(family_of[report.name], cfg.headdim, report.arch, score_mods_of(report.name))
        failure = report_failure(report, fast)
        if failure:
            failures.append(failure)
        if args.verbose or not report.ok or report.spills or report.serialized_wgmma:
            rows.append([report.arch, report.name, report.registers, smem_of[report.name],
                         report.stack_bytes, report.spills, "yes" if report.serialized_wgmma else "",
                         "fast" if fast else ""])
    summary = {}
    for report in reports:
        kernel = report.name.split("<")[0].removeprefix("cuflash::")
        key = (report.arch, kernel, cfg_of[report.name].short_name())
        regs, spills, count = summary.get(key, (0, 0, 0))
        summary[key] = (max(regs, report.registers), max(spills, report.spills), count + 1)
    print(tabulate([[a, k, c, n, r, s] for (a, k, c), (r, s, n) in sorted(summary.items())],
                   headers=["arch", "kernel", "config", "variants", "max registers", "max spill bytes"]))
    if rows:
        print()
        print(tabulate(rows, headers=["arch", "kernel", "registers", "smem bytes", "stack", "spill bytes",
                                      "serialised wgmma", "path"]))
    print()
    if args.sass:
        unchecked = set(fast_paths) - {name for _, name, _, keep in jobs if keep}
        if "sm_90" in archs:
            failures += [f"Hopper fast path not among the shipped specialisations: {n}" for n in sorted(unchecked)]
        failures += _sass_failures(reports, fast_paths, command, args.sass_dump)
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    print(f"{len(reports)} kernels compiled, {sum(r.ok for r in reports)} ok, {len(failures)} failures")
    return 1 if failures else 0
