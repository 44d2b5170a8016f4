"""Worker steps that only the nftables backend has, run inside the worker's namespace.

- ``raw-netlink``: the kernel's share of a full sync: the same batch netproxy's netlink writer
  sends, encoded beforehand, sent over a bare netlink socket into an empty namespace (median of 3, as
  ``bench.sample`` summarises netproxy's own cold sync).
  A full sync is compared with it as a ratio.
- ``churn``: 1,000 one-endpoint changes through the tracker and the backend; the process's
  resident set after the first and after the last (memory must not grow with syncs).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

from bench import gen, sample

CHURN = 1000


def rss_kib() -> int:
    """The worker's current resident set (VmRSS), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def raw_netlink(backend: Any, snapshot: Any, config: Any) -> Dict[str, Any]:
    """Seconds for the kernel to take netproxy's full batch (encoded before the clock starts)."""
    from netproxy.backends.nftables import encode
    from netproxy.backends.nftables.kernel.netlink import NetlinkRunner
    from netproxy.backends.nftables.transaction import full_transaction

    if getattr(config, "nftables_writer", "") != "netlink" or config.backend != "nftables":
        return {"skipped": "the netlink writer's reference"}
    state = backend._build_state(snapshot, None)
    backend.kernel.watch(False)  # as netproxy's own rewrite does: no change notifications to deliver
    runner = NetlinkRunner()
    runs: List[Dict[str, Any]] = []
    size = 0
    for _ in range(sample.FULL_RUNS):  # as many as netproxy's cold sync, summarised the same way
        runner.delete_tables()
        time.sleep(0.5)  # the kernel frees a deleted table's objects after the commit, in a worker
        tx = full_transaction(state, (), config)
        bodies = [m for m, _ in encode.Encoder().messages(tx.ops)]
        size = sum(len(b[3]) for b in bodies)
        t0 = time.perf_counter()
        runner._sock.send_batch(bodies)
        runs.append({"seconds": time.perf_counter() - t0})
    # The last run leaves the ruleset in place: the data-plane measure runs on it next.
    return {**sample.summary(runs), "bytes": size, "messages": len(bodies)}


def churn(change: Callable[[int], Dict[str, float]], n: int, variant: str) -> Dict[str, Any]:
    """``CHURN`` one-endpoint changes (``change(k)`` makes the k-th); RSS after the first and the last."""
    if n < 2:
        return {"skipped": "needs two services"}
    first = change(0)
    rss_first = rss_kib()
    times = [first["seconds"]]
    for k in range(1, CHURN):
        times.append(change(k)["seconds"])
    rss_last = rss_kib()
    return {"seconds": statistics.median(times), "syncs": CHURN, "rss_first_mib": rss_first / 1024,
            "rss_last_mib": rss_last / 1024, "growth_mib": (rss_last - rss_first) / 1024,
            "p99": sorted(times)[int(0.99 * len(times)) - 1], "variant": variant, "service": gen.service_name(n // 3)}
