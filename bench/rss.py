"""Peak RSS of the netproxy process: ``netproxy sync`` as its own process, its ``ru_maxrss`` from wait4().

``ip netns exec`` execs the command in place, so the PID we wait for *is* the netproxy process; the
kernel's ``ru_maxrss`` for it is its peak resident set (the tools it ran, iptables-restore or none
for libnftables, are counted only if one of them peaked higher).  The same run gives the wall time
of a whole ``netproxy sync`` (start-up, loading the JSON source, full sync).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Dict

from bench import netns
from netproxy.sandbox import netproxy_command


def measure_sync(sandbox: Any, combo: Any, source: str, timeout: float, log_path: str,
                 node_name: str = "np-node") -> Dict[str, Any]:
    args = [*netproxy_command(), "sync", "--source", source, *combo.cli_args(), "--hostname-override", node_name,
            "--log-level", "warning"]
    env = dict(os.environ)
    env["PATH"] = sandbox.iptables_bindir(combo.flavour) + os.pathsep + env.get("PATH", "/usr/sbin:/usr/bin")
    with open(log_path, "ab") as log:
        t0 = time.monotonic()
        proc = netns.spawn(sandbox.node, args, stdout=log, stderr=log, env=env)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                netns.stop(proc)
                return {"timeout": timeout}
            time.sleep(0.02)
    elapsed = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8
    netns.stop(proc)
    if proc.returncode != 0:
        return {"error": f"netproxy sync exited {proc.returncode} (log {log_path})",
                "maxrss_mib": usage.ru_maxrss / 1024}
    return {"seconds": elapsed, "maxrss_mib": usage.ru_maxrss / 1024}


def _self_test() -> None:  # pragma: no cover - manual check: `python -m bench.rss`
    proc = subprocess.Popen(["python3", "-c", "x = bytearray(50 << 20)"])
    _, _, usage = os.wait4(proc.pid, 0)
    print(f"50 MiB child: ru_maxrss {usage.ru_maxrss / 1024:.1f} MiB")


if __name__ == "__main__":  # pragma: no cover
    _self_test()
