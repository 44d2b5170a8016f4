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
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench import gen
from netproxy.lab import netns
from netproxy.lab.topology import netproxy_command

CHANGES = 20
POLL_ATTEMPT_MS = 2
_SYNCED = re.compile(r"synced (full|partial): .* in ([0-9.]+) s")
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d),(\d{3}) ")


def _write_atomic(path: str, objects: Sequence[gen.Obj]) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    gen.write_json(tmp, objects)
    os.replace(tmp, path)


def vm_hwm_kib(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


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
            deadline: Optional[float] = None) -> Dict[str, Any]:
    """``changes`` source-file changes against ``netproxy run``; latency stats in seconds, or ``error``.

    No new change starts after ``deadline`` (monotonic); the result then says how many were made.
    """
    src = os.path.join(workdir, f"latency-{combo.name.replace('/', '-')}-{n}")
    os.makedirs(src, exist_ok=True)
    pods = [(p.ip, 8080) for p in sandbox.pods]
    _write_atomic(os.path.join(src, "base.json"), gen.cluster(n, "uniform", pods))
    _write_atomic(os.path.join(src, "extra.json"), [])
    args = ["run", "--source", src, *combo.flags, "--min-sync-period", f"{min_sync}s",
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
        misses = 0
        for k in range(changes):
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(rng.uniform(0, 1.5 * min_sync))
            svc, eps = gen.extra_service(k, [pods[k % len(pods)]])
            poller = _poll(sandbox, client, gen.extra_ip(k), gen.PORT, 30.0 + min_sync)
            time.sleep(0.02)  # the poller is running (and failing) before the change
            t0 = time.monotonic()
            _write_atomic(os.path.join(src, "extra.json"), [svc, eps])
            t = _wait_poll(poller, 40.0 + min_sync)
            if t is None:
                misses += 1
                if misses >= 3:
                    break
                continue
            lat.append(max(0.0, t - t0))
        hwm = vm_hwm_kib(proc.pid)
    finally:
        netns.stop(proc)
    if not lat:
        return {"error": f"no change reached the kernel ({misses} missed)"}
    lat.sort()
    syncs, reloads = _log_times(log_path)
    return {"median": statistics.median(lat), "p95": lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))],
            "max": lat[-1], "runs": lat, "changes": len(lat), "wanted": changes, "missed": misses,
            "min_sync_period": min_sync,
            "sync_median": statistics.median(syncs) if syncs else None,
            "reload_median": statistics.median(reloads) if reloads else None,
            "run_vmhwm_mib": hwm / 1024 if hwm else None}
