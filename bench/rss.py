"""Peak RSS of the netproxy process: ``netproxy sync`` as its own process, its VmHWM sampled from /proc.

``ip netns exec`` execs the command in place, so the PID we started *is* the netproxy process.  Its
peak resident set is read from ``/proc/<pid>/status`` (VmHWM, the high-water mark of its own address
space) every 10 ms until it exits.  Not ``ru_maxrss`` from wait4(): the kernel folds the address
space a child had before exec() — a copy of this (big) benchmark process — into it, so it reports
the benchmark's size, not netproxy's.  The same run gives the wall time of a whole ``netproxy sync``
(start-up, loading the JSON source, full sync).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict

from bench.latency import vm_hwm_kib
from netproxy_lab import netns
from netproxy_lab.topology import netproxy_command


def measure_sync(sandbox: Any, combo: Any, source: str, timeout: float, log_path: str,
                 node_name: str = "np-node") -> Dict[str, Any]:
    args = [*netproxy_command(), "sync", "--source", source, *combo.flags, "--hostname-override", node_name,
            "--log-level", "warning"]
    env = dict(os.environ)
    env["PATH"] = sandbox.iptables_bindir(combo.flavour) + os.pathsep + env.get("PATH", "/usr/sbin:/usr/bin")
    with open(log_path, "ab") as log:
        t0 = time.monotonic()
        proc = netns.spawn(sandbox.node, args, stdout=log, stderr=log, env=env)
        deadline = t0 + timeout
        hwm = 0
        while True:
            hwm = max(hwm, vm_hwm_kib(proc.pid) or 0)
            pid, status, _usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                netns.stop(proc)
                return {"timeout": timeout}
            time.sleep(0.01)
    elapsed = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8
    netns.stop(proc)
    if proc.returncode != 0:
        return {"error": f"netproxy sync exited {proc.returncode} (log {log_path})", "maxrss_mib": hwm / 1024}
    return {"seconds": elapsed, "maxrss_mib": hwm / 1024}
