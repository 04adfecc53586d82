"""The one place that picks a kernel configuration for a problem.

Order: the autotune cache (when one is installed by `cuflash.autotune`), then
the heuristic table below. Each row of the table carries the measurement that
chose it.
"""

from __future__ import annotations

import contextlib
import dataclasses

from .config import FP8_DTYPE_NAME, FwdConfig, FwdSm90Config, kernel_headdim


@dataclasses.dataclass(frozen=True)
class FwdProblem:
    """What the forward kernel choice depends on."""

    dtype_name: str
    headdim: int  # the user's head dim
    causal: bool
    seqlen_q: int
    seqlen_k: int
    group: int  # query heads per kv head
    max_smem: int = 227 * 1024  # the device's opt-in shared memory per block
    arch: int = 80  # compute capability as major * 10 + minor

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

# Hook for the autotune cache: a callable (FwdProblem) -> FwdConfig | None.
_cache_lookup = None
_cache_enabled = True


def set_cache_lookup(lookup) -> None:
    global _cache_lookup
    _cache_lookup = lookup


def cache_enabled() -> bool:
    """Whether fwd_config consults the autotune cache now (not within heuristic_only)."""
    return _cache_enabled


def cache_state() -> tuple:
    """What fwd_config's choice depends on besides the problem and the cache's entries: the
    switch and the hook (part of cuflash.api's launch-plan keys)."""
    return _cache_enabled, _cache_lookup


@contextlib.contextmanager
def heuristic_only():
    """Within the block fwd_config ignores the autotune cache (the benchmark compares the two)."""
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
# The output tile staged in shared memory for bulk tensor stores (stage_o),
# same-run A/B on an H100: hdim 128 +4-9% at 2k, +0-2% at 8k-16k; hdim 64
# with 192-key tiles 1-4% slower, so that one stores from registers; hdim 256
# has no room for it.
HEURISTIC_SM90 = {
    64: FwdSm90Config(64, 192, 3, stage_o=False),
    128: FwdSm90Config(128, 128, 2),
    256: FwdSm90Config(256, 80, 2, stage_o=False),
}

# Short key sequences: kernel head dim -> (config, longest seqlen_k without
# and with the causal mask). Head dim 64: 128-key tiles without ping-pong,
# output staged. Kernel times against the table's config (ncu at locked
# clocks, H100): at 1k 6% shorter non-causal and 11% shorter causal; at 2k
# 5% longer non-causal and 3.5% shorter causal; at 4k 7% longer non-causal
# and equal causal.
SM90_SHORT_KEYS = {64: (FwdSm90Config(64, 128, 3, pingpong=False), {False: 1024, True: 2048})}


def sm90_table_configs() -> list[FwdSm90Config]:
    """Every 16-bit Hopper config the tables choose (for the compile and SASS checks)."""
    return list(HEURISTIC_SM90.values()) + [cfg for cfg, _ in SM90_SHORT_KEYS.values()]


def heuristic_sm90_config(kernel_headdim: int, seqlen_k: int, causal: bool) -> FwdSm90Config | None:
    """The Hopper table's config for a kernel head dim, key length and mask, if it has one."""
    headdim = sm90_headdim(kernel_headdim)
    short = SM90_SHORT_KEYS.get(headdim)
    if short is not None and seqlen_k <= short[1][causal]:
        return short[0]
    return HEURISTIC_SM90.get(headdim)


# Kernel head dims without a Hopper kernel of their own -> the Hopper kernel
# that serves them (its extra columns zero-filled by the tensor-map copies).
# Measured on an H200 (bench/sweep.py, fp16, 2k and 8k, both masks): d96 on
# the 128 kernel 320-489 TFLOP/s against 205-244 for the sm_80 kernel; d160
# and d192 on the 256 kernel 318-531 against 200-248; d224 not measured,
# between the two. d32 stays on the sm_80 kernel: the 64 kernel was 178-239
# against 193-231, no faster.
SM90_PADDED = {96: 128, 160: 256, 192: 256, 224: 256}


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
    if problem.arch != 90:
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
    sm90 = (heuristic_sm90_config(problem.kernel_headdim, problem.seqlen_k, problem.causal)
            if problem.arch == 90 else None)
    if sm90 is not None and sm90.smem_bytes() <= problem.max_smem:
        return sm90
    fast, general = HEURISTIC_FWD[problem.kernel_headdim]
    even = (
        problem.headdim == fast.headdim
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


def fwd_config(problem: FwdProblem) -> tuple[FwdConfig, str]:
    """The config to run and where it came from ("cache" or "heuristic")."""
    if _cache_lookup is not None and _cache_enabled:
        cfg = _cache_lookup(problem)
        if cfg is not None:
            return cfg, "cache"
    return heuristic_fwd_config(problem), "heuristic"
