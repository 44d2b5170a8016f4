"""The bounded-frequency runner, driven by a fake clock: no sleeping."""

from __future__ import annotations

import threading
from typing import List

import pytest

from netproxy.core.runner import BoundedFrequencyRunner


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Harness:
    """A runner over a fake clock that records when its function ran."""

    def __init__(self, min_interval: float = 1.0, max_interval: float = 30.0) -> None:
        self.clock = Clock()
        self.ran_at: List[float] = []
        self.runner = BoundedFrequencyRunner(lambda: self.ran_at.append(self.clock()), min_interval, max_interval,
                                             clock=self.clock)

    def run_until(self, end: float, tick: float = 0.125) -> List[float]:
        """Step every ``tick`` seconds of fake time up to ``end``; return the run times relative to the start."""
        start = self.clock.now
        first = len(self.ran_at)
        while self.clock.now < start + end - 1e-9:
            self.runner.step()
            self.clock.advance(tick)
        return [round(t - start, 6) for t in self.ran_at[first:]]


def test_first_run_is_immediate() -> None:
    h = Harness()
    assert h.runner.due_in(h.clock()) == 0
    assert h.runner.step()
    assert h.ran_at == [1000.0] and h.runner.runs == 1


def test_nothing_requested_runs_only_every_max_interval() -> None:
    h = Harness(min_interval=1, max_interval=30)
    assert h.run_until(100) == [0, 30, 60, 90]


def test_min_interval_is_respected_under_constant_requests() -> None:
    h = Harness(min_interval=2, max_interval=30)
    runs: List[float] = []
    start = h.clock.now
    while h.clock.now < start + 10:
        h.runner.request()
        if h.runner.step():
            runs.append(round(h.clock.now - start, 6))
        h.clock.advance(0.25)
    assert runs == [0, 2, 4, 6, 8]


def test_a_request_runs_at_min_interval_after_the_last_run() -> None:
    h = Harness(min_interval=5, max_interval=30)
    h.runner.step()
    h.clock.advance(1)
    h.runner.request()
    assert h.runner.due_in(h.clock()) == pytest.approx(4)
    assert not h.runner.step()
    h.clock.advance(3.9)
    assert not h.runner.step()
    h.clock.advance(0.1)
    assert h.runner.step()


def test_a_request_long_after_the_last_run_runs_at_once() -> None:
    h = Harness(min_interval=1, max_interval=30)
    h.runner.step()
    h.clock.advance(10)
    assert not h.runner.step()
    h.runner.request()
    assert h.runner.due_in(h.clock()) == 0
    assert h.runner.step()


def test_many_requests_coalesce_into_one_run() -> None:
    h = Harness(min_interval=1, max_interval=30)
    h.runner.step()
    for _ in range(1000):
        h.runner.request()
    assert h.run_until(5) == [1.0]  # one run at min_interval, then nothing until max_interval


def test_max_interval_forces_a_run_after_the_last_requested_one() -> None:
    h = Harness(min_interval=1, max_interval=10)
    h.runner.step()
    h.clock.advance(3)
    h.runner.request()
    assert h.run_until(20) == [0, 10]  # at t=3 and t=13 since the first run


def test_retry_after_runs_without_a_request() -> None:
    h = Harness(min_interval=1, max_interval=30)
    h.runner.step()
    h.runner.retry_after(4)
    assert h.run_until(8) == [4.0]
    assert h.run_until(20) == []  # the retry was consumed by that run; next is max_interval after it


def test_retry_respects_min_interval() -> None:
    h = Harness(min_interval=5, max_interval=30)
    h.runner.step()
    h.runner.retry_after(0.5)
    assert h.runner.due_in(h.clock()) == pytest.approx(5)


def test_retry_from_inside_the_run_with_growing_backoff() -> None:
    # The proxier calls retry_after from inside fn after a failure, doubling the delay each time.
    clock = Clock()
    ran: List[float] = []
    delays = iter([1, 2, 4, 8])
    runner: BoundedFrequencyRunner

    def failing() -> None:
        ran.append(clock())
        delay = next(delays, None)
        if delay is not None:
            runner.retry_after(delay)

    runner = BoundedFrequencyRunner(failing, 0.5, 60, clock=clock)
    start = clock.now
    while clock.now < start + 40:
        runner.step()
        clock.advance(0.25)
    assert [t - start for t in ran] == [0, 1, 3, 7, 15]


def test_a_request_before_the_retry_is_due_runs_early_and_consumes_it() -> None:
    h = Harness(min_interval=1, max_interval=30)
    h.runner.step()
    h.runner.retry_after(10)
    h.clock.advance(2)
    h.runner.request()
    assert h.run_until(25) == [0.0]


@pytest.mark.parametrize("low, high", [(-1, 10), (5, 1), (0, 0)])
def test_bad_intervals_rejected(low: float, high: float) -> None:
    with pytest.raises(ValueError):
        BoundedFrequencyRunner(lambda: None, low, high)


def test_min_interval_zero_runs_every_request() -> None:
    h = Harness(min_interval=0, max_interval=30)
    h.runner.step()
    h.runner.request()
    assert h.runner.step()
    assert not h.runner.step()


# -- the real loop, on a thread: woken by request and stop, never by a fixed sleep ----------------------

def test_loop_runs_on_request_and_stops_when_woken() -> None:
    ran = threading.Semaphore(0)
    runner = BoundedFrequencyRunner(ran.release, 0, 3600)
    stop = threading.Event()
    thread = threading.Thread(target=runner.loop, args=(stop,), daemon=True)
    thread.start()
    try:
        assert ran.acquire(timeout=5)  # the first run
        runner.request()
        assert ran.acquire(timeout=5)  # woken from a 3600 s wait by the request
    finally:
        stop.set()
        runner.wake()
        thread.join(timeout=5)
    assert not thread.is_alive()
    assert runner.runs == 2


def test_a_run_asked_for_before_the_source_is_ready_waits_for_it_not_for_min_interval() -> None:
    """The first lists arrive after the loop started: the first sync runs the moment they do (their
    request), not ``min_interval`` after an empty run spent while nothing was there to sync."""
    clock = Clock()
    ran: List[float] = []
    ready = [False]
    runner = BoundedFrequencyRunner(lambda: ran.append(clock()), 1.0, 30.0, clock=clock, ready=lambda: ready[0])
    assert runner.step() is False and runner.runs == 0  # asked for at start, held
    clock.advance(0.3)
    assert runner.step() is False
    ready[0] = True
    runner.request()  # what the tracker's services_synced/endpoints_synced do
    assert runner.step() is True and ran == [clock()]  # at once: 0.3 s after start, not 1.0
    clock.advance(0.2)
    runner.request()
    assert runner.step() is False  # from here min_interval holds as ever


def test_the_loop_sleeps_until_the_source_is_ready_and_then_runs_at_once() -> None:
    ran = threading.Event()
    ready = [False]
    runner = BoundedFrequencyRunner(ran.set, 5.0, 30.0, ready=lambda: ready[0])
    stop = threading.Event()
    loop = threading.Thread(target=runner.loop, args=(stop,), daemon=True)
    loop.start()
    try:
        assert not ran.wait(0.3)
        ready[0] = True
        runner.request()
        assert ran.wait(2.0), "the first run did not follow the request"
    finally:
        stop.set()
        runner.wake()
        loop.join(2.0)
