"""Kernel configurations: Python mirrors of the C++ template parameters.

`FwdConfig` fields match `cuflash::fwd_kernel`'s tile parameters one to one.
Each kernel's shared-memory layout is mirrored region for region from its C++
traits (`smem_layout()`: the traits' OFF_* constants and SMEM_BYTES, in the
same order); `smem_bytes()` is that layout's end. tests/test_smem_layout.py
compiles the traits of every shipped specialisation against these values.
"""

from __future__ import annotations

import dataclasses

from .compile import cpp_int_constant
from .score_mods import MOD_ALIBI, MOD_SOFTCAP, MOD_VARLEN, MOD_WINDOW

# Head dims the kernels are instantiated for; a user head dim d (multiple of 8)
# runs on the smallest of these >= d with the extra columns zero-filled.
KERNEL_HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)

DTYPE_NAMES = ("float16", "bfloat16")
# fp8 e4m3 inputs (bf16 output) run on the Hopper kernel only.
FP8_DTYPE_NAME = "float8_e4m3"
# The Hopper kernels' DTYPE template argument (cuda_src/sm90_tiles.cuh).
SM90_DTYPES = {"float16": 0, "bfloat16": 1, FP8_DTYPE_NAME: 2}


def kernel_headdim(d: int) -> int:
    """The instantiated head dim that serves a user head dim `d`."""
    for kd in KERNEL_HEADDIMS:
        if d <= kd:
            return kd
    raise ValueError(f"head dim {d} exceeds {KERNEL_HEADDIMS[-1]}")


def _cpp_bool(x: bool) -> str:
    return "true" if x else "false"


def _layout(*regions: tuple[str, int]) -> dict[str, int]:
    """Shared-memory regions laid out back to back: {OFF_<name>: offset, ..., SMEM_BYTES: end}."""
    layout, offset = {}, 0
    for name, size in regions:
        layout[f"OFF_{name}"] = offset
        offset += size
    layout["SMEM_BYTES"] = offset
    return layout


def _q_and_kv_ring_layout(block_m: int, block_n: int, stages: int, headdim: int) -> dict[str, int]:
    """A 16-bit Q tile, then STAGES K tiles and STAGES V tiles: the sm_80 forward's shared memory
    (FwdTraits)."""
    kv = 2 * stages * block_n * headdim
    return _layout(("Q", 2 * block_m * headdim), ("K", kv), ("V", kv))


@dataclasses.dataclass(frozen=True, order=True)
class FwdConfig:
    """Tile shape of the sm_80 forward kernel.

    headdim: kernel head dim (one of KERNEL_HEADDIMS).
    block_n: keys per K/V tile (BC).
    warps: warps per CTA; each owns `m_tiles` 16-row MMA tiles of queries.
    stages: K/V tiles in flight in the cp.async ring.
    min_blocks: CTAs per SM promised to the register allocator (__launch_bounds__).
    q_in_regs: hold Q's MMA fragments in registers (else re-read them from shared memory).
    """

    headdim: int
    block_n: int
    warps: int
    m_tiles: int
    stages: int
    min_blocks: int = 1
    q_in_regs: bool = True

    family = "fwd_sm80"

    @property
    def block_m(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_layout(self) -> dict[str, int]:
        """FwdTraits: the Q tile (reused for the output), STAGES K tiles, STAGES V tiles (16-bit)."""
        return _q_and_kv_ring_layout(self.block_m, self.block_n, self.stages, self.headdim)

    def smem_bytes(self, dtype_name: str = "float16", mods: int = 0) -> int:
        """The layout's size, the same for every dtype and score option (the arguments are
        FwdSm90Config.smem_bytes's, so that a caller of either takes one form)."""
        return self.smem_layout()["SMEM_BYTES"]

    def traits(self, dtype_name: str) -> str:
        """The C++ traits type of this config's kernel."""
        args = [self.headdim, self.block_n, self.warps, self.m_tiles, self.stages, self.min_blocks,
                _cpp_bool(self.q_in_regs), _cpp_bool(dtype_name == "bfloat16")]
        return "cuflash::FwdTraits<" + ", ".join(str(a) for a in args) + ">"

    def is_valid(self) -> bool:
        """Static constraints of FwdTraits (the static_asserts)."""
        return (
            self.headdim in KERNEL_HEADDIMS
            and self.block_n % 16 == 0
            and self.block_n >= 16
            and 1 <= self.stages <= 4
            and self.m_tiles in (1, 2)
            and 1 <= self.warps <= 16
            and self.smem_bytes() <= SM90_SMEM_LIMIT
        )

    def name_expression(self, dtype_name: str, causal: bool, even_n: bool, even_d: bool, mods: int = 0) -> str:
        if dtype_name not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype_name!r}")
        args = [
            self.headdim,
            self.block_n,
            self.warps,
            self.m_tiles,
            self.stages,
            self.min_blocks,
            _cpp_bool(self.q_in_regs),
            _cpp_bool(dtype_name == "bfloat16"),
            _cpp_bool(causal),
            _cpp_bool(even_n),
            _cpp_bool(even_d),
        ]
        return "cuflash::fwd_kernel<" + ", ".join(str(a) for a in [*args, mods]) + ">"

    def short_name(self) -> str:
        return (
            f"d{self.headdim}_m{self.block_m}_n{self.block_n}_w{self.warps}"
            f"_mt{self.m_tiles}_s{self.stages}_b{self.min_blocks}"
            + ("" if self.q_in_regs else "_qs")
        )


# Head dims of the Hopper forward kernel (wgmma n = head dim).
SM90_HEADDIMS = (64, 128, 192, 256)
# Opt-in shared memory per block on compute capability 9.0 (cuda_src/common.cuh SMEM_LIMIT).
SM90_SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True, order=True)
class FwdSm90Config:
    """Tile shape of the Hopper (sm_90a, wgmma, TMA, warp-specialised) forward kernel.

    headdim: kernel head dim (64, 128, 192 or 256; fp8: 128 or 256).
    block_n: keys per K/V tile (64, 80, 96, 112, 128, 176 or 192; a multiple of 64 for fp8).
    stages: K/V tiles in flight in the producer's ring.
    persistent: one CTA per SM taking work tiles from a counter (True), or
    one CTA per tile (False); the same kernel, launched on another grid.
    pingpong: the two consumer warpgroups take turns issuing their GEMMs
    (True), or each issues as soon as its tiles are in (False).
    stage_o: the output tile leaves through shared memory and bulk tensor
    stores (True; it must fit beside the ring), or straight from registers.
    Query rows per work tile are fixed at 128: two consumer warpgroups of 64
    rows, plus one producer warpgroup.
    """

    headdim: int
    block_n: int
    stages: int = 2
    persistent: bool = True
    pingpong: bool = True
    stage_o: bool = True

    family = "fwd_sm90"
    block_m = 128
    threads = 384
    min_blocks = 1
    # The wgmma n values FwdSm90Traits accepts (cuda_src/wgmma.cuh).
    BLOCK_N = (64, 80, 96, 112, 128, 176, 192)

    def alibi_gemm(self, dtype_name: str, mods: int) -> bool:
        """Whether the kernel's shared memory holds the B operand of ALiBi's column GEMM (fwd_sm90_kernel's
        ALIBI_B: it adds ALiBi's column part in its S GEMM unless a window comes without the causal mask)."""
        return (self.headdim in (64, 128) and dtype_name != FP8_DTYPE_NAME and bool(mods & MOD_ALIBI)
                and not mods & MOD_SOFTCAP)

    def tail_split(self, dtype_name: str, causal: bool, mods: int) -> bool:
        """Whether the kernel splits its last wave along the keys (fwd_sm90_kernel's TAIL_SPLIT, which
        this mirrors): persistent, equal-length tiles (no causal mask, window or packed batch), head dims
        64 and 128, and not ALiBi's column GEMM at head dim 128."""
        return (self.persistent and not causal and not mods & (MOD_WINDOW | MOD_VARLEN) and self.headdim <= 128
                and not (self.headdim == 128 and self.alibi_gemm(dtype_name, mods)))

    def smem_layout(self, dtype_name: str = "float16", mods: int = 0) -> dict[str, int]:
        """FwdSm90Traits (cuda_src/fwd_sm90_traits.cuh): the Q tile, STAGES K and V tiles, the staged
        output tile (16-bit), the mbarriers (full/empty of Q, and of K and V per stage), the segment in
        flight and the producer's next one (16 bytes each), a word per consumer thread, 32 bytes per
        consumer warp, 32 bytes per key of ALiBi's column GEMM where the kernel has it."""
        elem = 1 if dtype_name == FP8_DTYPE_NAME else 2
        consumer_threads = self.threads - 128
        kv = self.stages * self.block_n * self.headdim * elem
        return _layout(("Q", self.block_m * self.headdim * elem), ("K", kv), ("V", kv),
                       ("O", self.block_m * self.headdim * 2 if self.stage_o else 0),
                       ("BARS", 8 * (2 + 4 * self.stages)), ("SEGMENT", 16), ("NEXT", 16),
                       ("SINK", 4 * consumer_threads), ("TILE_WORDS", 32 * (consumer_threads // 32)),
                       ("ALIBI_B", 32 * self.block_n if self.alibi_gemm(dtype_name, mods) else 0))

    def smem_bytes(self, dtype_name: str = "float16", mods: int = 0) -> int:
        return self.smem_layout(dtype_name, mods)["SMEM_BYTES"]

    def traits(self, dtype_name: str, mods: int = 0) -> str:
        """The C++ traits type of this config's kernel for `dtype_name` and score options `mods`."""
        args = [self.headdim, self.block_n, self.stages, SM90_DTYPES[dtype_name], _cpp_bool(self.stage_o),
                _cpp_bool(self.alibi_gemm(dtype_name, mods))]
        return "cuflash::FwdSm90Traits<" + ", ".join(str(a) for a in args) + ">"

    def supports(self, dtype_name: str) -> bool:
        if dtype_name == FP8_DTYPE_NAME and (self.block_n % 64 != 0 or self.headdim not in (128, 256)):
            return False
        return self.smem_bytes(dtype_name) <= SM90_SMEM_LIMIT

    def staged_if_fits(self) -> FwdSm90Config:
        """This config with stage_o where the staged output tile fits (16-bit inputs), else without."""
        staged = dataclasses.replace(self, stage_o=True)
        return staged if staged.is_valid() else dataclasses.replace(self, stage_o=False)

    def is_valid(self) -> bool:
        return (
            self.headdim in SM90_HEADDIMS
            and self.block_n in self.BLOCK_N
            and 1 <= self.stages <= 4
            and self.smem_bytes() <= SM90_SMEM_LIMIT
        )

    def name_expression(self, dtype_name: str, causal: bool, even_n: bool, even_d: bool = True,
                        mods: int = 0) -> str:
        """The kernel for these inputs; even_d is not a template argument (TMA zero-fills columns past d)."""
        if dtype_name not in SM90_DTYPES or not self.supports(dtype_name):
            raise ValueError(f"unsupported dtype {dtype_name!r} for {self.short_name()}")
        args = [self.headdim, self.block_n, self.stages, SM90_DTYPES[dtype_name], _cpp_bool(causal),
                _cpp_bool(even_n), _cpp_bool(self.pingpong), _cpp_bool(self.stage_o)]
        return "cuflash::fwd_sm90_kernel<" + ", ".join(str(a) for a in [*args, mods]) + ">"

    def short_name(self) -> str:
        return (f"sm90_d{self.headdim}_m{self.block_m}_n{self.block_n}_s{self.stages}"
                + ("" if self.persistent else "_np") + ("" if self.pingpong else "_npp")
                + ("" if self.stage_o else "_nso"))


# Padding of the backward's per-row buffers (lse2, delta, dq_accum): every
# backward block of query rows (32, 64 or 128) divides it, so no row-bound checks.
BWD_ROW_PAD = cpp_int_constant("seq_span.cuh", "BWD_ROW_PAD")


def preprocess_row_lanes(headdim: int) -> int:
    """Lanes per query row of the backward preprocess (bwd_preprocess_kernel's ROW_LANES): one 16-byte
    load (8 elements) a lane for a row of `headdim`, a power of two from 4 to 16."""
    lanes = 4
    while lanes < 16 and 8 * lanes < headdim:
        lanes *= 2
    return lanes


@dataclasses.dataclass(frozen=True, order=True)
class BwdConfig:
    """Tile shapes of the backward kernels.

    headdim: kernel head dim (one of KERNEL_HEADDIMS).
    dkdv_block_m: query rows per step of the dK/dV kernel (32, 64 or 128).
    dkdv_warps: warps of the sm_80 dK/dV kernel; each owns 16 keys (keys per CTA = 16 x warps).
    dq_warps: warps of the deterministic dQ kernel; each owns 16 query rows.
    dq_block_n: keys per step of the dQ kernel.
    stages: tiles in flight in the cp.async rings of both kernels.
    min_blocks: CTAs per SM promised to the register allocator (__launch_bounds__).
    dkdv_chunk_m: query rows whose scores the dK/dV kernel holds in registers at
        once (a multiple of 16 dividing dkdv_block_m); 0 means the whole block.
    hopper: the Hopper kernels (cuda_src/bwd_sm90.cuh, sm_90a). dK/dV (and
        the fused dQ): 128 keys per CTA, dkdv_block_m query rows per step (128
        at head dim 64, 64 at 128); the deterministic dQ kernel: 128 query rows
        per CTA (dq_warps = 8: two warpgroups), dq_block_n keys per step (128
        at head dim 64, 64 at 128 and 192, 32 at 256); both `stages` deep. At head
        dims 192 and 256 (`wide`, cuda_src/bwd_sm90_wide.cuh) the dK/dV kernel takes 64
        keys per CTA and 64 query rows per step. dkdv_warps, min_blocks and
        dkdv_chunk_m then do not apply; the preprocess kernel is the sm_80 one.
    """

    headdim: int
    dkdv_block_m: int
    dkdv_warps: int
    dq_warps: int
    dq_block_n: int
    stages: int = 2
    min_blocks: int = 1
    dkdv_chunk_m: int = 0
    hopper: bool = False

    family = "bwd_sm80"  # the preprocess kernel's family (and every kernel's without hopper)
    # Head dim -> query rows per step of the Hopper dK/dV kernel (BwdSm90Traits, BwdSm90WideTraits).
    HOPPER_BLOCK_M = {64: 128, 128: 64, 192: 64, 256: 64}
    # Head dim -> keys per step of the Hopper dQ kernel (BwdSm90DqTraits).
    HOPPER_DQ_BLOCK_N = {64: 128, 128: 64, 192: 64, 256: 32}
    # Head dims of the Hopper dK/dV kernel whose consumers split keys, then columns (256) or outputs (192)
    # (BwdSm90WideTraits).
    HOPPER_WIDE = (192, 256)

    @property
    def wide(self) -> bool:
        """The Hopper dK/dV kernel of cuda_src/bwd_sm90_wide.cuh."""
        return self.hopper and self.headdim in self.HOPPER_WIDE

    def atomic_dq(self, deterministic: bool) -> bool:
        """Whether the dK/dV kernel sums dQ with atomics (else the dQ kernel computes it): in the
        default mode, but for the wide kernel, which with the dQ kernel after it took 0.93-1.01x the
        time of a form that summed dQ in it (H100, bench/PERFLOG.md)."""
        return not (deterministic or self.wide)

    @property
    def kernel_family(self) -> str:
        """The family of the dK/dV, deterministic dQ and dQ conversion kernels."""
        return "bwd_sm90" if self.hopper else self.family

    @property
    def dkdv_threads(self) -> int:
        return 384 if self.hopper else 32 * self.dkdv_warps

    @property
    def dkdv_block_n(self) -> int:
        if self.hopper:
            return 64 if self.wide else 128
        return 16 * self.dkdv_warps

    @property
    def hopper_dq_cols(self) -> int:
        """BwdSm90Traits::DQ_N: head-dim columns of each consumer's share of dQ."""
        return self.headdim if self.dkdv_block_m == 128 else self.headdim // 2

    @property
    def dkdv_chunk(self) -> int:
        return self.dkdv_chunk_m or self.dkdv_block_m

    @property
    def dq_block_m(self) -> int:
        return 16 * self.dq_warps

    def dkdv_smem_layout(self, atomic_dq: bool) -> dict[str, int]:
        """The dK/dV kernel's shared memory: BwdSm90Traits (K, V, STAGES x Q, STAGES x dO, 2 x dS^T,
        a dQ tile per consumer, STAGES x lse2 and Delta rows, mbarriers, the next tile), BwdSm90WideTraits
        (K, V, STAGES x Q, STAGES x dO, 2 x P, 2 x dS, STAGES x lse2 and Delta rows, mbarriers) or
        BwdDkdvTraits (K, V, STAGES x Q, STAGES x dO, STAGES x lse2 rows, STAGES x delta rows, dS^T)."""
        n, m, d, stages = self.dkdv_block_n, self.dkdv_block_m, self.headdim, self.stages
        if self.wide:
            tile = 2 * m * n  # one P or dS tile
            return _layout(("K", 2 * n * d), ("V", 2 * n * d), ("Q", stages * 2 * m * d), ("DO", stages * 2 * m * d),
                           ("P", 2 * tile), ("DS", 2 * tile), ("ROWS", 2 * stages * 4 * m),
                           ("BARS", 8 * (1 + 2 * stages)))
        if self.hopper:
            ds = 2 * n * m if atomic_dq else 0
            dq = 64 * self.hopper_dq_cols * 4 if atomic_dq else 0
            return _layout(("K", 2 * n * d), ("V", 2 * n * d), ("Q", stages * 2 * m * d), ("DO", stages * 2 * m * d),
                           ("DS", 2 * ds), ("DQ", 2 * dq), ("ROWS", 2 * stages * 4 * m),
                           ("BARS", 8 * (2 + 2 * stages)), ("TILE", 16))
        return _layout(("K", 2 * n * d), ("V", 2 * n * d), ("Q", 2 * stages * m * d), ("DO", 2 * stages * m * d),
                       ("LSE2", 4 * stages * m), ("DELTA", 4 * stages * m),
                       ("DS", 2 * n * m if atomic_dq else 0))

    def dkdv_smem_bytes(self, atomic_dq: bool) -> int:
        return self.dkdv_smem_layout(atomic_dq)["SMEM_BYTES"]

    def smem_bytes(self) -> int:
        """The most dynamic shared memory any of its kernels takes."""
        return max(self.dkdv_smem_bytes(self.atomic_dq(deterministic=False)), self.dq_smem_bytes())

    def dkdv_traits(self, atomic_dq: bool) -> str:
        """The C++ traits type of the dK/dV kernel."""
        if self.hopper:
            args = [self.headdim, self.dkdv_block_m, self.stages, _cpp_bool(atomic_dq)]
            traits = "BwdSm90WideTraits" if self.wide else "BwdSm90Traits"
            return f"cuflash::{traits}<" + ", ".join(str(a) for a in args) + ">"
        args = [self.headdim, self.dkdv_block_m, self.dkdv_chunk, self.dkdv_warps, self.stages, _cpp_bool(atomic_dq)]
        return "cuflash::BwdDkdvTraits<" + ", ".join(str(a) for a in args) + ">"

    @property
    def dq_threads(self) -> int:
        return 384 if self.hopper else 32 * self.dq_warps

    def dq_smem_layout(self) -> dict[str, int]:
        """The deterministic dQ kernel's shared memory: BwdSm90DqTraits (Q, dO, STAGES x K, STAGES x V,
        lse2 and Delta rows, mbarriers) or BwdDqTraits (Q, dO, STAGES x K, STAGES x V)."""
        m, n, d, stages = self.dq_block_m, self.dq_block_n, self.headdim, self.stages
        qb, kv = 2 * m * d, stages * 2 * n * d
        if self.hopper:
            return _layout(("Q", qb), ("DO", qb), ("K", kv), ("V", kv), ("ROWS", 2 * 4 * m),
                           ("BARS", 8 * (1 + 4 * stages)))
        return _layout(("Q", qb), ("DO", qb), ("K", kv), ("V", kv))

    def dq_smem_bytes(self) -> int:
        return self.dq_smem_layout()["SMEM_BYTES"]

    def dq_traits(self) -> str:
        """The C++ traits type of the deterministic dQ kernel."""
        if self.hopper:
            return f"cuflash::BwdSm90DqTraits<{self.headdim}, {self.dq_block_n}, {self.stages}>"
        return f"cuflash::BwdDqTraits<{self.headdim}, {self.dq_warps}, {self.dq_block_n}, {self.stages}>"

    def is_valid(self) -> bool:
        """Static constraints of BwdDkdvTraits (in both dQ modes) and BwdDqTraits (the static_asserts)."""
        rows = (32, 64, 128)
        if self.hopper:
            hopper_ok = self.HOPPER_BLOCK_M.get(self.headdim) == self.dkdv_block_m and 2 <= self.stages <= 3
            dq_ok = self.dq_warps == 8 and self.HOPPER_DQ_BLOCK_N.get(self.headdim) == self.dq_block_n
            return hopper_ok and dq_ok and self.smem_bytes() <= SM90_SMEM_LIMIT
        if not (self.headdim in KERNEL_HEADDIMS and self.dkdv_block_m in rows and self.dq_block_m in rows
                and 2 <= self.stages <= 3 and self.dq_block_n % 16 == 0 and self.dq_block_n >= 16):
            return False
        row_tiles = self.dkdv_block_m // 16
        if self.dkdv_warps % row_tiles or self.dkdv_chunk % 16 or self.dkdv_block_m % self.dkdv_chunk:
            return False
        dq_cols = self.headdim // (self.dkdv_warps // row_tiles)
        return dq_cols % 16 == 0 and self.smem_bytes() <= SM90_SMEM_LIMIT

    def dkdv_name(self, dtype_name: str, causal: bool, even_n: bool, even_d: bool, atomic_dq: bool,
                  mods: int = 0) -> str:
        """The dK/dV kernel; the Hopper one has no even_d argument (TMA zero-fills columns past d)."""
        if self.hopper:
            args = [self.headdim, self.dkdv_block_m, self.stages, SM90_DTYPES[dtype_name], _cpp_bool(causal),
                    _cpp_bool(even_n), _cpp_bool(atomic_dq)]
            kernel_ = "bwd_sm90_wide_kernel" if self.wide else "bwd_sm90_kernel"
            return f"cuflash::{kernel_}<" + ", ".join(str(a) for a in [*args, mods]) + ">"
        args = [self.headdim, self.dkdv_block_m, self.dkdv_chunk, self.dkdv_warps, self.stages, self.min_blocks,
                _cpp_bool(dtype_name == "bfloat16"), _cpp_bool(causal), _cpp_bool(even_n), _cpp_bool(even_d),
                _cpp_bool(atomic_dq)]
        return "cuflash::bwd_dkdv_kernel<" + ", ".join(str(a) for a in [*args, mods]) + ">"

    def dq_name(self, dtype_name: str, causal: bool, even_n: bool, even_d: bool, mods: int = 0) -> str:
        """The deterministic dQ kernel; the Hopper one has no even_d argument."""
        if self.hopper:
            args = [self.headdim, self.dq_block_n, self.stages, SM90_DTYPES[dtype_name], _cpp_bool(causal),
                    _cpp_bool(even_n)]
            return "cuflash::bwd_sm90_dq_kernel<" + ", ".join(str(a) for a in [*args, mods]) + ">"
        args = [self.headdim, self.dq_warps, self.dq_block_n, self.stages, self.min_blocks,
                _cpp_bool(dtype_name == "bfloat16"), _cpp_bool(causal), _cpp_bool(even_n), _cpp_bool(even_d)]
        return "cuflash::bwd_dq_kernel<" + ", ".join(str(a) for a in [*args, mods]) + ">"

    def preprocess_name(self, dtype_name: str, varlen: bool = False) -> str:
        lanes = preprocess_row_lanes(self.headdim)
        return f"cuflash::bwd_preprocess_kernel<{_cpp_bool(dtype_name == 'bfloat16')}, {_cpp_bool(varlen)}, {lanes}>"

    @staticmethod
    def convert_dq_name(dtype_name: str, varlen: bool = False) -> str:
        return f"cuflash::bwd_convert_dq_kernel<{_cpp_bool(dtype_name == 'bfloat16')}, {_cpp_bool(varlen)}>"

    def dq_accum_convert_name(self, dtype_name: str, varlen: bool = False) -> str:
        """The kernel turning dq_accum into dq: the Hopper kernel leaves each
        block of dq_accum in its own (fragment) order."""
        if self.hopper:
            args = [_cpp_bool(dtype_name == "bfloat16"), self.headdim, self.dkdv_block_m, _cpp_bool(varlen)]
            return "cuflash::bwd_sm90_convert_dq_kernel<" + ", ".join(str(a) for a in args) + ">"
        return self.convert_dq_name(dtype_name, varlen)

    def short_name(self) -> str:
        if self.hopper:
            return (f"d{self.headdim}_dkdv{self.dkdv_block_m}x{self.dkdv_block_n}sm90"
                    f"_dq{self.dq_block_m}x{self.dq_block_n}_s{self.stages}")
        return (
            f"d{self.headdim}_dkdv{self.dkdv_block_m}x{self.dkdv_block_n}w{self.dkdv_warps}"
            f"_dq{self.dq_block_m}x{self.dq_block_n}_s{self.stages}"
            + (f"_c{self.dkdv_chunk}" if self.dkdv_chunk != self.dkdv_block_m else "")
            + (f"_b{self.min_blocks}" if self.min_blocks != 1 else "")
        )


# Splits of a decoding step's keys at most (the kernel keeps a weight per split and row).
DECODE_MAX_SPLITS = cpp_int_constant("decode_sm80.cuh", "DECODE_MAX_SPLITS")
# Rows per tile up to which the decoding kernel merges its splits itself (cuflash/decode_launch.py
# has the measurement behind it).
DECODE_MERGE_MAX_ROWS = cpp_int_constant("decode_sm80.cuh", "DECODE_MERGE_MAX_ROWS")
# Floats after each row of a warp's output where the decoding kernel's warps merge (bank conflicts).
DECODE_MERGE_PAD = cpp_int_constant("decode_sm80.cuh", "DECODE_MERGE_PAD")
# Split CTAs of a decoding step that one thread-block cluster merges at most (sm_90).
DECODE_CLUSTER_MAX = cpp_int_constant("decode_sm80.cuh", "DECODE_CLUSTER_MAX")
# Warps of a wgmma decoding tile that stream its ring, after the row warps.
DECODE_COPY_WARPS = cpp_int_constant("decode_sm80.cuh", "DECODE_COPY_WARPS")


@dataclasses.dataclass(frozen=True, order=True)
class DecodeConfig:
    """Tile shape of the decoding kernel (cuda_src/decode_sm80.cuh): 4 or 8 warps, 64 keys a stage.

    headdim: kernel head dim (one of KERNEL_HEADDIMS).
    warps_m: warps splitting the packed (query, head) rows, 16 rows each.
    warps_n: warps splitting each stage's keys.
    stages: key blocks in the cp.async ring.
    fp8: the cache holds e4m3 (the ring holds e4m3 rows, widened a stage at a time).
    wgmma: the GEMMs on Hopper's wgmma (the decode_sm90 family): 4 or 8 row warps, 1 key warp, 16-bit;
        a warpgroup of copy warps (DECODE_COPY_WARPS) streams the ring.
    """

    headdim: int
    warps_m: int
    warps_n: int
    stages: int
    fp8: bool = False
    wgmma: bool = False

    BLOCK_N = 64  # DecodeTraits::BN

    @property
    def family(self) -> str:
        return "decode_sm90" if self.wgmma else "decode_sm80"

    @property
    def block_m(self) -> int:
        return 16 * self.warps_m

    @property
    def threads(self) -> int:
        return 32 * (self.warps_m * self.warps_n + (DECODE_COPY_WARPS if self.wgmma else 0))

    def smem_layout(self) -> dict[str, int]:
        """DecodeTraits: the Q tile, STAGES K tiles, STAGES V tiles (16-bit); with an fp8 cache the
        ring's tiles are e4m3, and a 16-bit V tile follows them; wgmma tiles end with each stage's
        full and empty mbarriers and the merge's two."""
        tile = self.BLOCK_N * self.headdim * (1 if self.fp8 else 2)
        return _layout(("Q", 2 * self.block_m * self.headdim), ("K", self.stages * tile), ("V", self.stages * tile),
                       ("V16", 2 * tile if self.fp8 else 0), ("BARS", 16 * self.stages + 16 if self.wgmma else 0))

    def smem_bytes(self) -> int:
        return self.smem_layout()["SMEM_BYTES"]

    def is_valid(self) -> bool:
        """Static constraints of DecodeTraits (the static_asserts): after the key loop the K/V ring
        holds the warps' fp32 outputs, maxima and sums (warps_n x block_m x (D + DECODE_MERGE_PAD + 2)
        floats), and in tiles that merge their splits (DECODE_MERGE_MAX_ROWS) the merge's weights;
        wgmma tiles are whole row warpgroups over a 16-bit cache in 64-column panels, with a block in
        flight beside the two a key step uses."""
        layout = self.smem_layout()
        ring = layout["OFF_BARS"] - layout["OFF_K"]  # DecodeTraits::RING_END
        return (self.warps_m in (1, 2, 4, 8) and self.warps_n in (1, 2, 4) and self.warps_m * self.warps_n in (4, 8)
                and 2 <= self.stages <= 8
                and 4 * self.warps_n * self.block_m * (self.headdim + DECODE_MERGE_PAD + 2) <= ring
                and (self.block_m > DECODE_MERGE_MAX_ROWS or 4 * (DECODE_MAX_SPLITS + 1) * self.block_m <= ring)
                and (not self.wgmma or self.warps_m in (4, 8) and self.warps_n == 1 and not self.fp8
                     and self.headdim % 64 == 0 and self.stages >= 3))

    def traits(self) -> str:
        return (f"cuflash::DecodeTraits<{self.headdim}, {self.warps_m}, {self.warps_n}, {self.stages}, "
                f"{_cpp_bool(self.fp8)}, {_cpp_bool(self.wgmma)}>")

    def name_expression(self, dtype_name: str, paged: bool, causal: bool, mods: int = 0) -> str:
        if dtype_name not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype_name!r}")
        args = [self.headdim, self.warps_m, self.warps_n, self.stages, _cpp_bool(dtype_name == "bfloat16"),
                _cpp_bool(self.fp8), _cpp_bool(paged), _cpp_bool(causal), mods]
        if self.wgmma:
            args.append("true")
        return "cuflash::decode_kernel<" + ", ".join(str(a) for a in args) + ">"

    @staticmethod
    def reads_fp8(name: str) -> bool:
        """Whether a kernel name expression is a decoding kernel over an fp8 cache (its FP8 argument)."""
        if not name.startswith("cuflash::decode_kernel<"):
            return False
        return name[name.index("<") + 1:-1].split(",")[5].strip() == "true"

    def short_name(self) -> str:
        return (f"d{self.headdim}_m{self.block_m}_n{self.BLOCK_N}_w{self.warps_m * self.warps_n}_s{self.stages}"
                + ("_e4m3" if self.fp8 else "") + ("_wgmma" if self.wgmma else ""))


# combine_kernel's OUT template argument per output dtype (cuda_src/combine.cuh).
COMBINE_OUT = {"float16": cpp_int_constant("combine.cuh", "COMBINE_OUT_F16"),
               "bfloat16": cpp_int_constant("combine.cuh", "COMBINE_OUT_BF16"),
               "float32": cpp_int_constant("combine.cuh", "COMBINE_OUT_F32")}


def combine_name(out_dtype_name: str, prefetch: bool) -> str:
    """combine_kernel for an output dtype; prefetch: the form that loads its first splits' outputs
    before it merges their logsumexps (cuda_src/combine.cuh, COMBINE_PREFETCH_SPLITS)."""
    return f"cuflash::combine_kernel<{COMBINE_OUT[out_dtype_name]}, {'true' if prefetch else 'false'}>"
