"""Event → kernel: ``netproxy run`` in the node namespace, a source file changes, when does it route?

The source is a directory: ``base.json`` (the N services) and ``extra.json`` (one extra service,
``extra-<k>`` with its own ClusterIP, whose endpoint is a real pod).  Change ``k`` rewrites
``extra.json`` (atomically: write then rename) to hold ``extra-<k>`` instead of ``extra-<k-1>``.
A poller in the client namespace, started just before the change, tries to connect to
``extra-<k>``'s ClusterIP every few milliseconds (one attempt = one fresh connection); the first
established connection is the moment the rule is in the kernel.  Latency = that moment (the
poller's CLOCK_MONOTONIC) − the moment before the rename (ours; same clock, same machine).

Changes are spaced by a random pause of 0–1.5 × ``--min-sync-period`` after the previous one
landed, so that some land while the runner is still holding back (the rate limit is part of what
a user waits for).  Also reported: the backend's own sync time for each change (from netproxy's
log) and the peak RSS (VmHWM) of the ``netproxy run`` process at the end.

A change that has not reached the kernel within its deadline (``change_deadline``: the poller's
lifetime) is a *failure*, not a sample left out: the result counts it (``failures`` of ``n``), and
the median and p95 count it as +inf, so a percentile that lands on one is reported as "over the
deadline" (``None`` in the JSON) rather than as the latency of the changes that did land.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
import subprocess
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench import gen
from netproxy_lab import netns
from netproxy_lab.topology import netproxy_command

CHANGES = 20
POLL_ATTEMPT_MS = 2
GIVE_UP_AFTER = 3
"""Failures in a row after which no further change is made (each one costs a whole deadline)."""
_SYNCED = re.compile(r"synced (full|partial): .* in ([0-9.]+) s")
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d),(\d{3}) ")


def _write_atomic(path: str, objects: Sequence[gen.Obj]) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    gen.write_json(tmp, objects)
    os.replace(tmp, path)


def proc_status_kib(pid: int, field: str) -> Optional[int]:
    """A KiB figure of ``/proc/<pid>/status`` (``VmHWM``: the peak resident set, ``VmRSS``: now)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def vm_hwm_kib(pid: int) -> Optional[int]:
    return proc_status_kib(pid, "VmHWM")


def _poll(sandbox: Any, client: Sequence[str], addr: str, port: int, seconds: float) -> subprocess.Popen:  # type: ignore[type-arg]
    return netns.spawn(sandbox.client, [*client, "poll", addr, str(port), str(seconds), str(POLL_ATTEMPT_MS)],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _wait_poll(proc: subprocess.Popen, timeout: float) -> Optional[float]:  # type: ignore[type-arg]
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        netns.stop(proc)
        return None
    netns.stop(proc)
    try:
        rec = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return float(rec["t"]) if rec.get("ok") else None


def _started(poller: subprocess.Popen, proc: subprocess.Popen, timeout: float) -> bool:  # type: ignore[type-arg]
    """Wait for the start-up poller to connect, giving up as soon as netproxy itself has exited."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            poller.wait(0.2)
            return _wait_poll(poller, 1.0) is not None
        except subprocess.TimeoutExpired:
            if proc.poll() is not None:
                return False
    return False


def _tail(log_path: str) -> str:
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            lines = [ln.strip() for ln in fh if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _log_times(log_path: str) -> Tuple[List[float], List[float]]:
    """(partial sync seconds, seconds from "source changed" to the next finished sync) from netproxy's log."""
    syncs: List[float] = []
    reloads: List[float] = []
    changed_at: Optional[float] = None
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return syncs, reloads
    for line in lines:
        stamp = _stamp(line)
        if "changed, reloading" in line:
            changed_at = stamp if changed_at is None else changed_at
            continue
        m = _SYNCED.search(line)
        if m and m.group(1) == "partial":
            syncs.append(float(m.group(2)))
            if changed_at is not None and stamp is not None:
                reloads.append(stamp - changed_at)
            changed_at = None
    return syncs, reloads


def _stamp(line: str) -> Optional[float]:
    """Seconds of the day of a logging line (``2026-12-03 08:30:12,880 INFO …``)."""
    m = _STAMP.match(line)
    if not m:
        return None
    h, mi, sec, ms = (int(g) for g in m.groups())
    return h * 3600 + mi * 60 + sec + ms / 1000


def measure(sandbox: Any, combo: Any, n: int, client: Sequence[str], workdir: str, *, changes: int = CHANGES,
            min_sync: float = 1.0, start_timeout: float = 120.0, node_name: str = "np-node",
            deadline: Optional[float] = None, variant: str = "uniform", one_file: bool = False) -> Dict[str, Any]:
    """``changes`` source-file changes against ``netproxy run``; latency stats in seconds, or ``error``.

    By default the cluster is one file of a source directory and each change replaces a second, small
    file beside it.  ``one_file``: the cluster and the change are one file, replaced whole at each
    change (``run --source FILE`` as a user keeps it: every change makes netproxy read all of it).
    No new change starts after ``deadline`` (monotonic); the result then says how many were made.
    """
    src = os.path.join(workdir, f"latency-{combo.name.replace('/', '-')}-{n}-{variant}{'-file' if one_file else ''}")
    os.makedirs(src, exist_ok=True)
    pods = [(p.ip, 8080) for p in sandbox.pods]
    base = gen.cluster(n, variant, pods)
    if one_file:
        target = os.path.join(src, "cluster.json")
        _write_atomic(target, base)
    else:
        target = src
        _write_atomic(os.path.join(src, "base.json"), base)
        _write_atomic(os.path.join(src, "extra.json"), [])
    args = ["run", "--source", target, *combo.flags, "--min-sync-period", f"{min_sync}s",
            "--metrics-bind-address", "", "--hostname-override", node_name, "--log-level", "info"]
    log_path = os.path.join(workdir, f"netproxy-run-{combo.name.replace('/', '-')}-{n}.log")
    env = dict(os.environ)
    env["PATH"] = sandbox.iptables_bindir(combo.flavour) + os.pathsep + env.get("PATH", "/usr/sbin:/usr/bin")
    with open(log_path, "wb") as log:
        proc = netns.spawn(sandbox.node, [*netproxy_command(), *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        first = _poll(sandbox, client, gen.cluster_ip(n - 1), gen.PORT, start_timeout)
        if not _started(first, proc, start_timeout + 5):
            netns.stop(first)
            if proc.poll() is not None:
                return {"error": f"netproxy run exited {proc.returncode} before programming the last service: "
                                 f"{_tail(log_path)} (log {log_path})"}
            return {"error": f"netproxy run did not program the last service within {start_timeout:.0f} s "
                             f"(log {log_path})"}
        rng = random.Random(n)
        lat: List[float] = []
        in_a_row = 0
        change_deadline = 30.0 + min_sync
        for k in range(changes):
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(rng.uniform(0, 1.5 * min_sync))
            svc, eps = gen.extra_service(k, [pods[k % len(pods)]])
            poller = _poll(sandbox, client, gen.extra_ip(k), gen.PORT, change_deadline)
            time.sleep(0.02)  # the poller is running (and failing) before the change
            changed, objects = (target, [*base, svc, eps]) if one_file else \
                (os.path.join(src, "extra.json"), [svc, eps])
            tmp = os.path.join(os.path.dirname(changed), "." + os.path.basename(changed) + ".tmp")
            gen.write_json(tmp, objects)  # written before the clock starts: the change is the rename
            t0 = time.monotonic()
            os.replace(tmp, changed)
            t = _wait_poll(poller, change_deadline + 10.0)
            if t is None:
                lat.append(math.inf)  # never in the kernel within the deadline: a failure, counted
                in_a_row += 1
                if in_a_row >= GIVE_UP_AFTER:
                    break
                continue
            in_a_row = 0
            lat.append(max(0.0, t - t0))
        hwm = vm_hwm_kib(proc.pid)
    finally:
        netns.stop(proc)
    if not lat:
        return {"error": "no change was made: the time budget ran out before the first"}
    syncs, reloads = _log_times(log_path)
    return {**summary(lat, change_deadline), "wanted": changes, "min_sync_period": min_sync,
            "sync_median": statistics.median(syncs) if syncs else None,
            "reload_median": statistics.median(reloads) if reloads else None,
            "run_vmhwm_mib": hwm / 1024 if hwm else None}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q`` quantile (0..1) of ``values``; an +inf (a change that timed out) is a value like any other."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def summary(lat: Sequence[float], change_deadline: float) -> Dict[str, Any]:
    """Median, p95 and max of ``lat`` (seconds; +inf for a change that missed ``change_deadline``).

    A statistic that lands on a timed-out change is ``None`` (over the deadline); ``failures`` counts
    those changes, ``n`` all changes made, ``runs`` the landed latencies in order."""
    failures = sum(1 for x in lat if not math.isfinite(x))
    return {"n": len(lat), "failures": failures, "change_deadline": change_deadline,
            "median": _finite(statistics.median(lat)), "p95": _finite(percentile(lat, 0.95)),
            "max": _finite(max(lat)), "runs": [x for x in lat if math.isfinite(x)]}


def _ms(x: Optional[float]) -> str:
    return "over the deadline" if x is None else f"{x * 1000:.0f} ms"


def describe(cell: Dict[str, Any]) -> str:
    """One line for a result of :func:`measure`: median, p95, n and the failures, said as failures."""
    text = f"median {_ms(cell.get('median'))}, p95 {_ms(cell.get('p95'))}, n {cell['n']}"
    if cell.get("failures"):
        text += (f", {cell['failures']} FAILED (not in the kernel within {cell['change_deadline']:.0f} s; "
                 "counted as +inf)")
    if cell.get("wanted") and cell["n"] < cell["wanted"]:
        text += f"; {cell['n']} of {cell['wanted']} changes made"
    return text
