"""The iptables backend's targets at 10,000 services, features on: a change costs what it changes.

Every ratio is against a raw tool measured in the same run: the *floor* (``control.floor``: the
raw ``iptables-<flavour>-restore --noflush`` of a one-rule change into the nat table as netproxy
left it, which a legacy write cannot go below because the kernel swaps the whole table) and the raw
restore of netproxy's own payload (``control.raw_own_payload``).  Each line says met / MISSED with
its figure, or why it has none; the ``reference`` lines (other writers, the floors themselves) carry
no target."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from bench.report import MB, MIXED_SUFFIX
from bench.targets_nft import Results, Target, _cell, _n, _sec, _t, _where, _why

LEGACY, LIBIPTC, NFT_FLAVOUR = "iptables-legacy/restore", "iptables-legacy/libiptc", "iptables-nft/restore"


def _ref(name: str, figure: str) -> Target:
    """A line with no target: a figure to read the targets by."""
    t = _t(name, "—", None, figure)
    t["reference"] = True
    return t


def _reason(r: Results, key: str, cell: Dict[str, Any]) -> str:
    """Why ``cell`` has no figure: the combination is unavailable or was not run, or the cell's own why."""
    if key in r.get("unavailable", {}):
        return f"{key} unavailable here: {str(r['unavailable'][key])[:160]}"
    if key not in [c["key"] for c in r["meta"].get("combos", [])]:
        return f"{key} not in this run (--backends)"
    return _why(cell)


def _ratio(x: Optional[float], ref: Optional[float], what: str, why: str = "") -> str:
    if x is not None and ref:
        return f"{x / ref:.2f}× {what} ({ref:.3f} s)"
    return f"{what} not measured" + (f" ({why})" if why and why != "not measured" else "")


def _change(r: Results, key: str, variant: str, step: str, floor_max: float, abs_max: Optional[float],
            name: str) -> Target:
    n = _n(r)
    cell, floor_cell = _cell(r, key, n, step, variant), _cell(r, key, n, "floor", variant)
    x, floor = _sec(r, key, n, step, variant), _sec(r, key, n, "floor", variant)
    target = (f"≤ {abs_max:g} s and " if abs_max else "") + f"≤ {floor_max:g}× the one-rule floor ({variant})"
    if x is None:
        return _t(name, target, None, _reason(r, key, cell) + _where(n))
    fig = f"{x:.3f} s, " + _ratio(x, floor, "the floor", _reason(r, key, floor_cell)) + _where(n)
    if abs_max is not None and x > abs_max:
        return _t(name, target, False, fig)  # missed on time alone, whatever the floor
    return _t(name, target, None if floor is None else x <= floor * floor_max, fig)


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


def _full(r: Results, key: str, variant: str, abs_max: float, name: str, raw_max: Optional[float] = 1.3) -> Target:
    """A cold full sync: ≤ ``abs_max`` s and (unless ``raw_max`` is None) ≤ ``raw_max``× the raw
    restore of its own payload; the raw figure is printed either way."""
    n = _n(r)
    cell, raw_cell = _cell(r, key, n, "cold", variant), _cell(r, key, n, "raw", variant)
    x, raw = _sec(r, key, n, "cold", variant), _sec(r, key, n, "raw", variant)
    target = f"≤ {abs_max:g} s" + (f" and ≤ {raw_max:g}× raw restore of its payload" if raw_max else "")
    if x is None:
        return _t(name, target, None, _reason(r, key, cell) + _where(n))
    fig = f"{x:.2f} s, " + _ratio(x, raw, "raw restore of its payload", _reason(r, key, raw_cell)) + _where(n)
    if x > abs_max or raw_max is None:
        return _t(name, target, x <= abs_max, fig)
    return _t(name, target, None if raw is None else x <= raw_max * raw, fig)


def full_syncs(r: Results) -> List[Target]:
    return [_full(r, LEGACY, "mixed", 8.0, "legacy, mixed cluster, cold full sync"),
            _full(r, LEGACY, "uniform", 2.5, "legacy, uniform cluster, full sync"),
            _full(r, NFT_FLAVOUR, "mixed", 60.0, "iptables-nft flavour, mixed cluster, cold full sync (measured, "
                  "not skipped)", raw_max=None)]


def peak_rss(r: Results) -> Target:
    n = _n(r)
    name, target = "legacy, peak RSS of `netproxy sync`, uniform / mixed", "≤ 100 MB / ≤ 160 MB"
    figs: List[str] = []
    oks: List[Optional[bool]] = []
    for key, limit, variant in ((LEGACY, 100, "uniform"), (LEGACY + MIXED_SUFFIX, 160, "mixed")):
        cell = r["rss"].get(key, {}).get(str(n), {})
        x = cell.get("maxrss_mib") if "seconds" in cell else None
        if x is None:
            why = _reason(r, LEGACY, cell)
            if not cell:  # never attempted: say what it waited for
                cold = _cell(r, LEGACY, n, "cold", variant)
                why = "not measured: " + ("no cold sync figure (" + _reason(r, LEGACY, cold) + ")"
                                          if _sec(r, LEGACY, n, "cold", variant) is None else "not attempted")
            figs.append(f"{variant} {why}")
            oks.append(None)
            continue
        figs.append(f"{variant} {x / MB:.0f} MB ({cell['seconds']:.1f} s)")
        oks.append(x / MB <= limit)
    ok = False if False in oks else (None if None in oks else True)
    return _t(name, target, ok, "; ".join(figs) + _where(n))


def restart(r: Results) -> Target:
    n = _n(r)
    cell = r["rss"].get(LEGACY, {}).get(str(n), {})
    res = cell.get("restart", {})
    y = res.get("seconds")
    name = "legacy, restart: a new `netproxy sync` with one endpoint changed on a programmed uniform node, end to end"
    if y is not None:
        first = cell.get("seconds")
        extra = f" (the first `netproxy sync` of the node: {first:.2f} s)" if first else ""
        return _t(name, "≤ 1.5 s", y <= 1.5, f"{y:.2f} s{extra}{_where(n)}")
    if res:
        why = _why(res)
    elif "seconds" not in cell:  # the restart follows the first `netproxy sync` (the RSS measure)
        why = "the first `netproxy sync` has no figure (" + _reason(r, LEGACY, cell) + ")"
    else:
        why = "not measured"
    return _t(name, "≤ 1.5 s", None, why + _where(n))


def floors(r: Results) -> Target:
    """The floors themselves, per writer/flavour and cluster: what the ratios above divide by."""
    n = _n(r)
    figs = []
    for key in (LEGACY, LIBIPTC, NFT_FLAVOUR):
        if _reason(r, key, {}) != "not measured":  # unavailable or not run: once, not per cluster
            figs.append(_reason(r, key, {}))
            continue
        per = []
        for variant in ("uniform", "mixed"):
            cell = _cell(r, key, n, "floor", variant)
            x = _sec(r, key, n, "floor", variant)
            per.append(f"{variant} " + (f"{x:.3f} s" if x is not None else _reason(r, key, cell)))
        figs.append(f"{key}: " + ", ".join(per))
    return _ref("the one-rule floor (raw `restore --noflush` of one new chain with one rule, table loaded)",
                "; ".join(figs) + _where(n))


OTHER_STEPS = (("uniform", ("endpoint", "add", "remove")), ("mixed", ("endpoint", "endpoint-affinity")))


def other_writers(r: Results) -> List[Target]:
    """Not targets, shown beside them: the libiptc writer and the iptables-nft flavour on the same clusters."""
    n = _n(r)
    out = []
    for key, what in ((LIBIPTC, "libiptc writer"), (NFT_FLAVOUR, "iptables-nft flavour")):
        if _reason(r, key, {}) != "not measured":
            out.append(_ref(f"{what}, changes ÷ its own floor", _reason(r, key, {}) + _where(n)))
            continue
        figs = []
        for variant, steps in OTHER_STEPS:
            x = _sec(r, key, n, "cold", variant)
            if x is None:
                figs.append(f"{variant}: {_reason(r, key, _cell(r, key, n, 'cold', variant))}")
                continue
            floor = _sec(r, key, n, "floor", variant)
            parts = [f"cold {x:.2f} s"]
            for step in steps:
                y = _sec(r, key, n, step, variant)
                if y is not None:
                    parts.append(f"{step} {y:.3f} s" + (f" = {y / floor:.2f}× floor" if floor else ""))
            figs.append(f"{variant}: " + ", ".join(parts))
        out.append(_ref(f"{what}, changes ÷ its own floor", "; ".join(figs) + _where(n)))
    return out


CHECKS: List[Callable[[Results], Any]] = [mixed_endpoint, full_syncs, uniform_changes, peak_rss, restart, floors,
                                          other_writers]
