"""Kernel choice without a GPU: family per architecture, shared-memory fallbacks."""

import dataclasses
import itertools

import pytest

from cuflash import dispatch
from cuflash.config import KERNEL_HEADDIMS, SM90_SMEM_LIMIT, FwdConfig, FwdSm90Config, kernel_headdim
from cuflash.score_mods import Dropout, ScoreMods

H200_SMEM = SM90_SMEM_LIMIT
ADA_SMEM = 99 * 1024  # sm_86 / sm_89 opt-in shared memory per block


def problem(headdim, *, arch=80, max_smem=H200_SMEM, seqlen=4096, causal=False):
    return dispatch.FwdProblem("float16", headdim, causal, seqlen, seqlen, 1, max_smem, arch)


@pytest.mark.parametrize("headdim", [64, 128, 256, 120, 72, 96, 160, 192, 200, 224])
def test_hopper_takes_the_sm90_kernel(headdim):
    # Head dims between the Hopper kernels' run on the next larger one.
    cfg = dispatch.heuristic_fwd_config(problem(headdim, arch=90))
    assert isinstance(cfg, FwdSm90Config) and cfg.headdim >= headdim


@pytest.mark.parametrize("headdim", [64, 48])
@pytest.mark.parametrize("causal,longest", [(False, 1024), (True, 6144)])
def test_hopper_short_keys_at_headdim_64(headdim, causal, longest):
    # Up to 1k keys (6k under the causal mask), head dims served by the 64
    # kernel take its short-key tiles.
    short, limits = dispatch.SM90_SHORT_KEYS[64]
    assert limits[causal, False] == longest
    assert dispatch.heuristic_fwd_config(problem(headdim, arch=90, seqlen=longest, causal=causal)) == short
    assert (dispatch.heuristic_fwd_config(problem(headdim, arch=90, seqlen=longest + 1, causal=causal))
            == dispatch.HEURISTIC_SM90[64])
    assert dispatch.heuristic_fwd_config(problem(128, arch=90, seqlen=512, causal=causal)) == dispatch.HEURISTIC_SM90[128]


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_alibi_short_keys_at_headdim_64(causal):
    # With ALiBi, head dim 64 keeps the short-key tiles up to 4k keys (6k under the causal mask, as plain);
    # head dim 128 its table's tiles.
    alibi = ScoreMods(alibi=True)
    short, limits = dispatch.SM90_SHORT_KEYS[64]
    longest = limits[causal, True]
    assert longest == (6144 if causal else 4096)
    for seqlen, expected in ((longest, short), (longest + 1, dispatch.HEURISTIC_SM90[64])):
        with_alibi = dataclasses.replace(problem(64, arch=90, seqlen=seqlen, causal=causal), mods=alibi)
        assert dispatch.heuristic_fwd_config(with_alibi) == expected
    at_128 = dataclasses.replace(problem(128, arch=90, seqlen=1024, causal=causal), mods=alibi)
    assert dispatch.heuristic_fwd_config(at_128) == dispatch.HEURISTIC_SM90[128]


@pytest.mark.parametrize("seqlen", [512, 2048, 16384])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_dropout_tiles(seqlen, causal):
    # With dropout, head dim 64 takes the dropout table's tiles at every length; head dim 128 its own.
    dropout = ScoreMods(dropout=Dropout(0.1, 1, 0))
    for headdim, expected in ((64, dispatch.SM90_DROPOUT[64]), (128, dispatch.HEURISTIC_SM90[128])):
        with_dropout = dataclasses.replace(problem(headdim, arch=90, seqlen=seqlen, causal=causal), mods=dropout)
        assert dispatch.heuristic_fwd_config(with_dropout) == expected
    assert dispatch.SM90_DROPOUT[64] in dispatch.sm90_table_configs()


@pytest.mark.parametrize("headdim", [8, 32])
def test_hopper_falls_back_where_no_sm90_kernel(headdim):
    assert isinstance(dispatch.heuristic_fwd_config(problem(headdim, arch=90)), FwdConfig)


@pytest.mark.parametrize("arch", [80, 86, 89, 100])
def test_other_gpus_take_the_sm80_kernel(arch):
    assert isinstance(dispatch.heuristic_fwd_config(problem(128, arch=arch)), FwdConfig)


def test_even_lengths_take_the_fast_config_and_ragged_ones_the_general():
    fast, general = dispatch.HEURISTIC_FWD[128]
    assert dispatch.heuristic_fwd_config(problem(128, seqlen=4096)) == fast
    assert dispatch.heuristic_fwd_config(problem(128, seqlen=4000)) == general
    assert dispatch.heuristic_fwd_config(problem(120, seqlen=4096)) == general  # padded head dim


@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
@pytest.mark.parametrize("max_smem", [ADA_SMEM, 163 * 1024, H200_SMEM])
def test_every_choice_fits_the_shared_memory(headdim, max_smem):
    for arch in (80, 90):
        for seqlen in (4096, 4000):
            assert dispatch.heuristic_fwd_config(problem(headdim, arch=arch, max_smem=max_smem,
                                                         seqlen=seqlen)).smem_bytes() <= max_smem
    for arch, deterministic in itertools.product((80, 90), (False, True)):
        cfg = dispatch.bwd_tiles(headdim, max_smem, arch, deterministic)
        assert cfg.smem_bytes() <= max_smem
        assert cfg.dkdv_smem_bytes(not deterministic) <= max_smem
        if deterministic:
            assert cfg.dq_smem_bytes() <= max_smem


@pytest.mark.parametrize("headdim", [1, 48, 64, 65, 96, 128, 129, 160, 192, 200, 256])
def test_backward_uses_the_hopper_kernel_on_sm90_only(headdim):
    kd = kernel_headdim(headdim)
    hopper = dispatch.bwd_tiles(headdim, H200_SMEM, 90)
    assert hopper.hopper == (kd >= 64)
    assert hopper.is_valid() and hopper.headdim == {96: 128, 160: 192, 224: 256}.get(kd, kd)
    assert hopper.wide == (kd > 128)
    assert hopper.atomic_dq(deterministic=False) == (kd <= 128) and not hopper.atomic_dq(deterministic=True)
    assert dispatch.bwd_tiles(headdim, H200_SMEM, 90, deterministic=True).hopper == (kd >= 64)
    assert not dispatch.bwd_tiles(headdim, H200_SMEM, 80).hopper


def test_no_kernel_fits_raises_clearly():
    with pytest.raises(RuntimeError, match="shared memory"):
        dispatch.heuristic_fwd_config(problem(256, max_smem=16 * 1024))
    with pytest.raises(RuntimeError, match="shared memory"):
        dispatch.bwd_tiles(256, 16 * 1024)
