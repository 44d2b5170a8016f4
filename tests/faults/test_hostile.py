"""Hostile and broken input through real netproxy, in the namespace harness (fault 4).

The generated cases run in-process by the thousand (tests/unit/test_hostile_input.py); here a seeded
batch of them, with duplicate keys, an alias bomb and a 50 MB document, goes through `netproxy sync`
(file source) and `netproxy run --kubeconfig` (API source) on every backend/writer: exit 2 naming
every hostile object and field, nothing of them in the kernel, the valid service beside them
reached by real traffic.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Sequence

import pytest

from netproxy_lab.apiserver_process import StandInProcess
from netproxy_lab.checks import assert_only_and_all, wait_for
from netproxy_lab.cleanup import stop_netproxy
from netproxy_lab.combos import Combo
from netproxy_lab.manifests import endpoint_slice, port, service
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import NODE_NAME, Sandbox
from tests.faults.figures import figure
from tests.kernel.test_kube_source import kubeconfig as _kubeconfig
from tests.unit.hostile_cases import MARK, Case, batch

# The quick tier runs this fault on the two default node kinds (nftables, iptables-legacy); the
# full tier on every combination (lab/netproxy_lab/tier.py).
pytestmark = [pytest.mark.kernel, pytest.mark.quick_combos("nftables", "iptables-legacy/restore")]

HERE = os.path.dirname(os.path.abspath(__file__))


GOOD_IP = "10.96.0.10"
BATCH = 80

RAW_DOCUMENTS = [
    # (YAML text, what the rejection must name)
    ("kind: Service\nmetadata: {name: dup}\nspec:\n  clusterIP: 10.96.2.1\n  clusterIP: 10.96.2.2\n"
     "  ports: [{port: 80}]\n", "Service default/dup: field spec.clusterIP"),
    ("kind: Service\nmetadata:\n  name: bomb\n  annotations:\n"
     + "\n".join(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else 'lol'] * 9)}]" for i in range(9))
     + "\nspec: {clusterIP: 10.96.2.3, ports: [{port: 80}]}\n", "Service default/bomb: field metadata.annotations.l8"),
    ("- just\n- a list\n", f"document {2 + BATCH + 3} of"),
    (f"kind: Service\nmetadata: {{name: huge-{'a' * (50 << 20)}{MARK}}}\nspec: {{clusterIP: 10.96.2.4}}\n",
     f"({len('huge-') + (50 << 20) + len(MARK)} characters): field metadata.name"),
]


def good(sandbox: Sandbox) -> List[Dict[str, Any]]:
    return [service("good", GOOD_IP, [port(80, 8080, name="http")]),
            endpoint_slice("good", sandbox.pods[:2], [port(8080, name="http")])]


def victim_ips(cases: Sequence[Case]) -> List[str]:
    """Addresses that only a hostile object carries: none may be in the kernel."""
    out = []
    for c in cases:
        if c.kind == "Service":
            out.append(c.obj["spec"].get("clusterIP"))
        else:
            out += [a for e in c.obj.get("endpoints") or [] if isinstance(e, dict)
                    for a in e.get("addresses") or [] if isinstance(a, str)]
    return [ip for ip in out if isinstance(ip, str) and re.fullmatch(r"[0-9.]+", ip)]


def assert_clean(ruleset: str, cases: Sequence[Case]) -> None:
    assert MARK not in ruleset, f"hostile text in the kernel: ...{ruleset[max(0, ruleset.find(MARK) - 200):][:300]}"
    leaked = [ip for ip in victim_ips(cases) if re.search(rf"(?<![0-9.]){re.escape(ip)}(?![0-9])", ruleset)]
    assert not leaked, f"addresses of rejected objects in the kernel: {leaked}"
    for ip in ("10.96.2.1", "10.96.2.2", "10.96.2.3", "10.96.2.4"):
        assert ip not in ruleset


def test_hostile_manifests_through_netproxy_sync(proxy: Proxy, sandbox: Sandbox, combo: Combo) -> None:
    cases = batch(BATCH, seed=16)
    path = os.path.join(proxy.workdir, "hostile.yaml")
    with open(path, "w") as f:
        docs = [json.dumps(o) for o in good(sandbox)] + [json.dumps(c.obj) for c in cases]
        docs += [text for text, _ in RAW_DOCUMENTS]
        f.write("\n---\n".join(docs))
    t0 = time.monotonic()
    proc = proxy.command("sync", "--source", path, *proxy.base_flags)
    took = time.monotonic() - t0
    lines = proc.stderr.splitlines()
    rejected = [ln for ln in lines if ln.startswith("netproxy: rejected ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert len(rejected) == len(cases) + len(RAW_DOCUMENTS), "\n".join(rejected)
    for case in cases:
        named = f"/{case.obj['metadata']['name']}: field "
        assert any(ln.startswith(f"netproxy: rejected {case.kind} ") and named in ln for ln in rejected), named
    for _, named in RAW_DOCUMENTS:
        assert any(named in ln for ln in rejected), f"{named!r} not among:\n" + "\n".join(rejected[-10:])
    assert all(len(ln) < 700 for ln in lines), "an unbounded message"
    assert_clean(proxy.ruleset(), cases)
    assert_only_and_all(sandbox.connect(GOOD_IP, 80, count=100), sandbox.pods[:2], total=100, at_least=20)
    figure(f"hostile manifests via netproxy sync, {combo.name}",
           f"{len(cases) + len(RAW_DOCUMENTS)} hostile objects (incl. a 50 MB one) in {took:.1f} s: exit 2, "
           "0 tracebacks, 0 in the kernel, the valid service reached", "0 tracebacks, 0 injections")


def _api_object(obj: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(obj)
    out.pop("apiVersion", None)
    out.pop("kind", None)
    return out




METRICS = "127.0.0.1:10349"
SCRAPE = ("import sys, urllib.request; "
          "sys.stdout.write(urllib.request.urlopen('http://" + METRICS + "/metrics', timeout=5).read().decode())")


def scrape(sandbox: Sandbox) -> Dict[str, float]:
    out = sandbox.exec(sandbox.node, [sys.executable, "-c", SCRAPE], timeout=30)
    if out.returncode != 0:
        return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", out.stdout, re.M)}


def test_hostile_api_objects_are_logged_counted_and_the_rest_applied(proxy: Proxy, sandbox: Sandbox, combo: Combo,
                                                                     tmp_path: Any) -> None:
    # The real API server validates metadata itself, and the stand-in keys objects by it: the hostile
    # fields here are the ones past metadata, which an aggregated or buggy server could still send.
    cases = [c for c in batch(BATCH, seed=61) if not c.path.startswith("metadata.")]
    objects = {"services": [_api_object(o) for o in good(sandbox)[:1]] +
               [_api_object(c.obj) for c in cases if c.kind == "Service"],
               "endpointslices": [_api_object(good(sandbox)[1])] +
               [_api_object(c.obj) for c in cases if c.kind == "EndpointSlice"],
               "nodes": [{"metadata": {"name": NODE_NAME}}]}
    with StandInProcess(objects, prefix=["ip", "netns", "exec", sandbox.node]) as url:
        log_path = str(tmp_path / "run.log")
        run = sandbox.start_netproxy(["run", "--kubeconfig", _kubeconfig(str(tmp_path / "kc"), url),
                                      "--hostname-override", NODE_NAME, "--metrics-bind-address", METRICS,
                                      "--healthz-bind-address", "", *combo.flags],
                                     flavour=combo.path_flavour, log_path=log_path)
        try:
            def answered() -> Any:
                res = sandbox.connect(GOOD_IP, 80, count=20, timeout=0.5)
                return None if sorted(res.counts) == sorted(p.name for p in sandbox.pods[:2]) else res.counts
            wait_for(answered, timeout=60)
            metrics = scrape(sandbox)
            assert metrics.get("netproxy_rejected_objects_total") == len(cases), {
                k: v for k, v in metrics.items() if "reject" in k}
            assert_clean(proxy.ruleset(), cases)
            assert run.poll() is None, "netproxy run exited"
        finally:
            stop_netproxy(run, timeout=15)
            with open(log_path, errors="replace") as f:
                log = f.read()
    logged = [ln for ln in log.splitlines() if "rejected " in ln]
    assert len(logged) == len(cases), "\n".join(logged[:5])
    assert "Traceback" not in log, log[-3000:]
    figure(f"hostile API objects via netproxy run, {combo.name}",
           f"{len(cases)} rejected: logged {len(logged)}, counted {len(cases)}, 0 in the kernel, valid rest applied",
           "logged, counted, the rest applied")
