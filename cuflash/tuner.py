"""Autotuner: find this device's fastest correct configuration per problem and cache it.

For each problem, in order:

1. the family's space (data) filtered by its `keep()` predicate (shared memory,
   threads, tile shapes against this device's limits);
2. the compile filter: every kernel a candidate may run is compiled for this
   device's arch and dropped on a compile error, a spill, or more registers
   than a block may hold. Compilation runs in threads (NVRTC releases the GIL)
   and also loads each candidate's kernel, so timing starts with every kernel
   compiled;
3. a correctness check: each candidate's output, written over NaN, is compared
   with the heuristic configuration's on the same inputs; a candidate that
   disagrees is rejected and never cached;
4. timing with CUDA events: warm-up, then the median of `repeats` calls that
   rotate over enough input sets that L2 never holds the next call's inputs;
5. the fastest, the heuristic included (so the cache never holds a config
   slower than the heuristic as measured), goes to the cache with its time and
   the heuristic's.

A kernel family plugs in through an object like `tune_fwd.FWD` or
`tune_bwd.BWD` (see `Family`). Nothing here tunes unless asked:
`cuflash.autotune(...)`, `python -m cuflash autotune`, `attention(...,
tune=True)`, `attention_backward(..., tune=True)` or `CUFLASH_AUTOTUNE=1`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import itertools
import os
import sys
import time
from typing import Any, Callable, Protocol, Sequence

from tqdm import tqdm

from . import compile as _compile
from . import score_mods, timing
from . import tune_cache
from . import dispatch
from .config import DTYPE_NAMES
from .dispatch import BwdProblem, FwdProblem
from .tune_bwd import BWD
from .tune_common import CallShape, KernelSpec
from .tune_fwd import FWD

# A candidate fails the check if any output element is NaN, or if it differs
# from the heuristic's by more than this fraction of the largest |output|.
CHECK_RTOL = 2e-2

REPEATS = 20
QUICK_REPEATS = 10
WARMUP = 3
# Input sets rotated during timing: enough for twice the L2 cache (cuflash.timing), at most this many.
MAX_INPUT_SETS = 32

DEFAULT_HEADDIMS = (64, 128)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 2048, 4096, 8192)

# How much of the space an entry's tuning searched; a cached entry satisfies a
# request for a space no larger than its own.
SPACE_RANK = {"custom": 0, "quick": 1, "full": 2}

PASSES = ("forward", "backward")


class Family(Protocol):
    """What the tuner needs from a kernel family (implemented by tune_fwd.FwdTuning and tune_bwd.BwdTuning)."""

    name: str  # the first part of its cache keys
    config_classes: tuple  # the classes of its configs

    def key(self, problem) -> str: ...  # cache key; problems with equal keys share a config
    def heuristic(self, problem): ...  # the trusted config: the reference output and the time to beat
    def space(self, problem, quick: bool) -> list: ...
    def keep(self, cfg, limits: DeviceLimits) -> bool: ...
    def kernels(self, cfg, problem) -> list[KernelSpec]: ...  # every kernel cfg may launch under the key
    def make_inputs(self, problem, shape, seed: int): ...  # .nbytes, .outputs(), .poison()
    def launch(self, cfg, problem, inputs) -> None: ...
    def flops(self, problem, shape) -> float: ...
    def describe(self, problem, shape) -> dict: ...


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    device: tune_cache.DeviceKey
    smem_per_block: int  # opt-in maximum
    smem_per_sm: int
    threads_per_sm: int
    regs_per_block: int
    l2_bytes: int

    @property
    def arch(self) -> str:
        return f"sm_{self.device.compute_capability}"

    @classmethod
    def current(cls) -> DeviceLimits:
        import cupy

        attrs = cupy.cuda.Device().attributes
        return cls(
            device=tune_cache.current_device(),
            smem_per_block=attrs["MaxSharedMemoryPerBlockOptin"],
            smem_per_sm=attrs["MaxSharedMemoryPerMultiprocessor"],
            threads_per_sm=attrs["MaxThreadsPerMultiProcessor"],
            regs_per_block=attrs["MaxRegistersPerBlock"],
            l2_bytes=attrs["L2CacheSize"],
        )


@dataclasses.dataclass
class Task:
    """One problem to tune: `shape` completes it to the call that is timed."""

    family: Family
    problem: Any
    shape: Any
    space: str = "full"  # "quick", "full", or "custom" for an explicit candidate list
    candidates: list = dataclasses.field(default_factory=list)

    @property
    def key(self) -> str:
        return self.family.key(self.problem)


def _log(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


# ---------------------------------------------------------------- space and compile filter


def candidates(family: Family, problem, limits: DeviceLimits, quick: bool, override=None) -> list:
    """The heuristic config first, then the space's (or `override`'s) configs that keep() accepts."""
    heuristic = family.heuristic(problem)
    pool = family.space(problem, quick) if override is None else list(override)
    kept = [cfg for cfg in pool if family.keep(cfg, limits) and cfg != heuristic]
    return [heuristic, *dict.fromkeys(kept)]


def compiled_ok(report: _compile.CompileReport, threads: int, limits: DeviceLimits) -> str | None:
    """Why a compiled kernel launched with `threads` per block is unusable, or None if it is fine."""
    if not report.ok:
        return "compile error"
    if report.spills:
        return f"{report.spills} bytes of spills"
    if report.registers * threads > limits.regs_per_block:
        return f"{report.registers} registers x {threads} threads exceed the block's {limits.regs_per_block}"
    return None


_reports: dict[tuple[str, str, str], _compile.CompileReport] = {}


def _compile_job(family: str, name: str, arch: str, load: tuple | None) -> _compile.CompileReport:
    """ptxas report of one kernel; with `load` = (device id, smem bytes), also load it for timing."""
    report = _reports.get((family, name, arch))
    try:
        if report is None:
            report = _reports[(family, name, arch)] = _compile.compile_report(family, name, arch)
        if load is not None and report.ok and not report.spills:
            import cupy

            device_id, smem_bytes = load
            with cupy.cuda.Device(device_id):
                _compile.get_kernel(family, name, smem_bytes)
    except Exception as exc:  # one bad candidate must not end the tuning
        return _compile.CompileReport(name, arch, ok=False, log=f"{type(exc).__name__}: {exc}")
    return report


def compile_filter(tasks: Sequence[Task], limits: DeviceLimits, *, load: bool, jobs: int | None = None,
                   progress: bool = True) -> None:
    """Drop each task's candidates whose kernels fail `compiled_ok` (the heuristic always stays)."""
    device_id = None
    if load:
        import cupy

        device_id = cupy.cuda.Device().id
    work = {}  # (family, name) -> load spec; a kernel shared by tasks is compiled once
    for task in tasks:
        for cfg in task.candidates:
            for kernel in task.family.kernels(cfg, task.problem):
                spec = (device_id, kernel.smem_bytes) if load and kernel.runs else None
                work[(kernel.family, kernel.name)] = work.get((kernel.family, kernel.name)) or spec
    jobs = jobs or os.cpu_count() or 1
    reports = {}
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(_compile_job, family, name, _compile.FAMILY_ARCH.get(family, limits.arch), spec):
                   (family, name)
                   for (family, name), spec in work.items()}
        for future in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="compiling",
                           unit="kernel", disable=not progress, file=sys.stderr, leave=False):
            reports[futures[future]] = future.result()
    if progress:
        _log(f"compiled {len(work)} kernels for {limits.arch} in {time.perf_counter() - started:.1f} s "
             f"({jobs} threads)")
    for task in tasks:
        heuristic, *rest = task.candidates
        kept = []
        for cfg in rest:
            kernels = task.family.kernels(cfg, task.problem)
            if not any(compiled_ok(reports[(k.family, k.name)], k.threads, limits) for k in kernels):
                kept.append(cfg)
        task.candidates = [heuristic, *kept]


# ---------------------------------------------------------------- check and time


def _disagreement(outputs, references) -> str | None:
    """Why `outputs` do not match `references`, or None."""
    import cupy

    for out, ref in zip(outputs, references):
        out32, ref32 = out.astype(cupy.float32), ref.astype(cupy.float32)
        if bool(cupy.isnan(out32).any()):
            return "NaN in the output"
        finite = cupy.isfinite(ref32)
        scale = float(cupy.abs(cupy.where(finite, ref32, 0)).max()) if out.size else 0.0
        # Equal infinities (-inf lse of a row that sees no key) agree.
        diff = cupy.where(out32 == ref32, 0, cupy.abs(out32 - ref32))
        worst = float(diff.max()) if out.size else 0.0
        if not worst <= CHECK_RTOL * scale:
            return f"max abs difference {worst:.3g} from the heuristic's output (scale {scale:.3g})"
    return None


def median_ms(fns: Sequence[Callable[[], None]], repeats: int, warmup: int = WARMUP) -> float:
    """Median device time of one call, rotating over `fns` (one per input set): cuflash.timing's timer."""
    return timing.median_ms(fns, repeats, warmup)


def _input_sets(task: Task, limits: DeviceLimits) -> list:
    import cupy

    first = task.family.make_inputs(task.problem, task.shape, 0)
    wanted = timing.input_set_count(first.nbytes, limits.l2_bytes)
    free, _ = cupy.cuda.runtime.memGetInfo()
    affordable = 1 + int(free // 2 // max(first.nbytes, 1))  # leave half of the free memory
    count = max(1, min(wanted, affordable, MAX_INPUT_SETS))
    return [first] + [task.family.make_inputs(task.problem, task.shape, seed) for seed in range(1, count)]


def _measure(task: Task, limits: DeviceLimits, launcher, repeats: int, bar) -> dict:
    """Check and time a task's candidates; the cache entry for the fastest correct one."""
    import cupy

    family, problem = task.family, task.problem
    launch = launcher or family.launch
    sets = _input_sets(task, limits)
    heuristic = task.candidates[0]

    sets[0].poison()
    launch(heuristic, problem, sets[0])
    references = [x.copy() for x in sets[0].outputs()]
    if bool(cupy.isnan(references[0]).any()):
        raise RuntimeError(f"cuflash: the heuristic config {heuristic.short_name()} gives NaN on {task.key}")

    def time_config(cfg) -> float:
        return median_ms([lambda s=s: launch(cfg, problem, s) for s in sets], repeats)

    timed, rejected = {}, []
    for cfg in task.candidates:
        bar.set_postfix_str(f"{task.key} {cfg.short_name()}", refresh=False)
        try:
            if cfg != heuristic:
                sets[0].poison()
                launch(cfg, problem, sets[0])
                why = _disagreement(sets[0].outputs(), references)
                if why:
                    rejected.append(cfg)
                    _log(f"rejected {cfg.short_name()} on {task.key}: {why}")
                    continue
            timed[cfg] = time_config(cfg)
        except Exception as exc:  # e.g. a launch that asks for too many resources
            if cfg == heuristic:
                raise
            rejected.append(cfg)
            _log(f"rejected {cfg.short_name()} on {task.key}: {type(exc).__name__}: {exc}")
        finally:
            bar.update()
    # The heuristic is timed first and again last, and its faster median
    # counts: a GPU still clocking up at the start cannot make it look slow.
    timed[heuristic] = min(timed[heuristic], time_config(heuristic))
    bar.update()

    flops = family.flops(problem, task.shape)

    def result(cfg):
        ms = timed[cfg]
        return {"config": dataclasses.asdict(cfg), "config_name": cfg.short_name(), "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12}

    return {
        **result(min(timed, key=timed.get)),
        "heuristic": result(heuristic),
        "shape": family.describe(problem, task.shape),
        "space": task.space,
        "timed": len(timed),
        "rejected": [cfg.short_name() for cfg in rejected],
        "repeats": repeats,
        "input_sets": len(sets),
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def run(tasks: Sequence[Task], *, launcher=None, repeats: int = REPEATS, jobs: int | None = None,
        progress: bool = True) -> dict[str, dict]:
    """Tune `tasks` (candidates already listed) on the current device; store and return their entries.

    `launcher(cfg, problem, inputs)` replaces the family's launch (tests use it
    to plant a wrong result).
    """
    limits = DeviceLimits.current()
    compile_filter(tasks, limits, load=True, jobs=jobs, progress=progress)
    results = {}
    total = sum(len(t.candidates) + 1 for t in tasks)  # + the heuristic's second timing
    with tqdm(total=total, desc="timing", unit="config", disable=not progress, file=sys.stderr) as bar:
        for task in tasks:
            entry = _measure(task, limits, launcher, repeats, bar)
            tune_cache.put(limits.device, {task.key: entry})  # stored at once: an interrupted run keeps it
            results[task.key] = entry
    return results


# ---------------------------------------------------------------- public entry points


def _covers(entry: dict | None, space: str) -> bool:
    searched = entry.get("space") if entry is not None else None
    return isinstance(searched, str) and SPACE_RANK.get(searched, -1) >= SPACE_RANK[space]


def _problems(passes, dtypes, headdims, causal, seqlens, limits: DeviceLimits, window_size=(-1, -1),
              softcap: float = 0.0, alibi: bool = False):
    """(family, problem) for every combination; the backward in both dQ modes. The score options
    apply to every problem, normalised per length as a call's are (a window that every pair passes
    is none; causal sets the window's right side to 0)."""
    arch = int(limits.device.compute_capability)
    seen = set()
    for dtype, headdim, is_causal, seqlen in itertools.product(dtypes, headdims, causal, seqlens):
        is_causal, mods = score_mods.normalise(is_causal, window_size, softcap, 0 if alibi else None, seqlen,
                                               seqlen)
        if (dtype, headdim, is_causal, seqlen, mods) in seen:  # a window (W, 0): causal asked for or not
            continue
        seen.add((dtype, headdim, is_causal, seqlen, mods))
        if "forward" in passes:
            yield FWD, FwdProblem(dtype, headdim, is_causal, seqlen, seqlen, 1, limits.smem_per_block, arch, mods)
        if "backward" in passes:
            for deterministic in (False, True):
                yield BWD, BwdProblem(dtype, headdim, is_causal, seqlen, seqlen, 1, deterministic,
                                      limits.smem_per_block, arch, mods)


def autotune(*, dtypes=DTYPE_NAMES, headdims=DEFAULT_HEADDIMS, causal=(False, True), seqlens=None,
             passes=PASSES, window_size=(-1, -1), softcap: float = 0.0, alibi: bool = False, quick: bool = False,
             clear: bool = False, repeats: int | None = None, candidates_override=None, launcher=None,
             jobs: int | None = None, progress: bool = True) -> dict[str, dict]:
    """Tune the forward and backward kernels for every combination of the arguments on the current device.

    passes: "forward" and/or "backward"; the backward is tuned in its default
    (atomic dQ) and deterministic modes, which are cached apart. Each problem
    is timed on the benchmark's shapes: batch * seqlen = 16k tokens, hidden
    size 2048, seqlen_q = seqlen_k. `window_size`, `softcap` and `alibi`
    (the standard slopes) tune those options' kernels, cached under keys of
    their own that calls with the same options read. `quick` uses the small
    candidate spaces, 10 repeats and seqlens 1k..8k unless given. Problems whose cached entry
    searched at least this space are skipped; `clear` first removes every
    entry of this device. `candidates_override` (a list of configs) replaces
    the space of the families they belong to; the other families are not
    tuned. Returns {cache key: entry} for every problem tuned or found.
    """
    window_size, softcap = score_mods.window_size(window_size, False), score_mods.softcap(softcap)
    limits = DeviceLimits.current()
    if clear:
        tune_cache.clear(limits.device)
    space = "custom" if candidates_override is not None else ("quick" if quick else "full")
    seqlens = seqlens or (QUICK_SEQLENS if quick else SEQLENS)
    tasks, results = [], {}
    for family, problem in _problems(passes, dtypes, headdims, causal, seqlens, limits, window_size, softcap, alibi):
        override = _own(family, candidates_override)
        if override == []:  # candidates were given, none of this family
            continue
        key = family.key(problem)
        entry = tune_cache.get(limits.device, key)
        if _covers(entry, space):
            results[key] = entry
            continue
        tasks.append(Task(family, problem, CallShape.benchmark(problem), space,
                          candidates(family, problem, limits, quick, override)))
    if progress and results:
        _log(f"{len(results)} problem(s) already tuned; tuning {len(tasks)}")
    repeats = repeats or (QUICK_REPEATS if quick else REPEATS)
    results.update(run(tasks, launcher=launcher, repeats=repeats, jobs=jobs, progress=progress))
    return results


def _own(family: Family, override):
    """The configs of `override` that belong to `family` (None: no override)."""
    if override is None:
        return None
    return [cfg for cfg in override if isinstance(cfg, family.config_classes)]


def _tune_one(family: Family, problem, shape: CallShape) -> None:
    """Tune one call's problem at its own shape, unless its key is cached already.

    ALiBi is timed with one row of standard slopes (batch stride 0): a call's (batch, nheads)
    slopes run the same kernel, and the tuner's inputs hold no slopes for its batch.
    """
    if family.cached(problem)[1] is not None:
        return
    if problem.mods.alibi_batch_stride:
        problem = dataclasses.replace(problem, mods=dataclasses.replace(problem.mods, alibi_batch_stride=0))
    limits = DeviceLimits.current()
    run([Task(family, problem, shape, "full", candidates(family, problem, limits, quick=False))])


def tune_call(problem: FwdProblem, batch: int, nheads: int, nheads_kv: int) -> None:
    """attention(..., tune=True): tune the forward call's problem at its shape."""
    _tune_one(FWD, problem, CallShape(batch, nheads, nheads_kv))


def tune_bwd_call(problem: BwdProblem, batch: int, nheads: int, nheads_kv: int) -> None:
    """attention_backward(..., tune=True): tune the backward call's problem at its shape."""
    _tune_one(BWD, problem, CallShape(batch, nheads, nheads_kv))


# ---------------------------------------------------------------- dispatch's view of the cache

class CacheLookup:
    """The tuning cache as dispatch reads it (dispatch.TunedLookup); `install` hands it over. The cache
    holds plain attention and windows, softcap and ALiBi (each combination under keys of its own);
    dispatch does not ask for varlen and dropout problems (ScoreMods.tuned)."""

    @staticmethod
    def fwd(problem: FwdProblem):
        return FWD.cached(problem)[1]

    @staticmethod
    def bwd(problem: BwdProblem):
        return BWD.cached(problem)[1]

    @staticmethod
    def state() -> tuple:
        # The entries' generation. Where the cache lives (CUFLASH_CACHE_DIR, ...) is read when
        # a call signature is first planned: reading the environment per call cost ~5 us.
        return tune_cache.generation()


def install() -> None:
    """Tuned configurations take precedence over dispatch's tables from now on."""
    dispatch.set_tuned_lookup(CacheLookup())
