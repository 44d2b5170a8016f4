"""Results → markdown tables, target check lines, JSON and a PNG plot.

Every cell is a figure measured in this run, or says why there is none (``timeout 250s``,
``error``, ``n/a``).  Ratios divide figures of the same run.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from bench import conntrack, latency, objects, sample, top

Results = Dict[str, Any]
Cell = Optional[Dict[str, Any]]

REF_ROWS = ("kube-proxy iptables-legacy", "kube-proxy iptables-nft", "kube-proxy nft")
REF_FOR_FAMILY = {("iptables", "legacy"): "kube-proxy iptables-legacy", ("iptables", "nft"): "kube-proxy iptables-nft",
                  ("nftables", "legacy"): "kube-proxy nft"}
MB = 1_000_000 / (1 << 20)  # MiB per MB


def _sec(cell: Cell, scale: float = 1.0, digits: int = 3) -> str:
    if not cell:
        return "-"
    if cell.get("seconds") is not None:
        return f"{cell['seconds'] * scale:.{digits}f}"
    if "timeout" in cell:
        return f"timeout {cell['timeout']:.0f}s"
    if "skipped" in cell:
        return f"skipped ({cell['skipped']})"
    return "error"


def seconds(cell: Cell) -> Optional[float]:
    if cell and cell.get("seconds") is not None:
        return float(cell["seconds"])
    return None


def _table(title: str, rows: Sequence[Tuple[str, Sequence[str]]], columns: Sequence[str], note: str = "") -> List[str]:
    out = [f"### {title}", ""]
    if note:
        out += [note, ""]
    out.append("| | " + " | ".join(columns) + " |")
    out.append("|---|" + "---|" * len(columns))
    out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return out + [""]


def _sizes(results: Results) -> List[int]:
    return [int(n) for n in results["meta"]["sizes"]]


def _ncols(sizes: Iterable[int]) -> List[str]:
    return [f"N={n:,}" for n in sizes]


def control_cell(results: Results, key: str, n: int, step: str, variant: str = "uniform") -> Cell:
    return results["control"].get(key, {}).get(variant, {}).get(str(n), {}).get(step)  # type: ignore[no-any-return]


def ref_cell(results: Results, ref: str, n: int, step: str) -> Cell:
    return results["reference"].get(ref, {}).get(str(n), {}).get(step)  # type: ignore[no-any-return]


def reference_for(combo: Dict[str, str]) -> str:
    return REF_FOR_FAMILY[(combo["backend"], combo["flavour"] if combo["backend"] == "iptables" else "legacy")]


def _combos(results: Results) -> List[Dict[str, str]]:
    return [c for c in results["meta"]["combos"] if c["key"] not in results.get("unavailable", {})]


def control_tables(results: Results) -> List[str]:
    sizes = _sizes(results)
    cols = _ncols(sizes)
    out: List[str] = []
    steps = [("cold", "Cold full sync (s)", 1.0, 3, "First full sync into an empty kernel, backend.sync() "
              "only. kube-proxy rows: its own layout applied with the raw tool. *raw* rows: "
              "netproxy's own `plan()` payload applied with the raw tool."),
             ("resync", "Resync with nothing changed (s)", 1.0, 3, "A full sync (every --sync-period) when "
              "nothing changed. On iptables-legacy the backend skips the write when its "
              "fingerprint of the tables says nobody touched them since its last full write "
              "(backends/iptables/kernel/stamp.py); the figure is that check. nftables and iptables-nft: "
              "the nf_tables ruleset generation."),
             ("endpoint", "One endpoint replaced (ms)", 1000.0, 1, "One slice changed → parse_objects → tracker → "
              "partial sync. kube-proxy rows: its partial payload (iptables: save + restore "
              "--noflush; nft: flush/refill the service's chains)."),
             ("add", "One service added (ms)", 1000.0, 1, "A Service and its slice → partial sync; median."),
             ("remove", "One service removed (ms)", 1000.0, 1, "The added service deleted again → partial sync."),
             ("source", "Source → snapshot (s)", 1.0, 3, "parse_objects of every object + ChangeTracker fill + "
              "take(): what a (re)list costs before any backend work.")]
    for step, title, scale, digits, note in steps:
        rows = []
        for c in _combos(results):
            rows.append((c["key"], [_sec(control_cell(results, c["key"], n, step), scale, digits) for n in sizes]))
            if step == "cold":
                rows.append((f"{c['key']}: raw apply of its payload",
                             [_sec(control_cell(results, c["key"], n, "raw"), scale, digits) for n in sizes]))
        if step in ("cold", "endpoint"):
            for ref in REF_ROWS:
                if ref in results["reference"]:
                    rows.append((ref, [_sec(ref_cell(results, ref, n, step), scale, digits) for n in sizes]))
        out += _table(title, rows, cols, note + SAMPLED)
    return out


SAMPLED = (f" Every cell, netproxy's and kube-proxy's alike: the median of up to {sample.FULL_RUNS} runs (full "
           f"syncs and applies) or {sample.CHANGE_RUNS} (changes), fewer when the next would not fit "
           f"{sample.BUDGET:.0f} s; min, max and every run in the JSON.")


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.2f}×"


def ratio_table(results: Results) -> List[str]:
    sizes = _sizes(results)
    cols = []
    for n in sizes:
        cols += [f"N={n:,} ÷ kube-proxy", f"N={n:,} ÷ raw"]
    rows = []
    for step, label in (("cold", "full sync"), ("endpoint", "endpoint change")):
        for c in _combos(results):
            ref = reference_for(c)
            cells = []
            for n in sizes:
                mine = seconds(control_cell(results, c["key"], n, step))
                cells.append(_ratio(mine, seconds(ref_cell(results, ref, n, step))))
                raw = seconds(control_cell(results, c["key"], n, "raw")) if step == "cold" else None
                cells.append(_ratio(mine, raw) if step == "cold" else "")
            rows.append((f"{c['key']} {label} (vs {ref})", cells))
    return _table("Ratios (same run)", rows, cols, "netproxy ÷ kube-proxy's layout on the same kernel path, and "
                  "netproxy's full sync ÷ the raw tool applying netproxy's own payload (its overhead over the "
                  "kernel). Below 1× netproxy is faster.")


def _dp(cell: Cell) -> str:
    if not cell:
        return "-"
    if "p50_us" in cell:
        failed = f" · FAILED: {cell['failed']} of {cell['attempted']} connections" if cell.get("failed") else ""
        best = f" (best {cell['best_p50_us']:.0f})" if "best_p50_us" in cell else ""
        return f"{cell['p50_us']:.0f}{best} / {cell['p99_us']:.0f} µs · {cell['rate']:.0f}/s{failed}"
    return _sec(cell)


def dataplane_table(results: Results) -> List[str]:
    dp_sizes = [int(n) for n in results["meta"]["dp_sizes"]]
    rows = []
    for key in [c["key"] for c in _combos(results)] + list(REF_ROWS):
        per = results["dataplane"].get(key)
        if not per:
            continue
        pairs = results.get("dataplane_pairs", {}).get(key, {})
        ordered = sorted(pairs.items(), key=lambda x: int(x[0]))
        ratios = ", ".join(f"{p['best_ratio']:.2f}× (median batch {p['ratio']:.2f}×) at N={int(n):,}"
                           for n, p in ordered if "best_ratio" in p)
        rows.append((key, [_dp(per.get(str(n))) for n in dp_sizes] + [ratios or "-"]))
    client = results["meta"].get("client", "?")
    return _table("Data plane: connect() p50 / p99 and new connections per second to the last service", rows,
                  _ncols(dp_sizes) + ["best-batch p50 ÷ N=1 alongside"],
                  f"Sequential connections from the client namespace through the node (nat PREROUTING) to one of "
                  f"10 pods; {client} client; {results['meta'].get('dp_count')} connections per figure in "
                  f"{results['meta'].get('dp_rounds')} batches alternating with the one-service baseline (a second "
                  "sandbox): median batch, best batch in brackets. The N=1 column is the baseline measured alongside "
                  "the largest N; the ratio divides figures taken under the same load.")


def latency_table(results: Results) -> List[str]:
    lat_sizes = sorted({int(n) for per in results["latency"].values() for n in per})
    rows = []
    for c in _combos(results):
        per = results["latency"].get(c["key"], {})
        cells = []
        for n in lat_sizes:
            cell = per.get(str(n))
            if cell and "n" in cell:
                sync = f"; sync {cell['sync_median'] * 1000:.0f} ms" if cell.get("sync_median") is not None else ""
                if cell.get("reload_median") is not None:
                    sync += f"; reload+sync {cell['reload_median'] * 1000:.0f} ms"
                cells.append(latency.describe(cell) + sync)
            else:
                cells.append(_sec(cell))
        rows.append((c["key"], cells))
    for key in [k for k in results["latency"] if k.endswith(MIXED_SUFFIX)]:  # one file replaced whole
        per = results["latency"][key]
        rows.append((f"{key}, one file replaced", [latency.describe(per[str(n)]) if "n" in per.get(str(n), {})
                                                   else _sec(per.get(str(n))) for n in lat_sizes]))
    msp = results["meta"].get("min_sync_period")
    return _table("Event → kernel in `netproxy run` (median / p95; backend sync and source reload + sync medians)",
                  rows, _ncols(lat_sizes),
                  f"{results['meta'].get('latency_changes')} source-file changes each, --min-sync-period {msp}s; "
                  f"detected by traffic (a poller connecting to the new service every {latency.POLL_ATTEMPT_MS} ms). "
                  "A change not in the kernel within its deadline is a failure: counted in n, and as +inf in the "
                  "median and p95 (shown as *over the deadline* when one lands on it). *reload+sync*: from "
                  "netproxy's log line saying the source changed to the one saying the sync finished.")


MIXED_SUFFIX = " (mixed cluster)"
"""RSS rows of the mixed cluster (its features on) are keyed ``<combo key> (mixed cluster)``."""


def rss_table(results: Results) -> List[str]:
    sizes = sorted({int(n) for per in results["rss"].values() for n in per})
    rows = []
    keys = [c["key"] for c in _combos(results)] + [k for k in results["rss"] if k.endswith(MIXED_SUFFIX)]
    for key in keys:
        per = results["rss"].get(key, {})
        cells = []
        for n in sizes:
            cell = per.get(str(n))
            if cell and cell.get("maxrss_mib") is not None and "seconds" in cell:
                cells.append(f"{cell['maxrss_mib']:.0f} MiB ({cell['seconds']:.1f} s)")
            else:
                cells.append(_sec(cell))
        rows.append((key, cells))
        run = results["latency"].get(key, {})
        if run:
            rows.append((f"{key} (`run`, VmHWM)",
                         [f"{run[str(n)]['run_vmhwm_mib']:.0f} MiB" if str(n) in run and
                          run[str(n)].get("run_vmhwm_mib") else "-" for n in sizes]))
    return _table("Peak RSS of the netproxy process", rows, _ncols(sizes),
                  "`netproxy sync` (whole process: start-up, JSON source, full sync) as its own process: its VmHWM "
                  "sampled every 10 ms, with the wall time in brackets; `run` rows: VmHWM of `netproxy run` after the "
                  "latency changes.")


def mixed_table(results: Results) -> List[str]:
    sizes = _sizes(results)
    rows = []
    for c in _combos(results):
        cells = []
        for n in sizes:
            per = results["control"].get(c["key"], {}).get("mixed", {}).get(str(n), {})
            cold, raw = per.get("cold"), per.get("raw")
            if not (cold and "seconds" in cold):
                cells.append(_sec(cold))
                continue
            ratio = f", {cold['seconds'] / raw['seconds']:.2f}× raw {_sec(raw)} s" if seconds(raw) else ""
            aff = per.get("endpoint-affinity")
            aff_txt = f" · affinity {_sec(aff, 1000, 1)} ms" if aff and "seconds" in aff else ""
            cells.append(f"{_sec(cold)} s{ratio} · {_sec(per.get('endpoint'), 1000, 1)} ms{aff_txt}")
        rows.append((c["key"], cells))
    if not any(r[1] for r in rows):
        return []
    return _table("Features on — mixed cluster: cold full sync (÷ raw tool) · one endpoint replaced", rows,
                  _ncols(sizes),
                  "1–50 endpoints per service (2.6× the uniform cluster's endpoints), one service in five UDP, one in "
                  "ten with ClientIP affinity, one in four a NodePort (a fifth of those externalTrafficPolicy: "
                  "Local), one in twenty internalTrafficPolicy: Local, every other endpoint on another node. "
                  "*raw*: the raw tool applying netproxy's own payload for it. Endpoint changes: a service without "
                  "affinity, then (*affinity*) one with ClientIP affinity, whose per-endpoint rules are rewritten.")


FLOOR_STEPS = {"uniform": (("endpoint", "endpoint"), ("add", "add"), ("remove", "remove")),
               "mixed": (("endpoint", "endpoint"), ("endpoint-affinity", "affinity endpoint"))}


def floor_table(results: Results) -> List[str]:
    """The one-rule floor of an iptables write into the table netproxy left loaded, and each
    one-service change of the same run as a ratio to it."""
    sizes = _sizes(results)
    rows = []
    for c in _combos(results):
        if c["backend"] != "iptables":
            continue
        for variant, steps in FLOOR_STEPS.items():
            cells = []
            for n in sizes:
                floor = control_cell(results, c["key"], n, "floor", variant)
                ref = seconds(floor)
                if ref is None:
                    cells.append(_sec(floor) if floor else "-")
                    continue
                parts = []
                for step, label in steps:
                    x = seconds(control_cell(results, c["key"], n, step, variant))
                    if x is not None:
                        parts.append(f"{label} {x / ref:.2f}×")
                cells.append(f"{ref:.3f} s" + (" · " + " · ".join(parts) if parts else ""))
            rows.append((f"{c['key']}, {variant} cluster", cells))
    if not rows:
        return []
    return _table("iptables: the one-rule floor of a write, and one-service changes ÷ it", rows,
                  _ncols(sizes),
                  "Floor: the raw `iptables-<flavour>-restore --noflush` of a one-rule change (one chain holding "
                  "one `-j RETURN` rule) into the nat table as netproxy's full sync and changes left it, timed "
                  "inside the namespace; min of up to 3. A legacy write swaps the whole table, so no change can "
                  "cost less. After it: each one-service change of the same worker (through parse → tracker → "
                  "sync, median) divided by the floor.")


TARGET_GROUPS = {"bench.targets_nft": "nftables at scale", "bench.targets_ipt": "iptables at scale, features on",
                 "bench.targets_floor": "close to the kernel's floor (start-up, restart, memory, full syncs)",
                 "bench.targets": "Earlier targets", "bench.conntrack": "The conntrack reconciler",
                 "bench.top": "netproxy top",
                 "bench.migratestep": "Live migration"}


def target_lines(results: Results) -> List[str]:
    out = ["### Targets", ""]
    group = None
    for t in results["targets"]:
        if t.get("group") and t["group"] != group:
            group = t["group"]
            if out[-1]:
                out.append("")
            out += [f"#### {TARGET_GROUPS.get(group, group)}", ""]
        if t.get("reference"):  # a figure to read the targets by, with no target of its own
            out.append(f"- reference: {t['name']}: {t['figure']}")
            continue
        word = {True: "met", False: "MISSED", None: "NOT MEASURED"}[t["met"]]
        out.append(f"- target {t['name']} ({t['target']}): {word} ({t['figure']})")
    return out + [""]


def markdown(results: Results) -> str:
    meta = results["meta"]
    head = [f"## netproxy benchmark — {meta['started']}", "",
            f"{meta['host']}: {meta['cpus']} CPUs, kernel {meta['kernel']}, {meta['iptables']}, {meta['nft']}, "
            f"Python {meta['python']}; commit {meta['commit']}; {meta['duration']:.0f} s wall.", ""]
    load = meta.get("loadavg")
    if load:
        busy = " — the machine was busy: figures are slower than on an idle one" if max(load) > meta["cpus"] else ""
        head += [f"Load average (1 min) at start / end: {load[0]:.1f} / {load[-1]:.1f} on {meta['cpus']} CPUs{busy}.",
                 ""]
    for key, why in results.get("unavailable", {}).items():
        head.append(f"- {key}: not measured — {why}")
    if results.get("unavailable"):
        head.append("")
    if meta.get("scale"):  # `--scale N`: phase A at one N only; the other tables would be empty
        body = control_tables(results) + floor_table(results) + rss_table(results) + target_lines(results)
    else:
        body = (control_tables(results) + ratio_table(results) + mixed_table(results) + floor_table(results)
                + dataplane_table(results)
                + latency_table(results) + rss_table(results) + objects.markdown(results.get("objects") or {})
                + conntrack.markdown(results.get("conntrack") or {})
                + top.markdown(results.get("top") or {})
                + target_lines(results))
    failed = results.get("dataplane_failures", [])
    if failed:
        body += ["### Data-plane failures (the run fails on these)", ""] + [f"- {f}" for f in failed] + [""]
    errors = results.get("errors", [])
    if errors:
        body += ["### Errors", ""] + [f"- {e}" for e in errors] + [""]
    return "\n".join(head + body)


def plot(results: Results, path: str) -> Optional[str]:
    """Sync time and connect latency against N (log scales); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    keys = [c["key"] for c in _combos(results)] + list(REF_ROWS)
    colour = {k: f"C{i}" for i, k in enumerate(keys)}  # one colour per row in both plots
    sizes = _sizes(results)
    for key in keys:
        ref = key.startswith("kube-proxy")
        ys = [seconds(ref_cell(results, key, n, "cold") if ref else control_cell(results, key, n, "cold"))
              for n in sizes]
        pts = [(n, y) for n, y in zip(sizes, ys) if y is not None]
        if pts:
            left.plot([p[0] for p in pts], [p[1] for p in pts], "--s" if ref else "-o", color=colour[key], label=key)
    left.set(xscale="log", yscale="log", xlabel="services (10 endpoints each)", ylabel="cold full sync (s)",
             title="Full sync time")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    dp_sizes = [int(n) for n in results["meta"]["dp_sizes"]]
    for key in keys:
        per = results["dataplane"].get(key, {})
        pts = [(n, per[str(n)].get("best_p50_us", per[str(n)]["p50_us"])) for n in dp_sizes
               if str(n) in per and "p50_us" in per[str(n)]]
        if pts:
            right.plot([p[0] for p in pts], [p[1] for p in pts], "--s" if key.startswith("kube-proxy") else "-o",
                       color=colour[key], label=key)
    right.set(xscale="log", xlabel="services", ylabel="connect() p50, best batch (µs)",
              title="Connect latency to the last service")
    right.set_ylim(bottom=0)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(results: Results, outdir: str, stem: str) -> Tuple[str, str, Optional[str]]:
    """JSON, markdown and PNG under ``outdir``; returns their paths (PNG None if not drawn)."""
    os.makedirs(outdir, exist_ok=True)
    json_path = os.path.join(outdir, f"{stem}.json")
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1, sort_keys=True)
    md_path = os.path.join(outdir, f"{stem}.md")
    with open(md_path, "w", encoding="utf-8") as fh:
        fh.write(markdown(results))
    png_path: Optional[str] = os.path.join(outdir, f"{stem}.png")
    problem = plot(results, png_path)  # type: ignore[arg-type]
    if problem:
        results.setdefault("errors", []).append(f"plot: {problem}")
        png_path = None
    return json_path, md_path, png_path
