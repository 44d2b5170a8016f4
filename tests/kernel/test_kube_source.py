"""`netproxy run --kubeconfig` against the API stand-in, in the node namespace: traffic follows an
endpoint change made through the API.

The stand-in (lab/netproxy_lab/apiserver.py) runs inside the node namespace on 127.0.0.1, so netproxy
reaches it over the node's loopback and nothing listens in the host namespace.  The change is made with
the official client from inside the node namespace too, as a controller would make it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Sequence

import pytest

from netproxy_lab.apiserver_process import StandInProcess, write_kubeconfig
from netproxy_lab.checks import assert_only_and_all, wait_for
from netproxy_lab.cleanup import stop_netproxy
from netproxy_lab.combos import Combo
from netproxy_lab.manifests import api_object, endpoint_slice, port, service, slice_port
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import NODE_NAME, Pod, Sandbox

pytestmark = pytest.mark.kernel

HERE = os.path.dirname(os.path.abspath(__file__))
UNIT_KUBE = os.path.join(os.path.dirname(HERE), "unit", "kube")


WEB_IP = "10.96.0.10"

UPDATE_SLICE = """
import json, sys
from kubernetes import client
cfg = client.Configuration(); cfg.host = sys.argv[1]
discovery = client.DiscoveryV1Api(client.ApiClient(cfg))
body = json.loads(sys.argv[2])
discovery.replace_namespaced_endpoint_slice(body["metadata"]["name"], "default", body)
print("replaced")
"""


kubeconfig = write_kubeconfig


def web_slice(pods: Sequence[Pod]) -> Dict[str, Any]:
    """``default/web``'s slice as the API holds it."""
    return api_object(endpoint_slice("web", pods, [slice_port(name="http")]))


def change_slice(sandbox: Sandbox, url: str, pods: Sequence[Pod]) -> None:
    """``default/web``'s slice replaced through the API (the official client, in the node namespace)."""
    change = sandbox.exec(sandbox.node, [sys.executable, "-c", UPDATE_SLICE, url, json.dumps(web_slice(pods))],
                          timeout=60)
    assert change.returncode == 0, change.stderr


def stopped(run: Any, log_path: str) -> str:
    """Stop a ``netproxy run``; its log, printed (its tail) for the test's output."""
    stop_netproxy(run, timeout=15)
    with open(log_path, errors="replace") as f:
        log = f.read()
    print(log[-4000:])
    return log


def answered_by(sandbox: Sandbox, pods: Sequence[Pod]) -> Any:
    def check() -> Any:
        res = sandbox.connect(WEB_IP, 80, count=30, timeout=0.5)
        got = sorted(res.counts)
        want = sorted(p.name for p in pods)
        return None if got == want and not res.errors else f"answered by {res.counts}, errors {res.errors}"
    return check


def test_traffic_follows_an_endpoint_change_made_through_the_api(proxy: Proxy, sandbox: Sandbox, combo: Combo,
                                                                 tmp_path: Any) -> None:
    first, second = sandbox.pods[:2], sandbox.pods[2:3]
    svc = api_object(service("web", WEB_IP, [port(80, 8080, name="http")]))
    objects: Dict[str, List[Dict[str, Any]]] = {
        "services": [svc], "endpointslices": [web_slice(first)],
        "nodes": [{"metadata": {"name": NODE_NAME, "labels": {"topology.kubernetes.io/zone": "zone-a"}}}],
    }
    with StandInProcess(objects, prefix=["ip", "netns", "exec", sandbox.node]) as url:
        config = kubeconfig(str(tmp_path / "kubeconfig"), url)
        log_path = str(tmp_path / "run.log")
        run = sandbox.start_netproxy(["run", "--kubeconfig", config, "--hostname-override", NODE_NAME,
                                      "--metrics-bind-address", "", *combo.flags],
                                     flavour=combo.path_flavour, log_path=log_path)
        try:
            wait_for(answered_by(sandbox, first), timeout=60)
            assert_only_and_all(sandbox.connect(WEB_IP, 80, count=200), first, total=200, at_least=40)
            change_slice(sandbox, url, second)
            took = wait_for(answered_by(sandbox, second), timeout=30)
            print(f"\n{combo.name}: traffic moved {took:.2f}s after the API change")
            assert_only_and_all(sandbox.connect(WEB_IP, 80, count=100), second, total=100)
            assert run.poll() is None, "netproxy run exited"
        finally:
            log = stopped(run, log_path)
    assert run.returncode == 0, f"netproxy run exited {run.returncode}:\n{log[-3000:]}"


OTHER_IP = "10.96.0.11"


def test_services_of_another_proxy_and_headless_slices_are_not_programmed(proxy: Proxy, sandbox: Sandbox,
                                                                          combo: Combo, tmp_path: Any) -> None:
    """kube-proxy's informer filter through the API: a Service labelled
    ``service.kubernetes.io/service-proxy-name`` (another proxy's) gets no rules, its address no
    answer; a headless service's slice (``service.kubernetes.io/headless``) is never listed."""
    pods = sandbox.pods[:2]
    theirs = api_object(service("other", OTHER_IP, [port(80, 8080, name="http")]))
    theirs["metadata"]["labels"] = {"service.kubernetes.io/service-proxy-name": "another-proxy"}
    their_slice = api_object(endpoint_slice("other", pods, [slice_port(name="http")]))
    their_slice["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] = "another-proxy"
    headless = api_object(endpoint_slice("db", pods, [slice_port(name="http")]))
    headless["metadata"]["labels"]["service.kubernetes.io/headless"] = ""
    objects: Dict[str, List[Dict[str, Any]]] = {
        "services": [api_object(service("web", WEB_IP, [port(80, 8080, name="http")])), theirs],
        "endpointslices": [web_slice(pods), their_slice, headless],
        "nodes": [{"metadata": {"name": NODE_NAME}}],
    }
    with StandInProcess(objects, prefix=["ip", "netns", "exec", sandbox.node]) as url:
        config = kubeconfig(str(tmp_path / "kubeconfig"), url)
        run = sandbox.start_netproxy(["run", "--kubeconfig", config, "--hostname-override", NODE_NAME,
                                      "--metrics-bind-address", "", *combo.flags],
                                     flavour=combo.path_flavour, log_path=str(tmp_path / "run.log"))
        try:
            wait_for(answered_by(sandbox, pods), timeout=60)
            held = json.loads(proxy.command("status", "--kernel", "-o", "json").stdout)["kernel"]
            assert [h["service"] for h in held] == ["default/web:http"], held
            other = sandbox.connect(OTHER_IP, 80, count=3, timeout=0.5)
            assert other.answered == 0, f"another proxy's service answered through netproxy's rules: {other}"
        finally:
            stop_netproxy(run, timeout=15)
    assert run.returncode == 0


def test_one_shot_commands_read_the_cluster_from_the_api(proxy: Proxy, sandbox: Sandbox, combo: Combo,
                                                         tmp_path: Any) -> None:
    """``sync``, ``plan --diff``, ``trace`` and ``migrate`` take ``--kubeconfig`` as ``run`` does: one
    list with kube-proxy's informer filter; another proxy's service gets no rules either way."""
    pods = sandbox.pods[:2]
    theirs = api_object(service("other", OTHER_IP, [port(80, 8080, name="http")]))
    theirs["metadata"]["labels"] = {"service.kubernetes.io/service-proxy-name": "another-proxy"}
    objects: Dict[str, List[Dict[str, Any]]] = {
        "services": [api_object(service("web", WEB_IP, [port(80, 8080, name="http")])), theirs],
        "endpointslices": [web_slice(pods)],
    }
    with StandInProcess(objects, prefix=["ip", "netns", "exec", sandbox.node]) as url:
        source = ["--kubeconfig", kubeconfig(str(tmp_path / "kubeconfig"), url), *proxy.base_flags]
        synced = proxy.command("sync", *source)
        assert synced.returncode == 0, synced.stderr
        assert_only_and_all(sandbox.connect(WEB_IP, 80, count=60), pods, total=60)
        assert sandbox.connect(OTHER_IP, 80, count=2, timeout=0.5).answered == 0
        diff = proxy.command("plan", "--diff", *source)
        assert diff.returncode == 0, diff.stdout + diff.stderr
        traced_ = proxy.command("trace", "--to", f"{WEB_IP}:80", *source)
        assert traced_.returncode == 0 and all(p.ip in traced_.stdout for p in pods), traced_.stdout
        other = "iptables" if combo.backend == "nftables" else "nftables"
        flags = [f for i, f in enumerate(combo.flags)  # migrate's --to is the backend
                 if f != "--backend" and (i == 0 or combo.flags[i - 1] != "--backend")]
        moved = proxy.command("migrate", "--to", other, *source, *flags, combo_flags=False)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert_only_and_all(sandbox.connect(WEB_IP, 80, count=60), pods, total=60)
        # Back to the combination's own dataplane, so that the sandbox's cleanup finds what it expects.
        back = proxy.command("migrate", "--to", combo.backend, *source, *flags, combo_flags=False)
        assert back.returncode == 0, back.stdout + back.stderr
        assert_only_and_all(sandbox.connect(WEB_IP, 80, count=60), pods, total=60)


def test_run_programs_at_once_and_its_health_check_tells_the_truth_through_the_api(
        proxy: Proxy, sandbox: Sandbox, combo: Combo, tmp_path: Any) -> None:
    """Through the API: the first sync runs as soon as the lists are in, not at the next
    --min-sync-period tick (20 s here); the health-check node port of an externalTrafficPolicy Local
    service answers 200 with the local count, 503 while the proxy's writes are refused and a change
    made through the API waits, and 200 again after."""
    from netproxy_lab.refuse import WritesRefused
    from tests.kernel.test_parity import http_get_headers

    here = [p for p in sandbox.pods if p.node_name == NODE_NAME][:2]
    hc_port, node_port = 30999, 30080
    svc = api_object(service("web", WEB_IP, [port(80, 8080, name="http", node_port=node_port)], type="LoadBalancer",
                             externalTrafficPolicy="Local", healthCheckNodePort=hc_port))
    objects: Dict[str, List[Dict[str, Any]]] = {"services": [svc], "endpointslices": [web_slice(here)]}
    refused = WritesRefused(sandbox, combo, str(tmp_path))
    node_ip = sandbox.node_ips[0]
    url = f"http://{node_ip}:{hc_port}/"

    def health(code: int, count: int, healthy: bool) -> Any:
        def check() -> Any:
            got, body, headers = http_get_headers(sandbox, sandbox.ext, url)
            doc = json.loads(body) if body.startswith("{") else body
            weight = headers.get("x-load-balancing-endpoint-weight")
            ok = got == code and isinstance(doc, dict) and doc.get("localEndpoints") == count \
                and doc.get("serviceProxyHealthy") is healthy and weight == str(count)
            return None if ok else f"HTTP {got} {doc} weight {weight}"
        return check

    with StandInProcess(objects, prefix=["ip", "netns", "exec", sandbox.node]) as api_url:
        config = kubeconfig(str(tmp_path / "kubeconfig"), api_url)
        log_path = str(tmp_path / "run.log")

        def start(*timing: str) -> Any:
            return sandbox.start_netproxy(["run", "--kubeconfig", config, "--hostname-override", NODE_NAME,
                                           "--metrics-bind-address", "", "--healthz-bind-address", "0.0.0.0:10256",
                                           "--iptables-lock-timeout", "60s", *timing, *combo.flags],
                                          flavour=combo.path_flavour, log_path=log_path, env=refused.env)

        run = start("--min-sync-period", "20s", "--sync-period", "30s")
        try:
            took = wait_for(answered_by(sandbox, here), timeout=15)
            assert took < 10, f"the first sync waited {took:.1f} s (a --min-sync-period tick is 20 s)"
        finally:
            stop_netproxy(run, timeout=15)
        run = start("--min-sync-period", "200ms", "--sync-period", "2s")  # healthz: 503 after 4 s waiting
        try:
            wait_for(health(200, 2, True), timeout=20)
            with refused:
                change_slice(sandbox, api_url, here[:1])
                wait_for(health(503, 2, False), timeout=15)
            wait_for(health(200, 1, True), timeout=20)
            assert run.poll() is None, "netproxy run exited"
        finally:
            log = stopped(run, log_path)
    assert run.returncode == 0, f"netproxy run exited {run.returncode}:\n{log[-3000:]}"
