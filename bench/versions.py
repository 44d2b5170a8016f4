"""``python -m bench.versions REV [REV ...]``: ``netproxy sync`` as a new process, one commit against another.

A figure of one bench run against a figure of another compares two machines as much as two
versions (this 2-vCPU machine's speed moves by a quarter from one day to the next).  This runs
each revision's ``netproxy/`` and ``backends/`` (from ``git archive``, laid out as the install lays
them out) in turn, alternating, in one throwaway ``np-bench-…-versions`` namespace, on the uniform
N × 10 cluster: a first sync into an empty kernel and a restart with one endpoint changed, for
nftables and iptables-legacy.  Every run is ``python -S`` with the venv's site-packages on the path
(so that the editable install's finder does not hand every run this checkout's code), timed whole
from outside, with its peak RSS.  Prints the median per revision.

``--worker``: the bench's control-plane worker (``bench.worker``, this checkout's, over each
revision's code) instead: the cold full sync, one endpoint changed, one service added and removed,
each the worker's own median, per revision; backends nftables, iptables-legacy, iptables-nft.  For a
change figure of one bench run that moved against another's: was it the code or the machine?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import site
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Dict, Iterator, List, Tuple

from bench import gen, installed
from bench.rss import measure_sync
from bench.stages import BACKENDS, empty_node
from netproxy_lab import netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def unpack(rev: str, into: str) -> str:
    """``rev``'s product code under ``into``/<rev>, ``backends/`` inside ``netproxy/`` as installed."""
    dest = os.path.join(into, rev)
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev, "netproxy", "backends"],
                             capture_output=True, check=True).stdout
    path = os.path.join(into, f"{rev}.tar")
    with open(path, "wb") as fh:
        fh.write(archive)
    with tarfile.open(path) as tar:
        tar.extractall(dest, filter="data")
    shutil.move(os.path.join(dest, "backends"), os.path.join(dest, "netproxy", "backends"))
    return dest


class _Node:
    """What :func:`bench.rss.measure_sync` needs of a sandbox: the node namespace and a PATH entry."""

    def __init__(self, ns: str) -> None:
        self.node = ns

    def iptables_bindir(self, _flavour: str) -> str:
        return "/usr/sbin"


class _Combo:
    def __init__(self, flags: List[str]) -> None:
        self.flags = flags
        self.flavour = "legacy"


Figures = Dict[Tuple[str, str, str], List[Tuple[float, float]]]
"""(backend, step, revision) → (seconds, peak RSS MiB) of each run."""


@contextlib.contextmanager
def _unpacked(revs: List[str]) -> Iterator[Tuple[str, Dict[str, str], str]]:
    """(a work directory, each revision's tree compiled to bytecode, the venv's site-packages)."""
    with tempfile.TemporaryDirectory(prefix="np-versions-") as work:
        trees = {rev: unpack(rev, work) for rev in revs}
        for tree in trees.values():
            installed.precompile(tree)
        yield work, trees, site.getsitepackages()[0]


def _turns(ns: str, revs: List[str], runs: int, backends: List[str]) -> Iterator[Tuple[str, str]]:
    """(backend, revision) in turn, ``runs`` times each, every one on a node emptied first."""
    for backend in backends:
        for _ in range(runs):
            for rev in revs:
                empty_node(ns)
                yield backend, rev
    empty_node(ns)


def compare(revs: List[str], n: int, runs: int, backends: List[str], variant: str = "uniform") -> Figures:
    out: Figures = {}
    with _unpacked(revs) as (work, trees, sp):
        source, changed = os.path.join(work, "c.json"), os.path.join(work, "c-changed.json")
        objects = gen.cluster(n, variant)
        gen.write_json(source, objects)
        objects[2 * (n // 2) + 1] = gen.replaced_endpoint(objects, n // 2, 7)
        gen.write_json(changed, objects)
        log = os.path.join(work, "sync.log")
        with netns.namespace("versions") as ns:
            node = _Node(ns)
            for backend, rev in _turns(ns, revs, runs, backends):
                os.environ["NETPROXY_CMD"] = f"{sys.executable} -S -m netproxy"
                os.environ["PYTHONPATH"] = f"{trees[rev]}:{sp}"
                for step, path in (("sync", source), ("restart", changed)):
                    got = measure_sync(node, _Combo(BACKENDS[backend]), path, 300, log)
                    if "seconds" not in got:
                        raise SystemExit(f"bench.versions: {rev} {backend} {step}: {got} (log {log})")
                    out.setdefault((backend, step, rev), []).append((got["seconds"], got["maxrss_mib"]))
    return out


WORKER_BACKENDS = {"nftables": ["--backend", "nftables", "--writer", "netlink"],
                   "iptables-legacy": ["--backend", "iptables", "--flavour", "legacy"],
                   "iptables-nft": ["--backend", "iptables", "--flavour", "nft"]}
WORKER_STEPS = ("cold", "endpoint", "add", "remove")


def compare_worker(revs: List[str], n: int, runs: int, backends: List[str]) -> Figures:
    """(backend, step, revision) → (the worker's median seconds, 0.0) of each run, alternating."""
    out: Figures = {}
    with _unpacked(revs) as (_work, trees, sp), netns.namespace("versions") as ns:
        for backend, rev in _turns(ns, revs, runs, backends):
            # The revision's netproxy first; `bench` (the harness) from this checkout.
            env = {**os.environ, "PYTHONPATH": f"{trees[rev]}:{ROOT}:{sp}"}
            args = [sys.executable, "-S", "-m", "bench.worker", *WORKER_BACKENDS[backend], "--n", str(n),
                    "--steps", "source,cold,endpoint,add"]
            done = netns.run_in_timeout(ns, args, timeout=600, env=env)
            steps = {}
            for line in done.stdout.decode().splitlines():
                record = json.loads(line)
                steps[record["step"]] = record
            for step in WORKER_STEPS:
                if "seconds" not in steps.get(step, {}):
                    raise SystemExit(f"bench.versions: {rev} {backend} {step}: {steps.get(step)} "
                                     f"{done.stderr.decode()[-800:]}")
                out.setdefault((backend, step, rev), []).append((steps[step]["seconds"], 0.0))
    return out


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value >= 0.1 else f"{value * 1000:.2f} ms"  # nftables' changes are ms


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.versions", description=__doc__.splitlines()[0])
    p.add_argument("revs", nargs="+", help="commits to compare (e.g. a72e1db HEAD)")
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backends", default="nftables,iptables-legacy")
    p.add_argument("--variant", default="uniform", choices=gen.VARIANTS,
                   help="the cluster (bench/gen.py); not with --worker")
    p.add_argument("--worker", action="store_true", help="the bench worker's cold, endpoint, add and remove steps "
                   "instead of `netproxy sync` processes (backends: " + ", ".join(WORKER_BACKENDS) + ")")
    args = p.parse_args(argv)
    revs = [subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", r], capture_output=True, text=True,
                           check=True).stdout.strip() for r in args.revs]
    os.chdir(tempfile.gettempdir())  # `-m netproxy` must not find this checkout through the current directory
    if args.worker:
        got = compare_worker(revs, args.services, args.runs, args.backends.split(","))
        print(f"bench.worker steps (each the worker's median), N = {args.services:,} × 10, median of {args.runs} "
              f"alternating runs ({time.strftime('%Y-%m-%d %H:%M')}):")
        for (backend, step, rev), runs in got.items():
            print(f"  {backend:16} {step:8} {rev}: {_seconds(statistics.median(r[0] for r in runs))} "
                  f"(runs {', '.join(_seconds(r[0]) for r in runs)})")
        return 0
    got = compare(revs, args.services, args.runs, args.backends.split(","), args.variant)
    print(f"`netproxy sync` as a new process, N = {args.services:,} ({args.variant}), median of {args.runs} "
          f"alternating runs ({time.strftime('%Y-%m-%d %H:%M')}):")
    for (backend, step, rev), runs in got.items():
        secs = statistics.median(r[0] for r in runs)
        rss = statistics.median(r[1] for r in runs)
        print(f"  {backend:16} {step:8} {rev}: {secs:.2f} s, peak RSS {rss:.0f} MiB "
              f"(runs {', '.join(f'{r[0]:.2f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
