"""What an operator replacing kube-proxy relies on, from a running ``netproxy run`` on every
combination: kube-proxy's metric names, moving with real syncs, and its /healthz."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional

from harness import Proxy, endpoint_slice, port, service, wait_for, write_manifests
from test_parity import http_get

from netproxy.sandbox import Sandbox

WEB_IP = "10.96.0.10"
METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"
KUBE_PROXY_NAMES = (
    "kubeproxy_sync_proxy_rules_duration_seconds_bucket", "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
    "kubeproxy_sync_partial_proxy_rules_duration_seconds_count", "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", "kubeproxy_network_programming_duration_seconds_count",
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending", "kubeproxy_sync_proxy_rules_endpoint_changes_total",
    "kubeproxy_sync_proxy_rules_service_changes_pending", "kubeproxy_sync_proxy_rules_service_changes_total",
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
    "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total",
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total", "kubeproxy_proxy_healthz_total",
)


def web(pods, **spec):  # type: ignore[no-untyped-def]
    return [service("web", WEB_IP, [port(80, 8080, name="http")], **spec),
            endpoint_slice("web", pods, [port(8080, name="http")])]


def _scrape(sb: Sandbox) -> str:
    code, body = http_get(sb, sb.node, f"http://{METRICS}/metrics")
    assert code == 200, body
    return body


def _value(text: str, name: str, labels: str = "") -> Optional[float]:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_run_serves_kube_proxys_metrics_and_healthz(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = sandbox.pods[:2]
    proxy.start_run(web(pods[:1]), "--metrics-bind-address", METRICS, "--healthz-bind-address", HEALTHZ)

    def synced_once() -> Optional[str]:
        if proxy.running() is False:
            raise AssertionError(proxy.run_output()[-3000:])
        try:
            text = _scrape(sandbox)
        except Exception as err:  # noqa: BLE001 - not listening yet
            return str(err)
        return None if (_value(text, "kubeproxy_sync_proxy_rules_duration_seconds_count") or 0) >= 1 else "no sync"

    wait_for(synced_once, timeout=20)
    code, body = http_get(sandbox, sandbox.node, f"http://{HEALTHZ}/healthz")
    assert code == 200 and json.loads(body)["lastUpdated"], body
    assert http_get(sandbox, sandbox.node, f"http://{HEALTHZ}/livez")[0] == 200
    first = _scrape(sandbox)
    missing = [n for n in KUBE_PROXY_NAMES + ("kubeproxy_proxy_livez_total",)
               if not re.search(rf"^{n}(\{{| )", first, re.M)]
    assert not missing, f"not served: {missing}"
    assert f'netproxy_backend_info{{backend="{proxy.combo.backend}"' in first

    elsewhere = [dataclasses.replace(p, node_name="np-other-node") for p in pods]
    write_manifests(proxy.source, web(elsewhere, internalTrafficPolicy="Local"))  # none on this node

    def moved() -> Optional[str]:
        now = _scrape(sandbox)
        syncs = _value(now, "kubeproxy_sync_proxy_rules_duration_seconds_count") or 0
        changes = _value(now, "kubeproxy_sync_proxy_rules_endpoint_changes_total") or 0
        if syncs > (_value(first, "kubeproxy_sync_proxy_rules_duration_seconds_count") or 0) and \
                changes > (_value(first, "kubeproxy_sync_proxy_rules_endpoint_changes_total") or 0):
            return None
        return f"syncs {syncs}, endpoint changes {changes}"

    wait_for(moved, timeout=10)
    later = _scrape(sandbox)
    assert _value(later, "kubeproxy_sync_proxy_rules_service_changes_total") > \
        _value(first, "kubeproxy_sync_proxy_rules_service_changes_total")  # type: ignore[operator]
    assert _value(later, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", '{traffic_policy="internal"}') == 1
    assert _value(later, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") >= \
        _value(first, "kubeproxy_sync_proxy_rules_last_timestamp_seconds")  # type: ignore[operator]
    assert (_value(later, "kubeproxy_proxy_healthz_total", '{code="200"}') or 0) >= 1
    assert proxy.stop_runs() == [0], proxy.run_output()[-3000:]
