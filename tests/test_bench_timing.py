"""cuflash.timing on a fake clock, and the benchmark's option spellings and shapes: no GPU needed."""

import argparse

import pytest

from cuflash import timing
from cuflash.bench import options
from cuflash.bench.shapes import Shape, build_shapes, seqlen_label


class FakeEvent:
    def __init__(self, t):
        self.t = t

    def synchronize(self):
        pass


class FakeClock:
    """Events are clock readings; every call advances the clock by its subject's duration."""

    def __init__(self):
        self.now = 0.0
        self.calls = []  # (subject name, input set), in call order

    def record(self):
        return FakeEvent(self.now)

    @staticmethod
    def elapsed_ms(start, end):
        return end.t - start.t

    def subject(self, name, ms, sets=2, fail_at=None):
        """timing.Calls whose call i on input set s takes `ms` (or ms[s]); the fail_at-th call raises."""
        def call(s):
            if fail_at is not None and self.count(name) == fail_at:
                raise RuntimeError("launch failed\nsecond line")
            self.calls.append((name, s))
            self.now += ms[s] if isinstance(ms, (list, tuple)) else ms

        return timing.Calls([lambda s=s: call(s) for s in range(sets)], events=self)

    def count(self, name):
        return sum(1 for n, _ in self.calls if n == name)


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(timing, "synchronize", lambda: None)
    return FakeClock()


def test_every_subject_gets_its_repeats_and_its_own_time(clock):
    entries = {name: clock.subject(name, ms) for name, ms in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
    results = timing.time_calls(entries, repeats=10, rounds=5)
    for name, ms in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        assert results[name]["ms"] == pytest.approx(ms)
        assert results[name]["repeats"] == 10
        # warm-up (3 calls) + a lead call a round + the timed ones
        assert clock.count(name) == 3 + 5 + 10


def test_rounds_follow_the_order_design(clock):
    entries = {name: clock.subject(name, 1.0) for name in "abc"}
    timing.time_calls(entries, repeats=6)
    # after 3 warm-up calls each; a lead call and a timed one per subject per round
    timed = [name for name, _ in clock.calls[9:]][1::2]
    rounds = [timed[i:i + 3] for i in range(0, 18, 3)]
    assert rounds == [["abc"[i] for i in order] for order in timing.round_orders(3)]


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_each_subject_holds_each_place_and_follows_each_other_equally_often(count):
    orders = timing.round_orders(count)
    places, follows = {}, {}
    for order in orders:
        assert sorted(order) == list(range(count))
        for place, subject in enumerate(order):
            places[place, subject] = places.get((place, subject), 0) + 1
        for before, after in zip(order, order[1:]):
            follows[before, after] = follows.get((before, after), 0) + 1
    assert len(places) == count * count and len(set(places.values())) == 1
    assert len(follows) == count * (count - 1) and len(set(follows.values())) == 1
    assert timing.rounds_for(count) % len(orders) == 0 and timing.rounds_for(count) >= timing.ROUNDS


def test_one_subject_takes_the_minimum_rounds():
    assert timing.round_orders(1) == [[0]]
    assert timing.rounds_for(1) == timing.rounds_for(0) == timing.ROUNDS


def test_a_subject_that_raises_is_reported_and_the_others_finish(clock):
    entries = {"a": clock.subject("a", 1.0), "bad": clock.subject("bad", 1.0, fail_at=5), "c": clock.subject("c", 1.0)}
    results = timing.time_calls(entries, repeats=10, rounds=5)
    assert results["bad"] == {"error": "RuntimeError: launch failed"}
    assert results["a"]["repeats"] == results["c"]["repeats"] == 10
    assert clock.count("c") == 3 + 5 + 10
    assert list(results) == ["a", "bad", "c"]  # the entries' order


def test_long_calls_get_fewer_repeats(clock):
    results = timing.time_calls({"slow": clock.subject("slow", 1000.0)}, repeats=30, budget_ms=3000.0)
    assert results["slow"]["repeats"] == timing.MIN_REPEATS


def test_calls_rotate_over_the_input_sets(clock):
    timing.time_calls({"a": clock.subject("a", 1.0, sets=3)}, repeats=6, rounds=2)
    warm, timed = clock.calls[:3], clock.calls[3:]
    assert [s for _, s in warm] == [0, 1, 2]  # warm-up touches every set
    assert [s for _, s in timed] == [2, 0, 1, 2, 2, 0, 1, 2]  # a lead call on the set before each round's first


def test_warm_up_touches_every_input_set_and_returns_the_last_call(clock):
    ms = timing.warm_up(clock.subject("a", [1.0, 2.0, 3.0, 4.0, 5.0], sets=5), count=3)
    assert [s for _, s in clock.calls] == [0, 1, 2, 3, 4]
    assert ms == 5.0


def test_median_ms_is_the_median_of_the_timed_calls(clock):
    calls = clock.subject("a", [1.0, 9.0, 2.0], sets=3)
    assert timing.median_ms(calls.fns, repeats=5, events=clock) == 2.0  # sets 0 1 2 0 1: 1 9 2 1 9
    assert clock.count("a") == timing.WARMUP + 1 + 5


def test_the_lead_call_of_a_batch_is_not_timed(clock):
    calls = clock.subject("a", [1.0, 1.0, 100.0], sets=3)
    marks = timing.record_calls(calls, 0, 2)  # lead on set 2, then sets 0 and 1
    assert [s for _, s in clock.calls] == [2, 0, 1]
    assert [clock.elapsed_ms(start, end) for start, end in marks] == [1.0, 1.0]
    assert timing.record_calls(calls, 3, 3) == [] and len(clock.calls) == 3  # an empty batch runs nothing


def test_median_ms_raises_what_a_call_raises(clock):
    calls = clock.subject("a", 1.0, fail_at=4)
    with pytest.raises(RuntimeError, match="launch failed"):
        timing.median_ms(calls.fns, repeats=5, events=clock)


@pytest.mark.parametrize("repeats, call_ms, budget, expected", [
    (30, 1.0, None, 30), (30, 1.0, 3000.0, 30), (30, 200.0, 3000.0, 15), (30, 1000.0, 3000.0, 5), (3, 1e4, 1.0, 3),
])
def test_repeats_within_a_budget(repeats, call_ms, budget, expected):
    assert timing.repeats_within(repeats, call_ms, budget) == expected


def test_input_sets_hold_twice_the_l2_cache():
    l2 = 50 << 20
    assert timing.input_set_count(192 << 20, l2) == timing.MIN_INPUT_SETS
    assert timing.input_set_count(10 << 20, l2) == 10
    assert timing.input_set_count(0, l2) == 2 * l2


def test_describe_is_one_line():
    assert timing.describe(ValueError("first\nsecond")) == "ValueError: first"
    assert timing.describe(KeyError()) == "KeyError: "


def test_host_events_waits_for_the_device_before_each_reading(monkeypatch):
    log, readings = [], iter([1.0, 1.5])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: log.append("read") or next(readings))
    wall = timing.HostEvents(sync=lambda: log.append("sync"))
    start, end = wall.record(), wall.record()
    end.synchronize()
    assert log == ["sync", "read", "sync", "read"]
    assert wall.elapsed_ms(start, end) == pytest.approx(500.0)


def test_time_calls_takes_host_events_subjects(monkeypatch):
    """A subject on a stream without events (XLA's) is timed by host time between device synchronisations."""
    now, syncs = [0.0], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(timing, "synchronize", lambda: syncs.append(now[0]))

    def twenty_steps():
        now[0] += 0.040

    results = timing.time_calls({"jit": timing.Calls([twenty_steps], timing.HostEvents())}, repeats=5)
    assert results["jit"]["ms"] == pytest.approx(40.0)
    assert results["jit"]["repeats"] == 5
    assert len(syncs) >= 2 * 5  # every timed call between two device-wide waits


def test_option_spellings():
    parser = argparse.ArgumentParser()
    assert options.seqlen_option(" 2K ") == 2048 and options.seqlen_option("512") == 512
    assert options.dtype_option("bf16") == "bfloat16" and options.dtype_option("Half") == "float16"
    assert options.list_option(parser, ["fp16,bf16", "fp16"], options.dtype_option, "--dtype") == [
        "float16", "bfloat16", "float16"]
    with pytest.raises(SystemExit):
        options.list_option(parser, ["fp32"], options.dtype_option, "--dtype")


def test_benchmark_shapes_hold_16k_tokens():
    shape = Shape("float16", 128, True, 2048)
    assert (shape.batch, shape.heads) == (8, 16)
    assert shape.flops == 4.0 * 8 * 16 * 2048 * 2048 * 128 / 2
    assert shape.bwd_flops == 3.5 * shape.flops
    assert len(build_shapes(["float16", "float16"], [64, 128], [False, True], [512, 2048])) == 8
    assert [seqlen_label(n) for n in (512, 2048, 1500)] == ["512", "2k", "1500"]


def test_speed_table_marks_mismatches_and_computes_ratios():
    from cuflash.bench import tables

    row = {"dtype": "float16", "headdim": 128, "causal": True, "seqlen": 2048, "check": {"ok": False},
           "libs": {"cuflash": {"tflops": 600.0}, "naive-cupy": {"skipped": "too long"},
                    "torch-flash": {"tflops": 300.0}, "torch-cudnn": {"error": "RuntimeError: x"}}}
    line = tables.speed_table([row]).splitlines()[-1].split()
    assert line[:5] == ["fp16", "128", "yes", "2k", "600.0!"]
    assert line[5:] == [tables.DASH, "300.0", tables.DASH, "2.00", tables.DASH]


def test_a_graph_replay_holds_the_calls_it_captured():
    """A captured graph reads the arrays its calls hold (a paged cache's pages and table exist nowhere
    else): its replay keeps them alive, and lets them go with itself."""
    import gc
    import weakref

    from cuflash.bench.decode import Replay

    class Pages:
        pass

    pages = Pages()
    alive = weakref.ref(pages)
    replay = Replay(lambda stream: None, [lambda held=pages: held])
    del pages
    gc.collect()
    assert alive() is not None
    del replay
    gc.collect()
    assert alive() is None
