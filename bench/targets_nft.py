"""The nftables backend's targets at scale (netlink writer), with the libnftables writer's
figures from the same run beside them, so the gain is a ratio and not a memory."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from bench.report import MB, MIXED_SUFFIX, control_cell, seconds

Results = Dict[str, Any]
Target = Dict[str, Any]
NFT, TEXT = "nftables", "nftables/libnftables"
BIG = 44000


def _t(name: str, target: str, ok: Optional[bool], figure: str) -> Target:
    return {"name": name, "target": target, "met": ok, "figure": figure}


def _n(results: Results) -> int:
    sizes = [int(n) for n in results["meta"]["sizes"] if int(n) <= 10000]
    return 10000 if 10000 in sizes else max(sizes)


def _where(n: int) -> str:
    return "" if n == 10000 else f" (at N={n:,}, not 10,000)"


def _cell(results: Results, key: str, n: int, step: str, variant: str = "uniform") -> Dict[str, Any]:
    got: Dict[str, Any] = control_cell(results, key, n, step, variant) or {}
    return got


def _sec(results: Results, key: str, n: int, step: str, variant: str = "uniform") -> Optional[float]:
    return seconds(_cell(results, key, n, step, variant))


def _why(cell: Dict[str, Any]) -> str:
    for k in ("skipped", "timeout", "error"):
        if k in cell:
            return f"{k}: {str(cell[k])[:160]}"
    return "not measured"


def _vs_text(x: Optional[float], y: Optional[float], unit: float = 1.0, fmt: str = "{:.3f} s") -> str:
    """``; libnftables writer Y (X/Y = r×)``."""
    if y is None:
        return "; libnftables writer not measured"
    ratio = f", {y / x:.1f}× slower" if x else ""
    return f"; libnftables writer {fmt.format(y * unit)}{ratio}"


def full_uniform(r: Results) -> Target:
    n = _n(r)
    x, raw = _sec(r, NFT, n, "cold"), _sec(r, NFT, n, "raw-netlink")
    name, target = "nftables full sync, uniform cluster", "≤ 0.8 s and ≤ 1.3× the raw netlink apply"
    if x is None:
        return _t(name, target, None, _why(_cell(r, NFT, n, "cold")) + _where(n))
    ratio = x / raw if raw else None
    ok = x <= 0.8 and (ratio is not None and ratio <= 1.3) if x <= 0.8 else False
    fig = (f"{x:.3f} s, {ratio:.2f}× the raw apply of its batch ({raw:.3f} s)" if ratio
           else f"{x:.3f} s, raw apply not measured")
    return _t(name, target, ok if ratio is not None or x > 0.8 else None,
              fig + _vs_text(x, _sec(r, TEXT, n, "cold")) + _where(n))


def endpoint(r: Results) -> Target:
    n = _n(r)
    cell = _cell(r, NFT, n, "endpoint")
    x = seconds(cell)
    name, target = "nftables one-endpoint change, tracker → kernel (the write alone)", "≤ 1 ms (≤ 0.3 ms)"
    if x is None:
        return _t(name, target, None, _why(cell) + _where(n))
    w = cell.get("backend_seconds")
    ok = x <= 0.001 and w is not None and w <= 0.0003
    fig = f"{x * 1000:.2f} ms ({'not measured' if w is None else f'{w * 1000:.2f} ms'})"
    return _t(name, target, ok, fig + _vs_text(x, _sec(r, TEXT, n, "endpoint"), 1000, "{:.2f} ms") + _where(n))


def full_mixed(r: Results) -> Target:
    n = _n(r)
    x, raw = _sec(r, NFT, n, "cold", "mixed"), _sec(r, NFT, n, "raw-netlink", "mixed")
    name, target = "nftables full sync, mixed cluster (affinity, NodePorts, Local)", "≤ 2.0 s"
    if x is None:
        return _t(name, target, None, _why(_cell(r, NFT, n, "cold", "mixed")) + _where(n))
    raw_txt = f"; raw apply of its batch {raw:.3f} s" if raw else ""
    return _t(name, target, x <= 2.0,
              f"{x:.3f} s{raw_txt}" + _vs_text(x, _sec(r, TEXT, n, "cold", "mixed")) + _where(n))


def affinity_change(r: Results) -> Target:
    n = _n(r)
    cell = _cell(r, NFT, n, "endpoint-affinity", "mixed")
    x = seconds(cell)
    name, target = "affinity service endpoint change, mixed cluster", "≤ 5 ms"
    if x is None:
        return _t(name, target, None, _why(cell) + _where(n))
    w = cell.get("backend_seconds")
    fig = f"{x * 1000:.2f} ms (the write {w * 1000:.2f} ms)" if w is not None else f"{x * 1000:.2f} ms"
    return _t(name, target, x <= 0.005,
              fig + _vs_text(x, _sec(r, TEXT, n, "endpoint-affinity", "mixed"), 1000, "{:.2f} ms") + _where(n))


def peak_rss(r: Results) -> Target:
    n = _n(r)
    uni = r["rss"].get(NFT, {}).get(str(n), {}).get("maxrss_mib")
    mix = r["rss"].get(NFT + MIXED_SUFFIX, {}).get(str(n), {}).get("maxrss_mib")
    name, target = "peak RSS of `netproxy sync`, uniform / mixed", "≤ 100 MB / ≤ 160 MB"
    if uni is None and mix is None:
        return _t(name, target, None, "not measured" + _where(n))

    def mb(x: Optional[float]) -> str:
        return "not measured" if x is None else f"{x / MB:.0f} MB"

    ok = None if uni is None or mix is None else (uni / MB <= 100 and mix / MB <= 160)
    text = r["rss"].get(TEXT, {}).get(str(n), {}).get("maxrss_mib")
    return _t(name, target, ok, f"{mb(uni)} / {mb(mix)}; libnftables writer uniform {mb(text)}{_where(n)}")


def churn(r: Results) -> Target:
    n = _n(r)
    name, target = "RSS after 1,000 incremental syncs minus after the first", "≤ 10 MB"
    figs, worst = [], None
    for variant in ("uniform", "mixed"):
        cell = _cell(r, NFT, n, "churn", variant)
        g = cell.get("growth_mib")
        if g is None:
            figs.append(f"{variant} {_why(cell)}")
            continue
        figs.append(f"{variant} {g * 1024 / 1000:+.1f} MB (median sync {cell['seconds'] * 1000:.2f} ms)")
        worst = g if worst is None else max(worst, g)
    return _t(name, target, None if worst is None else worst / MB <= 10, "; ".join(figs) + _where(n))


def large(r: Results) -> Target:
    name, target = f"{BIG:,} services × 10, `--max-services {BIG}`", "full ≤ 3 s, RSS ≤ 300 MB"
    cell = _cell(r, NFT, BIG, "cold")
    x = seconds(cell)
    if x is None:
        why = f"not run: make bench runs up to 10k; `make bench-100k` runs `python -m bench --scale {BIG} " \
            "--backends nft` (bench/results/44k/latest.md)" \
            if str(BIG) not in [str(s) for s in r["meta"]["sizes"]] else _why(cell)
        return _t(name, target, None, why)
    mem = r["rss"].get(NFT, {}).get(str(BIG), {}).get("maxrss_mib")
    ok = x <= 3.0 and (mem is not None and mem / MB <= 300)
    return _t(name, target, ok, f"{x:.3f} s, RSS {'not measured' if mem is None else f'{mem / MB:.0f} MB'}")


def process(r: Results) -> List[Target]:
    n = _n(r)
    out = []
    cell = r["rss"].get(NFT, {}).get(str(n), {})
    x = cell.get("seconds")
    text = r["rss"].get(TEXT, {}).get(str(n), {}).get("seconds")
    out.append(_t("`netproxy sync` of the uniform 10k cluster as one new process (load, render, write)", "≤ 1.5 s",
                  None if x is None else x <= 1.5,
                  ("not measured" if x is None else f"{x:.2f} s") + _vs_text(x, text) + _where(n)))
    restart = cell.get("restart", {})
    y = restart.get("seconds")
    text_restart = r["rss"].get(TEXT, {}).get(str(n), {}).get("restart", {}).get("seconds")
    out.append(_t("restart: a new `sync` process with one endpoint changed on a node holding the ruleset", "≤ 1.2 s",
                  None if y is None else y <= 1.2,
                  (_why(restart) if y is None else f"{y:.2f} s") + _vs_text(y, text_restart) + _where(n)))
    return out


CHECKS: List[Callable[[Results], Any]] = [full_uniform, endpoint, full_mixed, affinity_change, peak_rss, churn,
                                          large, process]

