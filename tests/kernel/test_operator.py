"""What an operator replacing kube-proxy relies on, from a running ``netproxy run`` on every
combination: kube-proxy's metric names, moving with real syncs, and its /healthz."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import time
from typing import Optional, Tuple

from netproxy_lab.checks import wait_for
from netproxy_lab.manifests import endpoint_slice, port, service, write_manifests
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import NODE_NAME, Sandbox
from tests.kernel.test_parity import http_get

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


V4 = '{ip_family="IPv4"}'
"""kube-proxy labels its per-sync metrics by IP family; these tests' services are IPv4."""


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
        return None if (_value(text, "kubeproxy_sync_proxy_rules_duration_seconds_count", V4) or 0) >= 1 \
            else "no sync"

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
        syncs = _value(now, "kubeproxy_sync_proxy_rules_duration_seconds_count", V4) or 0
        changes = _value(now, "kubeproxy_sync_proxy_rules_endpoint_changes_total") or 0
        if syncs > (_value(first, "kubeproxy_sync_proxy_rules_duration_seconds_count", V4) or 0) and \
                changes > (_value(first, "kubeproxy_sync_proxy_rules_endpoint_changes_total") or 0):
            return None
        return f"syncs {syncs}, endpoint changes {changes}"

    wait_for(moved, timeout=10)
    later = _scrape(sandbox)
    assert _value(later, "kubeproxy_sync_proxy_rules_service_changes_total") > \
        _value(first, "kubeproxy_sync_proxy_rules_service_changes_total")  # type: ignore[operator]
    assert _value(later, "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                  '{ip_family="IPv4",traffic_policy="internal"}') == 1
    assert _value(later, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", V4) >= \
        _value(first, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", V4)  # type: ignore[operator]
    assert (_value(later, "kubeproxy_proxy_healthz_total", '{code="200"}') or 0) >= 1
    assert proxy.stop_runs() == [0], proxy.run_output()[-3000:]


API_IP = "10.96.0.20"


def _diff(proxy: Proxy, objects: list) -> Tuple[int, str]:  # type: ignore[type-arg]
    write_manifests(proxy.source, objects)
    proc = proxy.command("plan", "--diff", "--source", proxy.source, *proxy.base_flags)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, proc.stdout


def test_plan_diff_names_what_a_sync_would_change_and_writes_nothing(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = sandbox.pods
    cluster = web(pods[:2]) + [service("api", API_IP, [port(80, 9090, name="http")]),
                               endpoint_slice("api", pods[:1], [port(9090, name="http")]),
                               # Node-wide state too (a ServiceCIDR): listed and compared like the rest.
                               {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                                "metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/16"]}}]
    code, out = _diff(proxy, cluster)
    assert code == 1 and "default/web:http: +" in out and "default/api:http: +" in out, out
    def tables() -> list:  # type: ignore[type-arg]
        # Without save's timestamps and the chains' packet counters: a stray packet is not a write.
        return [re.sub(r"\[\d+:\d+\]$", "", line) for line in proxy.ruleset().splitlines()
                if not line.startswith("#")]

    before = tables()
    assert _diff(proxy, cluster)[0] == 1 and tables() == before, "plan --diff wrote to the kernel"

    proxy.sync(cluster)
    code, out = _diff(proxy, cluster)
    assert (code, out) == (0, "the kernel already holds this plan: a sync would change nothing\n")

    # One endpoint more for web: only web's lines move, and the diff adds its address.
    changed = web(pods[:3]) + cluster[2:]
    code, out = _diff(proxy, changed)
    assert code == 1 and "default/web:http: +" in out and "default/api" not in out, out
    assert pods[2].ip in out
    proxy.sync(changed)
    assert _diff(proxy, changed)[0] == 0


def test_bad_input_to_plan_diff_exits_2(proxy: Proxy) -> None:
    with open(proxy.source, "w") as f:
        f.write("kind: [unclosed\n")
    proc = proxy.command("plan", "--diff", "--source", proxy.source, *proxy.base_flags)
    assert proc.returncode == 2, proc.stderr


def test_status_and_network_programming_from_a_running_proxy(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = sandbox.pods[:2]
    proxy.start_run(web(pods[:1]), "--metrics-bind-address", METRICS, "--healthz-bind-address", HEALTHZ)

    def status_ok() -> Optional[str]:
        if proxy.running() is False:
            raise AssertionError(proxy.run_output()[-3000:])
        proc = proxy.command("status", "-o", "json", combo_flags=False)
        return None if proc.returncode == 0 else proc.stderr[-300:] + proc.stdout[-300:]

    wait_for(status_ok, timeout=20)
    # The run answers: it started (and its tracker took its start time) before this moment, however
    # slowly it came up on a loaded machine. Stamps are measured from here, not from start_run.
    started = time.time()
    doc = json.loads(proxy.command("status", "-o", "json", combo_flags=False).stdout)
    assert (doc["backend"], doc["writer"], doc["service_ports"], doc["health_code"]) == \
        (proxy.combo.backend, proxy.combo.writer, 1, 200)
    assert doc["last_sync"] > time.time() - 60 and doc["last_sync_seconds"] > 0
    table = proxy.command("status", combo_flags=False).stdout
    assert f"backend:          {proxy.combo.backend}" in table and "healthz:          ok (200)" in table

    # A slice change stamped by the EndpointSlice controller 2 s ago reaches the kernel: one
    # network programming observation of at least 2 s.
    if proxy.combo.backend == "iptables":  # rule counts by table, reported by the backend in its SyncResult
        text = _scrape(sandbox)
        nat = '{ip_family="IPv4",table="nat"}'
        assert (_value(text, "kubeproxy_sync_proxy_rules_iptables_total", nat) or 0) > 0, text
        assert _value(text, "kubeproxy_sync_proxy_rules_iptables_last", nat) is not None

    # Stamps from before the proxy started are ignored, as kube-proxy does: this one, 2 s back and
    # cut to whole seconds (up to 3 s back), must still come after ``started``.
    time.sleep(max(0.0, started + 4 - time.time()))
    first = _scrape(sandbox)
    changed = web(pods)
    stamp = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=2)
    changed[1]["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": stamp.strftime("%Y-%m-%dT%H:%M:%SZ")}
    write_manifests(proxy.source, changed)

    def programmed() -> Optional[str]:
        n = _value(_scrape(sandbox), "kubeproxy_network_programming_duration_seconds_count", V4) or 0
        seen = _value(first, "kubeproxy_network_programming_duration_seconds_count", V4) or 0
        return None if n > seen else "none yet"

    wait_for(programmed, timeout=10)
    # What the kernel holds, read back by `status --kernel` (iptables-save / nft list): web's two pods.
    doc = json.loads(proxy.command("status", "--kernel", "-o", "json").stdout)
    assert {"service": "default/web:http", "frontend": f"{WEB_IP}:80/tcp",
            "endpoints": sorted(f"{p.ip}:8080" for p in pods)} in doc["kernel"], doc["kernel"]
    later = _scrape(sandbox)
    added = (_value(later, "kubeproxy_network_programming_duration_seconds_sum", V4) or 0) - \
        (_value(first, "kubeproxy_network_programming_duration_seconds_sum", V4) or 0)
    assert 1.0 <= added < 30, added  # the stamp has whole seconds: 2 s back, less up to 1 s
    assert _value(later, "kubeproxy_network_programming_duration_seconds_bucket", '{ip_family="IPv4",le="0.0"}') == 0

    # The node is being deleted: /healthz drains it (503, nodeEligible false), /livez stays 200.
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME},
            "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}
    write_manifests(proxy.source, changed + [node])

    def draining() -> Optional[str]:
        code, body = http_get(sandbox, sandbox.node, f"http://{HEALTHZ}/healthz")
        return None if code == 503 and json.loads(body)["nodeEligible"] is False else f"{code} {body}"

    wait_for(draining, timeout=10)
    assert http_get(sandbox, sandbox.node, f"http://{HEALTHZ}/livez")[0] == 200
    assert (_value(_scrape(sandbox), "kubeproxy_proxy_healthz_total", '{code="503"}') or 0) >= 1
    assert proxy.stop_runs() == [0], proxy.run_output()[-3000:]


CLIENT4 = "10.244.1.2"


def _traced(proxy: Proxy, to: str) -> Tuple[set, set]:  # type: ignore[type-arg]
    """(DNAT targets' addresses, other verdicts) that `netproxy trace` predicts from the client."""
    proc = proxy.command("trace", "--source", proxy.source, "--to", to, "--from", CLIENT4, *proxy.base_flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    targets, others = set(), set()
    for line in proc.stdout.splitlines()[1:]:
        m = re.search(r"DNAT to \[?([0-9a-f.:]+?)\]?:\d+,", line)
        if m:
            targets.add(m.group(1))
        else:
            others.add(line.split("%", 1)[1].split("via")[0].strip())
    return targets, others


def test_trace_predicts_the_endpoints_real_connections_reach(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = sandbox.pods[:3]
    remote = dataclasses.replace(pods[1], node_name="np-other-node")
    cluster = [service("web", "10.96.0.10", [port(80, 8080)]), endpoint_slice("web", pods[:2], [port(8080)]),
               service("near", "10.96.0.11", [port(80, 8080)], internalTrafficPolicy="Local"),
               endpoint_slice("near", [pods[0], remote, pods[2]], [port(8080)]),
               service("empty", "10.96.0.12", [port(80, 8080)]),
               # PreferSameNode: this node's endpoints only.
               service("same", "10.96.0.13", [port(80, 8080)], trafficDistribution="PreferSameNode"),
               endpoint_slice("same", [pods[0], remote, pods[2]], [port(8080)]),
               # A service CIDR: an address in it that no service owns is dropped.
               {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "kubernetes"},
                "spec": {"cidrs": ["10.96.0.0/16"]}}]
    proxy.sync(cluster)
    by_ip = {p.ip: p.name for p in pods}
    for to, want in (("10.96.0.10:80", {pods[0].name, pods[1].name}), ("10.96.0.11:80", {pods[0].name, pods[2].name}),
                     ("10.96.0.13:80", {pods[0].name, pods[2].name})):
        targets, others = _traced(proxy, to)
        predicted = {by_ip[t] for t in targets}
        assert predicted == want and not others, (to, targets, others)
        address, _, number = to.partition(":")
        reached = sandbox.connect(address, int(number), count=40, source=sandbox.client)
        assert reached.errors == {} and set(reached.counts) == predicted, (to, reached.counts, predicted)
    # --kernel traces what the kernel holds (iptables: iptables-save's spelling; nftables: the rules,
    # sets and maps read back over netlink): the same answer as the rendered rules.
    for to in ("10.96.0.10:80", "10.96.0.11:80", "10.96.0.12:80", "10.96.0.13:80", "10.96.0.99:80"):
        argv = ["trace", "--source", proxy.source, "--to", to, "--from", CLIENT4, *proxy.base_flags]
        rendered, kernel = proxy.command(*argv), proxy.command(*argv, "--kernel")
        assert (kernel.returncode, kernel.stdout) == (0, rendered.stdout), kernel.stderr[-2000:]
    targets, others = _traced(proxy, "10.96.0.12:80")
    assert not targets and others == {"refused (ICMP port unreachable)"}, others
    refused = sandbox.connect("10.96.0.12", 80, count=3, timeout=0.5, source=sandbox.client)
    assert refused.counts == {} and refused.failed == 3, refused.errors
    targets, others = _traced(proxy, "10.96.0.99:80")
    assert not targets and others == {"dropped"}, others
    dropped = sandbox.connect("10.96.0.99", 80, count=2, timeout=0.5, source=sandbox.client)
    assert dropped.counts == {} and dropped.errors == {"timeout": 2}, dropped.errors
