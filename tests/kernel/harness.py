"""Kernel-test fixtures: thin pytest wrappers over :class:`netproxy.sandbox.Sandbox`.

Loaded by ``tests/kernel/conftest.py``; any test module under ``tests/kernel`` can use:

- ``combo``   — one backend/writer combination (module scope, parametrised over
  ``NETPROXY_BACKENDS``, default all of :data:`COMBOS`);
- ``sandbox`` — a client / node / ext / pods topology for that module and combination;
- ``proxy``   — a :class:`Proxy` that runs netproxy in the node with the combination's flags and
  resets the node's netfilter state (every table of every flavour, conntrack) after each test, so
  tests share a sandbox without seeing each other's rules;
- manifest builders :func:`service` and :func:`endpoint_slice`.

Not root → skip.  ``CI=true`` → a missing capability (root, ``ip netns``, a binary, a library)
fails instead, so that a CI machine cannot pass by skipping.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import pytest

from netproxy.sandbox import NODE_NAME, ConnectResult, Pod, Sandbox, SandboxError, has_iptables

Manifest = Dict[str, Any]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(condition: bool, reason: str) -> None:
    """Skip when ``condition`` is false — or fail, under ``CI=true``."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


# ---- backend/writer combinations ---------------------------------------------------------------


@dataclass(frozen=True)
class Combo:
    """One way of running netproxy: backend, iptables writer, and the node's iptables flavour."""

    name: str
    backend: str
    writer: str
    flavour: str
    """The iptables the node has ("legacy"/"nft"): first in PATH for netproxy, and what the tests read back."""

    @property
    def path_flavour(self) -> Optional[str]:
        """The iptables put first in PATH: the combination's, if installed (a pure nftables node has none)."""
        return self.flavour if has_iptables(self.flavour) else None

    @property
    def flags(self) -> List[str]:
        if self.backend == "nftables":
            return ["--backend", self.backend, "--nftables-writer", self.writer, "--iptables-flavour", self.flavour]
        return ["--backend", self.backend, "--iptables-writer", self.writer, "--iptables-flavour", self.flavour]

    def missing(self) -> Optional[str]:
        """Why this combination cannot run here, or None."""
        if self.backend == "iptables":
            if not has_iptables(self.flavour):
                return f"iptables-{self.flavour} (and its -save/-restore, ip6tables-{self.flavour}*) is not installed"
            if self.writer == "libiptc" and importlib.util.find_spec("iptc") is None:
                return "python-iptables (iptc) is not importable"
        else:
            if shutil.which("nft") is None:
                return "nft is not installed"
            if self.writer == "libnftables" and importlib.util.find_spec("nftables") is None:
                return "the nftables Python binding is not importable"
        return None


COMBOS: Dict[str, Combo] = {c.name: c for c in (
    Combo("iptables-legacy/restore", "iptables", "restore", "legacy"),
    Combo("iptables-legacy/libiptc", "iptables", "libiptc", "legacy"),
    Combo("iptables-nft/restore", "iptables", "restore", "nft"),
    # An nftables node's `iptables` is iptables-nft: the version check must see that.
    Combo("nftables", "nftables", "netlink", "nft"),
    Combo("nftables/libnftables", "nftables", "libnftables", "nft"),
)}


def selected_combos() -> List[Combo]:
    """``NETPROXY_BACKENDS`` (comma-separated names from :data:`COMBOS`), default all."""
    raw = os.environ.get("NETPROXY_BACKENDS", "").strip()
    if not raw:
        return list(COMBOS.values())
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMBOS]
    if unknown:
        raise pytest.UsageError(f"NETPROXY_BACKENDS: unknown {unknown}; known: {', '.join(COMBOS)}")
    return [COMBOS[n] for n in names]


# ---- manifests ---------------------------------------------------------------------------------


def service(name: str, cluster_ip: str, ports: Sequence[Manifest], *, namespace: str = "default",
            **spec: Any) -> Manifest:
    """A v1 Service; ``ports`` are Kubernetes port dicts; ``spec`` adds fields (camelCase).

    ``load_balancer_ips=[...]`` becomes ``status.loadBalancer.ingress``.
    """
    lb_ips = spec.pop("load_balancer_ips", None)
    body: Manifest = {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "ports": list(ports)}
    body.update(spec)
    out: Manifest = {"apiVersion": "v1", "kind": "Service",
                     "metadata": {"name": name, "namespace": namespace}, "spec": body}
    if lb_ips:
        out["spec"].setdefault("type", "LoadBalancer")
        out["status"] = {"loadBalancer": {"ingress": [{"ip": ip} for ip in lb_ips]}}
    return out


def port(number: int, target: Any = 8080, *, name: str = "", protocol: str = "TCP") -> Manifest:
    out: Manifest = {"port": number, "targetPort": target, "protocol": protocol}
    if name:
        out["name"] = name
    return out


def endpoint_slice(service_name: str, pods: Sequence[Pod], ports: Sequence[Manifest], *,
                   namespace: str = "default", suffix: str = "a", ready: bool = True,
                   address_type: str = "IPv4") -> Manifest:
    """A discovery.k8s.io/v1 EndpointSlice for ``service_name`` with ``pods`` as endpoints.

    ``address_type="IPv6"`` lists the pods' IPv6 addresses (one slice per family, as Kubernetes does).
    """
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{service_name}-{suffix}", "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": address_type,
        "ports": list(ports),
        "endpoints": [{"addresses": [p.ip6 if address_type == "IPv6" else p.ip], "nodeName": p.node_name,
                       "conditions": {"ready": ready, "serving": ready, "terminating": False},
                       "targetRef": {"kind": "Pod", "name": p.name, "namespace": namespace}} for p in pods],
    }


def write_manifests(path: str, objects: Sequence[Manifest]) -> None:
    """Multi-document YAML (each document JSON, which YAML reads as is), replaced atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join("---\n" + json.dumps(o, indent=1) + "\n" for o in objects))
    os.replace(tmp, path)  # a watcher sees a whole file or the old one, never half of one


# ---- driving netproxy --------------------------------------------------------------------------


class Proxy:
    """netproxy in the sandbox's node, run with one combination's flags."""

    def __init__(self, sandbox: Sandbox, combo: Combo, workdir: str) -> None:
        self.sandbox, self.combo = sandbox, combo
        self.workdir = workdir
        self.source = os.path.join(workdir, "cluster.yaml")
        self.run_log = ""
        self._runs: List[subprocess.Popen] = []  # type: ignore[type-arg]
        # /run/xtables.lock is one file for every namespace of the machine: other test runs' legacy
        # writes (a 10k-rule bench) may hold it for longer than the 5 s default, which would fail a
        # one-shot sync here for a reason outside the test.  tests/faults/test_lock.py tests the default.
        self.base_flags = ["--hostname-override", NODE_NAME, "--iptables-lock-timeout", "60s"]

    def command(self, verb: str, *extra: str, combo_flags: bool = True) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        args = [verb, *extra, *(self.combo.flags if combo_flags else [])]
        return self.sandbox.netproxy(args, flavour=self.combo.path_flavour)

    def sync(self, objects: Sequence[Manifest], *, expect: int = 0) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        """Write ``objects`` as the source and run ``netproxy sync``; asserts the exit status."""
        write_manifests(self.source, objects)
        proc = self.command("sync", "--source", self.source, *self.base_flags)
        assert proc.returncode == expect, _explain(f"sync exited {proc.returncode}, expected {expect}", proc)
        return proc

    def cleanup(self, *, expect: int = 0) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        proc = self.command("cleanup")
        assert proc.returncode == expect, _explain(f"cleanup exited {proc.returncode}", proc)
        return proc

    def start_run(self, objects: Sequence[Manifest], *extra: str) -> subprocess.Popen:  # type: ignore[type-arg]
        """``netproxy run --source FILE`` in the background; stopped after the test."""
        write_manifests(self.source, objects)
        self.run_log = os.path.join(self.workdir, f"run-{len(self._runs)}.log")
        args = ["run", "--source", self.source, "--metrics-bind-address", "", *self.base_flags, *self.combo.flags]
        proc = self.sandbox.start_netproxy([*args, *extra], flavour=self.combo.path_flavour, log_path=self.run_log)
        self._runs.append(proc)
        return proc

    def run_output(self) -> str:
        """The latest ``run``'s log so far (its stdout and stderr)."""
        try:
            with open(self.run_log, errors="replace") as f:
                return f.read()
        except (OSError, AttributeError):
            return ""

    def running(self) -> Optional[bool]:
        """Whether the latest ``run`` is alive (None: none started)."""
        return self._runs[-1].poll() is None if self._runs else None

    def stop_runs(self) -> List[int]:
        """SIGTERM every ``run`` this proxy started; their exit codes."""
        codes = []
        for proc in self._runs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            codes.append(proc.returncode)
        self._runs.clear()
        return codes

    def ruleset(self) -> str:
        """What an operator would read: ``iptables-<flavour>-save`` (v4 and v6) and ``nft list ruleset``."""
        parts = []
        if has_iptables(self.combo.flavour):
            for tool in (f"iptables-{self.combo.flavour}-save", f"ip6tables-{self.combo.flavour}-save"):
                parts.append(self.sandbox.exec(self.sandbox.node, [tool], check=True).stdout)
        if shutil.which("nft"):
            parts.append(self.sandbox.exec(self.sandbox.node, ["nft", "list", "ruleset"], check=True).stdout)
        return "\n".join(parts)

    def reset(self) -> None:
        self.stop_runs()
        self.sandbox.reset_netfilter()


def _explain(headline: str, proc: subprocess.CompletedProcess) -> str:  # type: ignore[type-arg]
    return f"{headline}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"


# Waits are stretched by NETPROXY_TEST_TIME_SCALE (vagrant/guest-test sets 4 under QEMU's software
# emulation, where a process start costs seconds); 1 on real hardware, so host runs stay strict.
TIME_SCALE = float(os.environ.get("NETPROXY_TEST_TIME_SCALE", "1") or "1")


SETTLING = [0]
"""How many :func:`wait_for` loops are running: traffic sent inside one is not traced
(tests/kernel/traced.py), since the change waited for may reach the kernel between a batch and its trace."""


def wait_for(check: Callable[[], Optional[str]], timeout: float, step: float = 0.2) -> float:
    """Poll ``check`` (None = done, else why not yet) until done; the seconds it took; asserts.

    ``timeout`` is multiplied by :data:`TIME_SCALE`."""
    timeout *= TIME_SCALE
    t0 = time.monotonic()
    why: Optional[str] = "never checked"
    SETTLING[0] += 1
    try:
        while time.monotonic() - t0 < timeout:
            why = check()
            if why is None:
                return time.monotonic() - t0
            time.sleep(step)
    finally:
        SETTLING[0] -= 1
    raise AssertionError(f"not within {timeout}s: {why}")


def assert_only_and_all(result: ConnectResult, pods: Sequence[Pod], *, total: int, at_least: int = 1) -> None:
    """Every attempt answered, by exactly ``pods`` (each at least ``at_least`` times)."""
    want = sorted(p.name for p in pods)
    assert result.errors == {}, f"failed attempts {result.errors}; answers {result.counts}"
    assert sorted(result.counts) == want, f"answered by {result.counts}, expected exactly {want}"
    assert result.answered == total
    low = {pod: n for pod, n in result.counts.items() if n < at_least}
    assert not low, f"endpoints below {at_least} of {total}: {low} (all: {result.counts})"


# ---- fixtures ----------------------------------------------------------------------------------


def _netns_works() -> Optional[str]:
    probe = f"np-probe-{os.getpid()}"
    try:
        add = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if add.returncode != 0:
            return f"`ip netns add` failed: {add.stderr.strip()}"
        return None
    except OSError as err:
        return f"`ip` not runnable: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@pytest.fixture(scope="session")
def kernel_env() -> None:
    """Root and working ``ip netns`` — or skip (fail under CI=true)."""
    require(os.geteuid() == 0, "kernel tests need root")
    why = _netns_works()
    require(why is None, why or "")
    require(importlib.util.find_spec("pyroute2") is not None, "pyroute2 is not importable")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "combo" in metafunc.fixturenames:
        combos = selected_combos()
        metafunc.parametrize("combo", combos, ids=[c.name for c in combos], scope="module", indirect=True)


@pytest.fixture(scope="module")
def combo(request: pytest.FixtureRequest, kernel_env: None) -> Combo:
    chosen: Combo = request.param
    why = chosen.missing()
    require(why is None, f"{chosen.name}: {why}")
    return chosen


@pytest.fixture(scope="module")
def sandbox(kernel_env: None, combo: Combo) -> Iterator[Sandbox]:
    """Four pods (pod-3 is never an endpoint unless a test says so), per module and combination."""
    with Sandbox(pods=4, tcp_ports=(8080, 9090), udp_ports=(8080,)) as sb:
        yield sb


def driven(sandbox: Sandbox, combo: Combo, workdir: str) -> Iterator[Proxy]:
    """A :class:`Proxy` for one test on an emptied node; its runs stopped and the node reset after."""
    driver = Proxy(sandbox, combo, workdir)
    sandbox.reset_netfilter()
    try:
        yield driver
    finally:
        driver.reset()


@pytest.fixture()
def proxy(sandbox: Sandbox, combo: Combo, tmp_path: Any) -> Iterator[Proxy]:
    yield from driven(sandbox, combo, str(tmp_path))


@pytest.fixture(scope="module")
def bare_sandbox(kernel_env: None) -> Iterator[Sandbox]:
    """A sandbox for tests that choose their own flags (start-up selection, harness self-tests)."""
    with Sandbox(pods=3) as sb:
        yield sb
    # No netfilter reset needed: the namespaces, and all their tables, are gone.


__all__ = [
    "COMBOS", "Combo", "Manifest", "Proxy", "SandboxError", "assert_only_and_all", "bare_sandbox", "combo",
    "endpoint_slice", "in_ci", "kernel_env", "port", "proxy", "pytest_generate_tests", "require", "sandbox",
    "selected_combos", "service", "wait_for", "write_manifests",
]
