"""Waiting for a change to reach the kernel, and asserting who answered a batch of connections."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

from netproxy_lab.topology import Pod
from netproxy_lab.traffic import ConnectResult

# Waits are stretched by NETPROXY_TEST_TIME_SCALE (vagrant/guest-test sets 4 under QEMU's software
# emulation, where a process start costs seconds); 1 on real hardware, so host runs stay strict.
TIME_SCALE = float(os.environ.get("NETPROXY_TEST_TIME_SCALE", "1") or "1")


SETTLING = [0]
"""How many :func:`wait_for` loops are running: traffic sent inside one is not traced
(tests/kernel/traced.py), since the change waited for may reach the kernel between a batch and its trace."""


def wait_for(check: Callable[[], Optional[str]], timeout: float, step: float = 0.2) -> float:
    """Poll ``check`` (None = done, else why not yet) until done; the seconds it took; asserts.

    ``timeout`` is multiplied by :data:`TIME_SCALE`."""
    timeout *= TIME_SCALE
    t0 = time.monotonic()
    why: Optional[str] = "never checked"
    SETTLING[0] += 1
    try:
        while time.monotonic() - t0 < timeout:
            why = check()
            if why is None:
                return time.monotonic() - t0
            time.sleep(step)
    finally:
        SETTLING[0] -= 1
    raise AssertionError(f"not within {timeout}s: {why}")


def assert_only_and_all(result: ConnectResult, pods: Sequence[Pod], *, total: int, at_least: int = 1) -> None:
    """Every attempt answered, by exactly ``pods`` (each at least ``at_least`` times)."""
    want = sorted(p.name for p in pods)
    assert result.errors == {}, f"failed attempts {result.errors}; answers {result.counts}"
    assert sorted(result.counts) == want, f"answered by {result.counts}, expected exactly {want}"
    assert result.answered == total
    low = {pod: n for pod, n in result.counts.items() if n < at_least}
    assert not low, f"endpoints below {at_least} of {total}: {low} (all: {result.counts})"
