"""The backward's launch sequence on the host, with the kernels replaced by recorders (no GPU): what
run() launches, in which order, on which grids, and where the preprocess zeroes the dQ accumulator."""

import ctypes
import itertools

import numpy as np
import pytest

from cuflash import dispatch, launch
from cuflash.config import preprocess_row_lanes

_addresses = itertools.count(1 << 20, 1 << 16)


class FakeArray:
    """What the launch layer reads of a device array: shape, strides, dtype and an address."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, shape, dtype):
        host = np.empty(shape, dtype)
        self.shape, self.strides, self.itemsize, self.dtype, self.size = (
            host.shape, host.strides, host.itemsize, host.dtype, host.size)
        self.data = self._Data(next(_addresses))


class Recorder:
    smem_bytes = 0

    def __init__(self, family, name, launches):
        self.family, self.name, self.launches = family, name, launches

    def launch(self, grid, threads, args, stream):
        self.launches.append((self.name, grid, threads, args))


def word(args, i: int) -> int:
    """Argument i's first 8-byte word."""
    return int(args.buffer[args.words[i]])


@pytest.mark.parametrize("deterministic", [False, True])
def test_run_launches_preprocess_dkdv_dq_and_the_preprocess_zeroes_the_accumulator(monkeypatch, deterministic):
    launches = []
    monkeypatch.setattr(launch, "kernel", lambda family, name, smem, device: Recorder(family, name, launches))
    b, n, h, d = 2, 300, 3, 64
    q, k, v, dout, out, dq, dk, dv = (FakeArray((b, n, h, d), np.float16) for _ in range(8))
    lse = FakeArray((b, h, n), np.float32)
    cfg = dispatch.HEURISTIC_BWD[d]
    problem = dispatch.BwdProblem("float16", d, False, n, n, 1, deterministic)
    run = launch.prepare_bwd(cfg, problem, 0.125, q, k, v, dout, out, lse, dq, dk, dv, 0)
    workspace = launch.BackwardWorkspace(run.floats, 0, FakeArray((run.floats,), np.float32))
    run.run(q, k, v, dout, out, lse, dq, dk, dv, 0, workspace)

    names = [name for name, *_ in launches]
    last = cfg.dq_name("float16", False, False, True) if deterministic else cfg.dq_accum_convert_name("float16")
    assert names == [cfg.preprocess_name("float16"), names[1], last]
    assert "dkdv" in names[1]
    (_, pre_grid, pre_threads, pre_args), (_, dkdv_grid, _, _), (_, last_grid, _, _) = launches
    rows = launch.padded_rows(n)
    lanes = preprocess_row_lanes(cfg.headdim)
    assert pre_grid == (-(-rows // (pre_threads // lanes)), h, b)
    assert pre_grid[0] * pre_threads // lanes >= rows  # every padded row has its lanes
    assert dkdv_grid == (-(-n // cfg.dkdv_block_n), h, b)
    assert last_grid[0] * (cfg.dq_block_m if deterministic else pre_threads // 32) >= n
    lse2 = workspace.buffer.data.ptr
    assert word(pre_args, 3) == lse2 and word(pre_args, 4) == lse2 + 4 * run.rows
    accum_row = word(pre_args, 9) & 0xFFFFFFFF
    if deterministic:
        assert accum_row == 0
    else:  # the accumulator the dK/dV kernel adds into and the convert reads, zeroed row by row
        assert accum_row == cfg.headdim
        assert word(pre_args, 5) == lse2 + 8 * run.rows
        assert run.floats == 2 * run.rows + run.rows * accum_row
    # a second call with the same arrays launches the same three again
    run.run(q, k, v, dout, out, lse, dq, dk, dv, 0, workspace)
    assert [name for name, *_ in launches[3:]] == names


@pytest.mark.parametrize("headdim, lanes", [(32, 4), (64, 8), (96, 16), (128, 16), (256, 16)])
def test_the_preprocess_gives_a_row_the_lanes_its_16_byte_loads_need(headdim, lanes):
    assert preprocess_row_lanes(headdim) == lanes
    assert 8 * lanes >= min(headdim, 128) and (lanes == 4 or 8 * lanes // 2 < headdim)


def test_the_programmatic_launch_config_has_the_layout_of_cuda_h():
    """The Hopper backward's dK/dV and dQ kernels go through cuLaunchKernelEx: the structs it reads
    are laid out as cuda.h's CUlaunchAttribute (72 bytes, the value at 8) and CUlaunchConfig (56 bytes)."""
    from cuflash.kernel_call import _LaunchAttribute, _LaunchConfig

    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    offsets = {name: getattr(_LaunchConfig, name).offset for name in ("block", "smem", "stream", "attrs", "num_attrs")}
    assert offsets == {"block": 12, "smem": 24, "stream": 32, "attrs": 40, "num_attrs": 48}


@pytest.mark.parametrize("causal, deterministic, window, persistent", [
    (False, False, None, True), (True, False, None, True), (False, True, None, False),
    (False, False, (64, 64), False)])
def test_the_hopper_dkdv_kernel_is_persistent_but_with_windows_packed_batches_or_determinism(
        monkeypatch, causal, deterministic, window, persistent):
    """One CTA an SM takes the tiles from a ticket without a window or packed batch (with the atomic
    dQ); else one CTA a tile (cuda_src/bwd_sm90.cuh: bwd_sm90_persistent, which traps on a grid
    smaller than the tiles)."""
    from cuflash.score_mods import ScoreMods

    launches = []
    monkeypatch.setattr(launch, "kernel", lambda family, name, smem, device: Recorder(family, name, launches))
    monkeypatch.setattr(launch, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(launch.tma, "usable", lambda x: True)
    b, n, h, d = 2, 4096, 16, 128
    q, k, v, dout, out, dq, dk, dv = (FakeArray((b, n, h, d), np.float16) for _ in range(8))
    lse = FakeArray((b, h, n), np.float32)
    cfg = dispatch.HEURISTIC_BWD_SM90[d]
    problem = dispatch.BwdProblem("float16", d, causal, n, n, 1, deterministic, arch=90, mods=ScoreMods(window=window))
    run = launch.prepare_bwd(cfg, problem, 0.125, q, k, v, dout, out, lse, dq, dk, dv, 0)
    _, dkdv_grid, _, _ = run.stages["dkdv"]
    tiles = -(-n // cfg.dkdv_block_n) * h * b  # 1,024
    assert launch.hopper_bwd_persistent(cfg, problem) == persistent
    assert dkdv_grid == ((132 if persistent else tiles), 1, 1)
