"""Tensor maps for the Hopper kernel's bulk tensor copies (TMA).

A tensor map describes a strided tensor in device memory and the box one copy
moves; the driver encodes it (cuTensorMapEncodeTiled, through cuda-python:
CuPy has no binding) into 128 opaque bytes, which the kernel receives by value
as a `__grid_constant__` parameter (cuda_src/sm90_tiles.cuh: TmaDesc;
cuflash/kernel_call.py packs it).

Every map here is 4-D, innermost dim first, with a box whose inner extent is
one 128-byte swizzled panel (cuda_src/common.cuh: tile_offset), so that a copy
lands in shared memory in the layout wgmma reads. Elements past a dim's end
arrive as zeros: ragged sequence ends and head dims below the kernel's need
no masking on the loads.
"""

from __future__ import annotations

import functools

import numpy

# A map's bytes as the kernel parameter takes them: 16 little-endian words.
TMA_DESC_WORDS = 16

# Bytes of one swizzled panel row: the box's inner extent (128B swizzle).
PANEL_BYTES = 128
# Keys per panel of fp8 Vt (64-byte swizzle: cuda_src/sm90_tiles.cuh, desc_k_major_sw64).
VT_PANEL_KEYS = 64


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before the cuda.bindings package
        try:
            from cuda import cuda as driver
        except ImportError:
            raise RuntimeError(
                "cuflash: the Hopper kernel needs cuda-python for its tensor maps: pip install cuda-bindings"
            ) from None
    return driver


@functools.lru_cache(maxsize=1)
def _init_driver():
    driver = _driver()
    (err,) = driver.cuInit(0)
    if int(err) != 0:
        raise RuntimeError(f"cuflash: cuInit failed with CUresult {int(err)}")
    return driver


@functools.lru_cache(maxsize=4096)
def encode(ptr: int, itemsize: int, dims: tuple[int, ...], strides_bytes: tuple[int, ...],
           box: tuple[int, ...], swizzle_bytes: int = PANEL_BYTES) -> numpy.ndarray:
    """A tiled tensor map over `dims` (innermost first, elements) with byte strides of dims 1..3.

    swizzle_bytes: 128 or 64, the shared-memory swizzle (the box's inner extent in bytes).

    Cached on its arguments: a training loop that reuses its buffers encodes once.
    """
    driver = _init_driver()
    dtype = {1: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
             2: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16}[itemsize]
    err, tmap = driver.cuTensorMapEncodeTiled(
        dtype,
        len(dims),
        ptr,
        [driver.cuuint64_t(n) for n in dims],
        [driver.cuuint64_t(s) for s in strides_bytes],
        [driver.cuuint32_t(n) for n in box],
        [driver.cuuint32_t(1)] * len(dims),
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        {128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
         64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B}[swizzle_bytes],
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if int(err) != 0:
        raise RuntimeError(
            f"cuflash: cuTensorMapEncodeTiled failed (CUresult {int(err)}) for dims {dims}, "
            f"strides {strides_bytes} bytes, box {box}"
        )
    words = numpy.array([int(x) for x in tmap.opaque], numpy.uint64)
    words.flags.writeable = False  # memoised: shared by every launch that asks for this map
    return words


def _safe_strides(inner_bytes: int, shape, strides_bytes) -> tuple[int, ...]:
    # A dim of extent 1 is never stepped over, and its reported stride may be
    # anything (0 for a broadcast); TMA wants a nonzero multiple of 16 below
    # 2^40, so such a dim gets the packed stride of the dims inside it.
    out = []
    span = inner_bytes
    for n, s in zip(shape, strides_bytes):
        if n <= 1:
            s = -(-span // 16) * 16
        out.append(s)
        span = n * s
    return tuple(out)


def seq_major_map(x, box_rows: int) -> numpy.ndarray:
    """Map over a (batch, seq, heads, headdim) array; box: one panel of headdim x `box_rows` rows.

    Coordinates in the kernel: (column, row, head, batch).
    """
    return _seq_major_map(x.data.ptr, x.itemsize, x.shape, x.strides, box_rows)


# Memoised on the array's address and layout: the Hopper forward asks for three
# or four maps on every call, and forming the arguments took ~2.5 us each.
@functools.lru_cache(maxsize=4096)
def _seq_major_map(ptr: int, itemsize: int, shape: tuple, strides_bytes: tuple, box_rows: int) -> numpy.ndarray:
    batch, seqlen, heads, headdim = shape
    sb, sn, sh, _ = strides_bytes
    dims = (headdim, seqlen, heads, batch)
    strides = _safe_strides(headdim * itemsize, (seqlen, heads, batch), (sn, sh, sb))
    return encode(ptr, itemsize, dims, strides, (PANEL_BYTES // itemsize, box_rows, 1, 1))


def keys_major_map(vt, box_rows: int) -> numpy.ndarray:
    """Map over fp8 Vt (batch, heads_kv, headdim, keys), keys contiguous; box: one 64-byte-swizzled panel
    of VT_PANEL_KEYS keys x `box_rows` rows.

    Coordinates in the kernel: (key, row of head dim, kv head, batch).
    """
    batch, heads, headdim, keys = vt.shape
    sb, sh, sd, _ = vt.strides
    dims = (keys, headdim, heads, batch)
    strides = _safe_strides(keys * vt.itemsize, (headdim, heads, batch), (sd, sh, sb))
    return encode(vt.data.ptr, vt.itemsize, dims, strides, (VT_PANEL_KEYS, box_rows, 1, 1), swizzle_bytes=64)


def usable(x) -> bool:
    """Whether a (batch, seq, heads, headdim) array can be described by a tensor map as it is."""
    if x.data.ptr % 16:
        return False
    return all(s > 0 and s % 16 == 0 for n, s in zip(x.shape[:3], x.strides[:3]) if n > 1)
