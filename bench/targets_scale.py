"""The targets of a ``--scale N`` run (issue 40: 100,000 services × 10 endpoints on one node, and
the 44,000-service row, the largest public kube-proxy report, which ``make bench-100k`` runs too).

Every figure comes from the same run: the cold sync and the raw tool applying the same payload
(in the bench worker), one endpoint changed in the running process, `netproxy sync` as a new process
with its peak RSS, and the restart with one endpoint changed on the node the first one programmed.
Issue 40 sets every target at 100k and only the new process's time and peak at 44k: at any other N
(and at 44k for the lines without a target) the figure is printed as a reference line, with no
"met" or "missed" it was never given.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from bench.report import MB, control_cell, seconds

Results = Dict[str, Any]
Target = Dict[str, Any]
NFT, LEGACY = "nftables", "iptables-legacy/restore"

FULL = 100000
"""The N every target of issue 40 is set at."""
NFT_SYNC = {FULL: (8.0, 600.0), 44000: (3.0, 300.0)}
"""nftables `netproxy sync` as a new process: (seconds, MB of peak RSS) by N."""
NFT_RESTART_S, NFT_ENDPOINT_S = 5.0, 0.005
LEGACY_SYNC_RAW, LEGACY_RSS_MB = 2.0, 800.0


def _t(name: str, target: str, ok: Optional[bool], figure: str) -> Target:
    return {"name": name, "target": target, "met": ok, "figure": figure}


def _reference(target: Target) -> Target:
    """``target`` as a reference line: its figure (or why it has none), no target it was not given."""
    return {"name": target["name"], "target": "", "met": None, "reference": True, "figure": target["figure"]}


def _n(r: Results) -> int:
    return int(r["meta"]["sizes"][-1])


def _why(cell: Optional[Dict[str, Any]], r: Results, key: str) -> str:
    if key in r.get("unavailable", {}):
        return f"{key} unavailable: {r['unavailable'][key]}"
    for k in ("skipped", "timeout", "error"):
        if cell and k in cell:
            return f"{k}: {str(cell[k])[:160]}"
    return "not measured"


def _rss(r: Results, key: str, n: int) -> Dict[str, Any]:
    got: Dict[str, Any] = r["rss"].get(key, {}).get(str(n), {})
    return got


def nft_sync(r: Results) -> Target:
    n = _n(r)
    cell = _rss(r, NFT, n)
    x, mem = seconds(cell), cell.get("maxrss_mib") if "seconds" in cell else None
    name = f"nftables `netproxy sync` as a new process, {n:,} × 10 / its peak RSS"
    limits = NFT_SYNC.get(n)
    target = "" if limits is None else f"≤ {limits[0]:g} s / ≤ {limits[1]:g} MB"
    if x is None or mem is None:
        return _t(name, target, None, _why(cell, r, NFT))
    cold = seconds(control_cell(r, NFT, n, "cold", "uniform"))
    raw = seconds(control_cell(r, NFT, n, "raw-netlink", "uniform"))
    extra = "" if cold is None else f"; the full sync alone, in process, {cold:.2f} s"
    extra += "" if raw is None else f"; the raw netlink apply of its batch {raw:.2f} s"
    return _t(name, target, None if limits is None else x <= limits[0] and mem / MB <= limits[1],
              f"{x:.2f} s / {mem / MB:.0f} MB{extra}")


def nft_restart(r: Results) -> Target:
    n = _n(r)
    cell = _rss(r, NFT, n).get("restart") or {}
    x = seconds(cell)
    name = f"nftables restart: a new `sync` with one endpoint changed on the programmed node, {n:,} × 10"
    target = f"≤ {NFT_RESTART_S:g} s"
    if x is None:
        return _t(name, target, None, _why(cell, r, NFT))
    mem = cell.get("maxrss_mib")
    return _t(name, target, x <= NFT_RESTART_S, f"{x:.2f} s" + ("" if mem is None else f", peak RSS {mem / MB:.0f} MB"))


def nft_endpoint(r: Results) -> Target:
    n = _n(r)
    cell = control_cell(r, NFT, n, "endpoint", "uniform")
    x = seconds(cell)
    name = f"nftables one endpoint changed in the running process, tracker → kernel, {n:,} × 10"
    target = f"≤ {NFT_ENDPOINT_S * 1000:g} ms"
    if x is None:
        return _t(name, target, None, _why(cell, r, NFT))
    w = cell.get("backend_seconds")
    return _t(name, target, x <= NFT_ENDPOINT_S,
              f"{x * 1000:.2f} ms" + ("" if w is None else f" (the write {w * 1000:.2f} ms)"))


def legacy_sync(r: Results) -> Target:
    n = _n(r)
    cell = _rss(r, LEGACY, n)
    x, mem = seconds(cell), cell.get("maxrss_mib") if "seconds" in cell else None
    raw = seconds(control_cell(r, LEGACY, n, "raw", "uniform"))
    name = f"iptables-legacy `netproxy sync` as a new process, {n:,} × 10 / its peak RSS"
    target = f"≤ {LEGACY_SYNC_RAW:g}× the raw iptables-restore of its payload / ≤ {LEGACY_RSS_MB:g} MB"
    if x is None or mem is None:
        return _t(name, target, None, _why(cell, r, LEGACY))
    if raw is None:
        return _t(name, target, None, f"{x:.2f} s / {mem / MB:.0f} MB; the raw restore not measured "
                  f"({_why(control_cell(r, LEGACY, n, 'raw', 'uniform'), r, LEGACY)})")
    cold = seconds(control_cell(r, LEGACY, n, "cold", "uniform"))
    extra = "" if cold is None else f"; the full sync alone, in process, {cold:.2f} s"
    restart = seconds(cell.get("restart") or {})
    extra += "" if restart is None else f"; restart with one endpoint changed {restart:.2f} s"
    return _t(name, target, x <= LEGACY_SYNC_RAW * raw and mem / MB <= LEGACY_RSS_MB,
              f"{x:.2f} s = {x / raw:.2f}× the raw restore ({raw:.2f} s) / {mem / MB:.0f} MB{extra}")


CHECKS: List[Tuple[str, Callable[[Results], Target]]] = [(NFT, nft_sync), (NFT, nft_restart), (NFT, nft_endpoint),
                                                         (LEGACY, legacy_sync)]
"""Each line with the combination it measures."""


def check(results: Results) -> List[Target]:
    """Every line at 100k (one without its figure says why); at another N only the lines of the
    combinations the run was asked for (``make bench-100k``'s 44k run is nftables alone)."""
    n = _n(results)
    asked = {c["key"] for c in results["meta"].get("combos", [])}
    out: List[Target] = []
    for key, fn in CHECKS:
        if n != FULL and key not in asked:
            continue
        t = fn(results)
        if n != FULL and not (fn is nft_sync and n in NFT_SYNC):
            t = _reference(t)
        t.setdefault("group", __name__)
        out.append(t)
    return out
