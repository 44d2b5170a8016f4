"""The control-plane worker: runs INSIDE a node namespace and times netproxy's real code path.

    python -m bench.worker --backend B --writer W --flavour F --n N --variant V [--pods IP:PORT,...]
                           [--plan-out FILE]

Kubernetes objects (``bench.gen``) → ``parse_objects`` → :class:`ChangeTracker` → ``backend.sync``,
step by step, one JSON line per step on stdout (so that a step that times out loses only itself):

- ``source``: parse every object and fill the tracker (what a (re)list costs);
- ``cold``: the first full sync into an empty kernel (repeated after ``cleanup()`` while cheap);
- ``resync``: a full sync with nothing changed (what every ``--sync-period`` costs);
- ``endpoint``: one endpoint of one service moved: parse the slice, tracker, partial sync;
- ``endpoint-affinity``: the same for a ClientIP-affinity service (the mixed cluster has them);
- ``add`` / ``remove``: one service (and its slice) added, then removed again;
- ``plan``: the full payload as text, written to ``--plan-out`` for the raw-tool reference.

Every step but ``source`` and ``plan`` is repeated and summarised by ``bench.sample`` (median, min,
max, every run), exactly as kube-proxy's layout is (``bench/control.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench import gen, nftsteps, sample
from netproxy.backends import create
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes
from netproxy.core.tracker import ChangeTracker
from netproxy.source.files import parse_objects

NODE_NAME = "np-node"


def emit(step: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"step": step, **fields}) + "\n")
    sys.stdout.flush()


def _feed(tracker: ChangeTracker, objects: Sequence[Dict[str, Any]]) -> None:
    """Objects → parse_objects → tracker events (what the file and API sources do per event)."""
    loaded = parse_objects(iter(objects), NODE_NAME)
    if loaded.errors:
        raise SystemExit(f"bench: generated objects rejected: {loaded.errors[0]}")
    for (ns, name), ports in loaded.services.items():
        tracker.update_service(ns, name, ports)
    for (ns, name), eps in loaded.endpoints.items():
        tracker.update_endpoints(ns, name, eps)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        writers = {"nftables_writer": args.writer} if args.backend == "nftables" else {"iptables_writer": args.writer}
        self.config = ProxyConfig(backend=args.backend, iptables_flavour=args.flavour, hostname=NODE_NAME,
                                  **writers)
        pods = [_pod(p) for p in args.pods.split(",") if p] if args.pods else None
        self.pods = pods or [("10.244.1.10", 8080)]
        self.objects = gen.cluster(args.n, args.variant, pods)
        self.n = args.n
        self.variant = args.variant
        self.backend = create(args.backend, self.config)
        self.tracker = ChangeTracker()

    def probe(self) -> None:
        self.backend.probe()
        emit("probe", ok=True)

    def source(self) -> None:
        t0 = time.perf_counter()
        loaded = parse_objects(iter(self.objects), NODE_NAME)
        self.tracker.replace_services(loaded.services)
        self.tracker.replace_endpoints(loaded.endpoints)
        self.tracker.services_synced()
        self.tracker.endpoints_synced()
        self.snapshot, _ = self.tracker.take()
        emit("source", seconds=time.perf_counter() - t0, services=len(self.snapshot.services),
             endpoints=sum(len(v) for v in self.snapshot.endpoints.values()))

    def cold(self) -> None:
        self.backend.probe()

        def once(k: int) -> Dict[str, Any]:
            if k:  # into an empty kernel again, through a fresh process's backend
                self.backend.cleanup()
                self.backend = create(self.config.backend, self.config)
            t0 = time.perf_counter()
            result = self.backend.sync(self.snapshot, Changes(full=True))
            return {"seconds": time.perf_counter() - t0, "bytes": result.bytes_written}

        res = sample.repeat(once, sample.FULL_RUNS)
        # What `netproxy run` does after a full sync (netproxy/core/proxier.py): the long-lived objects go to
        # the permanent GC generation, so that the changes measured next pay no pass over them.
        gc.freeze()
        emit("cold", **res)

    def resync(self) -> None:
        def once(_: int) -> Dict[str, Any]:
            t0 = time.perf_counter()
            self.backend.sync(self.snapshot, Changes(full=True))
            return {"seconds": time.perf_counter() - t0}

        res = sample.repeat(once, sample.FULL_RUNS)
        gc.freeze()  # as after the cold sync
        emit("resync", **res)

    def _change(self, objects: Sequence[Dict[str, Any]],
                removals: Sequence[Tuple[str, str, str]] = ()) -> Dict[str, float]:
        """One event through the whole path; seconds for the whole and for the backend alone."""
        t0 = time.perf_counter()
        _feed(self.tracker, objects)
        for kind, ns, name in removals:
            if kind == "Service":
                self.tracker.update_service(ns, name, None)
            else:
                self.tracker.update_endpoints(ns, name, None)
        snapshot, changes = self.tracker.take()
        t1 = time.perf_counter()
        result = self.backend.sync(snapshot, changes)
        t2 = time.perf_counter()
        self.snapshot = snapshot
        return {"seconds": t2 - t0, "backend_seconds": t2 - t1, "written": result.services_written}

    def _service_index(self, affinity: bool) -> Optional[int]:
        """The first service from the middle on with (or without) ClientIP affinity, never the last
        (its endpoints are the real pods); ``None`` when the cluster has no such service."""
        shapes = gen.shapes(self.n, self.variant)
        mid = self.n // 2 if self.n > 1 else 0
        for i in list(range(mid, self.n - 1)) + list(range(0, mid)):
            if shapes[i].affinity == affinity:
                return i
        return 0 if self.n == 1 and not affinity else None

    def endpoint(self, affinity: bool = False) -> None:
        """One endpoint of a service moved.  Affinity services are measured apart (``endpoint-affinity``):
        their per-endpoint rules make a change cost more than an element swap on both backends."""
        step = "endpoint-affinity" if affinity else "endpoint"
        index = self._service_index(affinity)
        if index is None:
            emit(step, skipped=f"no service {'with' if affinity else 'without'} affinity in this cluster")
            return
        emit(step, **sample.repeat(lambda k: self._change([gen.replaced_endpoint(self.objects, index, k)]),
                                   sample.CHANGE_RUNS))

    def add_remove(self) -> None:
        adds: List[Dict[str, float]] = []
        removes: List[Dict[str, float]] = []
        # Added and removed in turn (each removal undoes its add), so sample.repeat's rule is applied to
        # the pairs by hand: as many runs, the same budget for both steps together, the same summary.
        for k in range(sample.CHANGE_RUNS):
            svc, eps = gen.extra_service(k, self.pods)
            adds.append(self._change([svc, eps]))
            removes.append(self._change([], [("Service", gen.NAMESPACE, svc["metadata"]["name"]),
                                             ("EndpointSlice", gen.NAMESPACE, eps["metadata"]["name"])]))
            spent = sum(r["seconds"] for r in adds + removes)
            if spent + adds[-1]["seconds"] + removes[-1]["seconds"] > sample.BUDGET:
                break
        for step, runs in (("add", adds), ("remove", removes)):
            emit(step, **sample.summary(runs))

    def churn(self) -> None:
        """1,000 one-endpoint changes of one service: memory after the first and the last (nftables)."""
        if self.config.backend != "nftables":
            emit("churn", skipped="nftables only (each iptables change swaps the whole table: 1,000 of them "
                              "do not fit a run)")
            return
        index = self.n // 3
        emit("churn", **nftsteps.churn(lambda k: self._change([gen.replaced_endpoint(self.objects, index, 100 + k)]),
                                       self.n, self.variant))

    def raw_netlink(self) -> None:
        emit("raw-netlink", **nftsteps.raw_netlink(self.backend, self.snapshot, self.config))

    def plan(self, path: Optional[str]) -> None:
        t0 = time.perf_counter()
        text = self.backend.plan(self.snapshot)
        elapsed = time.perf_counter() - t0
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        emit("plan", seconds=elapsed, bytes=len(text))


def _pod(text: str) -> Tuple[str, int]:
    ip, _, port = text.rpartition(":")
    return ip, int(port)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True)
    p.add_argument("--writer", default="restore")
    p.add_argument("--flavour", default="legacy")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--variant", default="uniform", choices=gen.VARIANTS)
    p.add_argument("--pods", default="", help="IP:PORT,... the last service's endpoints (real pods)")
    p.add_argument("--plan-out", default="")
    p.add_argument("--steps", default="source,cold,resync,endpoint,add,plan", help="probe,source,cold,...")
    args = p.parse_args(argv)
    run = Run(args)
    wanted = args.steps.split(",")
    steps: List[Tuple[str, Callable[[], None]]] = [
        ("probe", run.probe), ("source", run.source), ("cold", run.cold), ("resync", run.resync),
        ("endpoint", run.endpoint), ("endpoint-affinity", lambda: run.endpoint(affinity=True)),
        ("add", run.add_remove), ("churn", run.churn), ("plan", lambda: run.plan(args.plan_out)),
        ("raw-netlink", run.raw_netlink)]
    status = 0
    for name, fn in steps:
        if name not in wanted:
            continue
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - reported as the step's figure, loudly
            emit(name, error=f"{type(err).__name__}: {err}"[:2000])
            status = 1
            if name in ("probe", "source", "cold"):
                break  # nothing after this means anything without a first sync
    emit("done", maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return status


if __name__ == "__main__":
    sys.exit(main())
