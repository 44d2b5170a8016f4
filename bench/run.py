"""The benchmark's plan: which measure runs where, in what order, within what time budget.

One :class:`netproxy_lab.topology.Sandbox` (client, node, 10 pods) serves every measure; the node's
netfilter state is reset between measures.  Phases, most important first, so that a run that hits
its time budget loses the least important figures: (A) control plane + data plane + RSS per
backend/writer and N, (B) kube-proxy's layout, (C) event → kernel, (D) the mixed variant.
Every step prints a progress line; every step is bounded by its own timeout and by what is left of
the run's budget.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench import client as client_mod
from bench import conntrack, control, dataplane, gen, latency, objects, report, rss, top
from netproxy_lab import netns
from netproxy_lab.combos import Combo

DP_EXTRA = 1  # the data plane also runs at N=1
# Run at the largest N after everything else: iptables-nft's kernel cost grows faster than linearly
# (docs/performance.md), and a forced iptables-nft backend is the least common set-up.
DEFERRED = ("iptables-nft/restore",)
LARGE = 10000
AT_LARGE = ("nftables", "nftables/libnftables")
"""Past 10k services (``--max-services 44000``: the largest public kube-proxy report) only the
nftables writers run: the other combinations' cold syncs alone take minutes there."""


class Budget:
    """Wall-clock budget: each step gets min(its own timeout, what is left minus a reserve)."""

    def __init__(self, seconds: float, reserve: float = 15.0) -> None:
        self.end = time.monotonic() + seconds
        self.reserve = reserve

    def left(self) -> float:
        return self.end - self.reserve - time.monotonic()

    def timeout(self, wanted: float) -> float:
        return max(0.0, min(wanted, self.left()))


def combo_record(combo: Combo) -> Dict[str, str]:
    """``combo`` as the results' ``meta.combos`` list holds it; ``key`` is its name (the field name
    every results file, old ones included, uses)."""
    return {"key": combo.name, "backend": combo.backend, "writer": combo.writer, "flavour": combo.flavour}


class Bench:
    def __init__(self, combos: List[Combo], sizes: List[int], smoke: bool, budget: float, workdir: str,
                 out: Any = sys.stdout, scale: bool = False) -> None:
        self.combos = combos
        self.scale = scale
        """``--scale N``: only phase A at N, every combination asked for, no skipped RSS (run_scale)."""
        self.sizes = sizes
        self.smoke = smoke
        self.dp_sizes = sorted({DP_EXTRA} | {n for n in sizes if (n >= 1000 and n <= LARGE) or smoke})
        self.base: Any = None  # a second sandbox holding the one-service baseline for the data plane
        self._base_key: Optional[str] = None
        largest = max([n for n in sizes if n <= LARGE] or sizes)
        self.latency_sizes = sizes[-1:] if smoke else sorted({n for n in sizes if n == 1000} | {largest})
        self.budget = Budget(budget)
        self.workdir = workdir
        self.out = out
        self.t0 = time.monotonic()
        self.client: List[str] = []
        self.sandbox: Any = None
        self._probed = False
        self.min_sync = 0.2 if smoke else 1.0
        self.changes = 3 if smoke else latency.CHANGES
        self.results: Dict[str, Any] = {
            "meta": {}, "control": {}, "reference": {}, "dataplane": {}, "dataplane_pairs": {}, "latency": {},
            "rss": {}, "migrate": {}, "unavailable": {}, "errors": [], "dataplane_failures": [], "targets": []}

    # -- bookkeeping ------------------------------------------------------------------------------

    def progress(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.out, flush=True)

    def _cell(self, section: str, key: str, n: int, variant: Optional[str] = None) -> Dict[str, Any]:
        top = self.results[section].setdefault(key, {})
        if variant is not None:
            top = top.setdefault(variant, {})
        return top.setdefault(str(n), {})  # type: ignore[no-any-return]

    def _note_errors(self, what: str, steps: Dict[str, Any]) -> None:
        for step, cell in steps.items():
            if isinstance(cell, dict) and "error" in cell:
                self.results["errors"].append(f"{what} {step}: {cell['error']}")

    def _skip(self, why: str) -> Dict[str, Any]:
        return {"skipped": why}

    def _out_of_time(self, need: float) -> bool:
        return self.budget.left() < need

    def measure_floor(self, combo: Combo, steps: Dict[str, Any], what: str) -> Dict[str, Any]:
        """The one-rule floor on the table the worker just left loaded: what any write into it costs at
        least (``control.floor``); one-service changes are printed as ratios to it."""
        if "seconds" not in steps.get("cold", {}):
            return self._skip("no loaded table: the cold sync did not finish")
        if self._out_of_time(10):
            return self._skip("out of time budget")
        res = control.floor(combo, self.sandbox.node, self.workdir, self.budget.timeout(120))
        self._note_errors(what, {"floor": res})
        if "undo" in res:
            self.results["errors"].append(f"{what} floor: its chain could not be deleted: {res['undo']}")
        self.progress(f"{what}: one-rule floor ({res.get('tool', 'restore')} --noflush) {control.describe(res)}")
        return res

    # -- set-up -------------------------------------------------------------------------------------

    def meta(self) -> None:
        def tool(args: List[str]) -> str:
            try:
                return subprocess.run(args, capture_output=True, text=True, check=False).stdout.strip().splitlines()[0]
            except (OSError, IndexError):
                return f"{args[0]}: missing"

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "?"
        self.results["meta"] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpus": os.cpu_count(),
            "kernel": platform.release(), "python": platform.python_version(), "commit": commit,
            "iptables": tool(["iptables-legacy", "--version"]), "nft": tool(["nft", "--version"]),
            "sizes": self.sizes, "dp_sizes": self.dp_sizes, "combos": [combo_record(c) for c in self.combos],
            "smoke": self.smoke, "min_sync_period": self.min_sync, "latency_changes": self.changes,
            "loadavg": [os.getloadavg()[0]],
            "dp_count": dataplane.SMOKE_COUNT if self.smoke else dataplane.COUNT,
            "dp_rounds": dataplane.SMOKE_ROUNDS if self.smoke else dataplane.ROUNDS,
        }

    def budget_used(self) -> float:
        return time.monotonic() - self.t0

    def probe(self) -> None:
        """Which combos can run here (the backend's own probe, inside a throwaway namespace)."""
        self._probed = True
        for combo in self.combos:
            with netns.namespace("probe") as ns:
                steps = control.run_worker(ns, combo, 1, "uniform", [("10.244.1.10", 8080)], "", 60,
                                           os.path.join(self.workdir, "probe.log"), steps=("probe",))
            cell = steps["probe"]
            if not cell.get("ok"):
                why = str(cell.get("error") or cell)[:300]
                self.results["unavailable"][combo.name] = why
                self.progress(f"{combo.name}: unavailable — {why}")
            else:
                self.progress(f"{combo.name}: available")

    def available(self) -> List[Combo]:
        return [c for c in self.combos if c.name not in self.results["unavailable"]]

    # -- phase A ------------------------------------------------------------------------------------

    def worker_timeout(self, n: int) -> float:
        return max(60.0, 0.024 * n)

    def phase_control(self, combo: Combo, n: int) -> None:
        sb = self.sandbox
        cell = self._cell("control", combo.name, n, "uniform")
        timeout = self.budget.timeout(self.worker_timeout(n))
        if timeout < 10:
            cell["cold"] = self._skip("out of time budget")
            return
        sb.reset_netfilter()
        plan = os.path.join(self.workdir, f"plan-{combo.slug}-{n}")
        steps = control.run_worker(sb.node, combo, n, "uniform", control.pods_of(sb), plan, timeout,
                                   os.path.join(self.workdir, "worker.log"))
        cell.update(steps)
        self._note_errors(f"{combo.name} N={n}", steps)
        self.progress(f"{combo.name} N={n:,}: cold {control.describe(steps.get('cold'))}, resync "
                      f"{control.describe(steps.get('resync'))}, endpoint {control.describe(steps.get('endpoint'))}, "
                      f"add {control.describe(steps.get('add'))}, remove {control.describe(steps.get('remove'))}")
        if combo.backend == "iptables":  # on the table the worker left loaded
            cell["floor"] = self.measure_floor(combo, steps, f"{combo.name} N={n:,}")
        if "seconds" not in steps.get("cold", {}):
            return
        if n in self.dp_sizes:
            self.measure_dataplane(combo.name, n, self.base_netproxy(combo))
        self.measure_rss(combo, n, steps)
        sb.reset_netfilter()
        if "seconds" not in steps.get("plan", {}):
            cell["raw"] = self._skip("no plan payload: the plan step did not finish")
            return
        raw = control.raw_own_payload(combo, plan, self.workdir, self.budget.timeout(timeout),
                                      reset=sb.reset_netfilter, ns=sb.node)
        cell["raw"] = raw
        self._note_errors(f"{combo.name} N={n}", {"raw": raw})
        self.progress(f"{combo.name} N={n:,}: raw apply of its own payload {control.describe(raw)}")

    def measure_dataplane(self, key: str, n: int, load_base: Callable[[], bool]) -> None:
        """Connections to the last of ``n`` services, alternating with the one-service baseline."""
        cell = self._cell("dataplane", key, n)
        if self._out_of_time(30):
            cell.update(self._skip("out of time budget"))
            return
        if self._base_key != key:
            self.base.reset_netfilter()
            self._base_key = key if load_base() else None
            if self._base_key is None:
                cell.update({"error": "the one-service baseline could not be loaded"})
                self.results["errors"].append(f"data plane {key}: the one-service baseline could not be loaded")
                return
        big, one = dataplane.paired([(self.sandbox, *control.last_service(n)), (self.base, *control.last_service(1))],
                                    self.client, smoke=self.smoke)
        cell.update(big)
        self._cell("dataplane", key, 1).update(one)
        if "p50_us" in big and "p50_us" in one:
            self.results["dataplane_pairs"].setdefault(key, {})[str(n)] = {
                "p50_us": big["p50_us"], "p50_us_at_1": one["p50_us"], "ratio": big["p50_us"] / one["p50_us"],
                "best_p50_us": big["best_p50_us"], "best_p50_us_at_1": one["best_p50_us"],
                "best_ratio": big["best_p50_us"] / one["best_p50_us"]}
            self.progress(f"{key} N={n:,}: data plane p50 {big['p50_us']:.0f} µs (best batch {big['best_p50_us']:.0f}; "
                          f"N=1 alongside: {one['p50_us']:.0f}, best {one['best_p50_us']:.0f}), p99 "
                          f"{big['p99_us']:.0f} µs, {big['rate']:.0f} conn/s")
        else:
            self.progress(f"{key} N={n:,}: data plane {big} / N=1 {one}")
        for label, res in ((n, big), (1, one)):
            problem = dataplane.failure(res)
            if problem:  # fails the run (python -m bench exits 1 and names it)
                self.results["dataplane_failures"].append(f"{key} N={label}: {problem}")
                self.progress(f"{key} N={label:,}: data plane FAILED: {problem}")

    def base_netproxy(self, combo: Combo) -> Callable[[], bool]:
        """Loads the baseline: a `netproxy sync` of one service in the second sandbox (its RSS is N=1's)."""
        def load() -> bool:
            source = os.path.join(self.workdir, "cluster-1.json")
            gen.write_json(source, gen.cluster(1, "uniform", control.pods_of(self.base)))
            res = rss.measure_sync(self.base, combo, source, self.budget.timeout(60),
                                   os.path.join(self.workdir, "rss.log"))
            self._cell("rss", combo.name, 1).update(res)
            return "seconds" in res
        return load

    def base_kubeproxy(self, family: str, flavour: str) -> Callable[[], bool]:
        def load() -> bool:
            objects = gen.cluster(1, "uniform", control.pods_of(self.base))
            res = control.kubeproxy_reference(self.base.node, objects, family, self.workdir, 60, flavour,
                                              reset=self.base.reset_netfilter, full_only=True)
            return "seconds" in res["cold"]
        return load

    def measure_rss(self, combo: Combo, n: int, steps: Dict[str, Any]) -> None:
        cold = steps["cold"]["seconds"]
        cell = self._cell("rss", combo.name, n)
        if cold > 15 and n > 1000 and not self.scale:
            cell.update(self._skip(f"cold sync took {cold:.0f} s"))
            return
        source = os.path.join(self.workdir, f"cluster-{n}.json")
        if not os.path.exists(source):
            gen.write_json(source, gen.cluster(n, "uniform", control.pods_of(self.sandbox)))
        res = rss.measure_sync(self.sandbox, combo, source, self.budget.timeout(self.worker_timeout(n)),
                               os.path.join(self.workdir, "rss.log"))
        cell.update(res)
        self._note_errors(f"{combo.name} N={n} netproxy sync", {"rss": res})
        if "maxrss_mib" in res and "seconds" in res:
            self.progress(f"{combo.name} N={n:,}: `netproxy sync` peak RSS {res['maxrss_mib']:.0f} MiB "
                          f"({res['seconds']:.1f} s)")
            self.measure_restart(combo, n, source)

    def measure_restart(self, combo: Combo, n: int, source: str) -> None:
        """A new `netproxy sync` process with one endpoint changed, on the node that holds the ruleset
        the previous one wrote: what a restarted proxy (or a node-local tool) pays."""
        if n < 2:
            return
        objects = gen.cluster(n, "uniform", control.pods_of(self.sandbox))
        objects[2 * (n // 2) + 1] = gen.replaced_endpoint(objects, n // 2, 7)
        changed = source.replace(".json", "-changed.json")
        gen.write_json(changed, objects)
        res = rss.measure_sync(self.sandbox, combo, changed, self.budget.timeout(self.worker_timeout(n)),
                               os.path.join(self.workdir, "rss.log"))
        self._cell("rss", combo.name, n)["restart"] = res
        self._note_errors(f"{combo.name} N={n} restart", {"restart": res})
        if "seconds" in res:
            self.progress(f"{combo.name} N={n:,}: restart with one endpoint changed {res['seconds']:.2f} s")

    # -- phase B ------------------------------------------------------------------------------------

    def phase_reference(self, ref: str, family: str, flavour: str, n: int, timeout: float) -> None:
        cell = self._cell("reference", ref, n)
        timeout = self.budget.timeout(timeout)
        if timeout < 5:
            cell["cold"] = self._skip("out of time budget")
            return
        sb = self.sandbox
        sb.reset_netfilter()
        objects = gen.cluster(n, "uniform", control.pods_of(sb))
        steps = control.kubeproxy_reference(sb.node, objects, family, self.workdir, timeout, flavour,
                                            reset=sb.reset_netfilter)
        cell.update(steps)
        self._note_errors(f"{ref} N={n}", steps)
        self.progress(f"{ref} N={n:,}: full {control.describe(steps.get('cold'))}, one endpoint "
                      f"{control.describe(steps.get('endpoint'))}")
        if "seconds" in steps.get("cold", {}) and n in self.dp_sizes and n > 1:
            self.measure_dataplane(ref, n, self.base_kubeproxy(family, flavour))

    # -- the whole run ------------------------------------------------------------------------------

    def run(self) -> Dict[str, Any]:
        from netproxy_lab.topology import Sandbox

        if not self.results["meta"]:
            self.meta()
        netns.remove_stale()
        self.client = client_mod.build(self.workdir)
        self.results["meta"]["client"] = "C" if not self.client[0].endswith("python3") and len(self.client) == 1 \
            else "Python"
        self.progress(f"client: {' '.join(self.client)}")
        if not self._probed:
            self.probe()
        self.phase_objects()
        pods = 3 if self.smoke else 10
        self.progress(f"sandbox: client, node and {pods} pod namespaces")
        with Sandbox(pods=pods, udp_ports=(), ipv6=True) as sb, Sandbox(pods=pods, udp_ports=(), ipv6=True) as base:
            self.sandbox, self.base = sb, base
            self.progress(f"sandbox up: node {sb.node}; one-service baseline in {base.node}")
            big = max(n for n in self.sizes if n <= LARGE)  # the largest N every combination runs
            late = [c for c in self.available() if c.name in DEFERRED] if big > 1000 else []
            for combo in self.available():
                for n in self.sizes:
                    if n > LARGE and combo.name not in AT_LARGE:
                        self._cell("control", combo.name, n, "uniform")["cold"] = self._skip(
                            f"beyond {LARGE:,} services only {', '.join(AT_LARGE)} runs (the nftables 44k target)")
                    elif not (n == big and combo in late):
                        self.phase_control(combo, n)
            self.phase_references(upto=1000 if big > 1000 else big)
            if big > 1000:
                self.phase_references(only=big, refs=("kube-proxy iptables-legacy",))
            self.phase_latency()
            for combo in late:
                self.phase_control(combo, big)
            self.phase_mixed()
            self.phase_source_change()
            self.phase_migrate(big)
            if big > 1000:
                # The slow reference (kube-proxy's nft layout at 10k: a chain per endpoint in one
                # transaction, the slowest apply of the run; docs/performance.md) after the mixed
                # iptables figures, which are targets.
                self.phase_references(only=big, refs=("kube-proxy nft", "kube-proxy iptables-nft"))
            sb.reset_netfilter()
        self.phase_conntrack()
        self.phase_top()
        return self.results

    def run_scale(self) -> Dict[str, Any]:
        """``--scale N``: phase A at one large N (the cold sync in process, resync, one endpoint, one
        service added and removed, the raw tool applying the same payload, then `netproxy sync` as a new
        process with its peak RSS and the restart with one endpoint changed) for each combination asked
        for, and nothing else: no kube-proxy layout, data plane, latency or mixed phase, which at 100k
        would take hours and are measured at 10k by the full run."""
        from netproxy_lab.topology import Sandbox

        if not self.results["meta"]:
            self.meta()
        netns.remove_stale()
        if not self._probed:
            self.probe()
        n = self.sizes[-1]
        self.results["meta"]["scale"] = n
        self.dp_sizes = []
        with Sandbox(pods=10, udp_ports=(), ipv6=True) as sb:
            self.sandbox = sb
            sb.reset_timeout = max(60.0, 0.01 * n)  # legacy at 100k: a minute and more to empty under load
            self.progress(f"sandbox up: node {sb.node}")
            for combo in self.available():
                self.phase_control(combo, n)
                sb.reset_netfilter()
        return self.results

    def phase_objects(self) -> None:
        """The objects each backend renders for single-endpoint services against
        two-endpoint ones (bench/objects.py), at the largest N up to 10,000; no kernel involved."""
        n = max([k for k in self.sizes if k <= LARGE] or self.sizes[:1])
        try:
            cell = objects.measure(n)
        except Exception as err:  # noqa: BLE001 - a figure that failed is reported, the run goes on
            self.results["errors"].append(f"single-endpoint object counts N={n}: {err}")
            self.results["objects"] = {"n": n, "error": str(err)}
            return
        self.results["objects"] = cell
        for line in objects.lines(cell):
            self.progress(line)

    def phase_conntrack(self) -> None:
        """The conntrack reconciler at 100,000 entries, in a namespace of its own (bench/conntrack.py);
        not in a smoke run (filling the table takes seconds)."""
        if self.smoke:
            return
        timeout = self.budget.timeout(180.0)
        if timeout < 60:
            self.results["conntrack"] = self._skip("out of time budget")
            return
        self.progress("conntrack reconciler: 100,000 entries, one pass")
        try:
            self.results["conntrack"] = conntrack.measure(timeout=timeout)
        except Exception as err:  # noqa: BLE001 - one measure failing must not lose the others
            self.results["conntrack"] = {"error": repr(err)}
        if "error" in self.results["conntrack"]:
            self.results["errors"].append(f"conntrack reconciler: {self.results['conntrack']['error']}")

    def phase_top(self) -> None:
        """``netproxy top``'s refresh at 100,000 entries: the aggregation alone, and a whole refresh in a
        namespace of its own (bench/top.py); not in a smoke run (filling the table takes seconds)."""
        if self.smoke:
            return
        timeout = self.budget.timeout(180.0)
        if timeout < 60:
            self.results["top"] = self._skip("out of time budget")
            return
        self.progress("netproxy top: one refresh over 100,000 entries")
        try:
            self.results["top"] = top.measure(timeout=timeout)
        except Exception as err:  # noqa: BLE001 - one measure failing must not lose the others
            self.results["top"] = {"error": repr(err)}
        if "error" in self.results["top"]:
            self.results["errors"].append(f"netproxy top: {self.results['top']['error']}")

    def phase_migrate(self, n: int) -> None:
        """Live migration: ``netproxy migrate`` both ways at the largest N (bench/migratestep.py)."""
        from bench import migratestep

        keys = {c.name for c in self.available()}
        if self.smoke or not {"nftables", "iptables-legacy/restore"} <= keys:
            return
        if self._out_of_time(120.0):
            self.results["migrate"][str(n)] = {"all": {"skipped": "out of time"}}
            return
        steps = migratestep.measure(n, self.workdir, self.budget.timeout(600.0))
        self.results["migrate"][str(n)] = steps
        self._note_errors(f"migrate N={n}", steps)
        for line in migratestep.describe(steps):
            self.progress(f"migrate N={n:,}: {line}")

    def phase_references(self, upto: Optional[int] = None, only: Optional[int] = None,
                         refs: Optional[Sequence[str]] = None) -> None:
        """kube-proxy's layouts at the sizes ``<= upto`` or ``== only``, for the named ``refs`` (default all)."""
        table = [("kube-proxy iptables-legacy", "iptables", "legacy", "iptables-legacy-restore"),
                ("kube-proxy nft", "nft", "legacy", "nft"),
                ("kube-proxy iptables-nft", "iptables", "nft", "iptables-nft-restore")]
        for ref, family, flavour, tool in table:
            if refs is not None and ref not in refs:
                continue
            if shutil.which(tool) is None:
                self.results["errors"].append(f"{ref}: {tool} is not installed")
                continue
            for n in [n for n in self.sizes if (upto is None or n <= upto) and (only is None or n == only)
                      and n <= LARGE]:
                if ref == "kube-proxy iptables-nft" and n > 2000:
                    # Its kernel cost grows quadratically with the chains: past 2k services one apply
                    # alone would take most of the run's budget.
                    self._cell("reference", ref, n)["cold"] = self._skip(
                        "iptables-nft's kernel cost grows quadratically with kube-proxy's chains; not run past "
                        "2,000 services (the founding study in docs/performance.md, not a bench run)")
                    continue
                # kube-proxy's nft layout at 10k is the slow reference: bounded by a longer timeout.
                self.phase_reference(ref, family, flavour, n, 240.0 if n >= 10000 else 120.0)

    def phase_latency(self) -> None:
        for n in self.latency_sizes:
            for combo in self.available():
                if n > 1000 and combo.name != "nftables" and not self.smoke:
                    continue  # at 10k only the backend the target is about (each change re-reads 10k services)
                cell = self._cell("latency", combo.name, n)
                ep = report.seconds(report.control_cell(self.results, combo.name, n, "endpoint"))
                if ep is None or ep > 5:
                    cell.update(self._skip("no partial sync figure under 5 s at this N"))
                    continue
                source = report.seconds(report.control_cell(self.results, combo.name, n, "source")) or 0.0
                cold = report.seconds(report.control_cell(self.results, combo.name, n, "cold")) or 0.0
                # Each change waits 0-1.5 min-sync-periods, then the file source re-reads the changed file.
                need = self.changes * (self.min_sync * 0.75 + 0.3 * source + ep) + 2 * (source + cold) + 20
                if self._out_of_time(need):
                    cell.update(self._skip("out of time budget"))
                    continue
                self.sandbox.reset_netfilter()
                self.progress(f"{combo.name} N={n:,}: event → kernel, {self.changes} changes …")
                res = latency.measure(self.sandbox, combo, n, self.client, self.workdir, changes=self.changes,
                                      min_sync=self.min_sync, start_timeout=min(300.0, self.budget.timeout(300)),
                                      deadline=time.monotonic() + self.budget.timeout(2 * need))
                cell.update(res)
                if "n" in res:
                    self.progress(f"{combo.name} N={n:,}: event → kernel {latency.describe(res)}")
                    if res["failures"]:
                        self.results["errors"].append(f"latency {combo.name} N={n}: {latency.describe(res)}")
                else:
                    self.results["errors"].append(f"latency {combo.name} N={n}: {res}")
                    self.progress(f"{combo.name} N={n:,}: event → kernel {res}")

    def phase_source_change(self) -> None:
        """Issue 40's `run --source` change: the mixed 10k cluster kept in one file, replaced whole at
        each change, on iptables-legacy (the file is read again; only the objects whose bytes changed
        are converted: netproxy/source/itemmemo.py).  Event → kernel, by traffic, as ``phase_latency``."""
        if self.smoke or LARGE not in self.sizes:
            return
        combo = next((c for c in self.available() if c.name == SOURCE_CHANGE_COMBO), None)
        if combo is None:
            return
        key = SOURCE_CHANGE_COMBO + report.MIXED_SUFFIX
        cell = self._cell("latency", key, LARGE)
        need = SOURCE_CHANGES * (self.min_sync * 0.75 + 5.0) + 60
        if self._out_of_time(need):
            cell.update(self._skip("out of time budget"))
            return
        self.sandbox.reset_netfilter()
        self.progress(f"{combo.name} N={LARGE:,} mixed, one file replaced: event → kernel, {SOURCE_CHANGES} changes …")
        res = latency.measure(self.sandbox, combo, LARGE, self.client, self.workdir, changes=SOURCE_CHANGES,
                              min_sync=self.min_sync, start_timeout=min(300.0, self.budget.timeout(300)),
                              deadline=time.monotonic() + self.budget.timeout(2 * need), variant="mixed",
                              one_file=True)
        cell.update(res)
        described = latency.describe(res) if "n" in res else str(res)
        self.progress(f"{combo.name} N={LARGE:,} mixed, one file replaced: event → kernel {described}")
        if "n" not in res or res.get("failures"):
            self.results["errors"].append(f"source change {combo.name} N={LARGE}: {described}")

    def phase_mixed(self) -> None:
        """The features switched on: the mixed cluster (NodePorts, Local policies, affinity, UDP).

        Each backend/writer: cold full sync, one endpoint of a service without and of one with
        ClientIP affinity, the raw tool applying the same payload (the kernel's share) and, on
        iptables, the floor of any write into the loaded table."""
        if self.smoke:
            return
        big = max(n for n in self.sizes if n <= LARGE)
        for n in [n for n in self.sizes if n <= LARGE]:
            combos = self.available()
            if n == big:  # the combinations whose figures are targets first, the reference writers last
                combos.sort(key=lambda c: MIXED_ORDER.index(c.name) if c.name in MIXED_ORDER else len(MIXED_ORDER))
            for combo in combos:
                cell = self._cell("control", combo.name, n, "mixed")
                cold = report.seconds(report.control_cell(self.results, combo.name, n, "cold"))
                if cold is None:
                    cell["cold"] = self._skip("no uniform cold sync figure")
                    continue
                if n == big and n > 1000 and combo.name not in MIXED_AT_LARGEST:
                    cell["cold"] = self._skip(MIXED_AT_LARGEST_WHY.get(combo.name, "not run at the largest N"))
                    continue
                # 2.6x the endpoints; iptables-nft's cold sync of it is the slowest (its target allows 60 s).
                limit = min(400.0, 60 * cold + 60)
                if self._out_of_time(limit / 2):
                    cell["cold"] = self._skip("out of time budget")
                    continue
                self.sandbox.reset_netfilter()
                plan = os.path.join(self.workdir, f"mixed-{combo.slug}-{n}.plan")
                steps: Tuple[str, ...] = ("source", "cold", "endpoint", "endpoint-affinity", "churn", "plan",
                                          "raw-netlink")
                if combo.backend == "iptables":
                    steps = ("source", "cold", "endpoint", "endpoint-affinity", "plan")  # no churn: nftables only
                got = control.run_worker(self.sandbox.node, combo, n, "mixed", control.pods_of(self.sandbox), plan,
                                         self.budget.timeout(limit), os.path.join(self.workdir, "worker.log"),
                                         steps=steps)
                cell.update(got)
                if combo.backend == "iptables":
                    cell["floor"] = self.measure_floor(combo, got, f"{combo.name} mixed N={n:,}")
                self._note_errors(f"{combo.name} mixed N={n}", got)
                self.sandbox.reset_netfilter()
                if "seconds" not in got.get("plan", {}):
                    cell["raw"] = self._skip("no plan payload: the plan step did not finish")
                elif self._out_of_time(limit / 2):
                    cell["raw"] = self._skip("out of time budget")
                else:
                    cell["raw"] = control.raw_own_payload(combo, plan, self.workdir, self.budget.timeout(limit),
                                                          reset=self.sandbox.reset_netfilter, ns=self.sandbox.node)
                    self._note_errors(f"{combo.name} mixed N={n}", {"raw": cell["raw"]})
                    self.sandbox.reset_netfilter()
                if combo.name in RSS_MIXED and n == big and "seconds" in got.get("cold", {}):
                    self.measure_rss_mixed(combo, n, limit)
                self.progress(f"{combo.name} mixed N={n:,}: cold {control.describe(got.get('cold'))}, raw "
                              f"{control.describe(cell.get('raw'))}, endpoint {control.describe(got.get('endpoint'))}, "
                              f"affinity endpoint {control.describe(got.get('endpoint-affinity'))}")

    def measure_rss_mixed(self, combo: Combo, n: int, limit: float) -> None:
        """`netproxy sync` of the mixed cluster: the memory its features cost at the largest N."""
        if self._out_of_time(limit / 2):
            self._cell("rss", combo.name + report.MIXED_SUFFIX, n).update(self._skip("out of time budget"))
            return
        source = os.path.join(self.workdir, f"cluster-mixed-{n}.json")
        gen.write_json(source, gen.cluster(n, "mixed", control.pods_of(self.sandbox)))
        self.sandbox.reset_netfilter()
        res = rss.measure_sync(self.sandbox, combo, source, self.budget.timeout(limit),
                               os.path.join(self.workdir, "rss.log"))
        self.sandbox.reset_netfilter()
        self._cell("rss", combo.name + report.MIXED_SUFFIX, n).update(res)
        self._note_errors(f"{combo.name} mixed N={n} netproxy sync", {"rss": res})
        if "maxrss_mib" in res:
            self.progress(f"{combo.name} mixed N={n:,}: `netproxy sync` peak RSS {res['maxrss_mib']:.0f} MiB")


SOURCE_CHANGE_COMBO = "iptables-legacy/restore"
SOURCE_CHANGES = 8
"""Changes of the one-file source: each makes netproxy read the 10k mixed file (~3-5 s a change)."""
MIXED_AT_LARGEST = ("nftables", "nftables/libnftables", "iptables-legacy/restore", "iptables-legacy/libiptc",
                    "iptables-nft/restore")
MIXED_AT_LARGEST_WHY: Dict[str, str] = {}
MIXED_ORDER = ("nftables", "iptables-legacy/restore", "iptables-nft/restore", "iptables-legacy/libiptc",
               "nftables/libnftables")
"""The mixed phase's order at the largest N: the rows with targets first (nftables,
iptables-legacy, the iptables-nft flavour), the reference writers after, so a tight budget cuts those."""
RSS_MIXED = ("nftables", "nftables/libnftables", "iptables-legacy/restore")
"""Whose `netproxy sync` of the mixed cluster is measured for memory at the largest N."""


def new_workdir() -> str:
    return tempfile.mkdtemp(prefix=f"np-bench-{os.getpid()}-")
