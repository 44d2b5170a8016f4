"""``python -m bench.stages``: what one ``netproxy sync`` process spends its time and memory on.

The bench's ``netproxy sync`` rows give the whole (a new process: start, load, render, write);
this splits it.  In a throwaway ``np-bench-…-stages`` namespace, the uniform N × 10 cluster as a
JSON file (:mod:`bench.gen`), then ``netproxy sync`` as a new process in this module's ``--child``
mode, which times the CLI's own stages from outside (each wrapped once, nothing in netproxy changes)
and reads the resident set's high-water mark after each: the imports, loading the file, the
snapshot, the backend's render, its transaction, the write (encode + kernel for nftables; the
restore tool for iptables), what follows the write (the conntrack reconciler, the other dataplane's
leftovers), and the process's whole wall time as the parent sees it.  Then the restart: a new
process with one endpoint changed on the node the first one programmed.  Median of ``--runs``
(empty kernel before each first sync).  Prints a table and writes ``bench/results/stages.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

STAGES = ("imports", "load", "snapshot", "render", "transaction", "adopt", "write", "sync other", "after write",
          "main")
_T0 = time.perf_counter()


def _hwm_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _child(argv: List[str]) -> None:
    """Run ``netproxy`` with ``argv`` in this process, its stages timed; print one JSON line."""
    spent: Dict[str, float] = {}
    peak: Dict[str, float] = {}

    def wrap(owner: Any, name: str, stage: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[stage] = spent.get(stage, 0.0) + time.perf_counter() - t
                peak[stage] = _hwm_mib()

        setattr(owner, name, timed)

    from netproxy import cli
    from netproxy.cli import oneshot
    from netproxy.migration import migrate
    from netproxy.node import conntrack

    wrap(oneshot, "_load", "load")
    wrap(oneshot, "snapshot_of", "snapshot")
    wrap(conntrack.Reconciler, "reconcile", "after write")
    wrap(migrate, "remove_leftovers", "after write")
    if "iptables" in argv:
        import netproxy.backends.iptables as ipt
        from netproxy.backends.iptables.kernel import restore

        wrap(ipt.IptablesBackend, "sync", "sync")
        wrap(ipt.IptablesBackend, "_render", "render")
        wrap(restore.RestoreTools, "restore_stream", "write")
    else:
        import netproxy.backends.nftables as nft
        from netproxy.backends.nftables.kernel import netlink

        wrap(nft.NftablesBackend, "sync", "sync")
        wrap(nft.NftablesBackend, "_build_state", "render")
        wrap(nft, "full_transaction", "transaction")
        wrap(nft.adopt, "plan", "adopt")  # restart by adoption: the reads and the diff
        wrap(netlink.NetlinkRunner, "apply", "write")
    spent["imports"] = time.perf_counter() - _T0
    peak["imports"] = _hwm_mib()
    t = time.perf_counter()
    # As the program runs it (cli.main() then _leave): the parsed arguments keep the snapshot and the
    # backend's record alive until os._exit below, so their frees are not counted (cmd_sync).
    args = cli.build_parser().parse_args(argv)
    code = cli._main(args)
    spent["main"] = time.perf_counter() - t
    spent["sync other"] = spent.pop("sync", 0.0) - sum(spent.get(k, 0.0)
                                                       for k in ("render", "transaction", "adopt", "write"))
    print(json.dumps({"code": code, "seconds": spent, "peak_mib": peak, "hwm_mib": _hwm_mib()}), flush=True)
    os._exit(0)  # as the program leaves (netproxy.cli._leave): the wall time is a real process's


def _one(ns: str, source: str, flags: List[str]) -> Dict[str, Any]:
    from netproxy_lab import netns

    args = [sys.executable, "-m", "bench.stages", "--child", "sync", "--source", source, *flags,
            "--hostname-override", "np-node", "--log-level", "warning"]
    t = time.perf_counter()
    done = netns.run_in_timeout(ns, args, timeout=300, env={**os.environ, "PYTHONPATH": _root()})
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"bench.stages: {' '.join(args)} exited {done.returncode}: {done.stderr.decode()[-800:]}")
    got: Dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    got["wall"] = wall
    return got


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BACKENDS = {"nftables": ["--backend", "nftables"],
            "iptables-legacy": ["--backend", "iptables", "--iptables-flavour", "legacy"]}


def empty_node(ns: str) -> None:
    """netfilter of ``ns`` as a new node's: no ruleset, no legacy chains, and none of netproxy's
    ipsets (the legacy backend's hairpin and affinity sets outlive the chains that named them; left
    in place, the next "first" sync would read and compare a full hairpin set, ~0.24 s at 10k, that
    a new node does not have)."""
    from netproxy_lab import netns

    for args in (["nft", "flush", "ruleset"], *(["iptables-legacy", "-t", t, verb]
                                                 for t in ("nat", "filter") for verb in ("-F", "-X"))):
        netns.run_in_timeout(ns, args, timeout=60)
    done = netns.run_in_timeout(ns, [sys.executable, "-m", "netproxy.backends.iptables.ipset", "destroy-all"],
                                timeout=60, env={**os.environ, "PYTHONPATH": _root()})
    if done.returncode != 0:
        raise SystemExit(f"bench.stages: destroying netproxy's ipsets in {ns} exited {done.returncode}: "
                         f"{done.stderr.decode()[-400:]}")


def _median(runs: List[Dict[str, Any]], key: str, stage: str = "") -> float:
    values = [r[key].get(stage, 0.0) if stage else r[key] for r in runs]
    return float(statistics.median(values))


def measure(n: int, runs: int, backends: List[str], workdir: str) -> Dict[str, Any]:
    from bench import gen
    from netproxy_lab import netns

    source, changed = os.path.join(workdir, f"stages-{n}.json"), os.path.join(workdir, f"stages-{n}-changed.json")
    objects = gen.cluster(n, "uniform")
    gen.write_json(source, objects)
    objects[2 * (n // 2) + 1] = gen.replaced_endpoint(objects, n // 2, 7)
    gen.write_json(changed, objects)
    out: Dict[str, Any] = {}
    with netns.namespace("stages") as ns:
        for name in backends:
            first, again = [], []
            for _ in range(runs):
                empty_node(ns)
                first.append(_one(ns, source, BACKENDS[name]))
                again.append(_one(ns, changed, BACKENDS[name]))
            empty_node(ns)
            out[name] = {"sync": first, "restart": again}
    return out


def table(results: Dict[str, Any], n: int, commit: str) -> str:
    runs = len(next(iter(results.values()))["sync"])
    lines = [f"### `netproxy sync` stage by stage, N = {n:,} × 10 (median of {runs}; commit {commit})", "",
             "| | " + " | ".join(f"{b} {k}" for b in results for k in ("sync", "restart")) + " |",
             "|---|" + "---|" * (2 * len(results))]
    for stage in STAGES:
        cells = [f"{_median(results[b][k], 'seconds', stage):.3f} s" for b in results for k in ("sync", "restart")]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append("| whole process (wall, as started) | " + " | ".join(
        f"{_median(results[b][k], 'wall'):.3f} s" for b in results for k in ("sync", "restart")) + " |")
    lines.append("| peak RSS | " + " | ".join(
        f"{_median(results[b][k], 'hwm_mib'):.0f} MiB" for b in results for k in ("sync", "restart")) + " |")
    lines.append("| peak RSS after load / render / write | " + " | ".join(
        " / ".join(f"{_median(results[b][k], 'peak_mib', s):.0f}" for s in ("load", "render", "write")) + " MiB"
        for b in results for k in ("sync", "restart")) + " |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backends", default="nftables,iptables-legacy")
    p.add_argument("--out", default=os.path.join(_root(), "bench", "results", "stages.md"))
    args = p.parse_args(argv)
    import tempfile

    from bench import installed

    installed.precompile()
    commit = subprocess.run(["git", "-C", _root(), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="np-stages-") as workdir:
        results = measure(args.services, args.runs, args.backends.split(","), workdir)
    text = table(results, args.services, commit)
    sys.stdout.write(text)
    with open(args.out, "w") as fh:
        fh.write(f"<!-- python -m bench.stages --services {args.services} --runs {args.runs}, "
                 f"{time.strftime('%Y-%m-%d %H:%M')} -->\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
