"""What the autotuner needs to know about the forward kernels (sm_80 and Hopper).

Its search space (data), the `keep()` predicate, the cache key of a problem,
the kernels a configuration may run, and a workload to check and time on
(dispatch reads the cache through tuner.CacheLookup).
"""

from __future__ import annotations

import dataclasses
import itertools

from . import dispatch, launch
from .config import FwdConfig, FwdSm90Config
from .device import HOPPER
from .tune_common import (TILE_ALIGN, CallShape, KernelSpec, TunedFamily, alibi_slopes, default_scale,
                          length_variants, poison, problem_key, randn)

# Every value of every FwdConfig field the tuner tries; the product, less what
# keep() drops, is the space. QUICK_SPACE is the subset `--quick` tries.
SPACE = {
    "block_n": (32, 64, 128),
    "warps": (4, 8),
    "m_tiles": (1, 2),
    "stages": (2, 3),
    "q_in_regs": (True, False),
    "min_blocks": (1, 2),
}
QUICK_SPACE = {
    "block_n": (64, 128),
    "warps": (4, 8),
    "m_tiles": (1, 2),
    "stages": (2,),
    "q_in_regs": (True, False),
    "min_blocks": (1,),
}

# Hopper kernel candidates (compute capability 9.0 only), per field.
# (block_n 192 spills at head dim 128 and above: the compile filter drops it there;
# is_valid drops the tiles that do not fit in shared memory; the output tile is
# staged in shared memory wherever it fits.)
SPACE_SM90 = {"block_n": FwdSm90Config.BLOCK_N, "stages": (2, 3), "persistent": (True, False),
              "pingpong": (True, False)}
# `--quick`: every tile width, with and without ping-pong, 2 stages, persistent
# (3 stages and one CTA per tile were within +-5% of these on an H200).
QUICK_SPACE_SM90 = {"block_n": FwdSm90Config.BLOCK_N, "stages": (2,), "persistent": (True,),
                    "pingpong": (True, False)}


class FwdInputs:
    """Random q, k, v and output buffers for one forward call (and ALiBi slopes where the problem has ALiBi)."""

    def __init__(self, problem: dispatch.FwdProblem, shape: CallShape, seed: int):
        import cupy

        rng = cupy.random.default_rng(seed)
        q_shape, kv_shape = shape.shapes(problem)
        self.q, self.k, self.v = (randn(rng, s, problem.dtype_name) for s in (q_shape, kv_shape, kv_shape))
        self.out = cupy.empty_like(self.q)
        self.lse = cupy.empty((shape.batch, shape.nheads, problem.seqlen_q), dtype=cupy.float32)
        self.scale = default_scale(problem)
        self.slopes = alibi_slopes(problem, shape.nheads)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.q, self.k, self.v, self.out, self.lse))

    def outputs(self) -> tuple:
        return self.out, self.lse

    def poison(self) -> None:
        poison(self.out, self.lse)


class FwdTuning(TunedFamily):
    """The forward family as the tuner sees it (see cuflash.tuner.Family)."""

    name = "fwd"  # forward kernels of every family (sm_80 and, on Hopper, sm_90a) compete per key
    config_classes = (FwdConfig, FwdSm90Config)

    def key(self, problem: dispatch.FwdProblem) -> str:
        return problem_key(self.name, problem)

    def heuristic(self, problem: dispatch.FwdProblem) -> FwdConfig:
        return dispatch.heuristic_fwd_config(problem)

    def space(self, problem: dispatch.FwdProblem, quick: bool) -> list[FwdConfig]:
        values = QUICK_SPACE if quick else SPACE
        fields = list(values)
        space = [FwdConfig(problem.kernel_headdim, **dict(zip(fields, combo)))
                 for combo in itertools.product(*values.values())]
        sm90_d = dispatch.sm90_headdim(problem.kernel_headdim)
        if problem.arch == HOPPER and sm90_d is not None:
            values = QUICK_SPACE_SM90 if quick else SPACE_SM90
            space += [FwdSm90Config(sm90_d, **dict(zip(values, combo))).staged_if_fits()
                      for combo in itertools.product(*values.values())]
        return space

    def keep(self, cfg: FwdConfig, limits) -> bool:
        """Static filter: the traits' asserts, tile sides, this device's shared memory and threads."""
        return (
            cfg.is_valid()
            and cfg.block_m <= TILE_ALIGN
            and cfg.smem_bytes() <= limits.smem_per_block
            # min_blocks CTAs must fit on one SM together, or the promise to
            # the register allocator only costs registers.
            and cfg.min_blocks * cfg.smem_bytes() <= limits.smem_per_sm
            and cfg.min_blocks * cfg.threads <= limits.threads_per_sm
        )

    def kernel_names(self, cfg: FwdConfig, problem: dispatch.FwdProblem) -> list[str]:
        """The kernels `cfg` may run for calls with `problem`'s key; the first is `problem`'s own."""
        even_d = problem.headdim == cfg.headdim
        return [cfg.name_expression(problem.dtype_name, problem.causal, n, even_d, problem.mods.bits)
                for n in length_variants(problem, cfg.block_m, cfg.block_n)]

    def kernels(self, cfg: FwdConfig, problem: dispatch.FwdProblem) -> list[KernelSpec]:
        names = self.kernel_names(cfg, problem)
        smem = cfg.smem_bytes(problem.dtype_name, problem.mods.bits)
        return [KernelSpec(cfg.family, name, smem, cfg.threads, runs=i == 0) for i, name in enumerate(names)]

    def make_inputs(self, problem: dispatch.FwdProblem, shape: CallShape, seed: int) -> FwdInputs:
        return FwdInputs(problem, shape, seed)

    @staticmethod
    def launch(cfg: FwdConfig, problem: dispatch.FwdProblem, inputs: FwdInputs) -> None:
        x = inputs
        launch.launch_fwd(cfg, problem, x.q, x.k, x.v, x.out, x.lse, x.scale, slopes=x.slopes)

    def flops(self, problem: dispatch.FwdProblem, shape: CallShape) -> float:
        # The benchmark's count: 4·B·H·Nq·Nk·D, halved for causal.
        flops = 4.0 * shape.batch * shape.nheads * problem.seqlen_q * problem.seqlen_k * problem.headdim
        return flops / 2 if problem.causal else flops

    def describe(self, problem: dispatch.FwdProblem, shape: CallShape) -> dict:
        return {**dataclasses.asdict(problem), **dataclasses.asdict(shape)}

    def config_from_dict(self, fields, problem: dispatch.FwdProblem) -> FwdConfig | None:
        """The cached config, or None if it no longer fits this FwdConfig or this problem."""
        for config_class in self.config_classes:
            try:
                cfg = config_class(**fields)
            except TypeError:  # another family's fields
                continue
            if config_class is FwdSm90Config:
                if problem.arch != HOPPER:
                    return None
                headdim = dispatch.sm90_headdim(problem.kernel_headdim)
            else:
                headdim = problem.kernel_headdim
            return cfg if cfg.is_valid() and cfg.headdim == headdim else None
        return None


FWD = FwdTuning()
