"""One kernel-free flow table, run over both backends through their own tracers.

Each row is a cluster, a first packet and what must become of it: the DNAT targets with their
shares and whether the source is masqueraded, or a refusal, a drop, or nothing of netproxy's. The
same row runs on the iptables backend (its rendered tables, walked rule by rule) and the nftables
backend (its rendered tables, run expression by expression): the two renderings of docs/parity.md
must send every packet the same way. No kernel is read or written.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import pytest

from netproxy.backends import create
from netproxy.backends.base import Outcome, Packet
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Endpoint, NodeInfo, ServicePort, Snapshot
from netproxy_lab.manifests import service_port

ip = ipaddress.ip_address
net = ipaddress.ip_network

NODE = "node-a"
NODE_IP = "192.168.1.10"
CLUSTER_IP, CLUSTER_IP6, EXT_IP, LB_IP, NODE_PORT = "10.96.0.10", "fd00:96::10", "203.0.113.10", "198.51.100.10", 30080
LOCAL, REMOTE, LOCAL6 = "10.244.1.5", "10.244.2.5", "fd00:244:1::5"
POD, OUTSIDE = "10.244.1.99", "172.16.0.7"  # a pod on this node; a client outside the cluster
CONFIG = ProxyConfig(hostname=NODE, cluster_cidrs=(net("10.244.0.0/16"), net("fd00:244::/32")))


def svc(**kw: Any) -> ServicePort:
    return service_port(cluster_ip=CLUSTER_IP, **kw)


def eps(*addresses: str, **kw: Any) -> Tuple[Endpoint, ...]:
    where = {LOCAL: NODE, LOCAL6: NODE}
    return tuple(Endpoint(ip(a), 8080, node_name=where.get(a, "node-b"), **kw) for a in addresses)


Expect = Dict[str, Tuple[float, bool]]
"""``{"10.244.1.5:8080": (share, masqueraded)}``, or ``{"reject" | "drop" | "accept": (1.0, False)}``."""


class Row(NamedTuple):
    name: str
    service: ServicePort
    endpoints: Tuple[Endpoint, ...]
    packet: Packet
    expect: Expect
    node: NodeInfo = NodeInfo(name=NODE, addresses=(ip(NODE_IP),))


def half(a: str, b: str, masq: bool) -> Expect:
    return {f"{a}:8080": (0.5, masq), f"{b}:8080": (0.5, masq)}


def only(a: str, masq: bool) -> Expect:
    return {f"[{a}]:8080" if ":" in a else f"{a}:8080": (1.0, masq)}


REJECT: Expect = {"reject": (1.0, False)}
DROP: Expect = {"drop": (1.0, False)}
UNTOUCHED: Expect = {"accept": (1.0, False)}
BOTH = eps(LOCAL, REMOTE)
NODEPORT = svc(node_port=NODE_PORT, service_type="NodePort")
LOCAL_NODEPORT = svc(node_port=NODE_PORT, service_type="NodePort", external_traffic_policy="Local",
                     health_check_node_port=30999)

ROWS: List[Row] = [
    Row("clusterip from a pod", svc(), BOTH, Packet(POD, CLUSTER_IP, 80), half(LOCAL, REMOTE, False)),
    Row("clusterip from outside the cluster CIDR", svc(), BOTH, Packet(OUTSIDE, CLUSTER_IP, 80),
        half(LOCAL, REMOTE, True)),
    Row("clusterip, unknown port", svc(), BOTH, Packet(POD, CLUSTER_IP, 81), REJECT),
    Row("clusterip, other protocol", svc(), BOTH, Packet(POD, CLUSTER_IP, 80, proto="udp"), REJECT),
    Row("no endpoints", svc(), (), Packet(POD, CLUSTER_IP, 80), REJECT),
    Row("not a service", svc(), BOTH, Packet(POD, "10.96.9.9", 80), UNTOUCHED),
    Row("terminating only: serving ones used", svc(),
        eps(LOCAL, ready=False, serving=True, terminating=True) + eps(REMOTE, ready=False, serving=False,
                                                                      terminating=True),
        Packet(POD, CLUSTER_IP, 80), only(LOCAL, False)),
    Row("internalTrafficPolicy Local", svc(internal_traffic_policy="Local"), BOTH, Packet(POD, CLUSTER_IP, 80),
        only(LOCAL, False)),
    Row("internalTrafficPolicy Local, no local endpoint", svc(internal_traffic_policy="Local"), eps(REMOTE),
        Packet(POD, CLUSTER_IP, 80), DROP),
    Row("external IP from outside", svc(external_ips=(ip(EXT_IP),)), BOTH, Packet(OUTSIDE, EXT_IP, 80),
        half(LOCAL, REMOTE, True)),
    Row("load-balancer IP from outside", svc(load_balancer_ips=(ip(LB_IP),), service_type="LoadBalancer"), BOTH,
        Packet(OUTSIDE, LB_IP, 80), half(LOCAL, REMOTE, True)),
    Row("load-balancer source range refuses others",
        svc(load_balancer_ips=(ip(LB_IP),), service_type="LoadBalancer", source_ranges=(net("203.0.113.0/24"),)),
        BOTH, Packet(OUTSIDE, LB_IP, 80), DROP),
    Row("load-balancer source range admits its own",
        svc(load_balancer_ips=(ip(LB_IP),), service_type="LoadBalancer", source_ranges=(net("172.16.0.0/16"),)),
        BOTH, Packet(OUTSIDE, LB_IP, 80), half(LOCAL, REMOTE, True)),
    # kube-proxy's "same node to LB, SNATted to LB (implicitly allowed)": a range covering the node's
    # IP lets the LB IP itself in as a source (the node that holds the LB IP connects from it).
    Row("load-balancer source range covering the node admits the node holding the LB IP",
        svc(load_balancer_ips=(ip(LB_IP),), service_type="LoadBalancer", source_ranges=(net("192.168.1.0/24"),)),
        BOTH, Packet(LB_IP, LB_IP, 80, hook="output", local=frozenset({NODE_IP, LB_IP})), half(LOCAL, REMOTE, True),
        NodeInfo(name=NODE, addresses=(ip(NODE_IP),), ips=(ip(NODE_IP),))),
    Row("load-balancer source range covering the node still refuses others",
        svc(load_balancer_ips=(ip(LB_IP),), service_type="LoadBalancer", source_ranges=(net("192.168.1.0/24"),)),
        BOTH, Packet(OUTSIDE, LB_IP, 80), DROP, NodeInfo(name=NODE, addresses=(ip(NODE_IP),), ips=(ip(NODE_IP),))),
    Row("load-balancer source range not covering the node refuses the LB IP as a source",
        svc(load_balancer_ips=(ip(LB_IP),), service_type="LoadBalancer", source_ranges=(net("172.16.0.0/16"),)),
        BOTH, Packet(LB_IP, LB_IP, 80, hook="output", local=frozenset({NODE_IP, LB_IP})), DROP,
        NodeInfo(name=NODE, addresses=(ip(NODE_IP),), ips=(ip(NODE_IP),))),
    # A pod reaching itself through its ClusterIP leaves masqueraded (the nftables tracer follows nat
    # postrouting, where hairpin is marked; the iptables one KUBE-POSTROUTING), and reaching the other
    # endpoint keeps its source.
    Row("hairpin: a pod reaching itself through its ClusterIP is masqueraded", svc(), BOTH,
        Packet(LOCAL, CLUSTER_IP, 80), {f"{LOCAL}:8080": (0.5, True), f"{REMOTE}:8080": (0.5, False)}),
    Row("nodeport from outside", NODEPORT, BOTH,
        Packet(OUTSIDE, NODE_IP, NODE_PORT, local=frozenset({NODE_IP})), half(LOCAL, REMOTE, True)),
    Row("nodeport from the node itself", NODEPORT, BOTH,
        Packet(NODE_IP, NODE_IP, NODE_PORT, hook="output", local=frozenset({NODE_IP})), half(LOCAL, REMOTE, True)),
    Row("externalTrafficPolicy Local: local endpoints, source kept", LOCAL_NODEPORT, BOTH,
        Packet(OUTSIDE, NODE_IP, NODE_PORT, local=frozenset({NODE_IP})), only(LOCAL, False)),
    Row("externalTrafficPolicy Local without local endpoints: dropped", LOCAL_NODEPORT, eps(REMOTE),
        Packet(OUTSIDE, NODE_IP, NODE_PORT, local=frozenset({NODE_IP})), DROP),
    Row("externalTrafficPolicy Local: a pod's traffic is cluster traffic", LOCAL_NODEPORT, eps(REMOTE),
        Packet(POD, NODE_IP, NODE_PORT, local=frozenset({NODE_IP})), only(REMOTE, False)),
    Row("ClientIP affinity: a new client is balanced", svc(affinity="ClientIP"), BOTH,
        Packet(POD, CLUSTER_IP, 80), half(LOCAL, REMOTE, False)),
    Row("IPv6 clusterip", svc(cluster_ips=(ip(CLUSTER_IP6),)), eps(LOCAL6),
        Packet("fd00:244:1::99", CLUSTER_IP6, 80), only(LOCAL6, False)),
]


def _shares(outcomes: Sequence[Outcome]) -> Expect:
    got: Dict[str, Tuple[float, bool]] = {}
    for o in outcomes:
        key = str(o.target) if o.verdict == "dnat" else o.verdict
        share, _ = got.get(key, (0.0, False))
        got[key] = (round(share + o.share, 6), o.masquerade if o.verdict == "dnat" else False)
    return got


def trace(backend: str, row: Row, config: Optional[ProxyConfig] = None) -> Expect:
    config = dataclasses.replace(config or CONFIG, iptables_flavour="legacy")
    snapshot = Snapshot.build([row.service], {row.service.name: row.endpoints}, row.node)
    return _shares(create(backend, config).trace(snapshot, row.packet))  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_flow_table(row: Row, backend: str) -> None:
    assert trace(backend, row) == row.expect


def test_the_table_covers_every_verdict() -> None:
    """A table that only ever DNATs could not catch a backend that forgot to refuse or drop."""
    kinds = {k for r in ROWS for k in r.expect if k in ("reject", "drop", "accept")}
    assert kinds == {"reject", "drop", "accept"}
    assert {m for r in ROWS for _, m in r.expect.values()} == {True, False}


HEALTH_CHECKED = svc(service_type="LoadBalancer", node_port=NODE_PORT, external_traffic_policy="Local",
                     health_check_node_port=30999)


@pytest.mark.parametrize("endpoints", [BOTH, eps(REMOTE)], ids=["local endpoint", "no local endpoint"])
def test_health_check_node_port_is_accepted_by_iptables_and_left_alone_by_nftables(
        endpoints: Tuple[Endpoint, ...]) -> None:
    """The iptables backend accepts the health-check NodePort in filter, local endpoint or not (the load
    balancer asks every node), as kube-proxy's iptables mode: a node whose INPUT policy drops still
    answers its health checks.  nftables leaves it alone, as kube-proxy's nftables mode (an accept in one
    nftables table cannot override another table's drop).  Another port of the node stays untouched."""
    for port, iptables in ((30999, {"allow": (1.0, False)}), (31000, UNTOUCHED)):
        row = Row("health check", HEALTH_CHECKED, endpoints,
                  Packet(OUTSIDE, NODE_IP, port, local=frozenset({NODE_IP})), {})
        assert trace("iptables", row) == iptables, port
        assert trace("nftables", row) == UNTOUCHED, port
