"""A real Kubernetes control plane for the tests: etcd, kube-apiserver and kube-controller-manager,
built from Kubernetes' Go modules by ``make control-plane`` (scripts/build-control-plane), started
on the loopback of a network namespace (a sandbox's node, where netproxy runs and reaches it as a
real node reaches its API server), and stopped by the PIDs it started, its files removed, even when
a start fails half way.

What it sets up, and why:

- certificates it makes with ``openssl`` (a CA, the API server's serving certificate, client
  certificates for the admin — ``system:masters`` — and the controller manager), and an EC key that
  signs service-account tokens;
- etcd on two free loopback ports (client, peer), no TLS: only this namespace reaches it;
- kube-apiserver on a free loopback port with Node and RBAC authorisation, the default admission
  plugins (ServiceAccount, Priority, … as a real cluster has them), a service CIDR, privileged
  containers allowed (netproxy's DaemonSet asks for them);
- kube-controller-manager with only the controllers netproxy's objects need: the EndpointSlice
  controller and the mirroring one, the service-account controllers (Pods need their namespace's
  ``default`` ServiceAccount), the namespace controller and the garbage collector (slices of a
  deleted Service go through it).  The node life-cycle and pod GC controllers stay off: there is no
  kubelet, the tests play it (:meth:`ControlPlane.run_pod`), and those controllers would evict
  its pods.  Each controller uses its own service account's credentials, so RBAC decides for them
  as it does in a cluster.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from netproxy_lab.cleanup import stop_process
from netproxy_lab.kubeapi import ApiError, Client, Obj, free_port

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(_HERE))
BUILD = os.path.join(REPO, "scripts", "build-control-plane")
SERVICE_CIDR = "10.96.0.0/12"
"""Kubernetes' default (kubeadm's): the lab's service addresses (10.96.0.x) fall in it."""
CONTROLLERS = ("endpointslice-controller", "endpointslice-mirroring-controller", "serviceaccount-controller",
               "serviceaccount-token-controller", "namespace-controller", "garbage-collector-controller")
ZONE_LABEL = "topology.kubernetes.io/zone"


class Unavailable(RuntimeError):
    """The control plane cannot be built here (no Go, or a Go too old): a skip locally, a failure in CI."""


class BuildFailed(RuntimeError):
    """``make control-plane`` failed for another reason: always a failure."""


@dataclass(frozen=True)
class Binaries:
    apiserver: str
    controller_manager: str
    etcd: str
    versions: Dict[str, str]


def binaries() -> Binaries:
    """The three programs, built (or found up to date: seconds) by scripts/build-control-plane."""
    proc = subprocess.run([BUILD], capture_output=True, text=True, check=False)
    if proc.returncode == 2:
        raise Unavailable(proc.stderr.strip())
    if proc.returncode != 0:
        raise BuildFailed(f"scripts/build-control-plane exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    paths: Dict[str, str] = {}
    versions: Dict[str, str] = {}
    for line in proc.stdout.splitlines():
        path, _, version = line.partition("  ")
        paths[os.path.basename(path)] = path
        versions[os.path.basename(path)] = version.strip()
    try:
        return Binaries(paths["kube-apiserver"], paths["kube-controller-manager"], paths["etcd"], versions)
    except KeyError as err:
        raise BuildFailed(f"scripts/build-control-plane did not print {err}: {proc.stdout!r}") from None


# ---- certificates ------------------------------------------------------------------------------

def _openssl(*args: str, cwd: str) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {proc.stderr.strip()}")


def _leaf(pki: str, name: str, subject: str, usage: str, san: str = "") -> None:
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)
    ext = os.path.join(pki, f"{name}.ext")
    with open(ext, "w") as f:
        f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                f"extendedKeyUsage={usage}\n" + (f"subjectAltName={san}\n" if san else ""))
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.crt", "-extfile", ext, cwd=pki)


def make_pki(pki: str) -> None:
    """A CA and what is signed by it; the service-account signing key pair."""
    os.makedirs(pki, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=netproxy-lab-ca", cwd=pki)
    # 10.96.0.1: the `kubernetes` Service's address, which in-cluster clients dial.
    _leaf(pki, "apiserver", "/CN=kube-apiserver", "serverAuth",
          "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc")
    _leaf(pki, "admin", "/O=system:masters/CN=lab-admin", "clientAuth")
    _leaf(pki, "controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: str, server: str, ca: str, *, token: str = "", cert: str = "", key: str = "") -> str:
    """A kubeconfig for ``server`` authenticating with ``token`` or a client certificate."""
    user: Dict[str, str] = {"token": token} if token else {"client-certificate": cert, "client-key": key}
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "lab",
           "clusters": [{"name": "lab", "cluster": {"server": server, "certificate-authority": ca}}],
           "users": [{"name": "lab", "user": user}],
           "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}]}
    with open(path, "w") as f:
        json.dump(doc, f)  # JSON is YAML
    return path


# ---- processes ---------------------------------------------------------------------------------

class _Process:
    """One program of the control plane in the namespace: its own process group, its log file."""

    def __init__(self, name: str, argv: Sequence[str], netns: Optional[str], log_path: str) -> None:
        self.name, self.log_path = name, log_path
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.log = open(log_path, "ab")  # noqa: SIM115 - the child writes to it until stop() closes it
        self.proc = subprocess.Popen([*prefix, *argv], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, size: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - size))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if sig == signal.SIGKILL and self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)  # our child's own group (start_new_session)
        stop_process(self.proc, timeout=10)
        self.log.close()


def _wait(what: str, check: Any, proc: _Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    why = "not checked yet"
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited {proc.proc.returncode} before {what}:\n{proc.tail()}")
        try:
            why = check()
        except (OSError, ApiError) as err:
            why = str(err)
        if why is None:
            return
        time.sleep(0.3)
    raise RuntimeError(f"{proc.name}: not {what} within {timeout:.0f}s ({why}):\n{proc.tail()}")


class ControlPlane:
    """``with ControlPlane(netns) as cp:`` — etcd, one kube-apiserver (more on demand) and the
    controller manager on ``netns``'s loopback; ``cp.admin`` is a :class:`Client` as cluster-admin.

    ``controllers=False`` leaves the controller manager off (tests that write slices themselves).
    """

    def __init__(self, netns: Optional[str], *, controllers: bool = True, workdir: Optional[str] = None,
                 start_timeout: float = 240) -> None:
        self.netns, self.with_controllers, self.start_timeout = netns, controllers, start_timeout
        self.bins = binaries()
        self.dir = tempfile.mkdtemp(prefix="np-controlplane-", dir=workdir)
        self.pki = os.path.join(self.dir, "pki")
        self.procs: Dict[str, _Process] = {}
        self.etcd_url = ""
        self.apiserver_ports: Dict[str, int] = {}
        self.server = ""
        self.admin_kubeconfig = os.path.join(self.dir, "admin.kubeconfig")
        self._admin: Optional[Client] = None

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        t0 = time.monotonic()
        make_pki(self.pki)
        self.start_etcd()
        self.start_apiserver("apiserver")
        self.server = self.url("apiserver")
        write_kubeconfig(self.admin_kubeconfig, self.server, self.path("ca.crt"),
                         cert=self.path("admin.crt"), key=self.path("admin.key"))
        if self.with_controllers:
            self.start_controller_manager()
        self.started_in = time.monotonic() - t0

    def close(self) -> None:
        """Stop every program started (by PID, controllers first), remove the files.  Idempotent."""
        for name in reversed(list(self.procs)):
            self.procs.pop(name).stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name: str) -> str:
        return os.path.join(self.pki, name)

    @property
    def admin(self) -> Client:
        if self._admin is None:
            self._admin = self.client(self.server, cert=(self.path("admin.crt"), self.path("admin.key")))
        return self._admin

    def client(self, server: str, **auth: Any) -> Client:
        return Client(server, netns=self.netns, ca=self.path("ca.crt"), **auth)

    def url(self, apiserver: str) -> str:
        return f"https://127.0.0.1:{self.apiserver_ports[apiserver]}"

    # -- etcd ---------------------------------------------------------------------------------

    def start_etcd(self) -> None:
        client_port, peer_port = free_port(self.netns), free_port(self.netns)
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        argv = [self.bins.etcd, "--name", "lab", "--data-dir", os.path.join(self.dir, "etcd"),
                "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"lab={peer}", "--log-level", "warn",
                # A test's data lives for minutes: durability on power loss buys nothing here.
                "--unsafe-no-fsync"]
        proc = self.procs["etcd"] = _Process("etcd", argv, self.netns, os.path.join(self.dir, "etcd.log"))
        etcd = Client(self.etcd_url, netns=self.netns, timeout=5)

        def healthy() -> Optional[str]:
            doc = etcd.get("/health")
            return None if isinstance(doc, dict) and doc.get("health") == "true" else f"health {doc}"
        _wait("healthy", healthy, proc, 60)

    def etcd_revision(self) -> int:
        """etcd's current revision (what the API server calls a resourceVersion)."""
        etcd = Client(self.etcd_url, netns=self.netns, timeout=10)
        doc = etcd.call("POST", "/v3/kv/range", {"key": base64.b64encode(b"/").decode(), "count_only": True})
        return int(doc["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (physically): every older resourceVersion is gone, so a
        watch from one answers 410 Gone.  The revision compacted to."""
        revision = self.etcd_revision()
        etcd = Client(self.etcd_url, netns=self.netns, timeout=60)
        etcd.call("POST", "/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    # -- kube-apiserver -----------------------------------------------------------------------

    def start_apiserver(self, name: str, port: int = 0) -> str:
        """Start (or start again, on its old port) the API server ``name``; its URL once ready."""
        port = port or self.apiserver_ports.get(name) or free_port(self.netns)
        self.apiserver_ports[name] = port
        p = self.path
        argv = [self.bins.apiserver, "--etcd-servers", self.etcd_url,
                "--bind-address", "127.0.0.1", "--secure-port", str(port), "--advertise-address", "127.0.0.1",
                # The `kubernetes` Service's endpoints would be the loopback address, which an
                # EndpointSlice may not hold: no reconciler (the Service itself is still made).
                "--endpoint-reconciler-type", "none",
                "--service-cluster-ip-range", SERVICE_CIDR,
                "--authorization-mode", "Node,RBAC", "--allow-privileged",
                "--client-ca-file", p("ca.crt"), "--tls-cert-file", p("apiserver.crt"),
                "--tls-private-key-file", p("apiserver.key"),
                "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file", p("sa.pub"), "--service-account-signing-key-file", p("sa.key"),
                "--profiling=false", "--v", "1"]
        proc = self.procs[name] = _Process(name, argv, self.netns, os.path.join(self.dir, f"{name}.log"))
        url = self.url(name)
        probe = self.client(url, cert=(p("admin.crt"), p("admin.key")))
        probe.timeout = 5

        def ready() -> Optional[str]:
            status, body = probe.call("GET", "/readyz", expect=())
            return None if status == 200 else f"/readyz {status} {str(body)[-300:]}"
        _wait("ready", ready, proc, self.start_timeout)
        return url

    def kill_apiserver(self, name: str = "apiserver") -> None:
        """SIGKILL, as a crash: no graceful close of the watches."""
        self.procs.pop(name).stop(signal.SIGKILL)

    # -- kube-controller-manager ----------------------------------------------------------------

    def start_controller_manager(self) -> None:
        kubeconfig = write_kubeconfig(os.path.join(self.dir, "controller-manager.kubeconfig"), self.server,
                                      self.path("ca.crt"), cert=self.path("controller-manager.crt"),
                                      key=self.path("controller-manager.key"))
        argv = [self.bins.controller_manager, "--kubeconfig", kubeconfig,
                "--authentication-kubeconfig", kubeconfig, "--authorization-kubeconfig", kubeconfig,
                "--bind-address", "127.0.0.1", "--secure-port", str(free_port(self.netns)),
                "--controllers", ",".join(CONTROLLERS), "--use-service-account-credentials",
                "--service-account-private-key-file", self.path("sa.key"), "--root-ca-file", self.path("ca.crt"),
                "--leader-elect=false", "--v", "1"]
        proc = self.procs["controller-manager"] = _Process("controller-manager", argv, self.netns,
                                                           os.path.join(self.dir, "controller-manager.log"))

        def serving() -> Optional[str]:
            # The service-account controller made the default namespace's account: the controllers run.
            status, _ = self.admin.call("GET", "/api/v1/namespaces/default/serviceaccounts/default", expect=())
            return None if status == 200 else f"no default ServiceAccount yet ({status})"
        _wait("running its controllers", serving, proc, self.start_timeout)

    # -- what a cluster's users and kubelets do -------------------------------------------------

    def service_account_kubeconfig(self, path: str, namespace: str, name: str, server: str = "") -> str:
        """A kubeconfig with a token for ServiceAccount ``namespace/name`` from the TokenRequest API."""
        review = self.admin.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                                   {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                    "spec": {"expirationSeconds": 3600}})
        return write_kubeconfig(path, server or self.server, self.path("ca.crt"), token=review["status"]["token"])

    def ensure_namespace(self, name: str, wait_for_account: bool = True) -> None:
        """Namespace ``name``, and (unless told not to: no controllers, no Pods) its default ServiceAccount.

        A namespace of the same name still terminating (an earlier test's) is waited out first: its
        objects' deletions would otherwise reach the proxy under test as changes of its own."""
        self.wait_namespace_gone(name, only_terminating=True)
        try:
            self.admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": name}})
        except ApiError as err:
            if err.status != 409:
                raise
        if not wait_for_account:
            return
        # Pods need the namespace's default ServiceAccount (the ServiceAccount admission plugin).
        deadline = time.monotonic() + 60
        while self.admin.call("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default", expect=())[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace {name}: no default ServiceAccount after 60s")
            time.sleep(0.2)

    def delete_namespace(self, name: str, timeout: float = 120) -> None:
        """Delete namespace ``name`` and wait until the namespace controller has removed it and
        everything in it, so that the next test's proxy sees none of those deletions."""
        status, got = self.admin.call("DELETE", f"/api/v1/namespaces/{name}", expect=())
        if status not in (200, 202, 404):
            raise ApiError("DELETE", f"/api/v1/namespaces/{name}", status, got)
        self.wait_namespace_gone(name, timeout=timeout)

    def wait_namespace_gone(self, name: str, timeout: float = 120, only_terminating: bool = False) -> None:
        """Until namespace ``name`` is gone (404); with ``only_terminating``, only if it is being deleted."""
        deadline = time.monotonic() + timeout
        while True:
            status, got = self.admin.call("GET", f"/api/v1/namespaces/{name}", expect=())
            if status == 404:
                return
            if status != 200:
                raise ApiError("GET", f"/api/v1/namespaces/{name}", status, got)
            terminating = isinstance(got, dict) and bool((got.get("metadata") or {}).get("deletionTimestamp"))
            if only_terminating and not terminating:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace {name}: still there {timeout:.0f}s after its deletion "
                                   f"(status {(got.get('status') if isinstance(got, dict) else got)!r})")
            time.sleep(0.3)

    def node(self, name: str, zone: str = "") -> Obj:
        """A Node (as a kubelet registers it), labelled with ``zone``; created or updated."""
        labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **({ZONE_LABEL: zone} if zone else {})}
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
        status, got = self.admin.call("POST", "/api/v1/nodes", body, expect=())
        if status == 409:
            return dict(self.admin.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": labels}}))
        if status not in (200, 201):
            raise ApiError("POST", "/api/v1/nodes", status, got)
        return dict(got)

    def run_pod(self, namespace: str, name: str, ip: str, node: str, labels: Dict[str, str], *,
                ready: bool = True, ports: Sequence[int] = (8080,)) -> Obj:
        """A Pod bound to ``node``, then its status as that node's kubelet would report it: running,
        ``ip`` its address, ``Ready`` as asked."""
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
                "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                         "containers": [{"name": "app", "image": "localhost/lab-pod:1",
                                         "ports": [{"name": "http" if i == 0 else f"p{port}", "containerPort": port}
                                                   for i, port in enumerate(ports)]}]}}
        self.admin.create(f"/api/v1/namespaces/{namespace}/pods", body)
        return self.set_pod_status(namespace, name, ip, ready=ready)

    def set_pod_status(self, namespace: str, name: str, ip: str, *, ready: bool) -> Obj:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        flag = "True" if ready else "False"
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "startTime": now,
                  "conditions": [{"type": kind, "status": flag if kind in ("Ready", "ContainersReady") else "True",
                                  "lastTransitionTime": now}
                                 for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}
        return dict(self.admin.merge_patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status}))

    def slices(self, namespace: str, service: str) -> List[Obj]:
        listed = self.admin.get(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                                labelSelector=f"kubernetes.io/service-name={service}")
        return list(listed.get("items") or [])

    def log_of(self, name: str) -> str:
        proc = self.procs.get(name)
        return proc.tail(20000) if proc else ""


def version_line(binaries_: Binaries) -> str:
    """``kube-apiserver v1.36.3, kube-controller-manager v1.36.3, etcd 3.6.8`` for a test's output."""
    def short(text: str) -> str:
        found = re.search(r"v?\d+\.\d+\.\d+\S*", text)
        return found.group(0) if found else text
    return ", ".join(f"{name} {short(v)}" for name, v in sorted(binaries_.versions.items()))
