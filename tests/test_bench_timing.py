"""The benchmark's timer (bench_libs.time_calls) on fake libraries: no GPU needed."""

import contextlib

import pytest

from cuflash import bench_libs


class FakeEvent:
    def __init__(self, t):
        self.t = t

    def synchronize(self):
        pass


class FakeClock:
    """Events are clock readings; every call advances the clock by its library's duration."""

    def __init__(self):
        self.now = 0.0
        self.calls = []  # library names, in call order

    def record(self):
        return FakeEvent(self.now)

    @staticmethod
    def elapsed_ms(start, end):
        return end.t - start.t


class FakeLib:
    def __init__(self, name, ms, clock, fail_at=None):
        self.name, self.ms, self.clock, self.fail_at = name, ms, clock, fail_at
        self.events = clock

    def context(self):
        return contextlib.nullcontext()

    def fns(self, sets):
        def call(i):
            if self.fail_at is not None and len([c for c in self.clock.calls if c == self.name]) == self.fail_at:
                raise RuntimeError("launch failed\nsecond line")
            self.clock.calls.append(self.name)
            self.clock.now += self.ms

        return [lambda i=i: call(i) for i in range(sets)]


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(bench_libs, "synchronize", lambda: None)
    return FakeClock()


def _entries(libs, sets=2):
    return {lib.name: (lib, lib.fns(sets)) for lib in libs}


def test_every_library_gets_its_repeats_and_its_own_time(clock):
    libs = [FakeLib("a", 1.0, clock), FakeLib("b", 2.0, clock), FakeLib("c", 3.0, clock)]
    results = bench_libs.time_calls(_entries(libs), repeats=10, rounds=5)
    for lib in libs:
        assert results[lib.name]["ms"] == pytest.approx(lib.ms)
        assert results[lib.name]["repeats"] == 10
        # warm-up (3 calls) + the timed ones
        assert clock.calls.count(lib.name) == 3 + 10


def test_rounds_rotate_which_library_goes_first(clock):
    libs = [FakeLib(name, 1.0, clock) for name in "abc"]
    bench_libs.time_calls(_entries(libs), repeats=3, rounds=3)
    timed = clock.calls[9:]  # after 3 warm-up calls each; one call per library per round
    rounds = [timed[i:i + 3] for i in range(0, 9, 3)]
    assert rounds == [list("abc"), list("bca"), list("cab")]


def test_a_library_that_raises_is_reported_and_the_others_finish(clock):
    libs = [FakeLib("a", 1.0, clock), FakeLib("bad", 1.0, clock, fail_at=5), FakeLib("c", 1.0, clock)]
    results = bench_libs.time_calls(_entries(libs), repeats=10, rounds=5)
    assert results["bad"] == {"error": "RuntimeError: launch failed"}
    assert results["a"]["repeats"] == results["c"]["repeats"] == 10
    assert clock.calls.count("c") == 13


def test_long_calls_get_fewer_repeats(clock):
    libs = [FakeLib("slow", 1000.0, clock)]
    results = bench_libs.time_calls(_entries(libs), repeats=30, budget_ms=3000.0)
    assert results["slow"]["repeats"] == 5
