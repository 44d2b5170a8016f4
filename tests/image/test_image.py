"""The container image, as `make image` builds it and as the DaemonSet runs it.

`scripts/build-image` (idempotent: seconds when nothing changed) builds ``localhost/netproxy:<version>``;
then the image prints its version with no network at all, carries the production wheel only, and
inside a network namespace made for the test — never the host's — with only ``NET_ADMIN`` and
``NET_RAW``, the host's xtables lock mounted and the entrypoint choosing the iptables flavour as on a
node, it programs that namespace from ``examples/cluster.yaml`` on nftables and on iptables-legacy:
every service address of the example answers from its pods (the demo's probes), ``/healthz`` answers
200, SIGTERM stops it with 0, and the image's ``cleanup`` then leaves no table, chain or set of
netproxy's behind.

podman runs with the project's ``deploy/image/containers.conf`` (``CONTAINERS_CONF``).  Without root,
podman or mmdebstrap the tests skip; under ``CI=true`` they fail instead (``make image`` installs
podman and mmdebstrap; run-tests' image stage runs it first).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping

import pytest

from netproxy.source.files import flatten, read_documents
from netproxy_lab.demo import pods_of, print_table, probes_for, run_probe, wait_until
from netproxy_lab.pytest_plugin import require
from netproxy_lab.topology import GATEWAY4, Sandbox

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cluster.yaml"
CONTAINERS_CONF = REPO / "deploy" / "image" / "containers.conf"
XTABLES_LOCK = "/run/xtables.lock"
MAX_MB = 250
HEALTHZ_PORT = 10256


def version() -> str:
    """pyproject.toml's, the one source (tests/unit/test_version.py)."""
    found = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml has no version"
    return found.group(1)


def podman(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert proc.returncode == 0, f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def image() -> str:
    """The image of this tree's version, built (or found up to date) by scripts/build-image."""
    require(os.geteuid() == 0, "the image tests need root (podman, network namespaces)")
    for tool in ("podman", "mmdebstrap", "runc"):
        require(shutil.which(tool) is not None, f"{tool} is not installed (`make image` installs it)")
    t0 = time.monotonic()
    proc = subprocess.run([str(REPO / "scripts" / "build-image")], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"scripts/build-image exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    print(f"scripts/build-image: {time.monotonic() - t0:.0f} s\n{proc.stderr}", file=sys.stderr)
    return f"localhost/netproxy:{version()}"


def test_version_with_no_network(image: str) -> None:
    proc = podman("run", "--rm", "--network", "none", image, "--version")
    assert proc.stdout == f"netproxy {version()}\n"


def test_carries_the_production_wheel_only(image: str) -> None:
    """No lab, no tests, no pip; every module of the product imports (so none of them needs the lab
    or a test dependency), and so does the Kubernetes client the API source uses."""
    script = """
import importlib, importlib.util, json, os, pkgutil, site
import netproxy
mods = [m.name for m in pkgutil.walk_packages(netproxy.__path__, "netproxy.") if not m.name.endswith(".__main__")]
for name in mods:
    importlib.import_module(name)
from kubernetes import client, config
sp = site.getsitepackages()[0]
print(json.dumps({"modules": len(mods), "entries": sorted(os.listdir(sp)),
                  "product": sorted(os.listdir(os.path.join(sp, "netproxy"))),
                  "found": {m: importlib.util.find_spec(m) is not None
                            for m in ("netproxy_lab", "tests", "pytest", "pip", "hypothesis")}}))
"""
    proc = podman("run", "--rm", "--network", "none", "--entrypoint", "/opt/netproxy/bin/python", image,
                  "-c", script)
    seen = json.loads(proc.stdout)
    assert seen["found"] == {"netproxy_lab": False, "tests": False, "pytest": False, "pip": False,
                             "hypothesis": False}, seen["found"]
    assert "lab" not in seen["product"] and "netproxy_lab" not in seen["entries"], seen
    assert not [e for e in seen["entries"] if e.startswith(("netproxy_lab", "netproxy-lab", "tests"))], seen
    assert seen["modules"] > 50, seen["modules"]


def test_size_is_within_budget(image: str) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout)
    print(f"{image}: {size / 1e6:.0f} MB", file=sys.stderr)
    assert size <= MAX_MB * 1_000_000, f"{image} is {size / 1e6:.0f} MB, above {MAX_MB} MB"


# -- in a network namespace, as the DaemonSet runs it --------------------------------------------

def example_objects() -> List[Dict[str, Any]]:
    return [dict(o) for o in flatten(read_documents(str(EXAMPLE))) if isinstance(o, Mapping)]


@pytest.fixture()
def node() -> Iterator[Sandbox]:
    """The demo's sandbox: one pod namespace at each endpoint address of the example."""
    objects = example_objects()
    ports = sorted({int(p["port"]) for o in objects if o.get("kind") == "EndpointSlice" for p in o["ports"]})
    with Sandbox(pods=0, tcp_ports=ports, udp_ports=ports, ipv6=False) as box:
        for addr, name in sorted(pods_of(objects).items()):
            box.add_pod(name, ip=addr, start=False)
        for pod in box.pods:
            box.start_server(pod)
        yield box


def in_node(box: Sandbox, image: str, *args: str, name: str = "", detach: bool = False, init: bool = False,
            timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman run`` of the image in the sandbox's node namespace (never the host's), as the
    DaemonSet runs it: the proxy container with NET_ADMIN and NET_RAW only and the host's xtables
    lock (the example read-only as its source); ``init``: the init container, privileged with the
    host's /lib/modules read-only (the sysctls it sets are the node namespace's own)."""
    netns = f"/run/netns/{box.node}"
    assert os.path.exists(netns), netns
    argv = ["run", "--network", f"ns:{netns}"]
    if init:
        argv += ["--privileged"]
        if os.path.isdir("/lib/modules"):  # a kernel with its netfilter built in has none
            argv += ["--volume", "/lib/modules:/lib/modules:ro"]
    else:
        argv += ["--cap-drop", "all", "--cap-add", "NET_ADMIN,NET_RAW", "--volume", f"{XTABLES_LOCK}:{XTABLES_LOCK}",
                 "--volume", f"{EXAMPLE}:/etc/netproxy/cluster.yaml:ro"]
    argv += ["--detach", "--name", name] if detach else ["--rm"]
    return podman(*argv, image, *args, timeout=timeout, check=check)


def node_tables(box: Sandbox) -> Mapping[str, List[str]]:
    """What the node namespace holds: nft tables, legacy iptables chains and rules, ipsets."""
    nft = box.exec(box.node, ["nft", "list", "tables"], check=True).stdout.split("\n")
    legacy = [line for tool in ("iptables-legacy-save", "ip6tables-legacy-save")
              for line in box.exec(box.node, [tool], check=True).stdout.splitlines()
              if line.startswith(("-A", ":")) and not line.startswith((":PREROUTING", ":INPUT", ":FORWARD",
                                                                        ":OUTPUT", ":POSTROUTING"))]
    sets = box.exec(box.node, [sys.executable, "-c", "from netproxy.backends.iptables.ipset import KernelIpsets; "
                               "print(*sorted(KernelIpsets().sets()))"], check=True).stdout.split()
    return {"nft": [t for t in nft if t], "legacy": legacy, "ipsets": sets}


def healthz(box: Sandbox) -> int:
    """/healthz's status from the client namespace to the node's address, as the kubelet probes it."""
    code = ("import urllib.request, urllib.error\n"
            f"try: print(urllib.request.urlopen('http://{GATEWAY4}:{HEALTHZ_PORT}/healthz', timeout=3).status)\n"
            "except urllib.error.HTTPError as e: print(e.code)\n")
    proc = box.exec(box.client, [sys.executable, "-c", code], check=True)
    return int(proc.stdout.strip())


@pytest.mark.parametrize("flavour", ["nft", "legacy"])
def test_programs_a_namespace_and_cleans_it(image: str, node: Sandbox, flavour: str) -> None:
    """The entrypoint picks the node's flavour as on a real node: kubelet's KUBE-IPTABLES-HINT chain
    in the legacy mangle table says legacy (then netproxy's version check picks its iptables backend);
    an empty node is nft (then nftables)."""
    box = node
    backend = {"nft": "nftables", "legacy": "iptables"}[flavour]
    if flavour == "legacy":
        box.exec(box.node, ["iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"], check=True)
    kubelets = [":KUBE-IPTABLES-HINT - [0:0]"] if flavour == "legacy" else []
    if not os.path.exists(XTABLES_LOCK):
        open(XTABLES_LOCK, "a").close()  # what the DaemonSet's hostPath FileOrCreate does
    name = f"np-image-{box.id}-{secrets.token_hex(2)}"
    try:
        # The init container first: route_localnet (NodePorts on 127.0.0.1, iptables) is a sysctl the
        # proxy container's read-only /proc/sys cannot set.
        init = in_node(box, image, "run", "--init-only", "--hostname-override=np-node", init=True)
        assert f"host iptables flavour: {flavour}" in init.stderr, init.stderr
        in_node(box, image, "run", "--source=/etc/netproxy/cluster.yaml", "--hostname-override=np-node",
                "--min-sync-period=200ms", "--metrics-bind-address=", name=name, detach=True)
        probes = probes_for(str(EXAMPLE), pods_of(example_objects()))
        programmed = wait_until(box, probes[0], timeout=60.0)
        log = podman("logs", name, check=False)
        assert programmed, f"{probes[0]} never answered:\n{log.stdout}{log.stderr}"
        rows = [(p, *run_probe(box, p)) for p in probes]
        print_table(f"the image in {box.node}, {backend}", rows)
        assert all(ok for _, _, ok, _ in rows), [(p.service, p.address, p.origin, why) for p, _, ok, why in rows
                                                  if not ok]
        assert healthz(box) == 200
        held = node_tables(box)
        if backend == "nftables":
            assert "table ip netproxy" in held["nft"], held
            assert held["legacy"] == [], held
        else:
            assert any(line.startswith("-A KUBE-SERVICES") for line in held["legacy"]), held
            assert any(s.startswith("NETPROXY-") for s in held["ipsets"]), held  # shop/cart's affinity
            assert held["nft"] == [], held
        podman("stop", "--time", "20", name)
        state = json.loads(podman("inspect", name).stdout)[0]["State"]
        log = podman("logs", name)
        text = log.stdout + log.stderr
        assert state["ExitCode"] == 0, text
        assert f"host iptables flavour: {flavour}" in text, text
        assert f"backend {backend}: " in text, text  # the version check's choice, in the start-up log
    finally:
        podman("rm", "--force", "--ignore", name, check=False)
    # The rules stay when the proxy stops (so Services keep working, as with kube-proxy) ...
    assert node_tables(box) != {"nft": [], "legacy": kubelets, "ipsets": []}
    # ... until the image's cleanup removes netproxy's, and nothing else (kubelet's hint chain stays).
    proc = in_node(box, image, "cleanup", check=False)
    assert proc.returncode == 0, proc.stderr
    assert node_tables(box) == {"nft": [], "legacy": kubelets, "ipsets": []}
