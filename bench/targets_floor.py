"""Close to the kernel's floor: start-up, restart, memory and full syncs at 10,000 services × 10
endpoints (the uniform cluster unless a line says mixed), each against a fixed limit or against
what the kernel itself costs for the same work in the same run.

The cells are the ones the other target modules read: ``netproxy sync`` as its own process and its
restart (``rss`` section: ``bench/run.py``'s ``measure_rss`` / ``measure_restart`` /
``measure_rss_mixed``), the raw netlink apply of the nftables batch (``raw-netlink``), the raw
restore of the iptables payload (``raw``) and the one-rule floor (``floor``, ``control.floor``).
Two figures come from other runs: the ``run --source`` ratio (``python -m bench.api``, its own
report unless these results hold an ``api`` section shaped like ``api.json``) and the 44,000-service
line (this same bench with ``--max-services 44000``).  A line without its data says why."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench import api, latency
from bench.report import MB, MIXED_SUFFIX, seconds
from bench.targets_ipt import LEGACY, NFT_FLAVOUR, _reason
from bench.targets_nft import BIG, NFT, Results, Target, _cell, _n, _sec, _t, _where, _why

Part = Tuple[Optional[bool], str]
"""One figure of a line: met / missed / None (no figure), and its text."""
API_REPORT = "see bench/results/api.md (python -m bench.api)"


def _met(parts: Sequence[Part]) -> Optional[bool]:
    """Missed if any part missed, else not measured if any has no figure, else met."""
    oks = [ok for ok, _ in parts]
    return False if False in oks else (None if None in oks else True)


def _line(name: str, target: str, parts: Sequence[Part], where: str = "") -> Target:
    return _t(name, target, _met(parts), "; ".join(text for _, text in parts) + where)


def _absent(r: Results, key: str) -> Optional[str]:
    """Why ``key`` has no figure at all in these results (unavailable, not run), or None."""
    why = _reason(r, key, {})
    return None if why == "not measured" else why


def _rss_cell(r: Results, key: str, n: int, variant: str = "uniform") -> Dict[str, Any]:
    got: Dict[str, Any] = r["rss"].get(key + (MIXED_SUFFIX if variant == "mixed" else ""), {}).get(str(n), {})
    return got


def _rss_why(r: Results, key: str, n: int, variant: str) -> str:
    """Why the `netproxy sync` measure of ``key`` has no figure; an empty cell says what it waited for."""
    cell = _rss_cell(r, key, n, variant)
    if cell:
        return _reason(r, key, cell)
    if _sec(r, key, n, "cold", variant) is None:  # the measure follows the cold sync
        why = _reason(r, key, _cell(r, key, n, "cold", variant))
        return f"not measured: no {variant} cold sync" + ("" if why == "not measured" else f" ({why})")
    return "not measured"


def _process(r: Results, n: int, key: str, limit: float, restart: bool) -> Part:
    """The wall time of a new `netproxy sync` (its first on the node, or the restart after it) ≤ ``limit``."""
    absent = _absent(r, key)
    if absent:
        return None, absent
    cell = _rss_cell(r, key, n)
    x = seconds(cell.get("restart") if restart else cell)
    if x is not None:
        return x <= limit, f"{key} {x:.2f} s"
    if restart and cell.get("restart"):
        return None, f"{key} {_why(cell['restart'])}"
    if restart and seconds(cell) is not None:
        return None, f"{key} not measured"
    first = _rss_why(r, key, n, "uniform")
    return None, f"{key} " + (f"not measured: the first `netproxy sync` has no figure ({first})" if restart else first)


def sync_process(r: Results) -> Target:
    n = _n(r)
    return _line("`netproxy sync` as a new process (load, render, write), nftables / iptables-legacy (restore "
                 "writer)", "≤ 1.5 s / ≤ 2.0 s",
                 [_process(r, n, NFT, 1.5, False), _process(r, n, LEGACY, 2.0, False)], _where(n))


def restart(r: Results) -> Target:
    n = _n(r)
    return _line("restart: a new `netproxy sync` with one endpoint changed on the programmed node, nftables / "
                 "iptables-legacy", "≤ 1.2 s / ≤ 1.5 s",
                 [_process(r, n, NFT, 1.2, True), _process(r, n, LEGACY, 1.5, True)], _where(n))


def source_vs_sync(r: Results) -> Target:
    """`run --source` start → programmed ÷ `sync` of the same file: measured by ``python -m bench.api``."""
    name, target = "`run --source` start → programmed ÷ `netproxy sync` of the same file", \
        f"≤ {api.SOURCE_SYNC_TARGET:g}×"
    cells = (r.get("api") or {}).get("cells") or {}
    if not cells:
        return _t(name, target, None, API_REPORT)
    parts: List[Part] = []
    for key, cell in cells.items():
        ratio = api.source_vs_sync(cell)
        if ratio is None:
            parts.append((None, f"{key} not measured ({API_REPORT})"))
        else:
            parts.append((ratio <= api.SOURCE_SYNC_TARGET, f"{key} {ratio:.2f}× ({cell['source']['seconds']:.2f} s "
                          f"÷ {cell['sync']['seconds']:.2f} s)"))
    return _line(name, target, parts)


def _rss(r: Results, n: int, key: str, variant: str, limit: float) -> Part:
    cell = _rss_cell(r, key, n, variant)
    x = cell.get("maxrss_mib") if "seconds" in cell else None  # an error's high-water mark is no figure
    if x is None:
        return None, f"{variant} {_rss_why(r, key, n, variant)}"
    return x / MB <= limit, f"{variant} {x / MB:.0f} MB"


def peak_rss(r: Results) -> Target:
    n = _n(r)
    parts: List[Part] = []
    for key in (NFT, LEGACY):
        why = _absent(r, key)
        if why:
            parts.append((None, why))
            continue
        got = [_rss(r, n, key, "uniform", 100), _rss(r, n, key, "mixed", 160)]
        parts.append((_met(got), f"{key}: " + ", ".join(text for _, text in got)))
    return _line("peak RSS of `netproxy sync`, uniform / mixed cluster, nftables and iptables-legacy/restore",
                 "≤ 100 MB / ≤ 160 MB", parts, _where(n))


def _ratio(r: Results, n: int, key: str, step: str, ref: str, variant: str, limit: float, label: str) -> Part:
    """``step`` ÷ ``ref`` of the same run ≤ ``limit``."""
    x, y = _sec(r, key, n, step, variant), _sec(r, key, n, ref, variant)
    if x is None:
        return None, f"{label} {_reason(r, key, _cell(r, key, n, step, variant))}"
    if y is None:
        return None, f"{label} {x:.3f} s, {ref} {_reason(r, key, _cell(r, key, n, ref, variant))}"
    return x / y <= limit, f"{label} {x / y:.2f}× ({x:.3f} s ÷ {y:.3f} s)"


def _ratios(r: Results, key: str, name: str, target: str, limit: float,
            steps: Sequence[Tuple[str, str, str, str]]) -> Target:
    """One line of ratios of ``key``, each (step, reference step, cluster, label), or why ``key`` has none."""
    n = _n(r)
    why = _absent(r, key)
    parts: List[Part] = [(None, why)] if why else [_ratio(r, n, key, step, ref, variant, limit, label)
                                                     for step, ref, variant, label in steps]
    return _line(name, target, parts, _where(n))


def nft_full(r: Results) -> Target:
    return _ratios(r, NFT, "nftables full sync ÷ the raw netlink apply of its own batch", "≤ 2.0×", 2.0,
                   [("cold", "raw-netlink", "uniform", "uniform")])


def legacy_full(r: Results) -> Target:
    return _ratios(r, LEGACY, "iptables-legacy full sync ÷ the raw restore of its payload, uniform / mixed",
                   "≤ 1.3×", 1.3,
                   [("cold", "raw", "uniform", "uniform"), ("cold", "raw", "mixed", "mixed")])


ADD_REMOVE = [("add", "floor", "uniform", "added"), ("remove", "floor", "uniform", "removed")]


def legacy_changes(r: Results) -> Target:
    return _ratios(r, LEGACY, "iptables-legacy one service added / removed ÷ the one-rule floor", "≤ 1.3×", 1.3,
                   ADD_REMOVE)


def nft_flavour_changes(r: Results) -> Target:
    return _ratios(r, NFT_FLAVOUR, "iptables-nft one service added / removed ÷ its one-rule floor", "≤ 3×", 3.0,
                   ADD_REMOVE)


def nft_flavour_resync(r: Results) -> Target:
    """A periodic full sync with nothing changed on iptables-nft: skipped by the nf_tables generation."""
    n = _n(r)
    name, target = "iptables-nft resync with nothing changed (the generation check)", "≤ 50 ms"
    why = _absent(r, NFT_FLAVOUR)
    if why:
        return _t(name, target, None, why)
    cell = _cell(r, NFT_FLAVOUR, n, "resync")
    x = seconds(cell)
    if x is None:
        return _t(name, target, None, _reason(r, NFT_FLAVOUR, cell) + _where(n))
    return _t(name, target, x <= 0.050, f"{x * 1000:.1f} ms{_where(n)}")


def source_change(r: Results) -> Target:
    """Issue 40: a change to `run --source FILE` holding the mixed 10k cluster, on iptables-legacy,
    reaches the kernel (by traffic) within 2 s of the file being replaced (median)."""
    name, target = "`run --source FILE` change, mixed 10k cluster in one file, iptables-legacy: file replaced → " \
        "traffic reaches the new service (median)", "≤ 2 s"
    why = _absent(r, LEGACY)
    if why:
        return _t(name, target, None, why)
    cell: Dict[str, Any] = r["latency"].get(LEGACY + MIXED_SUFFIX, {}).get("10000", {})
    if "n" not in cell:
        return _t(name, target, None, _why(cell) if cell else "not measured (make bench runs it at N=10,000 only)")
    median = cell.get("median")
    figure = latency.describe(cell)
    return _t(name, target, median is not None and median <= 2.0, figure)


def large(r: Results) -> Target:
    name, target = f"{BIG:,} services × 10, nftables full sync / peak RSS of `netproxy sync`", "≤ 3.0 s / ≤ 300 MB"
    if BIG not in [int(s) for s in r["meta"]["sizes"]]:
        return _t(name, target, None, "not run: make bench runs up to 10k; `make bench-100k` runs "
                  f"`python -m bench --scale {BIG} --backends nft` (bench/results/44k/latest.md)")
    why = _absent(r, NFT)
    if why:
        return _t(name, target, None, why)
    x = _sec(r, NFT, BIG, "cold")
    full: Part = (x <= 3.0, f"full sync {x:.3f} s") if x is not None else \
        (None, f"full sync {_reason(r, NFT, _cell(r, NFT, BIG, 'cold'))}")
    mem = _rss(r, BIG, NFT, "uniform", 300)
    return _line(name, target, [full, (mem[0], "peak RSS " + mem[1].removeprefix("uniform "))])


CHECKS: List[Callable[[Results], Any]] = [sync_process, restart, source_vs_sync, peak_rss, nft_full, legacy_full,
                                          legacy_changes, nft_flavour_changes, nft_flavour_resync, source_change,
                                          large]
