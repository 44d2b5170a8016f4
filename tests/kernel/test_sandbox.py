"""The harness itself, with rules written by hand: if these fail, no behavioural result means anything.

They prove that the topology routes (client, ext, node's own sockets, IPv4 and IPv6), that pods
report who they are and the source they saw, that a statistic/numgen DNAT is measured as balanced,
and that closing a sandbox leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from netproxy_lab.checks import assert_only_and_all
from netproxy_lab.pytest_plugin import require
from netproxy_lab.topology import CLIENT4, EXT4, NODE_EXT4, Sandbox

pytestmark = pytest.mark.kernel

VIP = "10.96.0.99"


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_pods_answer_with_name_and_source(bare_sandbox: Sandbox) -> None:
    sb = bare_sandbox
    for pod in sb.pods:
        res = sb.connect(pod.ip, 8080, count=5)
        assert res.counts == {pod.name: 5} and res.sources == {pod.name: {CLIENT4: 5}}, res
        res = sb.connect(pod.ip, 8080, count=5, proto="udp", source=sb.ext)
        assert res.counts == {pod.name: 5} and res.sources == {pod.name: {EXT4: 5}}, res
        res = sb.connect(pod.ip6, 8080, count=2)
        assert res.counts == {pod.name: 2}, res
    res = sb.connect(sb.pods[0].ip, 8081, count=3)
    assert res.errors == {"refused": 3} and res.counts == {}


def test_many_clients_from_one_namespace(bare_sandbox: Sandbox) -> None:
    sb = bare_sandbox
    addrs = sb.client_addresses(5)
    res = sb.connect(sb.pods[1].ip, 8080, count=10, sources=addrs)
    assert res.sources == {sb.pods[1].name: {a: 2 for a in addrs}}, res


def test_stopped_server_refuses_and_restarts(bare_sandbox: Sandbox) -> None:
    sb = bare_sandbox
    pod = sb.pods[2]
    sb.stop_server(pod)
    assert sb.connect(pod.ip, 8080, count=2).errors == {"refused": 2}
    sb.start_server(pod)
    assert sb.connect(pod.ip, 8080, count=2).counts == {pod.name: 2}


def _legacy_dnat(sb: Sandbox) -> str:
    n = len(sb.pods)
    lines = ["*nat", ":NP-TEST - [0:0]", f"-A PREROUTING -d {VIP}/32 -j NP-TEST", f"-A OUTPUT -d {VIP}/32 -j NP-TEST"]
    for i, pod in enumerate(sb.pods):
        odds = [] if i == n - 1 else ["-m statistic --mode random --probability", f"{1 / (n - i):.11f}"]
        lines.append(" ".join(["-A NP-TEST -p tcp --dport 80", *odds, f"-j DNAT --to-destination {pod.ip}:8080"]))
    return "\n".join(lines + ["COMMIT", ""])


def test_raw_iptables_dnat_is_measured_balanced(bare_sandbox: Sandbox) -> None:
    require(shutil.which("iptables-legacy-restore") is not None, "iptables-legacy-restore is not installed")
    sb = bare_sandbox
    sb.exec(sb.node, ["iptables-legacy-restore"], input=_legacy_dnat(sb), check=True)
    try:
        res = sb.connect(VIP, 80, count=600)
        assert_only_and_all(res, sb.pods, total=600, at_least=140)
        assert res.elapsed < 3.0, f"600 connections took {res.elapsed:.2f}s"
        # The node's own sockets take the nat OUTPUT path, with the node's address as source.
        res = sb.connect(VIP, 80, count=60, source=sb.node)
        assert_only_and_all(res, sb.pods, total=60)
        assert set(res.source_addresses()) == {NODE_EXT4}
    finally:
        sb.reset_netfilter()
    # Without the rule the address leads nowhere: attempts time out, quickly and all at once.
    res = sb.connect(VIP, 80, count=20, timeout=0.3)
    assert res.errors == {"timeout": 20} and res.elapsed < 1.5


def test_raw_nft_dnat_udp_and_fixed_source_port(bare_sandbox: Sandbox) -> None:
    require(shutil.which("nft") is not None, "nft is not installed")
    sb = bare_sandbox
    targets = ", ".join(f"{i} : {p.ip}" for i, p in enumerate(sb.pods))
    ruleset = f"""
table ip np-test {{
  chain pre {{
    type nat hook prerouting priority dstnat; policy accept;
    ip daddr {VIP} udp dport 53 dnat to numgen random mod {len(sb.pods)} map {{ {targets} }} : 8080
  }}
}}
"""
    sb.exec(sb.node, ["nft", "-f", "-"], input=ruleset, check=True)
    try:
        res = sb.connect(VIP, 53, proto="udp", count=300)
        assert_only_and_all(res, sb.pods, total=300, at_least=60)
        # One source port = one conntrack flow = one endpoint, answer after answer.
        res = sb.connect(VIP, 53, proto="udp", count=10, bind=":40053", interval=0.02)
        assert res.answered == 10 and len(res.counts) == 1, res
    finally:
        sb.reset_netfilter()
    assert "np-test" not in sb.exec(sb.node, ["nft", "list", "tables"], check=True).stdout


@pytest.mark.parametrize("flavour,marker", [("legacy", "(legacy)"), ("nft", "(nf_tables)")])
def test_iptables_bindir_selects_flavour(bare_sandbox: Sandbox, flavour: str, marker: str) -> None:
    require(shutil.which(f"iptables-{flavour}") is not None, f"iptables-{flavour} is not installed")
    path = bare_sandbox.iptables_bindir(flavour)
    env = {"PATH": path + os.pathsep + os.environ.get("PATH", "")}
    out = bare_sandbox.exec(bare_sandbox.node, ["iptables", "--version"], env=env, check=True).stdout
    assert marker in out, out


def test_close_removes_namespaces_and_processes(kernel_env: None) -> None:
    sb = Sandbox(pods=2)
    sb.setup()
    names = [sb.node, sb.client, sb.ext] + [p.netns for p in sb.pods]
    pids = [proc.pid for proc in sb._servers.values()]
    assert all(name in _namespaces() for name in names)
    sb.close()
    listed = _namespaces()
    assert not [n for n in names if n in listed]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    sb.close()  # idempotent


def test_failed_setup_cleans_up(kernel_env: None) -> None:
    sb = Sandbox(pods=1, tcp_ports=(70000,))  # the pod server cannot bind: setup fails part-way
    with pytest.raises(Exception):  # noqa: B017 - whichever error, the point is what is left behind
        sb.setup()
    assert sb.node not in _namespaces()
