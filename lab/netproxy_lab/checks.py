"""Waiting for a change to reach the kernel, and asserting who answered a batch of connections."""

from __future__ import annotations

import os
import time
from typing import Callable, Collection, Dict, Optional, Sequence

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


NOT_SERVED_TIMEOUT = 2.0 * TIME_SCALE
"""Seconds per attempt of a batch that must not be served: a slow answer on a loaded machine is then
still an answer, and fails the check, instead of a timeout that reads as "not served".  (A refusal
comes back at once whatever the timeout; only a silent drop costs it, once per batch.)"""

DROPPED = "timeout"
"""The outcome of an attempt nothing answered nor refused: a silent drop."""


def outcomes(result: ConnectResult) -> Dict[str, int]:
    """How the batch's attempts ended that were not answered: each refusal by what sent it
    (:func:`netproxy_lab.client.refusal_kind`: ``icmp port-unreachable``, ``rst`` ...) and
    :data:`DROPPED` for those that timed out."""
    out = dict(result.refusals)
    if result.errors.get("timeout"):
        out[DROPPED] = result.errors["timeout"]
    return out


def assert_not_served(result: ConnectResult, total: int, kinds: Collection[str], what: str = "") -> None:
    """Not one of ``total`` attempts answered, and each ended as one of ``kinds`` (see :func:`outcomes`):
    a REJECT's ICMP error is not a reset, and neither is a silent drop."""
    seen = outcomes(result)
    where = f"{what}: " if what else ""
    assert result.answered == 0, f"{where}expected no answer ({sorted(kinds)}), got {result.counts}"
    assert sum(seen.values()) == total and set(seen) <= set(kinds), \
        f"{where}expected {total} attempts ended by {sorted(kinds)}, got {seen} (errors {result.errors})"
