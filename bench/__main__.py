"""``python -m bench`` — netproxy's benchmark (``make bench``; ``--smoke`` runs in ``make test``).

Measures sync speed, update latency, data-plane cost and memory per backend/writer, next to
kube-proxy's own layout and the raw tools, in network namespaces it creates and removes.  See
bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import List, Optional, Sequence

from bench import installed, report, targets, targets_scale
from bench.run import Bench, combo_record, new_workdir
from netproxy_lab import combos as combos_mod
from netproxy_lab import netns

DEFAULT_SIZES = (100, 1000, 10000)
HERE = os.path.dirname(os.path.abspath(__file__))


def sizes_for(max_services: int, smoke: bool) -> List[int]:
    if smoke:
        return [100]
    sizes = [n for n in DEFAULT_SIZES if n <= max_services]
    if max_services not in sizes:
        sizes.append(max_services)
    return sizes


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-services", type=int, default=10000,
                   help="largest N (default 10000; 30000 for a longer run); sizes are 100, 1000, 10000 up to it")
    p.add_argument("--backends", default="",
                   help="comma-separated: " + ", ".join(combos_mod.COMBOS) + " (or nft, legacy, libiptc, "
                   "iptables-nft); default all")
    p.add_argument("--smoke", action="store_true",
                   help="N=100, one backend (nftables if available, else iptables-legacy/restore), seconds; "
                   "fails if any measure cannot be taken")
    p.add_argument("--budget", type=float, default=0.0,
                   help="wall-clock budget in seconds (default 1140 = 19 min; scaled up for --max-services > 10000)")
    p.add_argument("--scale", type=int, default=0, metavar="N",
                   help="only the control-plane phase at N services × 10 (e.g. 100000), nftables and "
                   "iptables-legacy/restore unless --backends says; writes to results/<N/1000>k unless --out")
    p.add_argument("--out", default="", help="directory for JSON, markdown and PNG (default bench/results)")
    p.add_argument("--keep-workdir", action="store_true", help="keep payloads and logs (kept anyway on errors)")
    args = p.parse_args(argv)
    if args.max_services < 100:
        p.error("--max-services must be at least 100")
    if args.scale and (args.scale < 1000 or args.smoke):
        p.error("--scale takes N >= 1000 and no --smoke")
    if not args.out:
        args.out = os.path.join(HERE, "results", f"{args.scale // 1000}k" if args.scale else "")
    return args


def choose(args: argparse.Namespace) -> List[combos_mod.Combo]:
    if args.scale and not args.backends:
        return [combos_mod.COMBOS["nftables"], combos_mod.COMBOS["iptables-legacy/restore"]]
    if args.smoke and not args.backends:
        return [combos_mod.COMBOS["nftables"], combos_mod.COMBOS["iptables-legacy/restore"]]
    return combos_mod.parse(args.backends)


def preflight() -> Optional[str]:
    if os.geteuid() != 0:
        return "the benchmark needs root (it creates network namespaces)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    problem = preflight()
    if problem:
        print(f"bench: FAILED: {problem}", file=sys.stderr)
        return 1
    try:
        wanted = choose(args)
    except ValueError as err:
        print(f"bench: {err}", file=sys.stderr)
        return 2
    netns.install_handlers()
    installed.precompile()
    sizes = [args.scale] if args.scale else sizes_for(args.max_services, args.smoke)
    budget = args.budget or (300.0 if args.smoke else 0.03 * args.scale * len(wanted) + 600 if args.scale
                             else 1140.0 * max(1.0, args.max_services / 10000))
    workdir = new_workdir()
    bench = Bench(wanted, sizes, args.smoke, budget, workdir, scale=bool(args.scale))
    if args.scale:
        bench.progress(f"scale run: N = {args.scale:,}, backends {', '.join(c.name for c in wanted)}, "
                       f"budget {budget:.0f} s")
    elif args.smoke:
        bench.progress("smoke run: N=100, the first available of nftables, iptables-legacy/restore")
    else:
        bench.progress(f"full run: N in {sizes}, backends {', '.join(c.name for c in wanted)}, budget {budget:.0f} s")
    try:
        if args.smoke:
            bench.meta()
            bench.probe()
            chosen = bench.available()[:1]
            if not chosen:
                print("bench: FAILED: neither nftables nor iptables-legacy/restore can run here: "
                      f"{bench.results['unavailable']}", file=sys.stderr)
                return 1
            bench.combos = chosen
            bench.results["unavailable"] = {}
            bench.results["meta"]["combos"] = [combo_record(c) for c in chosen]
        results = bench.run_scale() if args.scale else bench.run()
    finally:
        netns.cleanup_all()
    results["meta"]["duration"] = bench.budget_used()
    results["meta"].setdefault("loadavg", []).append(os.getloadavg()[0])
    results["targets"] = targets_scale.check(results) if args.scale else targets.check(results)
    stem = "smoke" if args.smoke else "latest"
    json_path, md_path, png_path = report.write(results, args.out, stem)
    print(report.markdown(results))
    print(f"results: {json_path}, {md_path}" + (f", {png_path}" if png_path else ""))
    dp_failed = results.get("dataplane_failures", [])
    keep = args.keep_workdir or bool(results["errors"]) or bool(dp_failed)
    if keep:
        print(f"payloads and logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.smoke:
        failures = smoke_failures(results)
        if failures:
            print("bench: FAILED: " + "; ".join(str(f) for f in failures)[:3000], file=sys.stderr)
            return 1
        return 0
    # A full run reports what it could measure; a backend that failed is a finding, listed under Errors.
    if not bench.available():
        print("bench: FAILED: no backend could run here", file=sys.stderr)
        return 1
    # Traffic that did not get through is not a figure to read past: the run fails.
    if dp_failed:
        print(f"bench: FAILED: {len(dp_failed)} data-plane failure(s): " + "; ".join(dp_failed)[:3000],
              file=sys.stderr)
        return 1
    if results["errors"]:
        print(f"bench: {len(results['errors'])} measure(s) failed: see the Errors section above", file=sys.stderr)
    return 0


def smoke_failures(results: report.Results) -> List[str]:
    """In a smoke run every measure must have a figure: an error, timeout or skip fails it."""
    out = list(results["errors"]) + [f"data plane {f}" for f in results.get("dataplane_failures", [])]
    combo = results["meta"]["combos"][0]["key"] if results["meta"]["combos"] else "?"
    iptables = bool(results["meta"]["combos"]) and results["meta"]["combos"][0]["backend"] == "iptables"
    checks = [("control", results["control"].get(combo, {}).get("uniform", {}).get("100", {}),
               ("cold", "resync", "endpoint", "add", "remove", "raw") + (("floor",) if iptables else ())),
              ("dataplane", results["dataplane"].get(combo, {}), ("1", "100")),
              ("latency", results["latency"].get(combo, {}), ("100",)),
              ("rss", results["rss"].get(combo, {}), ("1", "100"))]
    for section, cells, keys in checks:
        for key in keys:
            cell = cells.get(key)
            if not cell or not any(k in cell for k in ("seconds", "p50_us", "n")):
                out.append(f"{section} {key}: no figure ({cell})")
    # Single-endpoint services: the object counts are printed, and one endpoint draws no random number.
    objs = results.get("objects") or {}
    for backend, column in (("nftables", "numgen rules"), ("iptables", "statistic rules")):
        counts = objs.get(backend, {})
        if "error" in objs or not counts:
            out.append(f"single-endpoint object counts, {backend}: no figure ({objs.get('error')})")
        elif counts["1"][column] != 0:
            out.append(f"single-endpoint services, {backend}: {counts['1'][column]} {column} (expected none)")
    for ref in ("kube-proxy iptables-legacy", "kube-proxy nft"):
        cell = results["reference"].get(ref, {}).get("100", {}).get("cold")
        if not cell or "seconds" not in cell:
            out.append(f"{ref} N=100: no figure ({cell})")
    return out


if __name__ == "__main__":
    sys.exit(main())
