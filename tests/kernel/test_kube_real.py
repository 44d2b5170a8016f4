"""netproxy against a real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager built by
``make control-plane``) in the node namespace, by traffic, on nftables and iptables-legacy.

What the API stand-in cannot tell: whether the real server's RBAC lets deploy/'s ServiceAccount read
what netproxy reads, whether the real server accepts deploy/'s manifests, what the real EndpointSlice
controller writes while pods become ready, unready and terminate, and how a watch ends when the server
restarts and etcd has compacted the watch's resourceVersion.  Pods are the sandbox's namespaces; the
tests play their kubelet (bind them, report their address and readiness, delete them after their
grace period) through the API.

One control plane per module and combination (``control_plane``); each test works in a namespace of
its own with service addresses of its own, and netproxy runs with deploy/rbac.yaml's ServiceAccount's
token, made through the TokenRequest API.  Run in the ``control-plane`` stage of scripts/run-tests
(marker ``controlplane``): without Go the fixture skips, and under ``CI=true`` it fails.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest
import yaml

from netproxy_lab.checks import assert_only_and_all, wait_for
from netproxy_lab.cleanup import stop_netproxy
from netproxy_lab.combos import Combo
from netproxy_lab.controlplane import ControlPlane, Unavailable, version_line
from netproxy_lab.kubeapi import ApiError, Client, Obj, free_port
from netproxy_lab.proxy import Proxy
from netproxy_lab.pytest_plugin import require
from netproxy_lab.topology import NODE_NAME, REMOTE_NODE_NAME, Pod, Sandbox

pytestmark = [pytest.mark.kernel, pytest.mark.controlplane,
              pytest.mark.quick_combos("nftables", "iptables-legacy/restore")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"

# Where a manifest of each kind lives in the API (what `kubectl apply` finds through discovery).
COLLECTION = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "DaemonSet": "/apis/apps/v1/namespaces/{ns}/daemonsets",
}


def manifests(*names: str) -> List[Obj]:
    docs: List[Obj] = []
    for name in names:
        with open(os.path.join(DEPLOY, name)) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def object_path(obj: Obj) -> str:
    meta = obj["metadata"]
    return f"{COLLECTION[obj['kind']].format(ns=meta.get('namespace', 'default'))}/{meta['name']}"


def apply(client: Client, obj: Obj, *, dry_run: bool = False) -> Any:
    """Server-side apply (strict field validation: an unknown or misspelt field is an error)."""
    query = {"fieldManager": "netproxy-lab", "fieldValidation": "Strict", "force": True,
             "dryRun": "All" if dry_run else None}
    return client.call("PATCH", object_path(obj), obj, query=query, content_type="application/apply-patch+yaml")


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def control_plane(sandbox: Sandbox, combo: Combo) -> Iterator[ControlPlane]:
    """The control plane on the node's loopback, this sandbox's two nodes registered (zones a and b)
    and deploy/rbac.yaml applied."""
    try:
        cp = ControlPlane(sandbox.node)
    except Unavailable as err:
        require(False, f"no control plane: {err}")
        raise
    with cp:
        print(f"\ncontrol plane up in {cp.started_in:.1f} s: {version_line(cp.bins)}")
        cp.node(NODE_NAME, "zone-a")
        cp.node(REMOTE_NODE_NAME, "zone-b")
        for obj in manifests("rbac.yaml"):
            apply(cp.admin, obj)
        yield cp


@pytest.fixture()
def sa_kubeconfig(control_plane: ControlPlane, tmp_path: Any) -> str:
    """deploy/rbac.yaml's ServiceAccount's kubeconfig (a TokenRequest token)."""
    return control_plane.service_account_kubeconfig(str(tmp_path / "netproxy.kubeconfig"), "kube-system", "netproxy")


class Cluster:
    """One test's namespace in the real cluster: Services and Pods made as a user and a kubelet would."""

    def __init__(self, cp: ControlPlane, sandbox: Sandbox, namespace: str) -> None:
        self.cp, self.sandbox, self.ns = cp, sandbox, namespace
        cp.ensure_namespace(namespace)

    def service(self, name: str, ip: str, *, labels: Optional[Dict[str, str]] = None, **spec: Any) -> Obj:
        body = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": self.ns, "labels": labels or {}},
                "spec": {"clusterIP": ip, "selector": {"app": name},
                         "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}], **spec}}
        return dict(self.cp.admin.create(f"/api/v1/namespaces/{self.ns}/services", body))

    def pod(self, pod: Pod, app: str, *, node: str = NODE_NAME, ready: bool = True) -> Obj:
        return self.cp.run_pod(self.ns, pod.name, pod.ip, node, {"app": app}, ready=ready)

    def ready(self, pod: Pod, ready: bool) -> None:
        self.cp.set_pod_status(self.ns, pod.name, pod.ip, ready=ready)

    def delete_pod(self, pod: Pod, grace: int) -> None:
        self.cp.admin.delete(f"/api/v1/namespaces/{self.ns}/pods/{pod.name}", gracePeriodSeconds=grace)

    def endpoints(self, service: str) -> Dict[str, Dict[str, bool]]:
        """The controller's view of ``service``: address → conditions, over all its slices."""
        out: Dict[str, Dict[str, bool]] = {}
        for sl in self.cp.slices(self.ns, service):
            for ep in sl.get("endpoints") or []:
                for addr in ep["addresses"]:
                    out[addr] = {k: bool(v) for k, v in (ep.get("conditions") or {}).items()}
        return out

    def wait_endpoints(self, service: str, want: Dict[str, Dict[str, bool]], timeout: float = 90) -> None:
        """Until the controller's slices hold exactly ``want`` (address → the conditions asked about)."""
        def check() -> Optional[str]:
            got = self.endpoints(service)
            trimmed = {a: {k: c.get(k) for k in want[a]} for a, c in got.items() if a in want}
            return None if set(got) == set(want) and trimmed == want else f"slices hold {got}, want {want}"
        wait_for(check, timeout=timeout)

    def close(self) -> None:
        # Pods first with no grace (the kubelet's final delete), then the namespace and with it the
        # rest, waited for: the namespace controller deletes in the background, and a deletion that
        # landed during the next test would reach that test's proxy as a change it did not make.
        # A test that failed with its API server down leaves this to the control plane's own end
        # (the next ensure_namespace of the same name waits for it).
        try:
            for pod in self.cp.admin.get(f"/api/v1/namespaces/{self.ns}/pods").get("items") or []:
                self.cp.admin.delete(f"/api/v1/namespaces/{self.ns}/pods/{pod['metadata']['name']}",
                                     gracePeriodSeconds=0)
            self.cp.delete_namespace(self.ns)
        except (OSError, ApiError, RuntimeError) as err:
            print(f"namespace {self.ns} left to the control plane's end: {err}")


@contextlib.contextmanager
def cluster(cp: ControlPlane, sandbox: Sandbox, namespace: str) -> Iterator[Cluster]:
    c = Cluster(cp, sandbox, namespace)
    try:
        yield c
    finally:
        c.close()


READY = {"ready": True}


def answered_by(sandbox: Sandbox, ip: str, pods: Sequence[Pod]) -> Any:
    def check() -> Optional[str]:
        res = sandbox.connect(ip, 80, count=30, timeout=0.5)
        got, want = sorted(res.counts), sorted(p.name for p in pods)
        return None if got == want and not res.errors else f"answered by {res.counts}, errors {res.errors}"
    return check


class Run:
    """``netproxy run --kubeconfig`` in the node; its log; stopped by the test's ``finally``."""

    def __init__(self, sandbox: Sandbox, combo: Combo, kubeconfig: str, log_path: str, *extra: str) -> None:
        self.log_path = log_path
        self.proc = sandbox.start_netproxy(["run", "--kubeconfig", kubeconfig, "--hostname-override", NODE_NAME,
                                            "--iptables-lock-timeout", "60s", *extra, *combo.flags],
                                           flavour=combo.path_flavour, log_path=log_path)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> str:
        stop_netproxy(self.proc, timeout=15)
        log = self.log()
        print(log[-3000:])
        return log


def start(sandbox: Sandbox, combo: Combo, kubeconfig: str, tmp_path: Any, *extra: str) -> Run:
    return Run(sandbox, combo, kubeconfig, str(tmp_path / f"run-{time.monotonic_ns()}.log"),
               *(extra or ("--metrics-bind-address", "")))


def changes_in(log: str) -> List[str]:
    """The tracker's debug lines: which Services and slices changed, for a failed count."""
    return [line.split(": ", 1)[-1] for line in log.splitlines()
            if re.search(r"tracker: (service|endpoint slice) ", line)]


def forbidden_lines(log: str) -> List[str]:
    return [line for line in log.splitlines() if re.search(r"\b403\b|[Ff]orbidden", line)]


# ---- the deploy/ manifests and RBAC -------------------------------------------------------------


def test_deploy_manifests_are_accepted_by_the_real_server(control_plane: ControlPlane) -> None:
    """Every object of deploy/ (RBAC, the Endpoints add-on role, the ConfigMap, both DaemonSets) passes
    the real server's validation and admission as a server-side apply, dry run, strict: no unknown
    field, no invalid value, a privileged init container allowed by the server's policy.  A misspelt
    field in a copy is refused, so this check can tell."""
    docs = manifests("rbac.yaml", "rbac-endpoints.yaml", "config.yaml", "daemonset.yaml", "daemonset-kubeadm.yaml")
    assert {d["kind"] for d in docs} == set(COLLECTION), sorted({d["kind"] for d in docs})
    for obj in docs:
        try:
            apply(control_plane.admin, obj, dry_run=True)
        except ApiError as err:
            raise AssertionError(f"deploy/ {obj['kind']} {obj['metadata']['name']}: {err}") from None
    daemonset = copy.deepcopy(next(d for d in docs if d["kind"] == "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(ApiError) as refused:
        apply(control_plane.admin, daemonset, dry_run=True)
    # v1.36.3 answers an apply with an undeclared field 500 ("failed to create typed patch object"), not
    # 400: the message names the field either way.
    assert refused.value.status in (400, 422, 500) and "hostNetwrok" in refused.value.message, refused.value


def test_the_service_accounts_token_programs_the_node_without_a_403(
        proxy: Proxy, sandbox: Sandbox, combo: Combo, control_plane: ControlPlane, sa_kubeconfig: str,
        tmp_path: Any) -> None:
    """deploy/rbac.yaml's role is enough: every list and watch netproxy makes is allowed (not one 403 in
    its log), and the Service and the controller's slice reach the kernel."""
    ip = "10.96.0.20"
    with cluster(control_plane, sandbox, "np-rbac") as c:
        pods = sandbox.pods[:2]
        c.service("web", ip)
        for pod in pods:
            c.pod(pod, "web")
        c.wait_endpoints("web", {p.ip: READY for p in pods})
        managed = {sl["metadata"]["labels"].get("endpointslice.kubernetes.io/managed-by")
                   for sl in control_plane.slices("np-rbac", "web")}
        assert managed == {SLICE_CONTROLLER}, managed
        run = start(sandbox, combo, sa_kubeconfig, tmp_path)
        try:
            wait_for(answered_by(sandbox, ip, pods), timeout=60)
            assert_only_and_all(sandbox.connect(ip, 80, count=100), pods, total=100, at_least=20)
            time.sleep(2)  # the node and ServiceCIDR watches are running too
            assert run.proc.poll() is None, "netproxy run exited"
        finally:
            log = run.stop()
        assert not forbidden_lines(log), forbidden_lines(log)
        assert "watching services, endpointslices" in log, log[-2000:]


def test_a_role_without_one_verb_is_named_in_the_error(
        proxy: Proxy, sandbox: Sandbox, combo: Combo, control_plane: ControlPlane, tmp_path: Any) -> None:
    """deploy/rbac.yaml's role with ``watch`` on EndpointSlices taken away: netproxy says which kind and
    which verb the server refused, once, and keeps running; nothing else is refused."""
    role = copy.deepcopy(next(d for d in manifests("rbac.yaml") if d["kind"] == "ClusterRole"))
    role["metadata"]["name"] = "netproxy-no-watch"
    for rule in role["rules"]:
        if "endpointslices" in rule["resources"]:
            rule["verbs"] = ["list"]
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "netproxy-no-watch",
                                                                           "namespace": "kube-system"}}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "netproxy-no-watch"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "netproxy-no-watch"},
               "subjects": [{"kind": "ServiceAccount", "name": "netproxy-no-watch", "namespace": "kube-system"}]}
    for obj in (account, role, binding):
        apply(control_plane.admin, obj)
    kubeconfig = control_plane.service_account_kubeconfig(str(tmp_path / "limited.kubeconfig"), "kube-system",
                                                           "netproxy-no-watch")
    run = start(sandbox, combo, kubeconfig, tmp_path)
    try:
        def refused() -> Optional[str]:
            return None if "EndpointSlice: watch refused (HTTP 403" in run.log() else "no refusal logged yet"
        wait_for(refused, timeout=60)
        time.sleep(3)
        assert run.proc.poll() is None, "netproxy run exited"
    finally:
        log = run.stop()
    lines = forbidden_lines(log)
    assert lines and all("EndpointSlice: watch refused" in line for line in lines), lines
    assert len(lines) == 1, f"the refusal is said once: {lines}"


# ---- the EndpointSlice controller, by traffic ----------------------------------------------------


def test_traffic_follows_the_controllers_slices_through_readiness_and_termination(
        proxy: Proxy, sandbox: Sandbox, combo: Combo, control_plane: ControlPlane, sa_kubeconfig: str,
        tmp_path: Any) -> None:
    """Pods becoming ready and unready, and deleted with a grace period, as the real controller writes
    them: a terminating pod leaves the ready set; when only terminating pods are left, the serving
    ones carry the traffic (kube-proxy's fallback); when those stop serving, nothing answers."""
    ip = "10.96.0.21"
    a, b, c_ = sandbox.pods[:3]
    with cluster(control_plane, sandbox, "np-life") as c:
        c.service("web", ip)
        for pod in (a, b, c_):
            c.pod(pod, "web")
        run = start(sandbox, combo, sa_kubeconfig, tmp_path)
        try:
            wait_for(answered_by(sandbox, ip, [a, b, c_]), timeout=60)
            c.ready(c_, False)
            c.wait_endpoints("web", {a.ip: READY, b.ip: READY, c_.ip: {"ready": False, "serving": False}})
            wait_for(answered_by(sandbox, ip, [a, b]), timeout=60)

            c.delete_pod(b, grace=300)
            c.wait_endpoints("web", {a.ip: READY, b.ip: {"ready": False, "serving": True, "terminating": True},
                                     c_.ip: {"ready": False}})
            wait_for(answered_by(sandbox, ip, [a]), timeout=60)
            assert_only_and_all(sandbox.connect(ip, 80, count=60), [a], total=60)

            c.delete_pod(a, grace=300)
            c.wait_endpoints("web", {a.ip: {"ready": False, "serving": True, "terminating": True},
                                     b.ip: {"terminating": True}, c_.ip: {"ready": False}})
            wait_for(answered_by(sandbox, ip, [a, b]), timeout=60)

            for pod in (a, b):
                c.ready(pod, False)
            c.wait_endpoints("web", {a.ip: {"serving": False, "terminating": True},
                                     b.ip: {"serving": False, "terminating": True}, c_.ip: {"serving": False}})

            def refused() -> Optional[str]:
                res = sandbox.connect(ip, 80, count=5, timeout=0.5)
                return None if res.answered == 0 else f"answered by {res.counts}"
            wait_for(refused, timeout=60)

            c.ready(c_, True)
            wait_for(answered_by(sandbox, ip, [c_]), timeout=60)
            for pod in (a, b):  # the kubelet's last word: the containers are gone
                c.delete_pod(pod, grace=0)
            c.wait_endpoints("web", {c_.ip: READY})
            assert_only_and_all(sandbox.connect(ip, 80, count=30), [c_], total=30)
            assert run.proc.poll() is None, "netproxy run exited"
        finally:
            run.stop()


def test_headless_and_another_proxys_services_are_not_programmed(
        proxy: Proxy, sandbox: Sandbox, combo: Combo, control_plane: ControlPlane, sa_kubeconfig: str,
        tmp_path: Any) -> None:
    """The controller labels a headless Service's slices ``service.kubernetes.io/headless`` and copies a
    Service's ``service.kubernetes.io/service-proxy-name`` onto its slices: netproxy programs neither,
    and programs the plain Service beside them."""
    web_ip, their_ip = "10.96.0.22", "10.96.0.23"
    pods = sandbox.pods[:2]
    with cluster(control_plane, sandbox, "np-skip") as c:
        c.service("web", web_ip)
        c.service("theirs", their_ip, labels={"service.kubernetes.io/service-proxy-name": "another-proxy"})
        c.service("db", "None")
        for pod in pods:
            c.pod(pod, "web")
        for i, pod in enumerate(pods):
            c.cp.run_pod("np-skip", f"theirs-{i}", pod.ip, NODE_NAME, {"app": "theirs"})
            c.cp.run_pod("np-skip", f"db-{i}", pod.ip, NODE_NAME, {"app": "db"})
        for name in ("web", "theirs", "db"):
            c.wait_endpoints(name, {p.ip: READY for p in pods})
        labels = {name: control_plane.slices("np-skip", name)[0]["metadata"]["labels"] for name in ("theirs", "db")}
        assert labels["theirs"].get("service.kubernetes.io/service-proxy-name") == "another-proxy", labels
        assert "service.kubernetes.io/headless" in labels["db"], labels
        run = start(sandbox, combo, sa_kubeconfig, tmp_path)
        try:
            wait_for(answered_by(sandbox, web_ip, pods), timeout=60)
            held = proxy.command("status", "--kernel", "-o", "json")
            services = {h["service"] for h in yaml.safe_load(held.stdout)["kernel"]}
            assert {s for s in services if s.startswith("np-skip/")} == {"np-skip/web:http"}, services
            other = sandbox.connect(their_ip, 80, count=3, timeout=0.5)
            assert other.answered == 0, f"another proxy's service answered through netproxy's rules: {other}"
        finally:
            run.stop()


def test_traffic_distribution_keeps_traffic_in_the_nodes_zone(
        proxy: Proxy, sandbox: Sandbox, combo: Combo, control_plane: ControlPlane, sa_kubeconfig: str,
        tmp_path: Any) -> None:
    """``trafficDistribution: PreferClose``: the controller hints each endpoint for its Node's zone
    (this node is in zone-a, the other in zone-b), and netproxy on this node sends only to zone-a's
    pods; without it the same pods all answer."""
    ip, plain_ip = "10.96.0.24", "10.96.0.25"
    here, there = sandbox.pods[:2], sandbox.pods[2]
    with cluster(control_plane, sandbox, "np-zone") as c:
        c.service("web", ip, trafficDistribution="PreferClose")
        c.service("plain", plain_ip, selector={"app": "web"})
        for pod in here:
            c.pod(pod, "web")
        c.pod(there, "web", node=REMOTE_NODE_NAME)

        def hinted() -> Optional[str]:
            hints = {ep["addresses"][0]: [z["name"] for z in (ep.get("hints") or {}).get("forZones") or []]
                     for sl in control_plane.slices("np-zone", "web") for ep in sl.get("endpoints") or []}
            want = {**{p.ip: ["zone-a"] for p in here}, there.ip: ["zone-b"]}
            return None if hints == want else f"hints {hints}"
        wait_for(hinted, timeout=60)
        run = start(sandbox, combo, sa_kubeconfig, tmp_path)
        try:
            wait_for(answered_by(sandbox, plain_ip, [*here, there]), timeout=60)
            wait_for(answered_by(sandbox, ip, here), timeout=60)
            assert_only_and_all(sandbox.connect(ip, 80, count=90), here, total=90, at_least=20)
        finally:
            run.stop()


# ---- the API server going away, and the watch's history with it ---------------------------------


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def test_apiserver_restart_and_compacted_history_relist_and_keep_traffic(
        proxy: Proxy, sandbox: Sandbox, combo: Combo, control_plane: ControlPlane, tmp_path: Any) -> None:
    """netproxy watches through one API server; it is killed.  Meanwhile, through a second API server
    on the same etcd (an HA control plane's other member), a Service is added, one changed and one
    deleted, and etcd is compacted past every resourceVersion netproxy held.  The first server comes
    back: netproxy's watches answer 410 Gone, it relists, applies exactly the three changes (its change
    counters move by those and nothing else: the untouched Service is not rewritten), traffic to the
    untouched Service never stops, and /healthz stays 200 throughout as kube-proxy's does with
    nothing pending."""
    cp = control_plane
    keep_ip, change_ip, gone_ip, new_ip = "10.96.0.30", "10.96.0.31", "10.96.0.32", "10.96.0.33"
    a, b, c_ = sandbox.pods[:3]
    other = cp.start_apiserver("apiserver-2")
    kubeconfig = cp.service_account_kubeconfig(str(tmp_path / "sa.kubeconfig"), "kube-system", "netproxy")
    with cluster(cp, sandbox, "np-restart") as c:
        c.service("keep", keep_ip)
        c.service("change", change_ip)
        c.service("gone", gone_ip)
        c.pod(a, "keep")
        c.pod(b, "change")
        c.pod(c_, "gone")
        for name, pod in (("keep", a), ("change", b), ("gone", c_)):
            c.wait_endpoints(name, {pod.ip: READY})
        health_port, metrics_port = free_port(sandbox.node), free_port(sandbox.node)
        node_http = Client(f"http://127.0.0.1:{health_port}", netns=sandbox.node, timeout=5)
        metrics_http = Client(f"http://127.0.0.1:{metrics_port}", netns=sandbox.node, timeout=5)
        run = start(sandbox, combo, kubeconfig, tmp_path, "--healthz-bind-address", f"127.0.0.1:{health_port}",
                    "--metrics-bind-address", f"127.0.0.1:{metrics_port}", "--sync-period", "3s",
                    "--log-level", "debug")  # the tracker names each change: a failed count says which
        try:
            for ip, pod in ((keep_ip, a), (change_ip, b), (gone_ip, c_)):
                wait_for(answered_by(sandbox, ip, [pod]), timeout=60)
            time.sleep(1)
            before = metrics_http.call("GET", "/metrics")
            counts = {n: metric(before, n) for n in ("kubeproxy_sync_proxy_rules_service_changes_total",
                                                     "kubeproxy_sync_proxy_rules_endpoint_changes_total")}
            pending = sandbox.start_connect(keep_ip, 80, count=400, interval=0.1, timeout=1.0, concurrency=1)

            cp.kill_apiserver("apiserver")
            via = cp.client(other, cert=(cp.path("admin.crt"), cp.path("admin.key")))
            port_81 = {"name": "http", "port": 81, "targetPort": "http", "protocol": "TCP"}
            via.merge_patch("/api/v1/namespaces/np-restart/services/change", {"spec": {"ports": [port_81]}})
            via.delete("/api/v1/namespaces/np-restart/services/gone")
            via.create("/api/v1/namespaces/np-restart/services",
                       {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "new", "namespace": "np-restart"},
                        "spec": {"clusterIP": new_ip,
                                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
            # A Service without a selector, its slice written as a controller of one's own writes it
            # (the controller manager talks to the killed server, and ignores such Services anyway).
            via.create("/apis/discovery.k8s.io/v1/namespaces/np-restart/endpointslices",
                       {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                        "metadata": {"name": "new-lab", "namespace": "np-restart",
                                     "labels": {"kubernetes.io/service-name": "new",
                                                "endpointslice.kubernetes.io/managed-by": "netproxy-lab"}},
                        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                        "endpoints": [{"addresses": [c_.ip], "conditions": {"ready": True}, "nodeName": NODE_NAME}]})
            compacted = cp.compact_etcd()
            down_health = [node_http.call("GET", "/healthz", expect=())[0] for _ in range(3)]
            assert down_health == [200, 200, 200], f"/healthz with the API down and nothing pending: {down_health}"

            cp.start_apiserver("apiserver")
            wait_for(answered_by(sandbox, new_ip, [c_]), timeout=120)
            wait_for(lambda: None if sandbox.connect(gone_ip, 80, count=2, timeout=0.5).answered == 0
                     else "the deleted Service still answers", timeout=60)
            res = sandbox.connect(change_ip, 81, count=20, timeout=0.5)
            assert_only_and_all(res, [b], total=20)
            sampled = pending.result()
            # The garbage collector removes the deleted Service's slice once its server is back.
            wait_for(lambda: None if not cp.slices("np-restart", "gone") else "gone's slice is still there", timeout=60)
            time.sleep(4)  # a periodic sync or two (--sync-period 3s): they must not count changes
            after = metrics_http.call("GET", "/metrics")
            moved = {n: metric(after, n) - v for n, v in counts.items()}
            assert node_http.call("GET", "/healthz", expect=())[0] == 200
            assert run.proc.poll() is None, "netproxy run exited"
        finally:
            log = run.stop()
            cp.procs.pop("apiserver-2").stop()
    assert sampled.errors == {} and sampled.counts == {a.name: 400}, \
        f"traffic to the untouched Service during the outage: {sampled.counts}, errors {sampled.errors}"
    assert re.search(r"Service: .*(410|too old|[Gg]one).*relisting", log), log[-3000:]
    # Three Services changed (one port, one gone, one new) and two slices (gone's, new's): nothing else.
    assert moved == {"kubeproxy_sync_proxy_rules_service_changes_total": 3,
                     "kubeproxy_sync_proxy_rules_endpoint_changes_total": 2}, (moved, compacted, changes_in(log))

