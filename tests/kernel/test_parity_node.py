"""kube-proxy parity (docs/parity.md): what counts as a local pod's traffic
(``--detect-local-mode``) and which node addresses take NodePorts (``--nodeport-addresses primary``,
127.0.0.1 with ``--iptables-localhost-nodeports``), one test body per behaviour on every
backend/writer, with real traffic in the sandbox (tests/kernel/README.md).

The sandbox's pods hang off the node on veths named ``v-pod<n>``, the in-cluster client on
``v-client`` (10.244.1.2): an interface prefix ``v-pod`` makes the pods local and the client not, a
"bridge" ``v-client`` the other way round; a Node whose ``spec.podCIDRs`` is 10.244.1.8/29 holds the
pods (.10 to .14) and not the client.
"""

from __future__ import annotations

import subprocess
from typing import Any, Dict, List, Optional

import pytest

from netproxy_lab.checks import NOT_SERVED_TIMEOUT, TIME_SCALE, assert_not_served, assert_only_and_all
from netproxy_lab.manifests import Manifest, endpoint_slice, service, write_manifests
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import CLIENT4, CLIENT6, EXT4, GATEWAY4, GATEWAY6, NODE_EXT4, NODE_EXT6, NODE_NAME, Sandbox
from tests.kernel.test_parity import (  # the shared body's helpers and its five-pod sandbox (pods 3-4 remote)
    ANSWER_TIMEOUT,
    DROP_TIMEOUT,
    KINDS,
    NODE_PORT,
    SVC_IP,
    SVC_IP6,
    alive,
    assert_dropped,
    assert_masqueraded,
    assert_preserved,
    connect_all,
    ep,
    http_port,
    local,
    port,
    remote,
    run_wait,
    sandbox,
    sources_of,
    trace_equals_traffic,  # noqa: F401  (autouse: every batch traced with trace --kernel, traced.py)
    web,
)

pytestmark = pytest.mark.kernel
__all__ = ["sandbox"]

POD_CIDR = "10.244.1.8/29"


def node_object(pod_cidrs: Any = None, internal_ip: str = "") -> Manifest:
    obj: Manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME}, "spec": {}, "status": {}}
    if pod_cidrs:
        obj["spec"]["podCIDRs"] = list(pod_cidrs)
    if internal_ip:
        obj["status"]["addresses"] = [{"type": "InternalIP", "address": internal_ip}]
    return obj


# mode -> (flags, extra objects, is the client local, is a pod local)
MODES: Dict[str, Any] = {
    "ClusterCIDR": (["--cluster-cidr", "10.244.0.0/16"], [], True, True),
    "NodeCIDR": (["--detect-local-mode", "NodeCIDR", "--cluster-cidr", "10.244.0.0/16"],
                 [node_object([POD_CIDR])], False, True),
    "BridgeInterface": (["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "v-client",
                         "--cluster-cidr", "10.244.0.0/16"], [], True, False),
    "InterfaceNamePrefix": (["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "v-pod"],
                            [], False, True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_detect_local_mode(mode: str, proxy: Proxy, sandbox: Sandbox) -> None:
    """Cluster traffic from a local pod keeps its source, from anything else is masqueraded; external
    traffic to an externalTrafficPolicy Local service without local endpoints reaches the (remote)
    endpoints from a local pod and is dropped from anything else (kube-proxy's exception)."""
    flags, objects, client_local, pod_local = MODES[mode]
    here, there = local(sandbox)[:2], remote(sandbox)
    pod = local(sandbox)[2]  # not an endpoint: a pod as a client
    proxy.base_flags = [*proxy.base_flags, *flags]
    proxy.sync([*web(here), *web(there, name="far", cluster_ip="10.96.1.11", node_port=NODE_PORT + 1,
                                 externalTrafficPolicy="Local"), *objects])
    from_client, from_pod, from_ext = connect_all(
        sandbox,
        (SVC_IP, 80, {"count": 30}),
        (SVC_IP, 80, {"count": 30, "source": pod.netns}),
        (SVC_IP, 80, {"count": 30, "source": sandbox.ext}),
    )
    for res in (from_client, from_pod, from_ext):
        assert_only_and_all(res, here, total=30)
    (assert_preserved if client_local else assert_masqueraded)(from_client, CLIENT4)
    (assert_preserved if pod_local else assert_masqueraded)(from_pod, pod.ip)
    assert_masqueraded(from_ext, EXT4)

    exempt = {"count": 30}
    dropped = {"count": 2, "timeout": DROP_TIMEOUT}
    client_call = (GATEWAY4, NODE_PORT + 1, dict(exempt if client_local else dropped))
    pod_call = (GATEWAY4, NODE_PORT + 1, dict(exempt if pod_local else dropped, source=pod.netns))
    for res, is_local in zip(connect_all(sandbox, client_call, pod_call), (client_local, pod_local)):
        if is_local:
            assert_only_and_all(res, there, total=30)
        else:
            assert_dropped(res, 2)


def _route_localnet(sb: Sandbox, ns: str) -> str:
    return sb.exec(ns, ["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"], check=True).stdout.strip()


def test_nodeport_on_localhost(proxy: Proxy, sandbox: Sandbox) -> None:
    """iptables (kube-proxy's iptables mode): NodePorts answer on 127.0.0.1 from the node, masqueraded,
    with route_localnet set in the node's namespace only; --iptables-localhost-nodeports=false turns
    that off.  nftables (kube-proxy's nftables mode): never on 127.0.0.1."""
    pods = local(sandbox)
    with open("/proc/sys/net/ipv4/conf/all/route_localnet") as f:
        host_before = f.read().strip()
    sandbox.exec(sandbox.node, ["sh", "-c", "echo 0 > /proc/sys/net/ipv4/conf/all/route_localnet"], check=True)
    objects = web(pods, node_port=NODE_PORT)
    proxy.sync(objects)
    served = proxy.combo.backend == "iptables"
    res = sandbox.connect("127.0.0.1", NODE_PORT, count=30 if served else 2, source=sandbox.node,
                          timeout=ANSWER_TIMEOUT if served else NOT_SERVED_TIMEOUT)
    if served:
        assert_only_and_all(res, pods, total=30)
        assert_masqueraded(res, "127.0.0.1")
        assert _route_localnet(sandbox, sandbox.node) == "1"
        rules = proxy.ruleset()
        assert "block incoming localnet connections" in rules
    else:
        assert_not_served(res, 2, KINDS["localhost-nodeport"], f"127.0.0.1:{NODE_PORT} on nftables")
        assert _route_localnet(sandbox, sandbox.node) == "0"
    with open("/proc/sys/net/ipv4/conf/all/route_localnet") as f:
        assert f.read().strip() == host_before, "the host's route_localnet changed"
    # The node's other addresses are unaffected either way.
    assert_only_and_all(sandbox.connect(NODE_EXT4, NODE_PORT, count=30, source=sandbox.ext), pods, total=30)

    sandbox.reset_netfilter()
    sandbox.exec(sandbox.node, ["sh", "-c", "echo 0 > /proc/sys/net/ipv4/conf/all/route_localnet"], check=True)
    proxy.base_flags = [*proxy.base_flags, "--iptables-localhost-nodeports=false"]
    proxy.sync(objects)
    res = sandbox.connect("127.0.0.1", NODE_PORT, count=2, timeout=NOT_SERVED_TIMEOUT, source=sandbox.node)
    assert_not_served(res, 2, KINDS["localhost-off"], f"--iptables-localhost-nodeports=false: 127.0.0.1:{NODE_PORT}")
    assert _route_localnet(sandbox, sandbox.node) == "0"
    assert "block incoming localnet connections" not in proxy.ruleset()


def test_nodeport_addresses_primary(proxy: Proxy, sandbox: Sandbox) -> None:
    """--nodeport-addresses primary: NodePorts on the Node's InternalIP only; without the flag the
    nftables backend does the same (kube-proxy's nftables default) and iptables takes every local
    address (its iptables default)."""
    pods = local(sandbox)
    objects: List[Manifest] = [*web(pods, node_port=NODE_PORT), node_object(internal_ip=NODE_EXT4)]

    def answers() -> Dict[str, bool]:
        primary, other = connect_all(sandbox, (NODE_EXT4, NODE_PORT, {"count": 6, "source": sandbox.ext}),
                                     (GATEWAY4, NODE_PORT, {"count": 2, "timeout": DROP_TIMEOUT}))
        assert primary.answered == 6, f"{NODE_EXT4}:{NODE_PORT} (the InternalIP): {primary.counts} {primary.errors}"
        return {"other": other.answered > 0}

    base = list(proxy.base_flags)
    proxy.base_flags = [*base, "--nodeport-addresses", "primary"]
    proxy.sync(objects)
    assert answers() == {"other": False}
    assert_only_and_all(sandbox.connect(SVC_IP, 80, count=30), pods, total=30)  # the ClusterIP is unaffected

    sandbox.reset_netfilter()
    proxy.base_flags = base
    proxy.sync(objects)
    assert answers() == {"other": proxy.combo.backend == "iptables"}


def test_primary_without_a_node_address_is_every_local_address(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy falls back to every local address when the Node has no InternalIP/ExternalIP."""
    pods = local(sandbox)
    proxy.base_flags = [*proxy.base_flags, "--nodeport-addresses", "primary"]
    proxy.sync([service("np", SVC_IP, [http_port(NODE_PORT)], type="NodePort"),
                endpoint_slice("np", [ep(p) for p in pods], [port(8080, name="http")])])
    for res in connect_all(sandbox, (NODE_EXT4, NODE_PORT, {"count": 30, "source": sandbox.ext}),
                           (GATEWAY4, NODE_PORT, {"count": 30})):
        assert_only_and_all(res, pods, total=30)


def test_node_cidr_run_exits_when_the_pod_cidrs_change(proxy: Proxy, sandbox: Sandbox) -> None:
    """netproxy run in NodeCIDR mode keeps the pod CIDRs it started with and exits 1 when the Node's
    change (kube-proxy's NodeManager does the same), so that its supervisor starts it again."""
    here, pod = local(sandbox)[:2], local(sandbox)[2]
    objects = web(here)
    proc = proxy.start_run([*objects, node_object([POD_CIDR])], "--detect-local-mode", "NodeCIDR")

    def preserved() -> Optional[str]:
        alive(proxy)
        res = sandbox.connect(SVC_IP, 80, count=6, source=pod.netns)
        return None if sources_of(res) == {pod.ip} else f"sources {res.sources}, errors {res.errors}"

    run_wait(proxy, preserved, timeout=15)
    assert preserved() is None  # settled: one batch outside the wait loop, traced (trace equals traffic)
    write_manifests(proxy.source, [*objects, node_object(["10.244.2.0/24"])])
    try:
        code = proc.wait(timeout=10 * TIME_SCALE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after the pod CIDRs changed:\n{proxy.run_output()[-2000:]}") from None
    assert code == 1, proxy.run_output()[-2000:]
    assert "spec.podCIDRs changed" in proxy.run_output()


@pytest.mark.parametrize("mode", ["BridgeInterface", "InterfaceNamePrefix"])
def test_detect_local_mode_by_interface_over_ipv6(mode: str, proxy: Proxy, sandbox: Sandbox) -> None:
    """The interface detectors know no address family: IPv6 cluster traffic from a local pod keeps
    its source, from anything else it is masqueraded to a node address (ip6tables / the ip6 table)."""
    flags, _, client_local, pod_local = MODES[mode]
    here, pod = local(sandbox)[:2], local(sandbox)[2]
    http = [port(8080, name="http")]
    proxy.base_flags = [*proxy.base_flags, *flags]
    proxy.sync([service("web6", SVC_IP6, [http_port()], clusterIPs=[SVC_IP6], ipFamilies=["IPv6"]),
                endpoint_slice("web6", [ep(p, ipv6=True) for p in here], http, address_type="IPv6")])
    from_client, from_pod = connect_all(sandbox, (SVC_IP6, 80, {"count": 30}),
                                        (SVC_IP6, 80, {"count": 30, "source": pod.netns}))
    node6 = {GATEWAY6, NODE_EXT6}
    for res, own, is_local in ((from_client, CLIENT6, client_local), (from_pod, pod.ip6, pod_local)):
        assert_only_and_all(res, here, total=30)
        seen = sources_of(res)
        assert (seen == {own}) if is_local else (seen and seen <= node6), \
            f"{mode}: pods saw {res.sources}; {own} is {'local' if is_local else 'not local'}"


def test_nodeport_addresses_primary_and_localhost(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy 1.37's keywords combined: ``primary,localhost`` takes the InternalIP and 127.0.0.1
    on iptables (route_localnet), the InternalIP only on nftables' rules: there localhost is served
    by ``run``'s userspace relay (KEP-6032; test_run_answers_nodeports_on_localhost_on_every_backend),
    which a one-shot ``sync`` does not leave behind."""
    pods = local(sandbox)
    sandbox.exec(sandbox.node, ["sh", "-c", "echo 0 > /proc/sys/net/ipv4/conf/all/route_localnet"], check=True)
    proxy.base_flags = [*proxy.base_flags, "--nodeport-addresses", "primary,localhost"]
    proxy.sync([*web(pods, node_port=NODE_PORT), node_object(internal_ip=NODE_EXT4)])
    primary, loopback, other = connect_all(
        sandbox,
        (NODE_EXT4, NODE_PORT, {"count": 30, "source": sandbox.ext}),
        ("127.0.0.1", NODE_PORT, {"count": 30, "timeout": DROP_TIMEOUT, "source": sandbox.node}),
        (GATEWAY4, NODE_PORT, {"count": 2, "timeout": DROP_TIMEOUT}),
    )
    assert_only_and_all(primary, pods, total=30)
    assert_not_served(other, 2, KINDS["unlisted-nodeport"], f"{GATEWAY4}:{NODE_PORT} (not listed)")
    if proxy.combo.backend == "iptables":
        assert_only_and_all(loopback, pods, total=30)
        assert _route_localnet(sandbox, sandbox.node) == "1"
    else:
        assert_not_served(loopback, 30, KINDS["localhost-nodeport"], f"127.0.0.1:{NODE_PORT} on nftables's rules")


@pytest.mark.untraced  # every batch is in a wait loop, and on nftables run's userspace relay answers, not a rule
def test_run_answers_nodeports_on_localhost_on_every_backend(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy 1.38: ``run`` answers a TCP NodePort on 127.0.0.1 and ::1 when --nodeport-addresses
    covers them — iptables by DNAT (route_localnet, IPv4), nftables through its userspace relay
    (KEP-6032, never route_localnet). The node's own connection is externalTrafficPolicy Local's
    exception: every endpoint answers, on this node or not; the relay follows endpoint changes, and
    a NodePort without endpoints is refused."""
    pods = [*local(sandbox)[:2], *remote(sandbox)[:1]]
    sandbox.exec(sandbox.node, ["sh", "-c", "echo 0 > /proc/sys/net/ipv4/conf/all/route_localnet"], check=True)
    http = [port(8080, name="http")]

    def cluster(eps: List[Any]) -> List[Manifest]:
        return [service("web", SVC_IP, [http_port(NODE_PORT)], type="NodePort", externalTrafficPolicy="Local",
                        clusterIPs=[SVC_IP, SVC_IP6], ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack"),
                endpoint_slice("web", [ep(p) for p in eps], http, suffix="v4"),
                endpoint_slice("web", [ep(p, ipv6=True) for p in eps], http, suffix="v6", address_type="IPv6"),
                node_object(internal_ip=NODE_EXT4)]

    proxy.start_run(cluster(pods), "--nodeport-addresses", "primary,localhost")

    def answered_by(address: str, want: List[Any]) -> Any:
        def check() -> Optional[str]:
            alive(proxy)
            res = sandbox.connect(address, NODE_PORT, count=30, timeout=1.0, source=sandbox.node)
            return None if sorted(res.counts) == sorted(p.name for p in want) and not res.errors else \
                f"{address}:{NODE_PORT} answered by {res.counts}, errors {res.errors}"
        return check

    run_wait(proxy, answered_by("127.0.0.1", pods), timeout=20, step=0.5)
    if proxy.combo.backend == "nftables":
        run_wait(proxy, answered_by("::1", pods), timeout=10, step=0.5)  # iptables' DNAT is IPv4 only
        with open("/proc/sys/net/ipv4/conf/all/route_localnet") as f:
            assert f.read().strip() == "0"
        assert sandbox.exec(sandbox.node, ["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"]).stdout.strip() == "0"
    # Endpoints move: so does the relay (or the DNAT).
    write_manifests(proxy.source, cluster(pods[:1]))
    run_wait(proxy, answered_by("127.0.0.1", pods[:1]), timeout=15, step=0.5)
    write_manifests(proxy.source, cluster([]))

    def refused() -> Optional[str]:
        res = sandbox.connect("127.0.0.1", NODE_PORT, count=3, timeout=DROP_TIMEOUT, source=sandbox.node)
        return None if res.answered == 0 else f"answered {res.counts} without endpoints"
    run_wait(proxy, refused, timeout=15, step=0.5)
    assert proxy.stop_runs() == [0], proxy.run_output()[-3000:]
    if proxy.combo.backend == "nftables":  # kube-proxy's gate turns the relay off
        proxy.start_run(cluster(pods), "--nodeport-addresses", "primary,localhost",
                        "--feature-gates", "KubeProxyNFTablesLocalhostNodePorts=false")
        run_wait(proxy, answered_by(NODE_EXT4, pods), timeout=20, step=0.5)
        run_wait(proxy, refused, timeout=5, step=0.5)
        assert proxy.stop_runs() == [0], proxy.run_output()[-3000:]
