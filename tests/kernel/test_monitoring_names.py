"""Every metric that deploy/monitoring/'s alerts and dashboard read is served by a real ``netproxy run``:
the example cluster programmed in a sandbox's node namespace, its /metrics scraped once a sync and a
conntrack reconciler pass are done and its health endpoints have been asked (as the DaemonSet's probe
asks), and each name an alert expression or a dashboard query selects must be a sample name of that
scrape (a histogram's ``_bucket``/``_count``, a counter's ``_total``: the names as PromQL writes them).
A name that no run serves would leave an alert that can never fire, or an empty panel."""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Set

import pytest
import yaml

from netproxy_lab.checks import wait_for
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import Sandbox
from tests.kernel.test_parity import http_get
from tests.monitoring_queries import ROOT, alert_expressions, dashboard_expressions, metric_names

pytestmark = [pytest.mark.kernel, pytest.mark.quick_combos("nftables", "iptables-legacy/restore")]

METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"
BACKEND_ONLY = {
    # kube-proxy's rule counts exist where there are iptables rules to count (the dashboard's panel says so).
    "kubeproxy_sync_proxy_rules_iptables_total": "iptables",
    "kubeproxy_sync_proxy_rules_iptables_last": "iptables",
}


def _example_cluster() -> List[Dict[str, object]]:
    with open(os.path.join(ROOT, "examples", "cluster.yaml")) as f:
        items: List[Dict[str, object]] = yaml.safe_load(f)["items"]
    return items


def _scrape(sandbox: Sandbox) -> str:
    code, body = http_get(sandbox, sandbox.node, f"http://{METRICS}/metrics")
    assert code == 200, body
    return body


def _served(exposition: str) -> Set[str]:
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", exposition, re.M)}


def _count(exposition: str, name: str) -> float:
    found = re.search(rf'^{name}{{ip_family="IPv4"}} ([0-9.e+]+)$', exposition, re.M)
    return float(found.group(1)) if found else 0.0


def test_every_name_the_alerts_and_the_dashboard_read_is_served(proxy: Proxy, sandbox: Sandbox) -> None:
    # node-a: the example's own node, so that its endpoints are local ones as written.
    proxy.start_run(_example_cluster(), "--metrics-bind-address", METRICS, "--healthz-bind-address", HEALTHZ,
                    "--hostname-override", "node-a")

    def synced_and_reconciled() -> Optional[str]:
        if proxy.running() is False:
            raise AssertionError(f"netproxy run exited:\n{proxy.run_output()[-3000:]}")
        try:
            text = _scrape(sandbox)
        except AssertionError as err:  # not listening yet
            return str(err)
        if _count(text, "kubeproxy_sync_proxy_rules_duration_seconds_count") < 1:
            return "no sync yet"
        # The example's UDP DNS service gives the reconciler something to check after the first sync.
        if _count(text, "kubeproxy_conntrack_reconciler_sync_duration_seconds_count") < 1:
            return "no conntrack reconciler pass yet"
        return None

    try:
        wait_for(synced_and_reconciled, timeout=30)
    except AssertionError as err:
        raise AssertionError(f"{err}\n--- netproxy run log ---\n{proxy.run_output()[-3000:]}") from None
    for path in ("/healthz", "/livez"):
        code, body = http_get(sandbox, sandbox.node, f"http://{HEALTHZ}{path}")
        assert code == 200, f"{path}: {code} {body}"
    served = _served(_scrape(sandbox))

    wanted: Dict[str, List[str]] = {}
    for where, expr in {**{f"alert {a}": e for a, e in alert_expressions().items()},
                        **dashboard_expressions()}.items():
        for name in metric_names(expr):
            wanted.setdefault(name, []).append(where)
    assert len(wanted) >= 20, sorted(wanted)  # the extraction found the queries' names, not nothing
    missing = {name: where for name, where in wanted.items()
               if name not in served and BACKEND_ONLY.get(name, proxy.combo.backend) == proxy.combo.backend}
    assert not missing, "read by deploy/monitoring/ but not served by netproxy run " \
                        f"({proxy.combo.name}):\n" + "\n".join(f"  {n}: {w}" for n, w in sorted(missing.items()))
    for name, backend in BACKEND_ONLY.items():
        assert name in wanted, f"{name} is no longer used: drop it from BACKEND_ONLY"
        if backend == proxy.combo.backend:
            assert name in served, name
