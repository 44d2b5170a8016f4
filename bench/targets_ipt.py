"""Issue 15's targets for the iptables backend at 10,000 services: a change costs what it changes.

Every ratio is against a raw tool measured in the same run: the *floor* (``control.floor``: the
raw ``iptables-restore --noflush`` of a one-rule change into the table as netproxy left it, which a
legacy write cannot go below because the kernel swaps the whole table) and the raw restore of
netproxy's own payload (``control.raw_own_payload``)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from bench.report import MB, MIXED_SUFFIX
from bench.targets_nft import Results, Target, _cell, _n, _sec, _t, _where, _why

LEGACY, LIBIPTC, NFT_FLAVOUR = "iptables-legacy/restore", "iptables-legacy/libiptc", "iptables-nft/restore"


def _ratio(x: Optional[float], ref: Optional[float], what: str) -> str:
    return f"{x / ref:.2f}× {what} ({ref:.3f} s)" if x is not None and ref else f"{what} not measured"


def _change(r: Results, key: str, variant: str, step: str, floor_max: float, abs_max: Optional[float],
            name: str) -> Target:
    n = _n(r)
    cell = _cell(r, key, n, step, variant)
    x, floor = _sec(r, key, n, step, variant), _sec(r, key, n, "floor", variant)
    target = (f"≤ {abs_max:.1f} s and " if abs_max else "") + f"≤ {floor_max:.1f}× the one-rule floor"
    if x is None:
        return _t(name, target, None, _why(cell) + _where(n))
    ok = None if floor is None else (x <= floor * floor_max and (abs_max is None or x <= abs_max))
    return _t(name, target, ok, f"{x:.3f} s, " + _ratio(x, floor, "the floor") + _where(n))


def mixed_endpoint(r: Results) -> List[Target]:
    return [_change(r, LEGACY, "mixed", "endpoint", 1.5, 2.0,
                    "legacy, mixed cluster, one endpoint replaced (service without affinity)"),
            _change(r, LEGACY, "mixed", "endpoint-affinity", 1.5, 2.0,
                    "legacy, mixed cluster, one endpoint replaced (service with ClientIP affinity)")]


def uniform_changes(r: Results) -> List[Target]:
    out = []
    for step, what in (("add", "added"), ("remove", "removed"), ("endpoint", "endpoint changed")):
        out.append(_change(r, LEGACY, "uniform", step, 1.2, None, f"legacy, uniform cluster, one service {what}"))
    return out


def _full(r: Results, key: str, variant: str, abs_max: float, name: str) -> Target:
    n = _n(r)
    x, raw = _sec(r, key, n, "cold", variant), _sec(r, key, n, "raw", variant)
    target = f"≤ {abs_max:g} s and ≤ 1.3× raw restore of its payload" if abs_max < 60 else f"≤ {abs_max:g} s"
    if x is None:
        return _t(name, target, None, _why(_cell(r, key, n, "cold", variant)) + _where(n))
    if abs_max >= 60:
        return _t(name, target, x <= abs_max, f"{x:.2f} s; " + _ratio(x, raw, "raw restore") + _where(n))
    ok = None if raw is None else (x <= abs_max and x <= 1.3 * raw)
    return _t(name, target, ok, f"{x:.2f} s, " + _ratio(x, raw, "raw restore of its payload") + _where(n))


def full_syncs(r: Results) -> List[Target]:
    return [_full(r, LEGACY, "mixed", 8.0, "legacy, mixed cluster, cold full sync (in process: render, sets, write)"),
            _full(r, LEGACY, "uniform", 2.5, "legacy, uniform cluster, full sync"),
            _full(r, NFT_FLAVOUR, "mixed", 60.0, "iptables-nft flavour, mixed cluster, cold full sync")]


def peak_rss(r: Results) -> Target:
    n = _n(r)
    uni = r["rss"].get(LEGACY, {}).get(str(n), {}).get("maxrss_mib")
    mix = r["rss"].get(LEGACY + MIXED_SUFFIX, {}).get(str(n), {}).get("maxrss_mib")
    name, target = "legacy, peak RSS of `netproxy sync`, uniform / mixed", "≤ 150 MB / ≤ 250 MB"

    def mb(x: Optional[float]) -> str:
        return "not measured" if x is None else f"{x / MB:.0f} MB"

    ok = None if uni is None or mix is None else (uni / MB <= 150 and mix / MB <= 250)
    return _t(name, target, ok, f"{mb(uni)} / {mb(mix)}{_where(n)}")


def restart(r: Results) -> Target:
    n = _n(r)
    cell = r["rss"].get(LEGACY, {}).get(str(n), {})
    res = cell.get("restart", {})
    y = res.get("seconds")
    name = "legacy, restart: a new `netproxy sync` with one endpoint changed on a programmed uniform node"
    first = cell.get("seconds")
    extra = f" (the first `netproxy sync` of the node: {first:.2f} s)" if first else ""
    return _t(name, "≤ 3.0 s", None if y is None else y <= 3.0,
              (_why(res) if y is None else f"{y:.2f} s") + extra + _where(n))


def libiptc_mixed(r: Results) -> Target:
    """Not an issue-15 target: the libiptc writer's figures on the same cluster, for comparison."""
    n = _n(r)
    x, e = _sec(r, LIBIPTC, n, "cold", "mixed"), _sec(r, LIBIPTC, n, "endpoint", "mixed")
    fig = "not measured" if x is None else f"cold {x:.2f} s" + ("" if e is None else f", one endpoint {e:.3f} s")
    return _t("libiptc writer, mixed cluster (reference)", "—", None, fig + _where(n))


CHECKS: List[Callable[[Results], Any]] = [mixed_endpoint, full_syncs, uniform_changes, peak_rss, restart,
                                          libiptc_mixed]
