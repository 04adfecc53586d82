"""What the autotuner needs to know about the backward kernels (sm_80 and Hopper).

The same parts as tune_fwd: the search space (data), the `keep()` predicate,
the cache key, the kernels a configuration may run, and a workload (a full
backward: preprocess, dK/dV and the dQ conversion, or the deterministic dQ
kernel).
"""

from __future__ import annotations

import dataclasses
import itertools

from . import dispatch, launch
from .dispatch import BwdProblem
from .config import BwdConfig
from .device import HOPPER
from .tune_common import (TILE_ALIGN, CallShape, KernelSpec, TunedFamily, alibi_slopes, default_scale,
                          length_variants, poison, problem_key, randn)

# Every value of every BwdConfig field the tuner tries; the product, less what
# keep() drops, is the space. The dQ kernel's fields only vary for
# deterministic problems (the default mode does not run that kernel).
# dkdv_chunk_m 0 is the whole block of queries.
SPACE = {
    "dkdv_block_m": (32, 64, 128),
    "dkdv_warps": (4, 8),
    "dkdv_chunk_m": (0, 16, 32, 64),
    "stages": (2, 3),
    "min_blocks": (1, 2),
}
QUICK_SPACE = {
    "dkdv_block_m": (64, 128),
    "dkdv_warps": (8,),
    "dkdv_chunk_m": (0, 16, 32, 64),
    "stages": (2,),
    "min_blocks": (1,),
}
DQ_SPACE = {"dq_warps": (4, 8), "dq_block_n": (32, 64, 128)}
QUICK_DQ_SPACE = {"dq_warps": (4, 8), "dq_block_n": (64,)}
# Ring depths of the Hopper kernels (their tile shapes are fixed per head dim).
HOPPER_STAGES = (2, 3)


def _product(values: dict) -> list[dict]:
    return [dict(zip(values, combo)) for combo in itertools.product(*values.values())]


class BwdInputs:
    """q, k, v, dout, the forward's out and lse, and gradient buffers for one backward call."""

    def __init__(self, problem: BwdProblem, shape: CallShape, seed: int):
        import cupy

        rng = cupy.random.default_rng(seed)
        q_shape, kv_shape = shape.shapes(problem)
        self.q, self.k, self.v = (randn(rng, s, problem.dtype_name) for s in (q_shape, kv_shape, kv_shape))
        self.dout = randn(rng, q_shape, problem.dtype_name)
        self.scale = default_scale(problem)
        self.slopes = alibi_slopes(problem, shape.nheads)
        # The forward's out and lse, from the heuristic's forward kernel.
        fwd = dispatch.FwdProblem(problem.dtype_name, problem.headdim, problem.causal, problem.seqlen_q,
                                  problem.seqlen_k, problem.group, problem.max_smem, problem.arch, problem.mods)
        self.out = cupy.empty_like(self.q)
        self.lse = cupy.empty((shape.batch, shape.nheads, problem.seqlen_q), dtype=cupy.float32)
        launch.launch_fwd(dispatch.heuristic_fwd_config(fwd), fwd, self.q, self.k, self.v, self.out, self.lse,
                          self.scale, slopes=self.slopes)
        self.dq, self.dk, self.dv = (cupy.empty_like(x) for x in (self.q, self.k, self.v))

    @property
    def nbytes(self) -> int:
        arrays = (self.q, self.k, self.v, self.dout, self.out, self.lse, self.dq, self.dk, self.dv)
        return sum(x.nbytes for x in arrays)

    def outputs(self) -> tuple:
        return self.dq, self.dk, self.dv

    def poison(self) -> None:
        poison(self.dq, self.dk, self.dv)


class BwdTuning(TunedFamily):
    """The backward family as the tuner sees it (see cuflash.tuner.Family)."""

    name = "bwd"
    config_classes = (BwdConfig,)

    def key(self, problem: BwdProblem) -> str:
        return problem_key(self.name, problem, "det" if problem.deterministic else "atomic")

    def heuristic(self, problem: BwdProblem) -> BwdConfig:
        return dispatch.heuristic_bwd_config(problem)

    def space(self, problem: BwdProblem, quick: bool) -> list[BwdConfig]:
        """The product of the space's fields, with the table's entry; the dQ fields of the table in atomic mode."""
        kd = problem.kernel_headdim
        table = dispatch.HEURISTIC_BWD[kd]
        dq_fields = (_product(QUICK_DQ_SPACE if quick else DQ_SPACE) if problem.deterministic
                     else [{"dq_warps": table.dq_warps, "dq_block_n": table.dq_block_n}])
        dkdv_fields = _product(QUICK_SPACE if quick else SPACE)
        configs = [table] + [BwdConfig(kd, **dkdv, **dq) for dkdv in dkdv_fields for dq in dq_fields]
        hopper = dispatch.hopper_bwd_config(kd, problem.arch)
        if hopper is not None:
            # The Hopper kernels first (the heuristic's choice there), in both ring depths (keep drops
            # those that do not fit).
            configs = [dataclasses.replace(hopper, stages=stages) for stages in HOPPER_STAGES] + configs
        return configs

    def keep(self, cfg: BwdConfig, limits) -> bool:
        """Static filter: the traits' asserts, tile sides, this device's shared memory and threads."""
        smem = cfg.smem_bytes()
        threads = max(cfg.dkdv_threads, cfg.dq_threads)
        return (
            cfg.is_valid()
            and cfg.dkdv_block_n <= TILE_ALIGN
            and cfg.dq_block_n <= TILE_ALIGN
            and smem <= limits.smem_per_block
            and cfg.min_blocks * smem <= limits.smem_per_sm
            and cfg.min_blocks * threads <= limits.threads_per_sm
        )

    def kernels(self, cfg: BwdConfig, problem: BwdProblem) -> list[KernelSpec]:
        """The dK/dV kernel, and for deterministic problems the dQ kernel, in each length variant.

        The row-wise preprocess and dQ conversion kernels do not depend on the config.
        """
        dtype_name, causal, even_d = problem.dtype_name, problem.causal, problem.headdim == cfg.headdim
        atomic, mods = cfg.atomic_dq(problem.deterministic), problem.mods.bits
        specs = [KernelSpec(cfg.kernel_family, cfg.dkdv_name(dtype_name, causal, n, even_d, atomic, mods),
                            cfg.dkdv_smem_bytes(atomic), cfg.dkdv_threads, runs=i == 0)
                 for i, n in enumerate(length_variants(problem, cfg.dkdv_block_m, cfg.dkdv_block_n))]
        if not atomic:
            specs += [KernelSpec(cfg.kernel_family, cfg.dq_name(dtype_name, causal, n, even_d, mods),
                                 cfg.dq_smem_bytes(), cfg.dq_threads, runs=i == 0)
                      for i, n in enumerate(length_variants(problem, cfg.dq_block_m, cfg.dq_block_n))]
        return specs

    def make_inputs(self, problem: BwdProblem, shape: CallShape, seed: int) -> BwdInputs:
        return BwdInputs(problem, shape, seed)

    @staticmethod
    def launch(cfg: BwdConfig, problem: BwdProblem, inputs: BwdInputs) -> None:
        x = inputs
        launch.launch_bwd(cfg, problem, x.scale, x.q, x.k, x.v, x.dout, x.out, x.lse, x.dq, x.dk, x.dv, x.slopes)

    def flops(self, problem: BwdProblem, shape: CallShape) -> float:
        # Five GEMMs against the forward's two: 2.5 x 4·B·H·Nq·Nk·D, halved for causal.
        flops = 10.0 * shape.batch * shape.nheads * problem.seqlen_q * problem.seqlen_k * problem.headdim
        return flops / 2 if problem.causal else flops

    def describe(self, problem: BwdProblem, shape: CallShape) -> dict:
        return {**dataclasses.asdict(problem), **dataclasses.asdict(shape)}

    def config_from_dict(self, fields, problem: BwdProblem) -> BwdConfig | None:
        """The cached config, or None if it no longer fits BwdConfig, this problem or this device."""
        try:
            cfg = BwdConfig(**fields)
        except TypeError:
            return None
        kd = problem.kernel_headdim
        headdim = dispatch.hopper_bwd_headdim(kd) if cfg.hopper else kd
        usable = (cfg.is_valid() and cfg.headdim == headdim and dispatch.fits(cfg, problem.max_smem)
                  and (not cfg.hopper or problem.arch == HOPPER))
        return cfg if usable else None


BWD = BwdTuning()
