"""Control-plane measures: netproxy's sync steps, the raw apply of its own payload, kube-proxy's layout.

Each function runs inside namespaces it is handed or creates, bounded by a timeout; a step that does
not finish in time is reported as ``{"timeout": seconds}``, a failing one as ``{"error": "..."}``,
never silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench import gen, sample
from netproxy_lab import kubeproxy_layout, netns
from netproxy_lab.combos import Combo

Step = Dict[str, Any]
WORKER_STEPS = ("source", "cold", "resync", "endpoint", "add", "remove", "churn", "plan", "raw-netlink")


def _python() -> str:
    return sys.executable


def _bench_env() -> Dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_worker(ns: str, combo: Combo, n: int, variant: str, pods: Sequence[Tuple[str, int]], plan_path: str,
               timeout: float, log_path: str, steps: Sequence[str] = WORKER_STEPS) -> Dict[str, Step]:
    """``bench.worker`` inside ``ns``; every step's JSON, and ``timeout``/``error`` for the missing ones."""
    args = [_python(), "-m", "bench.worker", "--backend", combo.backend, "--writer", combo.writer,
            "--flavour", combo.flavour, "--n", str(n), "--variant", variant, "--plan-out", plan_path,
            "--pods", ",".join(f"{ip}:{port}" for ip, port in pods), "--steps", ",".join(steps)]
    out: Dict[str, Step] = {}
    with open(log_path, "ab") as log:
        proc = netns.spawn(ns, args, stdout=subprocess.PIPE, stderr=log, env=_bench_env())
        lines: List[str] = []
        stdout = proc.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(ln.decode() for ln in stdout), daemon=True)
        reader.start()
        t0 = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        timed_out = proc.poll() is None
        netns.stop(proc)
        reader.join(2)
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        out[rec.pop("step")] = rec
    failed = next((s for s in steps if "error" in out.get(s, {})), None)
    for step in steps:
        if step not in out:
            if timed_out:
                out[step] = {"timeout": round(time.monotonic() - t0, 1)}
            elif failed is not None:
                out[step] = {"skipped": f"{failed} failed"}
            else:
                out[step] = {"error": f"worker exited {proc.returncode} before this step (see {log_path})"}
    return out


def raw_apply(spec: Sequence[Dict[str, Any]], ns: str, timeout: float) -> Step:
    """Time ``spec`` (bench.rawapply commands) inside ``ns``."""
    try:
        proc = netns.run_in_timeout(ns, [_python(), "-m", "bench.rawapply", json.dumps(list(spec))],
                                    timeout=timeout, env=_bench_env())
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    try:
        result: Dict[str, Any] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"rawapply: {proc.stderr.decode(errors='replace')[-500:]}"}
    if result["rc"] != 0:
        return {"error": f"{spec[-1]['argv'][0]} exited {result['rc']}: {result['stderr'].strip()[-600:]}"}
    return {"seconds": result["seconds"]}


def split_plan(combo: Combo, text: str, workdir: str) -> List[Dict[str, Any]]:
    """netproxy's ``plan()`` text → the raw tool commands that apply it to an empty namespace."""
    if combo.backend == "nftables":
        path = os.path.join(workdir, "plan.nft")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return [{"argv": ["nft", "-f", path]}]
    sections: Dict[int, List[str]] = {4: [], 6: []}
    family = 4
    for line in text.splitlines():
        if line.startswith("# IPv6"):
            family = 6
        elif line.startswith("# IPv4"):
            family = 4
        sections[family].append(line)
    spec: List[Dict[str, Any]] = []
    sets = sorted(set(re.findall(r"NETPROXY-[A-Z-]+?-[46](?:-\d+)?\b", text)))
    if sets:  # the payload's rules name netproxy's ipsets: they must exist (not timed: not the tool's work)
        spec.append({"argv": [_python(), "-m", "netproxy.backends.iptables.ipset", "create", *sets],
                     "untimed": True})
    for family, lines in sections.items():
        if not any(ln.startswith("*") for ln in lines):
            continue
        path = os.path.join(workdir, f"plan.v{family}")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        tool = f"{'iptables' if family == 4 else 'ip6tables'}-{combo.flavour}-restore"
        spec.append({"argv": [tool, "--noflush"], "stdin": path})
    return spec


FLOOR_CHAIN = "NP-BENCH-FLOOR"


def floor(combo: Combo, ns: str, workdir: str, timeout: float, budget: float = 6.0) -> Step:
    """The least any write costs on the table as it is now (the iptables targets' floor): the raw
    ``iptables-<flavour>-restore --noflush`` of a one-rule change into the nat table netproxy left
    loaded, timed inside ``ns`` (``rawapply``); min of up to 3 within ``budget`` seconds.

    The change declares one chain holding one ``-j RETURN`` rule: the first write creates it, the
    next ones flush and refill it (``--noflush`` flushes a declared chain), so every run is the same
    one-rule change.  The chain is deleted afterwards (untimed): the table is left as netproxy wrote
    it for the measures that follow (data plane, ``netproxy sync`` restart).  A legacy write swaps
    the whole table, so this is the table's own price; nftables has no such floor."""
    if combo.backend != "iptables":
        return {"skipped": "iptables only"}
    tool = f"iptables-{combo.flavour}-restore"
    change = _write(os.path.join(workdir, "floor.rules"),
                    f"*nat\n:{FLOOR_CHAIN} - [0:0]\n-A {FLOOR_CHAIN} -j RETURN\nCOMMIT\n")
    undo = _write(os.path.join(workdir, "floor-undo.rules"),
                  f"*nat\n:{FLOOR_CHAIN} - [0:0]\n-X {FLOOR_CHAIN}\nCOMMIT\n")
    deadline = time.monotonic() + timeout
    runs: List[float] = []
    out: Step = {}
    while len(runs) < 3 and sum(runs) + (runs[-1] if runs else 0) <= budget:
        res = raw_apply([{"argv": [tool, "--noflush"], "stdin": change}], ns, max(1.0, deadline - time.monotonic()))
        if "seconds" not in res:
            out = res
            break
        runs.append(res["seconds"])
    if runs:
        out = {"seconds": min(runs), "runs": runs, "tool": tool}
        left = raw_apply([{"argv": [tool, "--noflush"], "stdin": undo}], ns, max(5.0, deadline - time.monotonic()))
        if "seconds" not in left:
            out["undo"] = left  # the chain stays: harmless to the measures that follow, but said
    return out


def raw_own_payload(combo: Combo, plan_path: str, workdir: str, timeout: float, *, ns: str,
                    reset: Callable[[], None]) -> Step:
    """netproxy's own full payload applied with the raw tool into ``ns``, each run after ``reset()``;
    sampled as netproxy's cold sync is (``bench.sample``)."""
    try:
        with open(plan_path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return {"error": "no plan payload (the plan step did not run)"}
    spec = split_plan(combo, text, workdir)
    deadline = time.monotonic() + timeout

    def once(_: int) -> Step:
        reset()
        return raw_apply(spec, ns, max(1.0, deadline - time.monotonic()))

    res = sample.repeat(once, sample.FULL_RUNS)
    return {**res, "bytes": len(text)} if "seconds" in res else res


# -- kube-proxy's layout -----------------------------------------------------------------------------

def _moved(svcs: Sequence[kubeproxy_layout.Svc]) -> Tuple[int, kubeproxy_layout.Svc, kubeproxy_layout.Svc]:
    """(index, before, after) of the service whose first endpoint the "endpoint" step moves."""
    mid = len(svcs) // 2 if len(svcs) > 1 else 0
    if len(svcs) > 1 and mid == len(svcs) - 1:
        mid = 0
    old = svcs[mid]
    moved = (str(gen.REPLACED_NET + 1 + mid % 4096), old.endpoints[0][1])
    new = kubeproxy_layout.Svc(old.namespace, old.name, old.port_name, old.protocol, old.ip, old.port, old.affinity,
                               (moved,) + old.endpoints[1:])
    return mid, old, new


def _write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def kubeproxy_files(objects: Sequence[gen.Obj], family: str, workdir: str, flavour: str = "legacy"
                    ) -> Tuple[List[Dict[str, Any]], List[List[Dict[str, Any]]]]:
    """(full apply spec, [change there, change back]) for kube-proxy's ``family`` ("iptables"/"nft") layout;
    ``flavour`` picks iptables-legacy or iptables-nft for the iptables layout."""
    svcs = kubeproxy_layout.services(objects)
    mid, old, new = _moved(svcs)
    after = list(svcs)
    after[mid] = new
    base = os.path.join(workdir, f"kube-proxy.{family}-{flavour}")
    if family == "iptables":
        full = _write(base, kubeproxy_layout.iptables_full(svcs))
        there = _write(base + ".there", kubeproxy_layout.iptables_change(after, old, new))
        back = _write(base + ".back", kubeproxy_layout.iptables_change(svcs, new, old))
        # kube-proxy reads the table (iptables-save) and writes the change (restore --noflush).
        restore, save = f"iptables-{flavour}-restore", f"iptables-{flavour}-save"
        return ([{"argv": [restore], "stdin": full}],
                [[{"argv": [save, "-t", "nat"]}, {"argv": [restore, "--noflush"], "stdin": path}]
                 for path in (there, back)])
    full = _write(base, kubeproxy_layout.nft_full(svcs))
    there = _write(base + ".there", kubeproxy_layout.nft_change(old, new))
    back = _write(base + ".back", kubeproxy_layout.nft_change(new, old))
    return [{"argv": ["nft", "-f", full]}], [[{"argv": ["nft", "-f", path]}] for path in (there, back)]


def kubeproxy_reference(ns: str, objects: Sequence[gen.Obj], family: str, workdir: str, timeout: float,
                        flavour: str = "legacy", *, reset: Callable[[], None], full_only: bool = False
                        ) -> Dict[str, Step]:
    """kube-proxy's layout applied into ``ns`` (full, each run after ``reset()``), then one endpoint
    moved there and back (change); both sampled as netproxy's cold sync and endpoint change are
    (``bench.sample``: as many runs, the median).  ``full_only``: one full apply, no figure wanted
    (the data plane's one-service baseline)."""
    full_spec, changes = kubeproxy_files(objects, family, workdir, flavour)
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    if full_only:
        reset()
        return {"cold": raw_apply(full_spec, ns, timeout)}

    def full(_: int) -> Step:
        reset()
        return raw_apply(full_spec, ns, left())

    out: Dict[str, Step] = {"cold": sample.repeat(full, sample.FULL_RUNS)}
    if "seconds" not in out["cold"]:
        out["endpoint"] = {"error": "the full apply did not complete"}
        return out
    endpoint = sample.repeat(lambda k: raw_apply(changes[k % 2], ns, left()), sample.CHANGE_RUNS)
    if "seconds" in endpoint and len(endpoint["runs"]) % 2:
        # Back again, untimed: the table ends as the full apply wrote it, for the data plane after.
        raw_apply(changes[1], ns, left())
    out["endpoint"] = endpoint
    return out


def pods_of(sandbox: Any) -> List[Tuple[str, int]]:
    return [(p.ip, 8080) for p in sandbox.pods]


def last_service(n: int) -> Tuple[str, int]:
    return gen.cluster_ip(n - 1), gen.PORT


def describe(step: Optional[Step]) -> str:
    if not step:
        return "-"
    if "seconds" in step:
        return f"{step['seconds']:.3f}s"
    if "timeout" in step:
        return f"timeout after {step['timeout']}s"
    return f"error: {str(step.get('error'))[:120]}"
