"""Kernel configurations: Python mirrors of the C++ template parameters.

`FwdConfig` fields match `cuflash::fwd_kernel`'s tile parameters one to one;
`smem_bytes()` repeats `FwdTraits::SMEM_BYTES` (a test compiles the traits and
checks the two agree).
"""

from __future__ import annotations

import dataclasses

# Head dims the kernels are instantiated for; a user head dim d (multiple of 8)
# runs on the smallest of these >= d with the extra columns zero-filled.
KERNEL_HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)

DTYPE_NAMES = ("float16", "bfloat16")


def kernel_headdim(d: int) -> int:
    """The instantiated head dim that serves a user head dim `d`."""
    for kd in KERNEL_HEADDIMS:
        if d <= kd:
            return kd
    raise ValueError(f"head dim {d} exceeds {KERNEL_HEADDIMS[-1]}")


def _cpp_bool(x: bool) -> str:
    return "true" if x else "false"


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

    def smem_bytes(self) -> int:
        q_elems = self.block_m * self.headdim
        kv_elems = self.block_n * self.headdim
        return 2 * (q_elems + 2 * self.stages * kv_elems)

    def is_valid(self) -> bool:
        """Static constraints of FwdTraits (the static_asserts)."""
        return (
            self.headdim in KERNEL_HEADDIMS
            and self.block_n % 16 == 0
            and self.block_n >= 16
            and 1 <= self.stages <= 4
            and self.m_tiles in (1, 2)
            and 1 <= self.warps <= 16
            and self.smem_bytes() <= 227 * 1024
        )

    def name_expression(self, dtype_name: str, causal: bool, even_n: bool, even_d: bool) -> str:
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
        return "cuflash::fwd_kernel<" + ", ".join(str(a) for a in args) + ">"

    def short_name(self) -> str:
        return (
            f"d{self.headdim}_m{self.block_m}_n{self.block_n}_w{self.warps}"
            f"_mt{self.m_tiles}_s{self.stages}_b{self.min_blocks}"
            + ("" if self.q_in_regs else "_qs")
        )
