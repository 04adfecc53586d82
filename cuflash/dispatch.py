"""The one place that picks a kernel configuration for a problem: forward and backward.

Order: the tuning cache (through the lookup the tuning layer installs with
`set_tuned_lookup`; this module is its only reader), then the heuristic tables
below. Each row of a table carries the measurement that chose it.
"""

from __future__ import annotations

import contextlib
import dataclasses

from typing import Protocol

from .config import (DECODE_MAX_SPLITS, FP8_DTYPE_NAME, SM90_SMEM_LIMIT, BwdConfig, DecodeConfig, FwdConfig,
                     FwdSm90Config, kernel_headdim)
from .device import HOPPER
from .score_mods import NONE, ScoreMods


@dataclasses.dataclass(frozen=True)
class FwdProblem:
    """What the forward kernel choice depends on."""

    dtype_name: str
    headdim: int  # the user's head dim
    causal: bool
    seqlen_q: int
    seqlen_k: int
    group: int  # query heads per kv head
    max_smem: int = SM90_SMEM_LIMIT  # the device's opt-in shared memory per block
    arch: int = 80  # compute capability as major * 10 + minor
    mods: ScoreMods = NONE  # window, softcap, ALiBi

    @property
    def kernel_headdim(self) -> int:
        return kernel_headdim(self.headdim)


# Heuristic table: kernel head dim -> (fast config, general config). The fast
# one serves head dims equal to the kernel's and sequence lengths that are
# multiples of its block sizes; the general one everything else. Measured on an H200,
# fp16, batch*seqlen = 16k tokens, hidden 2048 (bench/PERFLOG.md):
# - d64: 128 x 64 tiles, 4 warps of 2 row tiles, Q in registers: 313 TFLOP/s at
#   8k (1.03x torch flash); 64-row tiles reach 266-275. Its uneven-length
#   causal variant spills, so the general config has 64-row tiles.
# - d128: the same tiles with Q re-read from shared memory (Q in registers
#   spills): 343-362 TFLOP/s (1.02x flash); 64-row tiles 288. Its uneven
#   variants spill (row/column predicates on the loads), so the general config
#   has 64-row tiles, which compile without spills.
# - other head dims: the largest tiles that compile without spills.
HEURISTIC_FWD = {
    32: (FwdConfig(32, 64, 4, 2, 2), FwdConfig(32, 64, 4, 2, 2)),
    64: (FwdConfig(64, 64, 4, 2, 2), FwdConfig(64, 64, 4, 1, 2)),
    96: (FwdConfig(96, 64, 4, 1, 2), FwdConfig(96, 64, 4, 1, 2)),
    128: (FwdConfig(128, 64, 4, 2, 2, q_in_regs=False), FwdConfig(128, 64, 4, 1, 2)),
    160: (FwdConfig(160, 64, 4, 1, 2, q_in_regs=False), FwdConfig(160, 32, 4, 1, 2, q_in_regs=False)),
    192: (FwdConfig(192, 32, 4, 1, 2, q_in_regs=False), FwdConfig(192, 32, 4, 1, 2, q_in_regs=False)),
    224: (FwdConfig(224, 32, 4, 1, 2, q_in_regs=False), FwdConfig(224, 32, 4, 1, 2, q_in_regs=False)),
    256: (FwdConfig(256, 64, 4, 1, 2, q_in_regs=False), FwdConfig(256, 64, 4, 1, 2, q_in_regs=False)),
}

class TunedLookup(Protocol):
    """The tuning cache as dispatch reads it (cuflash.tuning installs one), for problems whose
    options the autotuner measures (ScoreMods.tuned)."""

    def fwd(self, problem: FwdProblem) -> FwdConfig | FwdSm90Config | None: ...

    def bwd(self, problem: BwdProblem) -> BwdConfig | None: ...

    def state(self): ...  # what the answers depend on besides the problem (the cache's generation)


_tuned: TunedLookup | None = None
_cache_enabled = True


def set_tuned_lookup(lookup: TunedLookup | None) -> None:
    global _tuned
    _tuned = lookup


def cache_state() -> tuple:
    """What a choice depends on besides the problem: the switch, the lookup and its cache's state
    (part of the launch-plan keys of the entry points)."""
    return _cache_enabled, _tuned, _tuned.state() if _tuned is not None else None


@contextlib.contextmanager
def heuristic_only():
    """Within the block the choices ignore the tuning cache (the benchmark compares the two)."""
    global _cache_enabled
    saved, _cache_enabled = _cache_enabled, False
    try:
        yield
    finally:
        _cache_enabled = saved


# Hopper (compute capability 9.0 exactly: wgmma is sm_90a-only), kernel head
# dim -> config. Measured on an H200, fp16, 16k tokens, hidden 2048, N = 8k
# (bench/PERFLOG.md, bench/sweep.py): hdim 128 with 128-key tiles, 2 stages,
# persistent: 612-648 TFLOP/s at 2k-16k (0.98-1.01x cuDNN); 3 stages and one
# CTA per tile within the noise (+-5%), 64-key tiles 15-20% slower. hdim 64:
# 192-key tiles, 3 stages: 445 at 8k against 413 with 128-key tiles (+4-8% at
# 2k-16k, both masks). hdim 256 (bf16): 649-716 (0.92-0.98x cuDNN), against
# 221 for the sm_80 kernel; 80-key tiles (the widest whose two stages fit):
# +3-5% over 64 at 2k and 8k, both masks, in an interleaved A/B; in the
# benchmark 681-702 non-causal and 438-657 causal. A later same-run A/B with
# rotating order (H100) confirmed 80 over 64 keys on every row, causal 2k
# included (493 against 481).
# hdim 192 (bf16, H200, bench/sweep.py, same-run against torch): 112-key tiles,
# output from registers (three stages or a staged tile do not fit): 8k 768
# non-causal, 700 causal (1.18x, 1.25x cuDNN), against 580 / 483 on the 256
# kernel with zero-filled columns; 80- and 96-key tiles 6-9% slower at 8k.
# The output tile staged in shared memory for bulk tensor stores (stage_o),
# same-run A/B on an H100: hdim 128 +4-9% at 2k, +0-2% at 8k-16k; hdim 64
# with 192-key tiles 1-4% slower, so that one stores from registers; hdim 256
# has no room for it.
HEURISTIC_SM90 = {
    64: FwdSm90Config(64, 192, 3, stage_o=False),
    128: FwdSm90Config(128, 128, 2),
    192: FwdSm90Config(192, 112, 2, stage_o=False),
    256: FwdSm90Config(256, 80, 2, stage_o=False),
}

# Short key sequences: kernel head dim -> (config, longest seqlen_k by
# (causal, ALiBi)). Head dim 64: 128-key tiles without ping-pong,
# output staged. Kernel times against the table's config (ncu at locked
# clocks, H100): at 1k 6% shorter non-causal and 11% shorter causal; at 2k
# 5% longer non-causal and 3.5% shorter causal; at 4k 7% longer non-causal
# and equal causal. Causal calls timed at the GPU's own clocks (same process,
# forced configs, H100, fp16 and bf16, 16k and 64k tokens; bench/PERFLOG.md,
# "The short-key tiles for causal calls"): short over table time 0.93 at 2k,
# 0.95 at 3k, 0.96-0.97 at 4k, 0.97-0.98 at 6k, 0.99-1.00 at 8k. With ALiBi
# the 192-key tiles' diagonal blocks (each score its own distance) and partial
# last block weigh more: short over table time (same process, forced configs,
# H100, 16k tokens, fp16 and bf16; bench/PERFLOG.md, "ALiBi at head dim 64:
# the short-key tiles") 0.85-0.88 at 1k, 0.93-0.94 at 2k, 0.97-0.99 at 4k,
# 0.99-1.03 at 8k.
# Head dim 192: 80-key tiles with the output staged (bf16, H200, bench/sweep.py,
# each length in one run): non-causal / causal 672 / 574 at 2k against 650 / 529
# for the table's 112-key tiles, 710 / 642 at 4k against 743 / 625, 722 / 660 at
# 8k against 768 / 700. ALiBi (no column GEMM at 192) follows the plain calls.
SM90_SHORT_KEYS = {64: (FwdSm90Config(64, 128, 3, pingpong=False),
                        {(False, False): 1024, (True, False): 6144, (False, True): 4096, (True, True): 6144}),
                   192: (FwdSm90Config(192, 80, 2),
                         {(False, False): 2048, (True, False): 4096, (False, True): 2048, (True, True): 4096})}


# With dropout, kernel head dim -> config at every key length. Head dim 64: the short-key tiles
# (128 keys, no ping-pong). Forward with dropout 0.1 over the plain forward's time, same process,
# H100, fp16, 16k tokens, hidden 2048 (bench/PERFLOG.md, "Dropout: the head-dim-64 tile"): 1.42-1.52
# at 2k and 8k, both masks, against 1.42-1.59 on the table's 192-key ping-pong tiles. Head dim 128:
# the table's tiles (without ping-pong -6% to +3% of them in two runs, no sign that held).
SM90_DROPOUT = {64: SM90_SHORT_KEYS[64][0]}


def sm90_table_configs() -> list[FwdSm90Config]:
    """Every 16-bit Hopper config the tables choose (for the compile and SASS checks)."""
    configs = list(HEURISTIC_SM90.values()) + [cfg for cfg, _ in SM90_SHORT_KEYS.values()]
    return configs + [cfg for cfg in SM90_DROPOUT.values() if cfg not in configs]


def heuristic_sm90_config(kernel_headdim: int, seqlen_k: int, causal: bool,
                          dropout: bool = False, alibi: bool = False) -> FwdSm90Config | None:
    """The Hopper table's config for a kernel head dim, key length, mask, dropout and ALiBi, if it has one."""
    headdim = sm90_headdim(kernel_headdim)
    if dropout and headdim in SM90_DROPOUT:
        return SM90_DROPOUT[headdim]
    if headdim in SM90_SHORT_KEYS:
        short, longest = SM90_SHORT_KEYS[headdim]
        if seqlen_k <= longest[causal, alibi]:
            return short
    return HEURISTIC_SM90.get(headdim)


# Kernel head dims without a Hopper kernel of their own -> the Hopper kernel
# that serves them (its extra columns zero-filled by the tensor-map copies), in
# the forward and the backward alike (hopper_bwd_headdim). Forward, measured on an H200 (bench/sweep.py, fp16, 2k and 8k, both masks): d96 on
# the 128 kernel 320-489 TFLOP/s against 205-244 for the sm_80 kernel; d224
# on the 256 kernel, d160 on the 192 kernel (bf16, H200: 2k 595 / 495, 8k 670 /
# 608 non-causal / causal, against 485-501 / 355-412 on the 256 kernel). d32
# stays on the sm_80 kernel: the 64 kernel was 178-239 against 193-231, no
# faster. Backward, head dim 160 on the 192 kernels, fwd+bwd (bf16, H200, 2k and
# 8k, both masks): 339-418 TFLOP/s, against 258-325 on the 256 kernels and 215-259
# on the sm_80 160 kernels.
SM90_PADDED = {96: 128, 160: 192, 224: 256}


def sm90_headdim(kernel_headdim: int) -> int | None:
    """The Hopper kernel head dim that serves a kernel head dim, if any."""
    if kernel_headdim in HEURISTIC_SM90:
        return kernel_headdim
    return SM90_PADDED.get(kernel_headdim)


# fp8 (Hopper only): kernel head dim -> config; head dims up to 128 run on the
# 128 kernel (zero-filled columns), larger ones on the 256 kernel. Measured on
# an H100 (bench/PERFLOG.md v17, V transpose included, 8k-16k, same-run A/B
# with rotating order): at head dim 128, 192-key tiles with 2 stages, the
# output staged, no ping-pong; 3 stages and ping-pong each within +-4% of it
# (the sign changed between runs); 128-key tiles 2-11% slower (v11); 256
# keys do not fit the consumers' registers.
# Head dim 256: 128-key tiles with 2 stages, output staged: 1153 at 8k
# against 1058 without.
HEURISTIC_FP8 = {
    128: FwdSm90Config(128, 192, 2, pingpong=False),
    256: FwdSm90Config(256, 128, 2),
}


def fp8_config(problem: FwdProblem) -> FwdSm90Config:
    if problem.arch != HOPPER:
        raise RuntimeError("cuflash: fp8 attention needs a Hopper GPU (compute capability 9.0)")
    cfg = HEURISTIC_FP8[128 if problem.headdim <= 128 else 256]
    if cfg.smem_bytes(FP8_DTYPE_NAME) > problem.max_smem:
        raise RuntimeError(f"cuflash: the fp8 kernel needs {cfg.smem_bytes(FP8_DTYPE_NAME)} bytes of shared memory "
                           f"per block; the device has {problem.max_smem}")
    return cfg


def small_fwd_configs(kd: int) -> tuple[FwdConfig, ...]:
    """Fallbacks for GPUs with less shared memory per block than Hopper or A100 (e.g. 99 KB on sm_86/89)."""
    return (FwdConfig(kd, 32, 4, 1, 2, q_in_regs=False), FwdConfig(kd, 16, 4, 1, 2, q_in_regs=False))


def heuristic_fwd_config(problem: FwdProblem) -> FwdConfig | FwdSm90Config:
    if problem.dtype_name == FP8_DTYPE_NAME:
        return fp8_config(problem)
    sm90 = (heuristic_sm90_config(problem.kernel_headdim, problem.seqlen_k, problem.causal,
                                  problem.mods.dropout is not None, problem.mods.alibi)
            if problem.arch == HOPPER else None)
    if sm90 is not None and sm90.smem_bytes(problem.dtype_name, problem.mods.bits) <= problem.max_smem:
        return sm90
    fast, general = HEURISTIC_FWD[problem.kernel_headdim]
    # The fast d128 tiles spill with the score options (up to 424 bytes, window); the general ones do not.
    even = (
        not problem.mods.bits
        and problem.headdim == fast.headdim
        and problem.seqlen_q % fast.block_m == 0
        and problem.seqlen_k % fast.block_n == 0
    )
    choices = ((fast,) if even else ()) + (general,) + small_fwd_configs(problem.kernel_headdim)
    for cfg in choices:
        if cfg.smem_bytes() <= problem.max_smem:
            return cfg
    raise RuntimeError(
        f"cuflash: no forward kernel for head dim {problem.headdim} fits in {problem.max_smem} bytes of shared memory"
    )


def fwd_config(problem: FwdProblem) -> tuple[FwdConfig | FwdSm90Config, str]:
    """The forward config to run and where it came from ("cache" or "heuristic")."""
    if _tuned is not None and _cache_enabled and problem.mods.tuned:
        cfg = _tuned.fwd(problem)
        if cfg is not None:
            return cfg, "cache"
    return heuristic_fwd_config(problem), "heuristic"


# ---------------------------------------------------------------- backward

# Kernel head dim -> sm_80 backward tiles, the fast path on GPUs before Hopper.
# Measured on an H200 (the sm_80 kernels there), fwd+bwd, fp16, 16k tokens,
# hidden 2048, seqlen 2k / 8k, against torch SDPA flash in the same run
# (bench/PERFLOG.md, bench/bwd_sweep.py):
# - d64: 128 query rows x 128 keys, 8 warps: 0.92-0.93x non-causal, 0.83-0.90x
#   causal; the 64 x 64, 4-warp tile 0.83-0.85x.
# - d128: 64 x 128, 8 warps: 0.91-0.92x non-causal, 0.89-0.91x causal;
#   128 x 128: 0.92-0.93x non-causal but 0.86-0.87x causal.
# Holding all of a block's scores next to the dK and dV accumulators spills
# (up to 240 bytes at d64, 40 at d128); holding 64 (d64) or 32 (d128) queries'
# scores at a time (dkdv_chunk_m) is spill-free for every variant on sm_80 and
# measured 2-9% (d64) and 9-12% (d128) slower on the H200. The table takes the
# spill-free tiles (the autotuner also tries the whole block); the fallbacks
# for smaller shared memories are chunked likewise.
# - other head dims: unmeasured; tiles that fit the shared memory.
# On compute capability 9.0 the Hopper kernels below replace the dK/dV tiles
# at head dims 33-256.
HEURISTIC_BWD = {
    32: BwdConfig(32, 128, 8, 4, 64),
    64: BwdConfig(64, 128, 8, 4, 64, dkdv_chunk_m=64),
    96: BwdConfig(96, 64, 8, 4, 64),
    128: BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=32),
    160: BwdConfig(160, 32, 4, 4, 32),
    192: BwdConfig(192, 32, 4, 4, 32),
    224: BwdConfig(224, 32, 4, 4, 32),
    256: BwdConfig(256, 32, 4, 4, 32),
}


# Kernel head dim -> the Hopper backward kernels (cuda_src/bwd_sm90.cuh), used
# on compute capability 9.0. Measured on an H200 (bench/bwd_sweep.py, fwd+bwd, fp16, 2k and 8k;
# bench/PERFLOG.md): 1.3-1.6x the sm_80 dK/dV tiles; 3 stages +2-5% over 2 at
# head dim 128; at head dim 64 only 2 fit beside the dS and dQ tiles. Head dims
# 192 and 256: the wide dK/dV kernel (bwd_sm90_wide.cuh; two stages) and the dQ
# kernel. At 192 (bf16, H200, fwd+bwd, same run): 464-489 TFLOP/s non-causal and
# 395-465 causal at 2k-8k (1.22-1.30x cuDNN), against 346-383 on the 256 kernel
# with zero-filled columns; the dQ kernel's 64-key steps 6-10% faster than 32.
HEURISTIC_BWD_SM90 = {
    kd: BwdConfig(kd, block_m, 8, 8, BwdConfig.HOPPER_DQ_BLOCK_N[kd], stages=stages, hopper=True)
    for kd, block_m, stages in ((64, 128, 2), (128, 64, 3), (192, 64, 2), (256, 64, 2))
}


def hopper_bwd_headdim(kd: int) -> int | None:
    """The Hopper dK/dV kernel's head dim for kernel head dim `kd`, or None if it has none."""
    return kd if kd in BwdConfig.HOPPER_BLOCK_M else SM90_PADDED.get(kd)


def bwd_fallbacks(kd: int) -> tuple[BwdConfig, ...]:
    """Smaller tiles for GPUs with less shared memory per block than Hopper (A100: 163 KB, sm_86/89: 99 KB)."""
    # 16-query chunks in the first: with 32 its d128 causal dK/dV kernel spilled 12-44 bytes on sm_80.
    return (BwdConfig(kd, 64, 4, 4, 64, dkdv_chunk_m=16), BwdConfig(kd, 32, 4, 4, 32, dkdv_chunk_m=16),
            BwdConfig(kd, 32, 2, 2, 16, dkdv_chunk_m=16))


@dataclasses.dataclass(frozen=True)
class BwdProblem:
    """What the backward kernel choice depends on."""

    dtype_name: str
    headdim: int  # the user's head dim
    causal: bool
    seqlen_q: int
    seqlen_k: int
    group: int  # query heads per kv head
    deterministic: bool
    max_smem: int = SM90_SMEM_LIMIT  # the device's opt-in shared memory per block
    arch: int = 80  # compute capability as major * 10 + minor
    mods: ScoreMods = NONE  # window, softcap, ALiBi

    @property
    def kernel_headdim(self) -> int:
        return kernel_headdim(self.headdim)


def fits(cfg: BwdConfig, max_smem: int) -> bool:
    return cfg.smem_bytes() <= max_smem


def hopper_bwd_config(kd: int, arch: int) -> BwdConfig | None:
    """The Hopper backward's table config for kernel head dim `kd`, or None where the sm_80 kernels run."""
    return HEURISTIC_BWD_SM90.get(hopper_bwd_headdim(kd)) if arch == HOPPER else None


def bwd_tiles(headdim: int, max_smem: int, arch: int = 80, deterministic: bool = False) -> BwdConfig:
    """The Hopper kernels on compute capability 9.0 where they have the head dim; else the sm_80
    table's tiles, or smaller ones where the device has less shared memory per block."""
    hopper = hopper_bwd_config(kernel_headdim(headdim), arch)
    if hopper is not None and fits(hopper, max_smem):
        # Deterministic mode (dK/dV, then the dQ kernel) measured 2-10% faster
        # with 2 stages than with 3 at head dim 128 (bench/bwd_sweep.py).
        return dataclasses.replace(hopper, stages=2) if deterministic else hopper
    kd = kernel_headdim(headdim)
    for cfg in (HEURISTIC_BWD[kd], *bwd_fallbacks(kd)):
        if fits(cfg, max_smem):
            return cfg
    raise RuntimeError(f"cuflash: no backward kernel for head dim {headdim} fits in {max_smem} bytes of shared memory")


def hopper_bwd_plans() -> list[tuple[BwdConfig, bool]]:
    """(config, deterministic) of every Hopper backward the heuristic can pick: what check compiles."""
    return [(bwd_tiles(kd, SM90_SMEM_LIMIT, HOPPER, det), det) for kd in HEURISTIC_BWD_SM90 for det in (False, True)]


def heuristic_bwd_config(problem: BwdProblem) -> BwdConfig:
    return bwd_tiles(problem.headdim, problem.max_smem, problem.arch, problem.deterministic)


def bwd_config(problem: BwdProblem) -> tuple[BwdConfig, str]:
    """The backward config to run and where it came from ("cache" or "heuristic")."""
    if _tuned is not None and _cache_enabled and problem.mods.tuned:
        cfg = _tuned.bwd(problem)
        if cfg is not None:
            return cfg, "cache"
    return heuristic_bwd_config(problem), "heuristic"


# ---------------------------------------------------------------- decoding over a KV cache

# Bytes of K/V tiles the decoding kernel keeps in its cp.async ring: (stages - 1)
# x 64 keys x K and V in flight while a stage is computed. Measured on an H100,
# fp16, head dim 128 (3 stages at 96 KB, 2 CTAs an SM): GQA batch 8 8k 2518 GB/s
# against 2069 / 2399 / 2095 for rings of 64 / 128 / 192 KB; GQA batch 1 128k
# 2503 against 2055 / 2481 / 2280; MHA batch 8 8k 3010 against 3080 / 2954 / 2717.
DECODE_RING_BYTES = 96 * 1024
# The same for an e4m3 cache, whose shared memory also holds the widened 16-bit V tile: 48 KB (3
# stages at head dim 128, 68 KB a CTA) keeps three CTAs on an SM, whose extra warps hide the
# widening's latency. Same run, H100, head dim 128, fp8 GB/s against 64 KB (4 stages, 2 CTAs):
# MHA batch 8 8k 2557 / 2575, GQA batch 8 8k 2072 / 2044, GQA batch 1 128k 2267 / 2271, MQA batch 64
# 8k 1611 / 1326; GQA batch 64 8k (512 CTAs, no split) 2246 / 2614, a wave-count effect.
DECODE_RING_BYTES_FP8 = 48 * 1024
# One row warp per stage's 64 keys holds 16 x 64 scores next to its 16 x D output: past head dim 160
# that spills (head dim 256: 48 bytes), so larger head dims keep two row warps.
MAX_HEADDIM_4_ROW_WARPS = 160
# Warps per SM that keep an H100's memory system busy streaming a cache: two 4-warp CTAs, or one of
# 8 warps. Tiles of 17-32 rows (MQA; GQA groups of 4 over 8 queries) take 8 warps, 2 on the rows by
# 4 on each stage's keys, one CTA an SM, where 4 warps (2 by 2) ran 2 CTAs an SM with twice the
# splits. Same-run A/B (bench/PERFLOG.md), H100, fp16, head dim 128, best of 3 rounds, GB/s of
# cache read (copy rate 2975): MQA batch 64 8k 2574 (2 splits) against 2345 (4 splits); MQA batch 8
# 128k 2810 (16) against 2611 (32); GQA 8 queries, batch 8 8k 2629 (2) against 2358 (4).
DECODE_WARPS_PER_SM = 8
# ... but over a 16-bit cache the mma.sync tiles count one CTA an SM: the 4-warp 16-row tiles' steps of
# fewer row blocks than SMs, split into half as many CTAs, ran faster (fewer partials to merge, and the
# memory pipes no emptier). Same process, H100, fp16, head dim 128, graph replays, 32 query heads
# (bench/results/decode_slots_ab_h100.txt): 32 on 8 batch 1 32k 53.0 -> 51.0 us, 128k 182.4 -> 179.5,
# batch 8 8k 94.0 -> 93.1; 32 on 4 batch 2 64k 102.6 -> 97.9, batch 1 128k 103.1 -> 100.4; 32 on 2
# batch 4 64k 113.6 -> 104.2; MHA batch 1 8k 50.6 -> 49.7, 32k 180.3 -> 178.2; the other steps the same
# plans. Over an e4m3 cache the same halving ran 1.10-1.30x slower (its widening wants the warps).
DECODE_WARPS_PER_SM_16BIT = 4
# The 8-warp tile's merge of its warps' outputs (4 x 32 rows x (D + 2) floats) fits its K/V ring
# up to this head dim. Over an fp8 cache 32-row tiles keep 4 warps, three CTAs an SM: MQA batch 64
# 8k 83 us against 101 with 8 warps (H100, head dim 128, same run; bench/PERFLOG.md).
MAX_HEADDIM_8_WARPS = 128
# Key blocks (of 64 keys) a split takes at least: fewer, and the split's
# pipeline fill and its row of the combine cost more than its keys.
MIN_BLOCKS_PER_SPLIT = 4
# How full the last wave of split CTAs must be, relative to the fullest choice. FlashDecoding's
# 0.85 left SMs idle: MQA batch 8 and GQA batch 1, 128k cache (8 CTAs before splitting, 264 resident
# on an H100) took 29 splits (232 CTAs) and ran at 2505 (MQA) and 2590 GB/s (GQA) against 2608 and
# 2752 with 32 (256 CTAs); same run, fp16, head dim 128.
SPLIT_WAVE_EFFICIENCY = 0.95


# Hopper (compute capability 9.0): over a 16-bit cache at head dims 64 and 128, tiles of more than
# 32 rows per kv head run their GEMMs on wgmma (decode_sm90: one warpgroup for up to 64 rows, two
# for more), the query rows that share a kv head being many enough for the tensor cores to matter.
# Same-run A/B against the mma.sync tiles (bench/PERFLOG.md, "wgmma"), H100, causal, device time of
# CUDA-graph replays, us: MQA (32 heads on 1, head dim 128) batch 8 8k Nq 2 38.6 -> 33.2, Nq 8
# 50.8 -> 39.7, Nq 16 80.1 -> 59.9, batch 64 Nq 8 249.6 -> 171.2; GQA 32 on 4, Nq 16 83.4 -> 72.6;
# a paged chunked prefill (4 x 512 queries over 4k keys, 32 heads on 8) 502.6 -> 365.9.
WGMMA_MIN_ROWS = 33
# The wgmma tiles' ring: 4 stages at head dim 128, a block more than DECODE_RING_BYTES, since a key
# step keeps the block before it in use (its P V runs under the step's softmax). Same run, 3 stages:
# 35.9, 41.7, 61.7, 179.7, 73.3 and 368.9 us in the rows above.
DECODE_RING_BYTES_WGMMA = 128 * 1024


# ... except in small steps: there the wgmma tiles' fixed costs (a 64- or 128-row chain a CTA, the
# splits merged through global memory by a second kernel) outweigh their tensor cores, and the 32-row
# mma.sync tile (8 warps, its splits merged in thread-block clusters) runs the rows as row blocks of 32.
# A step's size: its 32-row x 64-key units of work per SM, batch x kv heads x ceil(rows / 32) x key
# blocks / SMs. Same process, H100, device time of CUDA-graph replays, 32 query heads on 1, 2 or 4,
# causal, Nq 2-16 (bench/PERFLOG.md, "The 32-row tile for small steps"); 32-row tile over wgmma time:
# - fp16, head dim 128, batch 1-16, caches of 1k-16k (225 steps): up to 8 units an SM 0.47-0.95 on every
#   step (MQA batch 1 1k Nq 8 17.8 -> 8.6 us); at 15.5 units 0.72-1.00 with 64 rows a kv head, 0.76-1.08
#   with 128, 0.80-1.15 with more; at 31 units 0.84-1.00 with 64 rows, 1.04-1.46 with more; at 62 and
#   more 0.96-3.2;
# - 44 steps of head dim 64, bf16, pages of 16 and new keys with rotary: up to 8 units 0.48-0.99; at
#   15.5 and 31 units with 64 rows a kv head 0.81-1.03 at head dim 128, 0.89-1.19 at 64; 128 rows at
#   15.5 units 0.99-1.24.
# So the tile takes steps of up to SMALL_STEP_UNITS_PER_SM units an SM, and at head dim 128 with one
# warpgroup's rows (64) up to WIDE_SMALL_STEP_UNITS_PER_SM.
SMALL_STEP_UNITS_PER_SM = 8
WIDE_SMALL_STEP_UNITS_PER_SM = 32
_small_step_tiles = True


def decode_small_step(kernel_headdim: int, rows: int, kv_blocks_per_sm: float) -> bool:
    """Whether a Hopper step of `rows` (> 32) packed rows a kv head over kv_blocks_per_sm 64-key cache
    blocks (of one batch and kv head) per SM runs on the 32-row mma.sync tile rather than the wgmma tiles."""
    units = kv_blocks_per_sm * -(-rows // 32)
    wide = kernel_headdim == 128 and rows <= 64
    return _small_step_tiles and units <= (WIDE_SMALL_STEP_UNITS_PER_SM if wide else SMALL_STEP_UNITS_PER_SM)


def small_step_tiles() -> bool:
    """Whether small steps take the 32-row tile (part of the decoding launch plans' keys)."""
    return _small_step_tiles


@contextlib.contextmanager
def large_step_tiles():
    """Within the block every decoding step takes the tiles of large steps (on Hopper the wgmma tiles),
    whatever its size: the tests of those tiles run small steps."""
    global _small_step_tiles
    saved, _small_step_tiles = _small_step_tiles, False
    try:
        yield
    finally:
        _small_step_tiles = saved


def decode_config(headdim: int, rows: int, max_smem: int, fp8: bool = False, arch: int = 80,
                  kv_blocks_per_sm: float = float("inf")) -> DecodeConfig:
    """The decoding kernel's tiles for `rows` packed (query, head) rows per kv head (fp8: an e4m3
    cache) on a GPU of compute capability `arch` (major * 10 + minor), for a step of kv_blocks_per_sm
    64-key blocks of cache (of one batch and kv head) per SM (decode_small_step; by default a large step)."""
    kd = kernel_headdim(headdim)
    takes_wgmma = (arch == HOPPER and not fp8 and rows >= WGMMA_MIN_ROWS and kd % 64 == 0
                   and kd <= MAX_HEADDIM_4_ROW_WARPS)
    if takes_wgmma and decode_small_step(kd, rows, kv_blocks_per_sm):
        rows, takes_wgmma = 32, False  # the 32-row tile, ceil(rows / 32) row blocks of it
    per_stage = 2 * DecodeConfig.BLOCK_N * kd * (1 if fp8 else 2)
    warps_m = 1 if rows <= 16 else (2 if rows <= 32 or kd > MAX_HEADDIM_4_ROW_WARPS else 4)
    warps_n = 4 if warps_m == 2 and kd <= MAX_HEADDIM_8_WARPS and not fp8 else 4 // warps_m
    ring = DECODE_RING_BYTES_FP8 if fp8 else DECODE_RING_BYTES
    # (row warps, key warps, wgmma, ring bytes) in order of preference. Where the preferred tile does
    # not fit (small shared memory: 99 KB on sm_86/89), fewer stages, then 4 warps, then fewer row warps.
    tiles = [(warps_m, warps_n, False, ring), (warps_m, 4 // warps_m, False, ring),
             *((m, 4 // m, False, ring) for m in (2, 1) if m < warps_m)]
    if takes_wgmma:
        tiles[:0] = [(m, 1, True, DECODE_RING_BYTES_WGMMA) for m in ((8, 4) if rows > 64 else (4,))]
    for m, n, wgmma, ring_bytes in tiles:
        for s in range(max(2, min(8, ring_bytes // per_stage)), 1, -1):
            cfg = DecodeConfig(kd, m, n, s, fp8, wgmma)
            if cfg.is_valid() and cfg.smem_bytes() <= max_smem:  # is_valid: wgmma tiles keep 3 stages at least
                return cfg
    raise RuntimeError(f"cuflash: no decoding kernel for head dim {headdim} fits in {max_smem} bytes of shared memory")


# A short cache's step of 17-32 packed rows a kv head (MQA's one query, GQA's 8 on 8 kv heads) whose
# 32-row tile splits its keys in two runs instead as two row blocks of the 16-row tile where those fit
# one wave: twice the CTAs, each with half the rows, and one split or two where there were two (a
# split's merge costs more than its keys here). Same process, H100, fp16, head dim 128, 32 query heads,
# device time of CUDA-graph replays, new / old time (bench/decode_halved_rows_ab.py; bench/PERFLOG.md,
# "Two row blocks of the 16-row tile"): 1k caches 0.887-0.924 (MQA batch 64 20.4 -> 18.1 us, GQA batch
# 8 with 8 queries 20.2 -> 18.7), over pages of 16 0.93-1.02; forced on 8k and longer caches 1.01-1.20
# (each row block reads the keys again), on steps of 8 splits a row block 1.00-1.02, on steps that
# would split in four 1.6.
HALVED_ROWS_MAX_KEY_BLOCKS = 16
HALVED_ROWS_MAX_SPLITS = 2


def decode_halves_rows(cfg: DecodeConfig, rows: int, key_blocks: int, splits: int, arch: int) -> bool:
    """Whether a Hopper step of `rows` packed rows a kv head over `key_blocks` key blocks, planned on `cfg`
    with `splits` splits, is one that two row blocks of the 16-row tile may take; the planner takes them
    where their own plan fits one wave. (Measured on Hopper only, where the 32-row plan's two splits
    merge in clusters; elsewhere they merge through the combine kernel.)"""
    return (arch == HOPPER and cfg.block_m == 32 and not cfg.wgmma and not cfg.fp8 and 16 < rows
            and key_blocks <= HALVED_ROWS_MAX_KEY_BLOCKS and 1 < splits <= HALVED_ROWS_MAX_SPLITS)


def decode_slots(cfg: DecodeConfig, resident_per_sm: int, sms: int) -> int:
    """CTAs of `cfg` that fill the GPU's memory pipes: per SM, as many as bring DECODE_WARPS_PER_SM
    warps (DECODE_WARPS_PER_SM_16BIT for the mma.sync tiles over a 16-bit cache), at least one, at most
    `resident_per_sm` (what shared memory lets reside)."""
    warps = cfg.warps_m * cfg.warps_n
    per_sm = DECODE_WARPS_PER_SM_16BIT if not cfg.fp8 and not cfg.wgmma else DECODE_WARPS_PER_SM
    return sms * max(1, min(resident_per_sm, per_sm // warps))


# ... and where a step's row blocks fill at least half the SMs over a 16-bit cache, it runs unsplit:
# one CTA an SM reads more than its SM's share of the copy rate (GQA 32 on 8, batch 9, 4k: 72 CTAs of
# the 16-row tile read 2.8 TB/s), so idle SMs cost less than splits and their merge. Same process,
# H100, fp16, head dim 128, 32 query heads, graph replays, unsplit / decode_splits' time on 72-120 row
# blocks over 1k-32k caches (bench/decode_split_free_ab.py; bench/PERFLOG.md, "Steps of half the SMs or
# more run unsplit"): 16-row tile 0.64-0.99 (32 on 2 batch 48 1k 35.1 -> 22.6 us), 32-row tile
# 0.64-0.84 (MQA batch 120 4k 125.6 -> 88.8, torch-cudnn 89.4), wgmma tiles 0.42-0.99 (MQA batch 120
# 4k with 4 causal queries 230.3 -> 97.6); with one query 1.01-1.70x torch-cudnn's time before,
# 0.99-1.12x after. Over pages of 16 the same but for the 16-row tile's long caches, whose copies cost
# more a block (their page ids) and want the splits' SMs (batch 9 32k 408.8 -> 470.0 us, 1.15; 4k-8k
# 0.95-1.01; 1k 0.68-0.92; ..._paged_unlimited_ab_h100.txt): it runs unsplit up to
# SPLIT_FREE_PAGED_16_ROWS_MAX_BLOCKS key blocks. Over an e4m3 cache (half the bytes a block) unsplit
# ran 0.81-2.08x the time: its steps keep the splits.
SPLIT_FREE_SM_SHARE = 0.5
SPLIT_FREE_PAGED_16_ROWS_MAX_BLOCKS = 64


def decode_split_free(cfg: DecodeConfig, ctas: int, sms: int, key_blocks: int, paged: bool) -> bool:
    """Whether a step of `ctas` row blocks of `key_blocks` key blocks on `cfg` runs unsplit (see
    SPLIT_FREE_SM_SHARE): over a 16-bit cache, at least that share of the SMs; over a paged cache the
    16-row tile up to SPLIT_FREE_PAGED_16_ROWS_MAX_BLOCKS key blocks."""
    if cfg.fp8 or ctas < SPLIT_FREE_SM_SHARE * sms:
        return False
    return not (paged and cfg.block_m <= 16 and key_blocks > SPLIT_FREE_PAGED_16_ROWS_MAX_BLOCKS)


# The wgmma tiles (8-12 warps, one CTA an SM) below that share split as many ways as fit one wave
# (slots // ctas, at least MIN_BLOCKS_PER_SPLIT key blocks a split; of those counts the fewest with the
# same longest split): the wave rule's several waves of short splits lost to one wave of longer ones.
# Same process, H100, fp16, head dim 128, graph replays, one wave / the wave rule
# (bench/decode_split_free_ab.py; bench/PERFLOG.md, "Steps of half the SMs or more run unsplit"): 36-60
# row blocks over 4k-16k 0.54-0.88 (MQA batch 60 4k with 4 causal queries, 11 splits -> 2, 122.2 ->
# 66.0 us), 48 (MQA batch 12 4k with 16) 0.69, paged alike; 4 row blocks at 64k took 33 splits of
# 31-32 blocks against the wave rule's 32 of 32, 1.02-1.03, whence the fewest; 8 and 16 row blocks
# the same plans.


def decode_split_count(cfg: DecodeConfig, ctas: int, key_blocks: int, slots: int, sms: int, paged: bool) -> int:
    """How many ways a step of `ctas` row blocks of `key_blocks` key blocks on `cfg` splits its keys (the
    cluster plans aside): 1 where decode_split_free; on the wgmma tiles as many as fit one wave of
    `slots` CTAs; else decode_splits' wave rule."""
    if decode_split_free(cfg, ctas, sms, key_blocks, paged):
        return 1
    return decode_splits(ctas, key_blocks, slots, one_wave=cfg.wgmma)


def decode_splits(ctas: int, key_blocks: int, slots: int, one_wave: bool = False) -> int:
    """How many ways to split each row block's keys, for `ctas` CTAs without a split and `slots` CTAs
    that fill the GPU (decode_slots), each split at least MIN_BLOCKS_PER_SPLIT key blocks.

    The wave rule: the fewest splits whose last wave is nearly full (at least
    SPLIT_WAVE_EFFICIENCY of the best wave efficiency over 1..max splits).
    one_wave: as many splits as fit one wave of `slots`, the fewest of those
    with the same longest split.
    """
    if ctas >= slots or key_blocks < 2 * MIN_BLOCKS_PER_SPLIT:
        return 1
    most = max(1, min(DECODE_MAX_SPLITS, key_blocks // MIN_BLOCKS_PER_SPLIT))
    if one_wave:
        most = max(1, min(most, slots // ctas))
        return -(-key_blocks // -(-key_blocks // most))
    efficiency = {}
    for splits in range(1, most + 1):
        waves = ctas * splits / slots
        efficiency[splits] = waves / -(-ctas * splits // slots)
    best = max(efficiency.values())
    return next(s for s in range(1, most + 1) if efficiency[s] >= SPLIT_WAVE_EFFICIENCY * best)


# Thread-block clusters (sm_90): the split CTAs of a row block merge inside one cluster, through
# distributed shared memory, instead of through global memory (decode_sm80.cuh,
# merge_cluster_splits), which saves the global merge's chain of round trips (2-4 µs). Same process,
# device time of CUDA-graph replays, H100, fp16, head dim 128, 32 query heads, µs (bench/PERFLOG.md,
# "clusters"; before -> after):
# - few keys, where the merge is most of a step after its key loop: GQA (on 8) batch 1 1k 11.2 ->
#   7.7 (8 splits of 2 blocks; with 4 splits 9.4, 16 of 1 block 8.4), MQA batch 1 1k 12.5 -> 9.0,
#   batch 8 1k 12.8 -> 9.7, GQA batch 1 2k 11.5 -> 9.7, 4k 13.2 -> 12.5;
# - more keys a split, on a grid that fills the SMs: GQA batch 1 8k 21.2 -> 18.3 (16 splits of 8
#   blocks), 16k 31.8 -> 30.4 (16 blocks), GQA batch 2 8k 30.3 -> 28.2; on half of them not (MQA batch
#   8 8k, 8 splits of 16 blocks on 64 SMs: 22.0 -> 23.6; the global merge's 16 splits keep 128). At 32
#   blocks a split the two runs disagreed (GQA batch 1 32k 54.0 -> 51.5, 53.3 -> 53.9);
# - with more CTAs than SMs the clusters ran slower (GQA batch 8 8k, 4 splits, 256 CTAs: 94.8 ->
#   113.0): a cluster step takes one CTA an SM at most.
MIN_BLOCKS_PER_CLUSTER_SPLIT = 2
# ... but one for the 32-row tile (MQA: 8 warps, twice the rows a block): batch 1 1k 16 splits of one
# block 8.70 us against 8 of two 9.26, batch 2 8.58 against 9.12 (same process, graph replays).
MIN_BLOCKS_PER_CLUSTER_SPLIT_32_ROWS = 1
# One cluster a row block takes splits of up to this many key blocks, by the share of the SMs its grid
# fills: (share, blocks) pairs, the first whose share the grid reaches. A longer split's chain of key
# blocks costs more than what the alternative adds: the combine kernel after several clusters (3-4 us
# in a graph) on grids of up to half the SMs; past three quarters, where no row block takes several,
# the global merge inside the kernel, which long splits do not beat. The 16-row tile's blocks are half
# the 32-row tile's work, so it takes longer splits. Same process, H100, fp16, head dim 128, 32 query
# heads, graph replays, before -> after (bench/PERFLOG.md, "one cluster a row block"):
# - 16-row tile: 32 on 4 batch 1 8k (64 CTAs of 8 blocks) 16.1 -> 12.7 us, 32 on 2 batch 1 8k (32
#   CTAs) 15.1 -> 13.1, batch 2 8k 17.4 -> 13.9; 32 blocks a split on 64 CTAs: 32 on 2 batch 2 32k 35.9
#   -> 31.5, 32 on 4 batch 1 32k 34.5 -> 31.7; on 128 (32 on 8 batch 1 32k) 51.0 -> 55.7, and on 32
#   (32 on 2 batch 1 32k) 23.2 -> 27.8;
# - 32-row tile (MQA): batch 4 8k (64 CTAs of 8 blocks) 17.6 -> 15.8, batch 8 4k (clusters of 8)
#   16.0 -> 15.4; 16 CTAs of 8 blocks (batch 1 8k) 13.6 -> 15.1, 32 (batch 2) 14.3 -> 15.1.
# - over pages of 16 (their copies cost more a block) the 16-row tile takes the 32-row tile's limits:
#   its 32-block splits lost (32 on 4 batch 1 32k 29.3 -> 35.0 us, 32 on 2 batch 2 32k 35.1 -> 36.0),
#   16 blocks on 64 CTAs read 0.96-1.09x the time in two runs, 8 blocks on 32 CTAs 1.00-1.06x, 8 on 64
#   CTAs 0.89-0.96x (bench/results/decode_plans_paged_ab_h100.txt); the 32-row tile's 8 blocks on 64
#   CTAs 0.94x (MQA batch 4 8k) and 1.04-1.05x (batch 8 4k, clusters of 8).
ONE_CLUSTER_SPLIT_BLOCKS_16_ROWS = ((0.75, 16), (0.45, 32), (0.24, 8), (0.0, 4))
ONE_CLUSTER_SPLIT_BLOCKS = ((0.75, 16), (0.45, 8), (0.0, 4))
# Where one cluster a row block leaves its splits long on a grid of few SMs (MQA, or 32 query heads on
# 2: one or two row blocks), a row block takes several clusters, as many as bring a split to
# MIN_BLOCKS_PER_CLUSTER_SPLIT blocks (the clusters the GPU holds and the SMs allowing); each cluster's
# merged result is a partial that combine_kernel merges. Measured (H100, graph replays, fp16, head dim
# 128, one cluster a row block -> several, clusters bringing a split to 4 / 2 blocks): MQA batch 1 8k
# 16.1 -> 14.6 / 13.3 us, 16k 18.6 -> 15.5 / 15.6, 32k 24.7 -> 17.8 / 17.9, batch 2 8k 16.4 -> 15.1 /
# 14.7; 32 on 2 batch 1 8k 26.9 -> 16.6 / 15.3; 32 on 4 19.8 -> 18.6 / 18.4.
# Several clusters keep splits of up to SEVERAL_CLUSTERS_MAX_BLOCKS blocks: past 16 they still beat the
# global merge's splits, whose one merge of every split's partial is a chain (H100, fp16, head dim 128,
# graph replays, limit 16 -> 48; bench/results/decode_clusters_long_ab_h100.txt): MQA batch 1 128k
# 42.6 -> 35.6 us (7 clusters of 16, 19 blocks a split), batch 2 64k 39.3 -> 34.6, batch 2 128k
# 60.5 -> 57.5; 32 on 2 batch 1 128k 65.4 -> 60.8; 24 and 32 took part of it; shorter caches and more
# row blocks unchanged.
SEVERAL_CLUSTERS_MAX_BLOCKS = 48
# Several clusters a row block are of 8 CTAs, over at most SEVERAL_CLUSTERS_GRID_SHARE of the SMs (more
# where splits would pass SEVERAL_CLUSTERS_MAX_BLOCKS), for the 16-row tile and the 32-row tile's lone
# row block (MQA batch 1); the 32-row tile's row blocks take the largest clusters otherwise. Same
# process, H100, fp16, head dim 128, graph replays, 7 clusters of 16 -> 11 of 8 (bench/PERFLOG.md, "one
# cluster a row block"): MQA batch 1 16k 15.4 -> 14.9 us, 32k 17.9 -> 17.6, 128k 35.5 -> 34.9; 4 of 16
# -> 8 of 8 at 8k 13.6 -> 12.7; 32 on 2 batch 1, 4 of 16 -> 5 of 8, 16k 18.1 -> 16.6, 32k 24.0 -> 22.2.
# Over the whole grid (15 clusters of 8, 120 CTAs) MQA batch 1 16k took 15.5 us: fewer, longer splits
# merge faster. MQA batch 2 in clusters of 8 ran 1.02-1.03x slower at 8k-32k. A paged cache's copies
# cost more a block (its page ids), and its steps kept the largest clusters over every SM: MQA batch 1
# over pages of 16, 7 clusters of 16 against 11 of 8, 32k 17.1 against 18.0 us, 128k 34.6 against 36.5.
SEVERAL_CLUSTERS_SIZE = 8
SEVERAL_CLUSTERS_GRID_SHARE = 0.67


def decode_may_cluster(cfg: DecodeConfig, ctas: int, sms: int, arch: int) -> bool:
    """Whether a step of `ctas` row blocks could merge its splits in clusters (two splits of each, one
    CTA an SM): Hopper and an mma.sync tile; decode_launch.clusters_held is asked only then."""
    return arch == HOPPER and not cfg.wgmma and 2 * ctas <= sms


def decode_cluster_plan(cfg: DecodeConfig, ctas: int, key_blocks: int, sms: int, arch: int, held: dict,
                        forced: int = 0, paged: bool = False) -> tuple[int, int]:
    """(splits, CTAs a cluster) of a step whose split CTAs merge inside thread-block clusters, for `ctas`
    row blocks of `key_blocks` key blocks on `sms` SMs; (0, 0) where it does not take them. held: cluster
    size -> clusters the GPU holds at once (decode_launch.clusters_held); a cluster step takes one CTA
    an SM at most, and the GPU holds all its clusters at once. forced: the caller's split count (0:
    chosen), one cluster a row block where it fits. Chosen: one cluster a row block, of as many splits
    as the largest cluster, the SMs and MIN_BLOCKS_PER_CLUSTER_SPLIT(_32_ROWS) allow, where a split is no
    longer than one_cluster_split_blocks allows on its grid; else several clusters a row block
    (SEVERAL_CLUSTERS_SIZE CTAs over SEVERAL_CLUSTERS_GRID_SHARE of the SMs for a contiguous cache's
    16-row tile and lone row block, the largest over all the SMs otherwise: `paged`, a paged cache),
    each split of MIN_BLOCKS_PER_CLUSTER_SPLIT blocks where they fit, of SEVERAL_CLUSTERS_MAX_BLOCKS at
    most."""
    if not decode_may_cluster(cfg, ctas, sms, arch):
        return 0, 0
    largest = max((size for size, count in held.items() if count >= ctas), default=0)
    if forced:
        return (forced, forced) if 1 < forced <= largest and ctas * forced <= sms else (0, 0)
    floor = MIN_BLOCKS_PER_CLUSTER_SPLIT_32_ROWS if cfg.block_m == 32 else MIN_BLOCKS_PER_CLUSTER_SPLIT
    splits = min(largest, key_blocks // floor, sms // ctas)
    if splits >= 2 and -(-key_blocks // splits) <= one_cluster_split_blocks(cfg, ctas * splits / sms, paged):
        return splits, splits
    eight_ctas = not paged and (cfg.block_m <= 16 or ctas == 1)
    size = min(largest, SEVERAL_CLUSTERS_SIZE) if eight_ctas else largest
    if size < 2:
        return 0, 0
    most = min(held[size] // ctas, sms // (ctas * size))  # clusters a row block the GPU holds at once
    grid_sms = int(SEVERAL_CLUSTERS_GRID_SHARE * sms) if eight_ctas else sms
    clusters = min(most, grid_sms // (ctas * size), -(-key_blocks // (size * MIN_BLOCKS_PER_CLUSTER_SPLIT)))
    if clusters < 2:
        return 0, 0
    # ... more, up to `most`, where splits would be longer than SEVERAL_CLUSTERS_MAX_BLOCKS
    clusters = max(clusters, min(most, -(-key_blocks // (size * SEVERAL_CLUSTERS_MAX_BLOCKS))))
    if -(-key_blocks // (clusters * size)) <= SEVERAL_CLUSTERS_MAX_BLOCKS:
        return clusters * size, size
    return 0, 0


def one_cluster_split_blocks(cfg: DecodeConfig, grid_share: float, paged: bool = False) -> int:
    """The longest split (key blocks) of a step whose row blocks take one cluster each, on a grid of
    grid_share of the SMs, over a paged cache or not (ONE_CLUSTER_SPLIT_BLOCKS(_16_ROWS))."""
    limits = ONE_CLUSTER_SPLIT_BLOCKS_16_ROWS if cfg.block_m <= 16 and not paged else ONE_CLUSTER_SPLIT_BLOCKS
    return next(blocks for share, blocks in limits if grid_share >= share)
