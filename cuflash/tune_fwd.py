"""What the autotuner needs to know about the sm_80 forward kernel.

Its search space (data), the `keep()` predicate, the cache key of a problem,
the kernels a configuration may run, and a workload to check and time on.
`lookup` is the dispatcher's cache hook for this family.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy

from . import api, dispatch, tune_cache
from .config import FwdConfig, FwdSm90Config

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
SPACE_SM90 = {"block_n": (64, 128), "stages": (2, 3)}

# No tile side in the space exceeds this. Lengths that are multiples of it run
# every candidate's even-length kernel, so the cache keeps those problems apart
# from the ragged ones, whose kernels carry the boundary predicates.
TILE_ALIGN = 128

# The benchmark's shapes (cuflash.benchmark): batch * seqlen tokens, hidden size.
TOKENS = 16384
HIDDEN = 2048


def seqlen_bucket(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def _tiles_divide(cfg: FwdConfig, seqlen_q: int, seqlen_k: int) -> bool:
    return seqlen_q % cfg.block_m == 0 and seqlen_k % cfg.block_n == 0


@dataclasses.dataclass(frozen=True)
class FwdShape:
    """The rest of a forward call's shape: what the timing runs on, not part of the key."""

    batch: int
    nheads: int
    nheads_kv: int

    @classmethod
    def benchmark(cls, problem: dispatch.FwdProblem) -> FwdShape:
        heads = max(1, HIDDEN // problem.headdim)
        return cls(max(1, TOKENS // problem.seqlen_q), heads, heads)


class FwdInputs:
    """Random q, k, v and output buffers for one forward call."""

    def __init__(self, problem: dispatch.FwdProblem, shape: FwdShape, seed: int):
        import cupy

        dtype = numpy.float16 if problem.dtype_name == "float16" else api._BF16
        rng = cupy.random.default_rng(seed)
        q_shape = (shape.batch, problem.seqlen_q, shape.nheads, problem.headdim)
        kv_shape = (shape.batch, problem.seqlen_k, shape.nheads_kv, problem.headdim)
        self.q, self.k, self.v = (rng.standard_normal(s, dtype=cupy.float32).astype(dtype)
                                  for s in (q_shape, kv_shape, kv_shape))
        self.out = cupy.empty(q_shape, dtype=dtype)
        self.lse = cupy.empty((shape.batch, shape.nheads, problem.seqlen_q), dtype=cupy.float32)
        self.scale = 1.0 / math.sqrt(problem.headdim)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.q, self.k, self.v, self.out, self.lse))

    def outputs(self) -> tuple:
        return self.out, self.lse

    def poison(self) -> None:
        """NaN in every output, so a kernel that skips a row is caught."""
        self.out.view(numpy.uint16).fill(0x7FFF)  # a NaN in float16 and in bfloat16 alike
        self.lse.fill(numpy.nan)


class FwdTuning:
    """The forward family as the tuner sees it (see cuflash.tuner.Family)."""

    name = "fwd"  # forward kernels of every family (sm_80 and, on Hopper, sm_90a) compete per key

    def key(self, problem: dispatch.FwdProblem) -> str:
        # The user's head dim, not the kernel's: it decides whether the
        # zero-padded variant runs. Left out: the GQA ratio (query heads only
        # pick which K/V head a CTA reads; the tile trade-offs are the same),
        # and batch and head counts (the benchmark's 16k tokens give every
        # bucket several waves of CTAs).
        aligned = problem.seqlen_q % TILE_ALIGN == 0 and problem.seqlen_k % TILE_ALIGN == 0
        return "/".join([
            self.name,
            problem.dtype_name,
            f"d{problem.headdim}",
            "causal" if problem.causal else "full",
            f"q{seqlen_bucket(problem.seqlen_q)}",
            f"k{seqlen_bucket(problem.seqlen_k)}",
            "even" if aligned else "ragged",
        ])

    def heuristic(self, problem: dispatch.FwdProblem) -> FwdConfig:
        return dispatch.heuristic_fwd_config(problem)

    def space(self, problem: dispatch.FwdProblem, quick: bool) -> list[FwdConfig]:
        values = QUICK_SPACE if quick else SPACE
        fields = list(values)
        space = [FwdConfig(problem.kernel_headdim, **dict(zip(fields, combo)))
                 for combo in itertools.product(*values.values())]
        if problem.arch == 90 and problem.kernel_headdim in dispatch.HEURISTIC_SM90:
            space += [FwdSm90Config(problem.kernel_headdim, **dict(zip(SPACE_SM90, combo)))
                      for combo in itertools.product(*SPACE_SM90.values())]
        return space

    def keep(self, cfg: FwdConfig, limits) -> bool:
        """Static filter: the traits' asserts, tile sides, this device's shared memory and threads."""
        return (
            cfg.is_valid()
            and cfg.block_m <= TILE_ALIGN
            and cfg.block_n <= TILE_ALIGN
            and cfg.smem_bytes() <= limits.smem_per_block
            # min_blocks CTAs must fit on one SM together, or the promise to
            # the register allocator only costs registers.
            and cfg.min_blocks * cfg.smem_bytes() <= limits.smem_per_sm
            and cfg.min_blocks * cfg.threads <= limits.threads_per_sm
        )

    def kernel_names(self, cfg: FwdConfig, problem: dispatch.FwdProblem) -> list[str]:
        """The kernels `cfg` may run for calls with `problem`'s key; the first is `problem`'s own."""
        even_n = _tiles_divide(cfg, problem.seqlen_q, problem.seqlen_k)
        even_d = problem.headdim == cfg.headdim
        variants = [even_n]
        if problem.seqlen_q % TILE_ALIGN or problem.seqlen_k % TILE_ALIGN:
            variants.append(not even_n)  # a ragged key's calls may run either length variant
        return [cfg.name_expression(problem.dtype_name, problem.causal, n, even_d) for n in variants]

    def make_inputs(self, problem: dispatch.FwdProblem, shape: FwdShape, seed: int) -> FwdInputs:
        return FwdInputs(problem, shape, seed)

    @staticmethod
    def launch(cfg: FwdConfig, problem: dispatch.FwdProblem, inputs: FwdInputs) -> None:
        x = inputs
        api.launch_fwd(cfg, problem, x.q, x.k, x.v, x.out, x.lse, x.scale)

    def flops(self, problem: dispatch.FwdProblem, shape: FwdShape) -> float:
        # The benchmark's count: 4·B·H·Nq·Nk·D, halved for causal.
        flops = 4.0 * shape.batch * shape.nheads * problem.seqlen_q * problem.seqlen_k * problem.headdim
        return flops / 2 if problem.causal else flops

    def describe(self, problem: dispatch.FwdProblem, shape: FwdShape) -> dict:
        return {**dataclasses.asdict(problem), **dataclasses.asdict(shape)}

    def config_from_dict(self, fields, problem: dispatch.FwdProblem) -> FwdConfig | None:
        """The cached config, or None if it no longer fits this FwdConfig or this problem."""
        for config_class in (FwdConfig, FwdSm90Config):
            try:
                cfg = config_class(**fields)
            except TypeError:  # another family's fields
                continue
            if config_class is FwdSm90Config and problem.arch != 90:
                return None
            return cfg if cfg.is_valid() and cfg.headdim == problem.kernel_headdim else None
        return None

    def cached(self, problem: dispatch.FwdProblem) -> tuple[dict | None, FwdConfig | None]:
        """(the cache entry for `problem` on the current device, its usable config)."""
        entry = tune_cache.get(tune_cache.current_device(), self.key(problem))
        if entry is None or not isinstance(entry.get("config"), dict):
            return entry, None
        return entry, self.config_from_dict(entry["config"], problem)


FWD = FwdTuning()


def lookup(problem: dispatch.FwdProblem) -> FwdConfig | None:
    """The dispatcher's cache hook: the tuned config for `problem`, if any."""
    return FWD.cached(problem)[1]
