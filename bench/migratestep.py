"""The live-migration measure: ``netproxy migrate`` at N services, and how long two rulesets were installed together.

In throwaway namespaces (``np-bench-<pid>-…-migrate``), on the uniform cluster of N services:

- ``iptables-to-nftables``: netproxy's iptables-legacy ruleset (a ``netproxy sync``, untimed), then
  ``netproxy migrate --to nftables``;
- ``nftables-to-iptables``: on the node that left, ``netproxy migrate --to iptables`` (legacy);
- ``kube-proxy-to-nftables``: kube-proxy's iptables-legacy layout (``kubeproxy_layout``, with its
  node chains) in a fresh namespace, then ``netproxy migrate --to nftables --from-kube-proxy``.

Each cell holds ``seconds`` (the switch as migrate measures it: from the start of the new ruleset's
write to the old one's removal), ``overlap`` (from the new ruleset's commit to the old one's
removal: the longest window with two rulesets installed) and ``wall`` (the whole command: Python
start, loading the source, surveying the node).  Run alone: ``python -m bench.migratestep --services 10000``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from bench import gen
from bench.control import _bench_env, _python
from netproxy_lab import kubeproxy_layout, netns

Step = Dict[str, Any]
STEPS = ("iptables-to-nftables", "nftables-to-iptables", "kube-proxy-to-nftables")
_DONE = re.compile(r"done: .* in ([0-9.]+) s; two rulesets were installed together for ([0-9.]+) s")


def _netproxy(ns: str, args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    return netns.run_in_timeout(ns, [_python(), "-m", "netproxy.cli", *args], timeout, env=_bench_env())


def _migrate(ns: str, source: str, to: str, timeout: float, *extra: str) -> Step:
    t0 = time.monotonic()
    try:
        proc = _netproxy(ns, ["migrate", "--to", to, "--source", source, "--iptables-flavour", "legacy",
                              "--log-level", "warning", *extra], timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    wall = time.monotonic() - t0
    out = proc.stdout.decode(errors="replace")
    found = _DONE.search(out)
    if proc.returncode != 0 or found is None:
        return {"error": (proc.stderr.decode(errors="replace") or out).strip()[-500:]}
    return {"seconds": float(found.group(1)), "overlap": float(found.group(2)), "wall": round(wall, 3)}


def _sync_iptables(ns: str, source: str, timeout: float) -> Optional[str]:
    proc = _netproxy(ns, ["sync", "--source", source, "--backend", "iptables", "--iptables-flavour", "legacy",
                          "--log-level", "warning"], timeout)
    return None if proc.returncode == 0 else proc.stderr.decode(errors="replace").strip()[-500:]


def _kube_proxy(ns: str, objects: Sequence[gen.Obj], workdir: str, timeout: float) -> Optional[str]:
    svcs = kubeproxy_layout.services(objects)
    for k, payload in enumerate((kubeproxy_layout.iptables_full(svcs), kubeproxy_layout.iptables_node_chains())):
        path = os.path.join(workdir, f"kube-proxy-{k}.rules")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(payload)
        proc = netns.run_in_timeout(ns, ["sh", "-c", 'iptables-legacy-restore --noflush < "$0"', path], timeout)
        if proc.returncode != 0:
            why: str = proc.stderr.decode(errors="replace").strip()[-500:]
            return why
    return None


def measure(n: int, workdir: str, timeout: float = 600.0, steps: Sequence[str] = STEPS) -> Dict[str, Step]:
    """The steps at N = ``n`` (uniform cluster); a step that cannot run says why."""
    objects = gen.cluster(n)
    source = os.path.join(workdir, f"migrate-{n}.json")
    gen.write_json(source, objects)
    out: Dict[str, Step] = {}
    if {"iptables-to-nftables", "nftables-to-iptables"} & set(steps):
        with netns.namespace("migrate") as ns:
            why = _sync_iptables(ns, source, timeout)
            if why:
                return {s: {"error": f"the iptables ruleset to start from: {why}"} for s in steps}
            out["iptables-to-nftables"] = _migrate(ns, source, "nftables", timeout)
            if "nftables-to-iptables" in steps:
                out["nftables-to-iptables"] = (_migrate(ns, source, "iptables", timeout)
                                               if "seconds" in out["iptables-to-nftables"]
                                               else {"error": "the switch to nftables failed"})
    if "kube-proxy-to-nftables" in steps:
        with netns.namespace("migrate-kp") as ns:
            why = _kube_proxy(ns, objects, workdir, timeout)
            out["kube-proxy-to-nftables"] = ({"error": f"kube-proxy's layout: {why}"} if why else
                                             _migrate(ns, source, "nftables", timeout, "--from-kube-proxy"))
    return out


def describe(steps: Dict[str, Step]) -> List[str]:
    lines = []
    for name, cell in steps.items():
        if "seconds" in cell:
            lines.append(f"{name}: switch {cell['seconds']:.3f} s, two rulesets installed {cell['overlap']:.3f} s "
                         f"(command {cell['wall']:.2f} s)")
        else:
            lines.append(f"{name}: {json.dumps(cell)[:300]}")
    return lines


def figures(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The report's lines (references only: no target number is set), at the largest N measured."""
    measured = results.get("migrate", {})
    if not measured:
        return []
    n = max(measured, key=int)
    return [{"name": f"netproxy migrate {name}, N={int(n):,}", "target": "", "met": None, "reference": True,
             "figure": line.split(": ", 1)[1]}
            for name, line in zip(measured[n], describe(measured[n]))]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.migratestep", description=__doc__.split("\n\n")[0])
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {', '.join(STEPS)}")
    args = p.parse_args(argv)
    netns.install_handlers()
    netns.remove_stale()
    workdir = tempfile.mkdtemp(prefix="np-bench-migrate-")
    try:
        steps = measure(args.services, workdir, steps=[s for s in args.steps.split(",") if s])
    finally:
        netns.cleanup_all()
    print(f"migrate at N={args.services:,} (uniform cluster):")
    for line in describe(steps):
        print(f"  {line}")
    print(json.dumps({"services": args.services, "steps": steps}))
    return 0 if all("seconds" in c for c in steps.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
