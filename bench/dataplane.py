"""Data-plane measure: new TCP connections per second and connect() latency to the LAST service.

The client (``bench/connect.c`` compiled with cc, else ``bench/client.py``) runs in the sandbox's
client namespace and opens sequential connections to the last service's ClusterIP; each SYN goes
through the node's nat PREROUTING hook (where the service dispatch is) and is DNAT-ed to one of ten
pods.  Only the first packet of a connection meets the NAT rules, so connect() latency is where the
per-service dispatch cost shows.  Bounded: at most COUNT connections and SECONDS seconds in all, in
BATCHES batches; the median batch is reported, so that one noisy moment on a shared machine does
not move the figure.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from typing import Any, Dict, List, Sequence

COUNT = 3000
SECONDS = 4.0
WARMUP = 100
BATCHES = 3
SMOKE_COUNT = 300


def prepare_client(sandbox: Any) -> None:
    """More ephemeral ports in the client namespace, so that no source port (and no stale conntrack
    entry with its NAT binding) is reused during a batch."""
    sandbox.exec(sandbox.client, ["sh", "-c", "echo '10000 65000' > /proc/sys/net/ipv4/ip_local_port_range"],
                 check=True)


def reachable(sandbox: Any, client: Sequence[str], addr: str, port: int, seconds: float = 10.0) -> Dict[str, Any]:
    """Poll ``addr:port`` until a connection is established (the rules are in place) or give up."""
    proc = sandbox.exec(sandbox.client, [*client, "poll", addr, str(port), str(seconds), "5"],
                        timeout=seconds + 10)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    except (ValueError, IndexError):
        return {"ok": 0, "error": proc.stderr.strip()[-300:]}


def measure(sandbox: Any, client: Sequence[str], addr: str, port: int, smoke: bool = False) -> Dict[str, Any]:
    """One batch from the client namespace; the client's JSON, or ``error``."""
    prepare_client(sandbox)
    probe = reachable(sandbox, client, addr, port)
    if not probe.get("ok"):
        return {"error": f"{addr}:{port} not reachable from the client namespace within 10 s"}
    count = SMOKE_COUNT if smoke else COUNT
    batches: List[Dict[str, Any]] = []
    for _ in range(BATCHES):
        res = _batch(sandbox, client, addr, port, count // BATCHES)
        if "p50_us" not in res:
            return res
        batches.append(res)
    # The median batch by p50 (the machine is shared: one noisy moment should not move the figure).
    batches.sort(key=lambda b: b["p50_us"])
    out = dict(batches[len(batches) // 2])
    out["p99_us"] = statistics.median(b["p99_us"] for b in batches)
    out["rate"] = statistics.median(b["rate"] for b in batches)
    out["batches"] = [{k: b[k] for k in ("ok", "errors", "p50_us", "p99_us", "rate")} for b in batches]
    errors = sum(b["errors"] for b in batches)
    if errors:
        out["warning"] = f"{errors} of {errors + sum(b['ok'] for b in batches)} connections failed"
    return out


def _batch(sandbox: Any, client: Sequence[str], addr: str, port: int, count: int) -> Dict[str, Any]:
    args: List[str] = [*client, "rate", addr, str(port), str(count), str(SECONDS / BATCHES), str(WARMUP)]
    try:
        proc = sandbox.exec(sandbox.client, args, timeout=SECONDS + 20)
    except subprocess.TimeoutExpired:
        return {"timeout": SECONDS + 20}
    try:
        out: Dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"client failed: {proc.stderr.strip()[-300:]}"}
    if not out.get("ok"):
        return {"error": f"no connection succeeded ({out.get('errors')} errors)"}
    return out
