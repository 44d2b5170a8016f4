"""docs/parity.md in the nftables backend, one test per feature, against the fake kernel.

Each test asserts what a packet would meet (which map element, which chain, which rules) and, for
changes, that an incremental sync leaves exactly what a fresh full sync writes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from netproxy.backends.nftables import names
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes, NodeInfo, ServicePort, Snapshot
from tests.unit.nftables.nft_helpers import backend, dumps, eps, fresh_dumps, snap, svc

MARK = "meta mark set meta mark | 0x00004000"


def nodeport(s: ServicePort, port: int = 30080, **kw: Any) -> ServicePort:
    return dataclasses.replace(s, node_port=port, service_type="NodePort", **kw)


def _incremental(b: Any, snapshot: Snapshot, *changed: ServicePort) -> None:
    b.sync(snapshot, Changes(full=False, services=frozenset(s.name for s in changed)))


# ---- NodePort ------------------------------------------------------------------------------------

def test_nodeport_dispatch_on_local_addresses_by_protocol_and_port() -> None:
    b, fake = backend()
    s = nodeport(svc("web", "10.96.0.10"))
    b.sync(snap((s, eps("10.1.0.1", "10.1.0.2"))), Changes())
    assert fake.elements("ip", names.SERVICE_NODEPORTS) == {"tcp . 30080": "goto external-tcp-nodeport-pick-2"}
    assert fake.elements("ip", "external-tcp-nodeport-endpoints-2") == {
        "30080 . 0": "10.1.0.1 . 8080", "30080 . 1": "10.1.0.2 . 8080"}
    # ETP Cluster: marked for masquerade, then DNAT keyed by the nodePort alone.
    assert fake.chain_rules("ip", "external-tcp-nodeport-pick-2") == [
        MARK, "meta l4proto tcp dnat ip to th dport . numgen random mod 2 map @external-tcp-nodeport-endpoints-2"]
    # Last in services: any local address but loopback (nat prerouting and output both jump here).
    assert fake.chain_rules("ip", names.SERVICES)[-1] == (
        "fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports")
    assert fake.chain_rules("ip", names.NAT_OUTPUT)[-1] == f"jump {names.SERVICES}"


def test_nodeport_addresses_limit_nodeports_and_follow_the_node() -> None:
    config = ProxyConfig(hostname="node-a", nodeport_addresses=parse_cidrs("192.0.2.0/24"))
    b, fake = backend(config)
    s = nodeport(svc("web", "10.96.0.10"))
    node = NodeInfo("node-a", addresses=(ipaddress.ip_address("192.0.2.1"), ipaddress.ip_address("10.0.0.1")))
    snapshot = Snapshot.build([s], {s.name: eps("10.1.0.1")}, node)
    b.sync(snapshot, Changes())
    assert fake.chain_rules("ip", names.SERVICES)[-1] == (
        "ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports")
    assert set(fake.elements("ip", names.NODEPORT_IPS)) == {"192.0.2.1"}, "only addresses inside the CIDRs"
    # The node gains an address: a full sync that the kernel vouches for writes only that element.
    moved = dataclasses.replace(node, addresses=node.addresses + (ipaddress.ip_address("192.0.2.5"),))
    later = Snapshot.build([s], {s.name: eps("10.1.0.1")}, moved)
    b.sync(later, Changes())
    assert set(fake.elements("ip", names.NODEPORT_IPS)) == {"192.0.2.1", "192.0.2.5"}
    assert [(v, type(o).__name__) for v, _, o in fake.transactions[-1]
            if getattr(o, "set", None) != names.STAMP] == [("add", "Element")]
    assert dumps(fake) == fresh_dumps(later, config)


def test_nodeport_without_endpoints_is_rejected_in_filter() -> None:
    b, fake = backend()
    b.sync(snap((nodeport(svc("web", "10.96.0.10")), ())), Changes())
    assert fake.elements("ip", names.NO_ENDPOINT_NODEPORTS) == {"tcp . 30080": f"goto {names.REJECT}"}
    assert fake.elements("ip", names.SERVICE_NODEPORTS) == {}
    rules = fake.chain_rules("ip", names.FILTER_INPUT)
    assert any("vmap @no-endpoint-nodeports" in r and r.startswith("ct state new fib daddr type local") for r in rules)


# ---- masquerade ----------------------------------------------------------------------------------

def test_masquerade_bit_and_cluster_cidrs() -> None:
    config = ProxyConfig(hostname="n", masquerade_bit=5, cluster_cidrs=parse_cidrs("10.250.0.0/16,10.244.0.0/16"))
    b, fake = backend(config)
    b.sync(snap((svc("web", "10.96.0.10"), eps("10.1.0.1"))), Changes())
    assert fake.chain_rules("ip", "cluster-tcp-pick-1")[0] == (
        "ip saddr != @cluster-cidrs meta mark set meta mark | 0x00000020")
    assert sorted(fake.elements("ip", names.CLUSTER_CIDRS)) == ["10.244.0.0/16", "10.250.0.0/16"]
    post = fake.chain_rules("ip", names.NAT_POSTROUTING)
    assert post[-1] == ("meta mark & 0x00000020 == 0x00000020 meta mark set meta mark ^ 0x00000020 "
                        "masquerade fully-random")


def test_hairpin_pairs_for_endpoints_that_can_hairpin_here_refcounted() -> None:
    b, fake = backend()
    a = svc("a", "10.96.0.10")
    z = svc("z", "10.96.0.11")
    shared_ep = eps("10.1.0.1", node="node-a")
    first = snap((a, shared_ep + eps("10.1.0.9", node="node-b") + eps("10.1.0.7")), (z, shared_ep), node="node-a")
    b.sync(first, Changes())
    # Own node's and unknown node's endpoints; not another node's (it hairpins through its own node).
    assert set(fake.elements("ip", names.HAIRPIN)) == {"10.1.0.1 . 10.1.0.1", "10.1.0.7 . 10.1.0.7"}
    assert fake.chain_rules("ip", names.NAT_POSTROUTING)[0] == f"ct status dnat ip saddr . ip daddr @hairpin {MARK}"
    # a drops 10.1.0.1; z still uses it: the pair stays.
    second = snap((a, eps("10.1.0.7")), (z, shared_ep), node="node-a")
    _incremental(b, second, a)
    assert set(fake.elements("ip", names.HAIRPIN)) == {"10.1.0.1 . 10.1.0.1", "10.1.0.7 . 10.1.0.7"}
    assert dumps(fake) == fresh_dumps(second)
    third = snap((a, eps("10.1.0.7")), node="node-a")
    _incremental(b, third, z)
    assert set(fake.elements("ip", names.HAIRPIN)) == {"10.1.0.7 . 10.1.0.7"}
    assert dumps(fake) == fresh_dumps(third)


# ---- externalTrafficPolicy / internalTrafficPolicy ----------------------------------------------

def test_etp_local_local_endpoints_unmarked_with_exceptions_for_pods_and_node() -> None:
    config = ProxyConfig(hostname="node-a", cluster_cidrs=parse_cidrs("10.244.0.0/16"), masquerade_all=True)
    b, fake = backend(config)
    s = nodeport(svc("web", "10.96.0.10", lb=["198.51.100.10"], ext_policy="Local"))
    endpoints = eps("10.1.0.1", node="node-a") + eps("10.1.0.8", "10.1.0.9", node="node-b")
    b.sync(snap((s, endpoints), node="node-a"), Changes())
    assert fake.elements("ip", names.SERVICE_IPS)["198.51.100.10 . tcp . 80"] == "goto local-tcp-pick-1"
    assert fake.elements("ip", names.SERVICE_NODEPORTS) == {"tcp . 30080": "goto local-tcp-nodeport-pick-1"}
    assert fake.elements("ip", "local-tcp-nodeport-endpoints-1") == {"30080": "10.1.0.1 . 8080"}
    assert fake.chain_rules("ip", "local-tcp-nodeport-pick-1") == [
        "ip saddr @cluster-cidrs meta l4proto . th dport vmap @exempt-nodeports",
        f"fib saddr type local {MARK} meta l4proto . th dport vmap @exempt-nodeports",
        "meta l4proto tcp dnat ip to th dport map @local-tcp-nodeport-endpoints-1",
    ]
    # The exceptions reach every endpoint, unmarked (even with --masquerade-all, as kube-proxy).
    assert fake.elements("ip", names.EXEMPT_NODEPORTS) == {"tcp . 30080": "goto exempt-tcp-nodeport-pick-3"}
    assert fake.elements("ip", names.EXEMPT_IPS) == {"198.51.100.10 . tcp . 80": "goto exempt-tcp-pick-3"}
    assert not any("meta mark" in r for r in fake.chain_rules("ip", "exempt-tcp-nodeport-pick-3"))
    assert len(fake.elements("ip", "exempt-tcp-endpoints-3")) == 3
    # Cluster traffic: every endpoint, marked per --masquerade-all.
    assert fake.elements("ip", names.SERVICE_IPS)["10.96.0.10 . tcp . 80"] == "goto cluster-tcp-pick-3"


def test_etp_local_changes_incrementally_equal_a_fresh_sync() -> None:
    b, fake = backend(ProxyConfig(hostname="node-a", cluster_cidrs=parse_cidrs("10.244.0.0/16")))
    s = nodeport(svc("web", "10.96.0.10", external=["192.0.2.10"], ext_policy="Local"))
    steps = [eps("10.1.0.1", node="node-a") + eps("10.1.0.9", node="node-b"),
             eps("10.1.0.9", node="node-b"),
             eps("10.1.0.1", "10.1.0.2", node="node-a"),
             ()]
    b.sync(snap((s, steps[0]), node="node-a"), Changes())
    for step in steps[1:]:
        now = snap((s, step), node="node-a")
        _incremental(b, now, s)
        assert dumps(fake) == fresh_dumps(now, b.config)
    assert fake.elements("ip", names.NO_ENDPOINT_NODEPORTS) == {"tcp . 30080": f"goto {names.REJECT}"}
    assert not [c for c in fake.tables["ip"].chains if "pick" in c], "unused pick chains are removed"


def test_itp_local_cluster_traffic_local_only_external_unrestricted() -> None:
    b, fake = backend()
    s = nodeport(svc("web", "10.96.0.10"), internal_traffic_policy="Local")
    endpoints = eps("10.1.0.1", node="node-a") + eps("10.1.0.8", "10.1.0.9", node="node-b")
    b.sync(snap((s, endpoints), node="node-a"), Changes())
    assert fake.elements("ip", "cluster-tcp-endpoints-1") == {"10.96.0.10 . 80": "10.1.0.1 . 8080"}
    assert fake.elements("ip", names.SERVICE_NODEPORTS) == {"tcp . 30080": "goto external-tcp-nodeport-pick-3"}
    b.sync(snap((s, eps("10.1.0.8", node="node-b")), node="node-a"), Changes())
    assert fake.elements("ip", names.NO_ENDPOINTS) == {"10.96.0.10 . tcp . 80": "drop"}


def test_affinity_with_etp_local_goes_through_the_exceptions_chain() -> None:
    b, fake = backend(ProxyConfig(hostname="node-a"))
    s = nodeport(svc("s", "10.96.0.20", affinity=True, ext_policy="Local", lb=["198.51.100.20"]))
    b.sync(snap((s, eps("10.1.0.1", node="node-a") + eps("10.1.0.2", node="node-b")), node="node-a"), Changes())
    assert fake.elements("ip", names.SERVICE_NODEPORTS) == {"tcp . 30080": "goto local-tcp-nodeport-sticky-pick-1"}
    rules = fake.chain_rules("ip", "local-tcp-nodeport-sticky-pick-1")
    # the node's own traffic first (every endpoint, through the exceptions), then remembered
    # clients, then the local endpoints only
    assert rules == [f"fib saddr type local {MARK} meta l4proto . th dport vmap @exempt-nodeports",
                     "meta l4proto tcp dnat ip to ip saddr . ip daddr . th dport map @affinity-tcp",
                     "meta l4proto tcp dnat ip to th dport map @local-tcp-nodeport-sticky-endpoints-1"]
    assert fake.elements("ip", "local-tcp-nodeport-sticky-endpoints-1") == {"30080": "10.1.0.1 . 8080"}
    assert fake.elements("ip", names.EXEMPT_NODEPORTS) == {"tcp . 30080": "goto exempt-tcp-nodeport-sticky-pick-2"}
    assert set(fake.elements("ip", "exempt-tcp-nodeport-sticky-endpoints-2").values()) == {
        "10.1.0.1 . 8080", "10.1.0.2 . 8080"}
    assert fake.elements("ip", names.AFFINITY_NODEPORTS) == {"tcp . 30080": "goto affinity-tcp-10800"}


# ---- loadBalancerSourceRanges -------------------------------------------------------------------

def test_source_ranges_restrict_load_balancer_ips_only() -> None:
    b, fake = backend()
    s = nodeport(svc("web", "10.96.0.10", external=["192.0.2.10"], lb=["198.51.100.10"]),
                 source_ranges=parse_cidrs("192.0.2.100/32,10.0.0.0/8,fd00::/8"))
    b.sync(snap((s, eps("10.1.0.1"))), Changes())
    assert set(fake.elements("ip", names.FIREWALL_IPS)) == {"198.51.100.10 . tcp . 80"}
    assert set(fake.elements("ip", names.FIREWALL_ALLOW)) == {
        "198.51.100.10 . tcp . 80 . 192.0.2.100/32", "198.51.100.10 . tcp . 80 . 10.0.0.0/8"}
    for chain in (names.NAT_PREROUTING, names.NAT_OUTPUT):
        assert fake.chain_rules("ip", chain)[0] == (
            "ip daddr . meta l4proto . th dport @firewall-ips "
            "ip daddr . meta l4proto . th dport . ip saddr != @firewall-allow drop")
    # Dropping the ranges removes every firewall element.
    plain = dataclasses.replace(s, source_ranges=())
    _incremental(b, snap((plain, eps("10.1.0.1"))), plain)
    assert fake.elements("ip", names.FIREWALL_IPS) == {} and fake.elements("ip", names.FIREWALL_ALLOW) == {}


# ---- refusals ------------------------------------------------------------------------------------

def test_active_cluster_ips_reject_other_ports_refcounted_across_ports() -> None:
    b, fake = backend()
    http = svc("web", "10.96.0.10")
    https = svc("web", "10.96.0.10", 443, port_name="https")
    b.sync(snap((http, eps("10.1.0.1")), (https, ())), Changes())
    assert set(fake.elements("ip", names.CLUSTER_IPS)) == {"10.96.0.10"}
    for chain in (names.FILTER_INPUT, names.FILTER_FORWARD, names.FILTER_OUTPUT):
        rules = fake.chain_rules("ip", chain)
        at = rules.index("ct state new ip daddr @cluster-ips reject")
        # Then only the service-CIDR drop (forward and output, as kube-proxy's cluster-ips-check).
        assert rules[at + 1:] == ([] if chain == names.FILTER_INPUT else
                                  ["ct state new ip daddr @service-cidrs drop"])
    assert fake.tables["ip"].chains[names.FILTER_OUTPUT].hook.priority == -90, "after nat output's DNAT"
    _incremental(b, snap((http, eps("10.1.0.1"))), https)
    assert set(fake.elements("ip", names.CLUSTER_IPS)) == {"10.96.0.10"}, "still used by the http port"
    _incremental(b, snap(), http)
    assert fake.elements("ip", names.CLUSTER_IPS) == {}


# ---- dual-stack ----------------------------------------------------------------------------------

def test_dual_stack_service_renders_into_both_tables() -> None:
    b, fake = backend()
    s = dataclasses.replace(svc("web", "10.96.0.10"), cluster_ips=(ipaddress.ip_address("10.96.0.10"),
                                                                    ipaddress.ip_address("fd00::10")))
    b.sync(snap((s, eps("10.1.0.1", "fd01::1"))), Changes())
    assert fake.elements("ip", "cluster-tcp-endpoints-1") == {"10.96.0.10 . 80": "10.1.0.1 . 8080"}
    assert fake.elements("ip6", "cluster-tcp-endpoints-1") == {"fd00::10 . 80": "fd01::1 . 8080"}
    assert fake.chain_rules("ip6", names.SERVICES)[-1].startswith("fib daddr type local ip6 daddr != ::1")
    assert set(fake.elements("ip6", names.CLUSTER_IPS)) == {"fd00::10"}
