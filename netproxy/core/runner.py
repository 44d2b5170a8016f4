"""A bounded-frequency runner: kube-proxy's BoundedFrequencyRunner, with an injectable clock.

``request()`` asks for a run; runs happen at most every ``min_interval`` and at least every
``max_interval``; ``retry_after(delay)`` schedules a retry after a failure (backoff is the caller's
policy).  :meth:`BoundedFrequencyRunner.step` does one decision for a given time so unit tests drive it
without sleeping; :meth:`BoundedFrequencyRunner.loop` is the real thread body.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)


class BoundedFrequencyRunner:
    def __init__(self, fn: Callable[[], None], min_interval: float, max_interval: float,
                 clock: Callable[[], float] = time.monotonic, idle: Optional[Callable[[], object]] = None,
                 idle_interval: float = 0.5, ready: Optional[Callable[[], bool]] = None) -> None:
        if min_interval < 0 or max_interval <= 0 or min_interval > max_interval:
            raise ValueError(f"need 0 <= min_interval ({min_interval}) <= max_interval ({max_interval})")
        self.fn = fn
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.clock = clock
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._requested = True  # the first run happens as soon as possible
        self._retry_at: Optional[float] = None
        self._last_run: Optional[float] = None
        self.runs = 0
        self.idle = idle
        """Called between runs, every ``idle_interval`` seconds, in the loop's own thread (so never
        during ``fn``): the check for rules changed behind the proxy's back, which may request a run."""
        self.idle_interval = idle_interval
        self._last_idle: Optional[float] = None
        self.ready = ready
        """False until ``fn`` has something to do (the source's first lists): a run asked for before
        then is held, not spent, so the first sync starts the moment the lists arrive (the request
        they make wakes the loop) instead of ``min_interval`` after an empty first run."""

    def request(self) -> None:
        """Something changed: run soon (but not sooner than min_interval after the last run)."""
        with self._lock:
            self._requested = True
        self._wake.set()

    def retry_after(self, delay: float) -> None:
        """The last run failed: run again after ``delay`` seconds, even with nothing requested."""
        with self._lock:
            self._retry_at = self.clock() + delay
        self._wake.set()

    def due_in(self, now: float) -> float:
        """Seconds until the next run is due (0 when due now)."""
        with self._lock:
            if self._last_run is None:
                return 0.0
            waits = [self._last_run + self.max_interval - now]
            if self._requested:
                waits.append(self._last_run + self.min_interval - now)
            if self._retry_at is not None:
                # A retry still respects min_interval so that a failing kernel is not hammered.
                waits.append(max(self._retry_at, self._last_run + self.min_interval) - now)
            return max(0.0, min(waits))

    def step(self, now: Optional[float] = None) -> bool:
        """Run ``fn`` if it is due at ``now``; return whether it ran."""
        now = self.clock() if now is None else now
        if self.due_in(now) > 0 or not self._ready():
            return False
        with self._lock:
            self._requested = False
            self._retry_at = None
            self._last_run = now
        self.runs += 1
        self.fn()
        return True

    def _ready(self) -> bool:
        return self.ready is None or self.ready()

    def idle_step(self, now: Optional[float] = None) -> float:
        """Call ``idle`` if its interval has passed at ``now``; seconds until it is due again."""
        if self.idle is None:
            return float("inf")
        now = self.clock() if now is None else now
        if self._last_idle is not None and now - self._last_idle < self.idle_interval:
            return self._last_idle + self.idle_interval - now
        self._last_idle = now
        try:
            self.idle()
        except Exception:  # noqa: BLE001 - a failed look must not stop the proxy from syncing
            log.exception("idle step %r failed", self.idle)
        return self.idle_interval

    def loop(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set, sleeping between runs (woken early by request/retry/stop)."""
        while not stop.is_set():
            if self.step():
                continue
            self._wake.clear()
            idle_in = self.idle_step()
            if not self._ready():
                # Nothing to run yet: sleep until a request (the lists arriving) wakes us.
                self._wake.wait(min(idle_in, self.max_interval))
                continue
            delay = min(self.due_in(self.clock()), idle_in)
            if delay > 0:
                self._wake.wait(delay)

    def wake(self) -> None:
        """Interrupt a sleeping :meth:`loop` (used on shutdown)."""
        self._wake.set()
