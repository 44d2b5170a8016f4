"""Data-plane measure: new TCP connections per second and connect() latency to the LAST service.

The client (``bench/connect.c`` compiled with cc, else ``bench/client.py``) runs in the sandbox's
client namespace and opens sequential connections to the last service's ClusterIP; each SYN goes
through the node's nat PREROUTING hook (where the service dispatch is) and is DNAT-ed to one of ten
pods.  Only the first packet of a connection meets the NAT rules, so connect() latency is where the
per-service dispatch cost shows.  Bounded: COUNT connections per target in ROUNDS batches of at
most BATCH_SECONDS each.  Batches alternate between the big ruleset and a one-service baseline held
in a second sandbox, and the median batch is reported: on a shared machine the load drifts, and
alternating makes the N vs N=1 ratio a comparison under the same load; the best batch's p50 (least
disturbed by other work) is reported next to the median batch's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from typing import Any, Dict, List, Sequence, Tuple

COUNT = 3000  # per target, over all rounds
ROUNDS = 10
BATCH_SECONDS = 1.0
WARMUP = 50
SMOKE_COUNT = 300
SMOKE_ROUNDS = 2


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


def paired(targets: Sequence[Tuple[Any, str, int]], client: Sequence[str], smoke: bool = False
           ) -> List[Dict[str, Any]]:
    """Batches to every ``(sandbox, addr, port)`` in turn, ROUNDS times; a summary per target.

    Alternating batches between the big ruleset and the one-service baseline (each in its own
    sandbox) puts both under the same machine load, so their ratio is not the load's drift.
    """
    out: List[Dict[str, Any]] = [{} for _ in targets]
    live = []
    for i, (sandbox, addr, port) in enumerate(targets):
        prepare_client(sandbox)
        probe = reachable(sandbox, client, addr, port)
        if probe.get("ok"):
            live.append(i)
        else:
            out[i] = {"error": f"{addr}:{port} not reachable from the client namespace within 10 s"}
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    count = (SMOKE_COUNT if smoke else COUNT) // rounds
    batches: Dict[int, List[Dict[str, Any]]] = {i: [] for i in live}
    for _ in range(rounds):
        for i in list(batches):
            sandbox, addr, port = targets[i]
            res = _batch(sandbox, client, addr, port, count)
            if "p50_us" not in res:
                out[i] = res
                del batches[i]
            else:
                batches[i].append(res)
    for i, got in batches.items():
        out[i] = summarise(got)
    return out


def summarise(batches: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The median batch by p50 (with median p99 and rate), and the best batch's p50.

    On a shared machine other work only ever adds latency, and it comes and goes between batches:
    the best batch's p50 is the figure least disturbed by it (the targets' ratios use it; the median
    batch is shown too).
    """
    batches = sorted(batches, key=lambda b: b["p50_us"])
    out = dict(batches[len(batches) // 2])
    out["p99_us"] = statistics.median(b["p99_us"] for b in batches)
    out["rate"] = statistics.median(b["rate"] for b in batches)
    out["best_p50_us"] = batches[0]["p50_us"]
    out["batches"] = [{k: b[k] for k in ("ok", "errors", "p50_us", "p99_us", "rate")} for b in batches]
    errors = sum(b["errors"] for b in batches)
    if errors:
        # A connection that failed is a data-plane failure, not noise: the run fails on it (failure()).
        out["failed"] = errors
        out["attempted"] = errors + sum(b["ok"] for b in batches)
    return out


def failure(cell: Dict[str, Any]) -> str:
    """Why ``cell`` (a result of :func:`paired`) is a data-plane failure, or "" when it is not.

    Failed connections in otherwise measured batches count as much as no figure at all: either
    means traffic to a service did not get through."""
    if cell.get("failed"):
        return f"{cell['failed']} of {cell['attempted']} connections failed"
    if "p50_us" in cell:
        return ""
    if "timeout" in cell:
        return f"a batch of connections did not finish within {cell['timeout']:.0f} s"
    return str(cell.get("error") or cell or "no figure")


def _batch(sandbox: Any, client: Sequence[str], addr: str, port: int, count: int) -> Dict[str, Any]:
    args: List[str] = [*client, "rate", addr, str(port), str(count), str(BATCH_SECONDS), str(WARMUP)]
    try:
        proc = sandbox.exec(sandbox.client, args, timeout=BATCH_SECONDS + 20)
    except subprocess.TimeoutExpired:
        return {"timeout": BATCH_SECONDS + 20}
    try:
        out: Dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"client failed: {proc.stderr.strip()[-300:]}"}
    if not out.get("ok"):
        return {"error": f"no connection succeeded ({out.get('errors')} errors)"}
    return out
