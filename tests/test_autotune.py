"""The autotuner without a GPU: its spaces and filters, the cache keys, and the JSON cache."""

import dataclasses
import json
import multiprocessing
import warnings

import pytest

from cuflash import compile as cf_compile
from cuflash import dispatch, score_mods, tune_cache, tuner
from cuflash.cli import autotune as cli_autotune
from cuflash.cli import info as cli_info
from cuflash.dispatch import BwdProblem
from cuflash.config import SM90_SMEM_LIMIT, BwdConfig, FwdConfig
from cuflash.dispatch import FwdProblem
from cuflash.tune_common import CallShape, seqlen_bucket
from cuflash.tune_bwd import BWD
from cuflash.tune_fwd import FWD, QUICK_SPACE

DEVICE = tune_cache.DeviceKey("Test GPU 80GB", "90")
H100 = tuner.DeviceLimits(DEVICE, smem_per_block=SM90_SMEM_LIMIT, smem_per_sm=228 * 1024, threads_per_sm=2048,
                          regs_per_block=65536, l2_bytes=50 << 20)


def entry(name="d64_x", ms=1.0):
    return {"config": {"headdim": 64, "block_n": 64, "warps": 4, "m_tiles": 1, "stages": 2}, "config_name": name,
            "ms": ms, "tflops": 100.0, "heuristic": {"config_name": "h", "ms": 2 * ms, "tflops": 50.0},
            "space": "quick", "timed": 3, "rejected": []}


# ---------------------------------------------------------------- space and filters


def test_keep_drops_over_budget_and_invalid():
    ok = FwdConfig(128, 64, 4, 2, 2, q_in_regs=False)  # 64 KiB
    assert FWD.keep(ok, H100)
    small = tuner.DeviceLimits(DEVICE, 48 * 1024, 100 * 1024, 2048, 65536, 1 << 20)
    assert not FWD.keep(ok, small)  # over the block's shared memory
    assert FWD.keep(FwdConfig(64, 32, 4, 1, 2), small)
    assert not FWD.keep(FwdConfig(128, 64, 4, 2, 2, min_blocks=2), small)  # 2 CTAs do not fit an SM
    assert not FWD.keep(FwdConfig(128, 128, 4, 1, 4), H100)  # over 227 KiB
    assert not FWD.keep(FwdConfig(64, 24, 4, 1, 2), H100)  # block_n not a multiple of 16
    assert not FWD.keep(FwdConfig(64, 64, 4, 1, 5), H100)  # too many stages
    assert not FWD.keep(FwdConfig(64, 64, 8, 2, 2), H100)  # 256-row tiles: larger than the key's alignment


def test_space_is_the_product_less_keep():
    problem = FwdProblem("float16", 128, False, 4096, 4096, 1)
    raw = FWD.space(problem, quick=True)
    assert len(raw) == len(set(raw)) == len(QUICK_SPACE["block_n"]) * len(QUICK_SPACE["warps"]) * \
        len(QUICK_SPACE["m_tiles"]) * len(QUICK_SPACE["stages"]) * len(QUICK_SPACE["q_in_regs"]) * \
        len(QUICK_SPACE["min_blocks"])
    assert all(c.headdim == 128 for c in raw)
    cands = tuner.candidates(FWD, problem, H100, quick=True)
    assert cands[0] == dispatch.heuristic_fwd_config(problem)
    assert len(cands) == len(set(cands))
    assert set(cands[1:]) == {c for c in raw if FWD.keep(c, H100)} - {cands[0]}
    assert 6 <= len(cands) <= 14
    full = tuner.candidates(FWD, problem, H100, quick=False)
    assert len(full) > len(cands)


def test_compile_filter_drops_spills_errors_and_register_hogs(monkeypatch):
    problem = FwdProblem("float16", 64, True, 4096, 4096, 1)
    heuristic = dispatch.heuristic_fwd_config(problem)
    clean, spills, broken, hog = (FwdConfig(64, 32, 4, 1, 2), FwdConfig(64, 64, 4, 1, 3),
                                  FwdConfig(64, 128, 4, 1, 2), FwdConfig(64, 64, 8, 1, 2))
    real = cf_compile.compile_report(clean.family, FWD.kernel_names(clean, problem)[0], "sm_90")
    assert real.ok and real.spills == 0 and tuner.compiled_ok(real, clean.threads, H100) is None

    def fake(family, name, arch):
        report = cf_compile.CompileReport(name, arch, ok=True, registers=128)
        if name in FWD.kernel_names(spills, problem):
            report.spill_stores = 16
        elif name in FWD.kernel_names(broken, problem):
            report.ok = False
        elif name in FWD.kernel_names(hog, problem):
            report.registers = 255  # x 256 threads > the 32k registers below
        return report

    monkeypatch.setattr(cf_compile, "compile_report", fake)
    monkeypatch.setattr(tuner, "_reports", {})
    limits = tuner.DeviceLimits(DEVICE, SM90_SMEM_LIMIT, 228 * 1024, 2048, 32768, 1 << 20)
    task = tuner.Task(FWD, problem, CallShape(1, 1, 1), "custom", [heuristic, clean, spills, broken, hog])
    tuner.compile_filter([task], limits, load=False, jobs=2, progress=False)
    assert task.candidates == [heuristic, clean]


def test_ragged_problems_check_both_length_variants():
    cfg = FwdConfig(64, 64, 4, 1, 2)
    even = FWD.kernel_names(cfg, FwdProblem("float16", 64, False, 4096, 4096, 1))
    ragged = FWD.kernel_names(cfg, FwdProblem("float16", 64, False, 3000, 3000, 1))
    assert len(even) == 1 and len(ragged) == 2
    assert ragged[0] == cfg.name_expression("float16", False, False, True)
    assert ragged[1] == cfg.name_expression("float16", False, True, True)


# ---------------------------------------------------------------- keys


@pytest.mark.parametrize("n, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (1000, 1024), (1024, 1024),
                                       (1025, 2048), (16384, 16384)])
def test_seqlen_bucket(n, bucket):
    assert seqlen_bucket(n) == bucket


def test_key():
    assert FWD.key(FwdProblem("float16", 128, True, 4096, 4096, 1)) == "fwd/float16/d128/causal/q4096/k4096/even"
    assert FWD.key(FwdProblem("bfloat16", 72, False, 3000, 100, 4)) == "fwd/bfloat16/d72/full/q4096/k128/ragged"
    # Same bucket and class, different GQA ratio and lengths: one entry.
    assert FWD.key(FwdProblem("float16", 64, False, 2048, 1920, 1)) == FWD.key(
        FwdProblem("float16", 64, False, 1152, 1152, 8))


# ---------------------------------------------------------------- the JSON cache


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.delenv("CUFLASH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tune_cache.cache_dir() == tmp_path / "xdg" / "cuflash"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "mine"))
    assert tune_cache.cache_dir() == tmp_path / "mine"
    assert tune_cache.cache_path(DEVICE).name == "test-gpu-80gb-sm90.json"


def test_round_trip(cache, monkeypatch):
    assert tune_cache.get(DEVICE, "a") is None
    tune_cache.put(DEVICE, {"a": entry("A")})
    tune_cache.put(DEVICE, {"b": entry("B")})
    assert tune_cache.get(DEVICE, "a")["config_name"] == "A"  # this process's writes refresh its memo
    monkeypatch.setattr(tune_cache, "_memo", {})  # a new process reads the file
    assert {k: e["config_name"] for k, e in tune_cache.entries(DEVICE).items()} == {"a": "A", "b": "B"}
    data = json.loads(tune_cache.cache_path(DEVICE).read_text())
    assert data["device"] == DEVICE.name and data["compute_capability"] == "90"
    assert data["source_hash"] == cf_compile.source_hash() and data["format"] == tune_cache.FORMAT
    other = tune_cache.DeviceKey("Other GPU", "80")
    assert tune_cache.get(other, "a") is None
    tune_cache.clear(DEVICE)
    assert tune_cache.entries(DEVICE) == {}
    assert not list(cache.glob("*.tmp"))


def test_cache_writes_move_the_generation(cache):
    # The entry points' launch plans hold dispatch decisions keyed by it (cuflash/plans.py).
    before = tune_cache.generation()
    tune_cache.put(DEVICE, {"a": entry("A")})
    middle = tune_cache.generation()
    tune_cache.clear(DEVICE)
    assert before < middle < tune_cache.generation()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"format": 1, "entries": 3}',
                                  '{"format": 999, "entries": {}}', '{"entries": {}}'])
def test_corrupt_or_foreign_format_file_is_ignored_once_and_rewritten(cache, monkeypatch, text):
    path = tune_cache.cache_path(DEVICE)
    path.write_text(text)
    with pytest.warns(RuntimeWarning, match="ignoring tuning cache"):
        assert tune_cache.entries(DEVICE) == {}
    monkeypatch.setattr(tune_cache, "_memo", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second read in the same process stays quiet
        assert tune_cache.entries(DEVICE) == {}
        tune_cache.put(DEVICE, {"a": entry()})
    data = json.loads(path.read_text())
    assert data["format"] == tune_cache.FORMAT and list(data["entries"]) == ["a"]


def test_source_hash_change_invalidates(cache, monkeypatch):
    tune_cache.put(DEVICE, {"a": entry()})
    monkeypatch.setattr(cf_compile, "source_hash", lambda: "0123456789abcdef")
    assert tune_cache.get(DEVICE, "a") is None
    tune_cache.put(DEVICE, {"b": entry()})
    data = json.loads(tune_cache.cache_path(DEVICE).read_text())
    assert list(data["entries"]) == ["b"] and data["source_hash"] == "0123456789abcdef"


def test_unwritable_cache_keeps_results_in_process(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(tune_cache, "_memo", {})
    with pytest.warns(RuntimeWarning, match="cannot write"):
        tune_cache.put(DEVICE, {"a": entry()})
    assert tune_cache.get(DEVICE, "a") is not None


def _writer(directory, prefix, count):
    import os

    os.environ["CUFLASH_CACHE_DIR"] = directory
    for i in range(count):
        tune_cache.put(DEVICE, {f"{prefix}{i}": entry(f"{prefix}{i}")})


def test_concurrent_writers_lose_nothing(cache):
    count = 25
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(cache), prefix, count)) for prefix in ("p", "q")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = json.loads(tune_cache.cache_path(DEVICE).read_text())
    assert set(data["entries"]) == {f"{p}{i}" for p in "pq" for i in range(count)}


# ---------------------------------------------------------------- dispatch and info


def test_dispatch_uses_the_cache(cache, monkeypatch):
    monkeypatch.setattr(tune_cache, "current_device", lambda: DEVICE)
    problem = FwdProblem("float16", 64, False, 2000, 2000, 1)
    assert dispatch.fwd_config(problem) == (dispatch.heuristic_fwd_config(problem), "heuristic")
    tuned = FwdConfig(64, 32, 8, 1, 3)
    tune_cache.put(DEVICE, {FWD.key(problem): {**entry(), "config": dataclasses.asdict(tuned)}})
    assert dispatch.fwd_config(problem) == (tuned, "cache")
    # Another call in the same bucket and length class uses it too.
    assert dispatch.fwd_config(FwdProblem("float16", 64, False, 1100, 1500, 2)) == (tuned, "cache")
    with dispatch.heuristic_only():
        assert dispatch.fwd_config(problem)[1] == "heuristic"
    assert "cache hit" in cli_info.choice_report(problem, has_device=True)
    report = cli_info.tuning_cache_report(DEVICE)
    assert "(this device)" in report and FWD.key(problem) in report
    # An entry whose config this FwdConfig cannot build is ignored.
    tune_cache.put(DEVICE, {FWD.key(problem): {**entry(), "config": {"headdim": 64, "tile": 3}}})
    assert dispatch.fwd_config(problem)[1] == "heuristic"
    assert "does not fit" in cli_info.choice_report(problem, has_device=True)


def test_cli_rejects_bad_options():
    with pytest.raises(SystemExit):
        cli_autotune.main(["--headdim", "7"])
    with pytest.raises(SystemExit):
        cli_autotune.main(["--dtype", "fp8"])


# ---------------------------------------------------------------- the backward


def bwd_problem(headdim=128, seqlen=4096, causal=True, deterministic=False):
    return BwdProblem("float16", headdim, causal, seqlen, seqlen, 1, deterministic)


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_space_holds_the_table_and_fits(headdim, deterministic):
    problem = bwd_problem(headdim, deterministic=deterministic)
    quick = tuner.candidates(BWD, problem, H100, quick=True)
    full = tuner.candidates(BWD, problem, H100, quick=False)
    assert quick[0] == full[0] == dispatch.HEURISTIC_BWD[headdim]
    assert len(quick) == len(set(quick)) and len(full) == len(set(full))
    assert set(quick) <= set(full) and len(quick) < len(full)
    for cfg in full:
        assert cfg.headdim == headdim and cfg.is_valid() and BWD.keep(cfg, H100)
        assert max(cfg.dkdv_smem_bytes(True), cfg.dq_smem_bytes()) <= H100.smem_per_block
    # The dQ kernel's tiles only vary where that kernel runs.
    dq_tiles = {(cfg.dq_warps, cfg.dq_block_n) for cfg in full}
    assert (len(dq_tiles) > 1) == deterministic
    assert {cfg.dkdv_chunk for cfg in full} >= {16, 32, 64}


def test_bwd_keep_drops_over_budget():
    small = tuner.DeviceLimits(DEVICE, 99 * 1024, 100 * 1024, 1536, 65536, 1 << 20)
    table = dispatch.HEURISTIC_BWD[128]
    assert BWD.keep(table, H100) and not BWD.keep(table, small)
    assert all(BWD.keep(cfg, small) for cfg in tuner.candidates(BWD, bwd_problem(), small, quick=False)[1:])
    assert not BWD.keep(BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=48), H100)  # chunk does not divide the block
    assert not BWD.keep(BwdConfig(128, 128, 4, 4, 64), H100)  # 8 row tiles of dQ for 4 warps


def test_bwd_key_and_kernels():
    assert BWD.key(bwd_problem()) == "bwd/float16/d128/causal/q4096/k4096/even/atomic"
    ragged = BwdProblem("bfloat16", 72, False, 3000, 100, 4, True)
    assert BWD.key(ragged) == "bwd/bfloat16/d72/full/q4096/k128/ragged/det"
    cfg = BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=32)
    (even,) = BWD.kernels(cfg, bwd_problem())
    assert even.runs and even.name == cfg.dkdv_name("float16", True, True, True, True)
    assert even.smem_bytes == cfg.dkdv_smem_bytes(True) and even.threads == 256
    kernels = BWD.kernels(cfg, BwdProblem("float16", 120, True, 3000, 3000, 1, True))
    assert [k.runs for k in kernels] == [True, False, True, False]
    assert kernels[0].name == cfg.dkdv_name("float16", True, False, False, False)
    assert kernels[2].name == cfg.dq_name("float16", True, False, False)


def test_bwd_choice_uses_the_cache(cache, monkeypatch):
    monkeypatch.setattr(tune_cache, "current_device", lambda: DEVICE)
    problem = bwd_problem(64, seqlen=2000)
    heuristic = dispatch.heuristic_bwd_config(problem)
    assert dispatch.bwd_config(problem) == (heuristic, "heuristic")
    tuned = BwdConfig(64, 64, 8, 4, 64, dkdv_chunk_m=32)
    tune_cache.put(DEVICE, {BWD.key(problem): {**entry(), "config": dataclasses.asdict(tuned)}})
    assert tune_cache.get(DEVICE, BWD.key(problem))["config"] == dataclasses.asdict(tuned)
    assert dispatch.bwd_config(problem) == (tuned, "cache")
    # Same bucket and length class: the same entry; the other dQ mode has its own.
    assert dispatch.bwd_config(bwd_problem(64, seqlen=1500))[1] == "cache"
    assert dispatch.bwd_config(bwd_problem(64, seqlen=2000, deterministic=True))[1] == "heuristic"
    with dispatch.heuristic_only():
        assert dispatch.bwd_config(problem) == (heuristic, "heuristic")
    # Entries that this BwdConfig cannot build, or that do not fit the device, are ignored.
    for config in ({"headdim": 64, "tile": 3}, dataclasses.asdict(BwdConfig(128, 64, 8, 4, 64))):
        tune_cache.put(DEVICE, {BWD.key(problem): {**entry(), "config": config}})
        assert dispatch.bwd_config(problem) == (heuristic, "heuristic")
    small = dataclasses.replace(problem, max_smem=99 * 1024)
    tune_cache.put(DEVICE, {BWD.key(problem): {**entry(), "config": dataclasses.asdict(dispatch.HEURISTIC_BWD[64])}})
    assert dispatch.bwd_config(small) == (dispatch.heuristic_bwd_config(small), "heuristic")


def test_bwd_compile_filter_checks_every_kernel(monkeypatch):
    problem = bwd_problem(128, deterministic=True)
    heuristic = BWD.heuristic(problem)
    clean, dq_spills = BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=16), BwdConfig(128, 64, 8, 8, 64, dkdv_chunk_m=16)

    def fake(family, name, arch):
        report = cf_compile.CompileReport(name, arch, ok=True, registers=128)
        if name == dq_spills.dq_name("float16", True, True, True):
            report.spill_loads = 8
        return report

    monkeypatch.setattr(cf_compile, "compile_report", fake)
    monkeypatch.setattr(tuner, "_reports", {})
    task = tuner.Task(BWD, problem, CallShape(1, 1, 1), "custom", [heuristic, clean, dq_spills])
    tuner.compile_filter([task], H100, load=False, jobs=2, progress=False)
    assert task.candidates == [heuristic, clean]


def test_autotune_builds_both_passes():
    limits = dataclasses.replace(H100, device=tune_cache.DeviceKey("Test GPU", "90"))
    pairs = list(tuner._problems(tuner.PASSES, ["float16"], [64], [True], [1024], limits))
    assert [family.name for family, _ in pairs] == ["fwd", "bwd", "bwd"]
    assert [p.deterministic for _, p in pairs[1:]] == [False, True]
    assert all(p.arch == 90 and p.max_smem == H100.smem_per_block for _, p in pairs)
    only = list(tuner._problems(("backward",), ["float16"], [64], [True], [1024], limits))
    assert {family.name for family, _ in only} == {"bwd"}
    override = [FwdConfig(64, 32, 4, 1, 2), BwdConfig(64, 64, 8, 4, 64)]
    assert tuner._own(BWD, override) == override[1:]
    assert tuner._own(FWD, override) == override[:1]


def test_cli_rejects_bad_pass():
    with pytest.raises(SystemExit):
        cli_autotune.main(["--only", "sideways"])


def test_hopper_192_key_tiles_are_tuned_with_both_length_variants():
    # 192-key tiles do not divide the 128-aligned lengths of an "even" key:
    # they stay in the space, and both of their length variants are compiled.
    from cuflash.config import FwdSm90Config

    problem = FwdProblem("float16", 64, True, 4096, 4096, 1, arch=90)
    kept = tuner.candidates(FWD, problem, H100, quick=False)
    wide = [c for c in kept if isinstance(c, FwdSm90Config) and c.block_n == 192]
    assert wide, "no 192-key Hopper candidate kept"
    names = FWD.kernel_names(wide[0], problem)
    assert len(names) == 2 and names[0] != names[1]


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_hopper_candidates_stage_the_output_wherever_it_fits(headdim):
    from cuflash.config import FwdSm90Config

    problem = FwdProblem("float16", headdim, False, 4096, 4096, 1, arch=90)
    hopper = [c for c in FWD.space(problem, quick=False) if isinstance(c, FwdSm90Config) and c.is_valid()]
    assert hopper
    for cfg in hopper:
        staged = dataclasses.replace(cfg, stage_o=True)
        assert cfg.stage_o == (staged.smem_bytes() <= SM90_SMEM_LIMIT), cfg.short_name()


def test_staged_output_counts_in_shared_memory():
    from cuflash.config import FwdSm90Config

    assert FwdSm90Config(128, 128, 2).staged_if_fits().stage_o
    assert not FwdSm90Config(256, 80, 2).staged_if_fits().stage_o
    assert not FwdSm90Config(128, 176, 2).supports("float16")
    assert FwdSm90Config(128, 176, 2, stage_o=False).supports("float16")
    # fp8 inputs stage a 16-bit (bf16) output tile: 192-key tiles fit it with 3 stages, not with 4.
    assert FwdSm90Config(128, 192, 3).supports("float8_e4m3")
    assert not FwdSm90Config(128, 192, 4).supports("float8_e4m3")
    assert FwdSm90Config(128, 192, 4, stage_o=False).supports("float8_e4m3")


def test_quick_hopper_space_is_a_subset_of_the_full_one():
    from cuflash.config import FwdSm90Config

    problem = FwdProblem("float16", 128, True, 4096, 4096, 1, arch=90)
    quick = [c for c in tuner.candidates(FWD, problem, H100, quick=True) if isinstance(c, FwdSm90Config)]
    full = [c for c in tuner.candidates(FWD, problem, H100, quick=False) if isinstance(c, FwdSm90Config)]
    assert quick[0] == dispatch.heuristic_fwd_config(problem)
    assert set(quick) <= set(full) and len(quick) < len(full)
    assert {c.block_n for c in quick} == {c.block_n for c in full}
    assert {c.pingpong for c in quick} == {True, False}


# ---------------------------------------------------------------- score options


def _mods(causal=False, window=(-1, -1), softcap=0.0, alibi=False, seqlen=4096, **extra):
    causal, mods = score_mods.normalise(causal, window, softcap, 0 if alibi else None, seqlen, seqlen)
    return dataclasses.replace(mods, **extra) if extra else mods


def test_option_problems_have_keys_of_their_own():
    plain = FwdProblem("float16", 128, False, 4096, 4096, 1)
    assert FWD.key(dataclasses.replace(plain, mods=_mods(softcap=30.0))) == FWD.key(plain) + "/softcap"
    assert FWD.key(dataclasses.replace(plain, mods=_mods(softcap=30.0, alibi=True))).endswith("/softcap+alibi")
    # A window's sides are bucketed like the lengths; an unbounded side is inf.
    assert FWD.key(dataclasses.replace(plain, mods=_mods(window=(1000, 0)))).endswith("/w1024,0")
    assert FWD.key(dataclasses.replace(plain, mods=_mods(window=(900, -1)))).endswith("/w1024,inf")
    assert BWD.key(dataclasses.replace(bwd_problem(), mods=_mods(alibi=True))) == BWD.key(bwd_problem()) + "/alibi"
    # The slopes' layout and the softcap's value change no kernel: one key.
    assert FWD.key(dataclasses.replace(plain, mods=_mods(softcap=5.0, alibi=True, alibi_batch_stride=16))) == \
        FWD.key(dataclasses.replace(plain, mods=_mods(softcap=30.0, alibi=True)))


def test_option_problems_compile_their_own_kernels():
    mods = _mods(window=(256, 0), softcap=30.0)
    problem = FwdProblem("float16", 128, True, 4096, 4096, 1, mods=mods)
    cfg = FwdConfig(128, 64, 4, 1, 2)
    (kernel,) = FWD.kernels(cfg, problem)
    assert kernel.name == cfg.name_expression("float16", True, True, True, mods.bits) and mods.bits
    bwd = BwdProblem("float16", 128, True, 4096, 4096, 1, True, mods=mods)
    bcfg = BwdConfig(128, 64, 8, 4, 64, dkdv_chunk_m=32)
    dkdv, dq = BWD.kernels(bcfg, bwd)
    assert dkdv.name == bcfg.dkdv_name("float16", True, True, True, False, mods.bits)
    assert dq.name == bcfg.dq_name("float16", True, True, True, mods.bits)


def test_the_cache_serves_tuned_options_but_not_varlen_or_dropout(cache, monkeypatch):
    monkeypatch.setattr(tune_cache, "current_device", lambda: DEVICE)
    tuner.install()
    plain = FwdProblem("float16", 64, False, 2000, 2000, 1)
    softcap = dataclasses.replace(plain, mods=_mods(softcap=30.0, seqlen=2000))
    tuned = FwdConfig(64, 32, 8, 1, 3)
    tune_cache.put(DEVICE, {FWD.key(plain): {**entry(), "config": dataclasses.asdict(tuned)}})
    assert dispatch.fwd_config(plain) == (tuned, "cache")
    assert dispatch.fwd_config(softcap)[1] == "heuristic"  # the plain entry is not the softcap one
    tune_cache.put(DEVICE, {FWD.key(softcap): {**entry(), "config": dataclasses.asdict(tuned)}})
    assert dispatch.fwd_config(softcap) == (tuned, "cache")
    varlen = dataclasses.replace(plain, mods=_mods(seqlen=2000, varlen=score_mods.Varlen(2, 2000, 2000)))
    dropout = dataclasses.replace(plain, mods=_mods(seqlen=2000, dropout=score_mods.Dropout(0.1, 1, 0)))
    assert FWD.key(varlen) == FWD.key(plain) and FWD.key(dropout) == FWD.key(plain)
    assert dispatch.fwd_config(varlen)[1] == "heuristic" and dispatch.fwd_config(dropout)[1] == "heuristic"
    bwd = BwdProblem("float16", 64, False, 2000, 2000, 1, False, mods=_mods(alibi=True, seqlen=2000))
    bcfg = BwdConfig(64, 64, 8, 4, 64, dkdv_chunk_m=32)
    tune_cache.put(DEVICE, {BWD.key(bwd): {**entry(), "config": dataclasses.asdict(bcfg)}})
    assert dispatch.bwd_config(bwd) == (bcfg, "cache")
    assert dispatch.bwd_config(dataclasses.replace(bwd, mods=score_mods.NONE))[1] == "heuristic"


def test_autotune_problems_carry_the_options_normalised():
    limits = dataclasses.replace(H100, device=tune_cache.DeviceKey("Test GPU", "90"))
    pairs = list(tuner._problems(("forward",), ["float16"], [64], [False, True], [1024, 4096], limits,
                                 window_size=(2048, 0), softcap=30.0))
    # (2048, 0) is causal: asked with and without causal, each length is one problem; at 1k the
    # window covers every key, so only the causal mask is left.
    assert [(p.seqlen_q, p.causal, p.mods.window) for _, p in pairs] == [(1024, True, None), (4096, True, (2048, 0))]
    assert all(p.mods.softcap == 30.0 and not p.mods.alibi for _, p in pairs)
    (pair,) = tuner._problems(("forward",), ["float16"], [64], [False], [1024], limits, alibi=True)
    assert pair[1].mods.alibi and FWD.key(pair[1]).endswith("/alibi")


def test_cli_rejects_bad_score_options():
    for argv in (["--softcap", "-1"], ["--softcap", "inf"], ["--window=-2,0"], ["--window", "a,b"]):
        with pytest.raises(SystemExit):
            cli_autotune.main(argv)


def test_a_call_with_batched_alibi_slopes_is_tuned_with_one_row(monkeypatch):
    """The tuner's inputs hold (nheads,) slopes: a call's (batch, nheads) slopes (a batch stride) are timed
    with stride 0, under the same key."""
    tasks = []
    monkeypatch.setattr(tuner.DeviceLimits, "current", classmethod(lambda cls: H100))
    monkeypatch.setattr(tuner, "candidates", lambda family, problem, limits, quick: [family.heuristic(problem)])
    monkeypatch.setattr(tuner, "run", lambda new, **kwargs: tasks.extend(new))
    monkeypatch.setattr(FWD, "cached", lambda problem: (None, None))
    problem = FwdProblem("float16", 64, False, 512, 512, 1, mods=_mods(alibi=True, seqlen=512, alibi_batch_stride=8))
    tuner.tune_call(problem, 2, 8, 8)
    (task,) = tasks
    assert task.problem.mods.alibi and task.problem.mods.alibi_batch_stride == 0
    assert FWD.key(task.problem) == FWD.key(problem)


def test_autotune_rejects_bad_score_options():
    for window, softcap, named in (((-2, 0), 0.0, "window_size"), ((-1, -1), -1.0, "softcap"),
                                   ((-1, -1), float("inf"), "softcap")):
        with pytest.raises(ValueError, match=named):
            tuner.autotune(window_size=window, softcap=softcap)
