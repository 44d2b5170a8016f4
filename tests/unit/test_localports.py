"""Which NodePorts the localhost relay serves, and where a connection may go (netproxy/node/localports.py)."""

from __future__ import annotations

import ipaddress

from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot
from netproxy.node.localports import families_served, targets

net = ipaddress.ip_network


def _svc(name: str, node_port: int, protocol: str = "TCP", policy: str = "Cluster") -> ServicePort:
    return ServicePort(ServicePortName("ns", name, "p"), protocol, 80, 8080,
                       cluster_ips=(ipaddress.ip_address("10.96.0.10"),), node_port=node_port,
                       external_traffic_policy=policy, service_type="NodePort")


def _ep(ip: str, node: str) -> Endpoint:
    return Endpoint(ipaddress.ip_address(ip), 8080, node_name=node)


def test_the_relay_serves_a_family_only_when_its_loopback_is_covered() -> None:
    assert families_served((net("127.0.0.0/8"), net("::1/128"))) == (4, 6)
    assert families_served((net("10.0.0.0/8"), net("::1/128"))) == (6,)
    assert families_served((net("192.0.2.1/32"),)) == ()
    assert families_served(()) == ()


def test_tcp_nodeports_with_every_endpoint_of_the_family_whatever_the_policy() -> None:
    local = _svc("local", 30080, policy="Local")
    udp = _svc("dns", 30053, protocol="UDP")
    none = _svc("empty", 30090)
    snap = Snapshot({s.name: s for s in (local, udp, none)},
                    {local.name: (_ep("10.1.0.1", "node-a"), _ep("10.1.0.2", "node-b"), _ep("fd01::1", "node-a"))},
                    node=NodeInfo("node-a"))
    got = targets(snap, (4, 6))
    # externalTrafficPolicy Local: the node's own connection is its exception (every endpoint)
    assert got[(4, 30080)] == (("10.1.0.1", 8080), ("10.1.0.2", 8080))
    assert got[(6, 30080)] == (("fd01::1", 8080),)
    assert got[(4, 30090)] == ()  # listened on, and reset: no endpoint
    assert (4, 30053) not in got  # TCP only, as kube-proxy's relay
