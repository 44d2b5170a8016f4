"""How a timed step is repeated and summarised: one rule for netproxy and for kube-proxy's layout.

Both sides of a ratio must be sampled alike, or the ratio compares statistics rather than code: a
min of three against a single run flatters the side that got three tries.  So netproxy's steps
(``bench/worker.py``, the raw apply of its payload in ``bench/control.py``) and kube-proxy's layout
(``control.kubeproxy_reference``) all go through :func:`repeat`: up to ``FULL_RUNS`` full
syncs/applies or ``CHANGE_RUNS`` one-service changes, fewer only when the next run would not fit
``BUDGET`` seconds (at 10k services some writes take a minute), and the same statistic, the
median, with min, max and every run beside it.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Sequence

Step = Dict[str, Any]

FULL_RUNS = 3
"""Full syncs and full applies (each after a reset of the node's tables)."""
CHANGE_RUNS = 4
"""One-service changes; even, so that kube-proxy's there-and-back change leaves its table as it found it."""
BUDGET = 5.0
"""Seconds of runs worth repeating: another run is made while the runs so far plus one more like
the last fit in it."""


def repeat(once: Callable[[int], Step], runs: int, budget: float = BUDGET) -> Step:
    """``once(k)`` for k = 0, 1, … up to ``runs`` times (at least once) while the budget allows;
    :func:`summary` of the runs, or the first run that failed (a step without ``seconds``), as it is."""
    got: List[Step] = []
    for k in range(runs):
        res = once(k)
        if "seconds" not in res:
            return res
        got.append(res)
        spent = sum(r["seconds"] for r in got)
        if spent + got[-1]["seconds"] > budget:
            break
    return summary(got)


def summary(got: Sequence[Step]) -> Step:
    """The median of the runs' ``seconds`` (and of every other ``*_seconds`` field), with ``min``,
    ``max``, ``runs`` (every run's seconds, in order) and the last run's other fields."""
    if not got:
        raise ValueError("summary of no runs")
    out: Step = dict(got[-1])
    xs = [float(r["seconds"]) for r in got]
    for key in [k for k in out if k.endswith("_seconds")]:
        out[key] = statistics.median(float(r[key]) for r in got)
    out.update(seconds=statistics.median(xs), min=min(xs), max=max(xs), runs=xs)
    return out
