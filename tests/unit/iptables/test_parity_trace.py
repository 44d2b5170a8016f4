"""docs/parity.md, rule by rule, through the packet tracer: what a packet ends at, masqueraded or not."""

from __future__ import annotations

import ipaddress
from typing import Any, Optional, Sequence, Set

import pytest

from netproxy.backends.iptables import names
from netproxy.backends.iptables.assemble import assemble
from netproxy.backends.iptables.render import FamilyRuleset, render_service
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from netproxy_lab.manifests import service_port
from tests.unit.iptables.iptables_tracer import Outcome, Packet, Tracer

ip = ipaddress.ip_address
net = ipaddress.ip_network

NODE_IP = "192.168.1.10"
NODE = NodeInfo(name="node", addresses=(ip(NODE_IP),))
CLUSTER_IP, EXT_IP, LB_IP, NODE_PORT = "10.96.0.10", "203.0.113.10", "198.51.100.10", 30080
LOCAL_EP, REMOTE_EP = "10.244.1.5", "10.244.2.5"
POD, CLIENT = "10.244.1.99", "172.16.0.7"  # a pod on this node; an off-cluster client
CIDR = ProxyConfig(hostname="node", cluster_cidrs=(net("10.244.0.0/16"),))
BOTH = {f"{LOCAL_EP}:8080", f"{REMOTE_EP}:8080"}


def service(**kw: Any) -> ServicePort:
    return service_port(cluster_ip=CLUSTER_IP, **kw)


def endpoints(*which: str) -> Sequence[Endpoint]:
    where = {LOCAL_EP: "node", REMOTE_EP: "other"}
    return tuple(Endpoint(ip(a), 8080, node_name=where.get(a, "other")) for a in which)


def ruleset(services: Sequence[ServicePort], eps: Sequence[Endpoint], config: ProxyConfig = CIDR,
            node: NodeInfo = NODE, family: int = 4, random_fully: bool = True) -> FamilyRuleset:
    rendered = [render_service(s, eps, node, family, config) for s in services]
    return assemble(family, [r for r in rendered if r is not None], config, node, random_fully)


def tracer(svc: ServicePort, eps: Sequence[Endpoint] = endpoints(LOCAL_EP, REMOTE_EP), **kw: Any) -> Tracer:
    return Tracer(ruleset([svc], eps, **kw), local_addresses=(NODE_IP,))


def reach(t: Tracer, src: str, dst: str, port: int = 80, from_node: bool = False) -> Set[Outcome]:
    return t.trace(Packet(src, dst, port, from_node=from_node))


def dnat(endpoints_: Set[str], masq: bool) -> Set[Outcome]:
    return {Outcome("accept", e, masq) for e in endpoints_}


REFUSED = {Outcome("reject")}
DROPPED = {Outcome("drop")}
UNTOUCHED = {Outcome("accept")}


# ---- ClusterIP and masquerade ------------------------------------------------------------------

def test_cluster_ip_reaches_every_endpoint_without_masquerade_from_pods() -> None:
    assert reach(tracer(service()), POD, CLUSTER_IP) == dnat(BOTH, masq=False)


def test_cluster_ip_from_outside_the_cluster_cidr_is_masqueraded() -> None:
    assert reach(tracer(service()), CLIENT, CLUSTER_IP) == dnat(BOTH, masq=True)
    assert reach(tracer(service()), NODE_IP, CLUSTER_IP, from_node=True) == dnat(BOTH, masq=True)


def test_without_cluster_cidr_cluster_traffic_is_not_masqueraded() -> None:
    t = tracer(service(), config=ProxyConfig(hostname="node"))
    assert reach(t, CLIENT, CLUSTER_IP) == dnat(BOTH, masq=False)


def test_masquerade_all_marks_cluster_traffic_from_pods_too() -> None:
    t = tracer(service(), config=ProxyConfig(hostname="node", masquerade_all=True))
    assert reach(t, POD, CLUSTER_IP) == dnat(BOTH, masq=True)


def test_several_cluster_cidrs_mark_only_sources_outside_all_of_them() -> None:
    config = ProxyConfig(hostname="node", cluster_cidrs=(net("10.244.0.0/16"), net("10.250.0.0/16")))
    t = tracer(service(), config=config)
    assert reach(t, POD, CLUSTER_IP) == dnat(BOTH, masq=False)
    assert reach(t, "10.250.3.3", CLUSTER_IP) == dnat(BOTH, masq=False)
    assert reach(t, CLIENT, CLUSTER_IP) == dnat(BOTH, masq=True)
    assert names.MASQ_NONCLUSTER in t.ruleset.chains("nat")


def test_masquerade_bit_and_random_fully() -> None:
    rs = ruleset([service()], endpoints(LOCAL_EP), ProxyConfig(hostname="node", masquerade_bit=3))
    nat = rs.chains("nat")
    assert nat[names.MARK_MASQ] == (("-j", "MARK", "--or-mark", "0x8"),)
    assert nat[names.POSTROUTING][-1][-2:] == ("MASQUERADE", "--random-fully")
    old = ruleset([service()], endpoints(LOCAL_EP), random_fully=False).chains("nat")[names.POSTROUTING]
    assert old[-1][-1] == "MASQUERADE"


# ---- hairpin --------------------------------------------------------------------------------------

def test_hairpin_masquerades_only_an_endpoint_landing_on_itself() -> None:
    outcomes = reach(tracer(service()), LOCAL_EP, CLUSTER_IP)
    assert outcomes == {Outcome("accept", f"{LOCAL_EP}:8080", True), Outcome("accept", f"{REMOTE_EP}:8080", False)}


def test_hairpin_through_a_deep_tree() -> None:
    eps = tuple(Endpoint(ip(f"10.244.{i // 250}.{i % 250 + 1}"), 8080) for i in range(2000))
    svcs = [service()]
    t = Tracer(ruleset(svcs, eps[:1]), local_addresses=(NODE_IP,))
    assert reach(t, str(eps[0].ip), CLUSTER_IP) == {Outcome("accept", f"{eps[0].ip}:8080", True)}
    big = Tracer(ruleset(svcs, eps), local_addresses=(NODE_IP,))
    assert len(big.ruleset.hairpin) == 2000  # one set element per endpoint, no rule per endpoint
    chosen = eps[1234]
    seen = {o for o in reach(big, str(chosen.ip), CLUSTER_IP) if o.masquerade}
    assert seen == {Outcome("accept", f"{chosen.ip}:8080", True)}


# ---- NodePort -------------------------------------------------------------------------------------

def test_node_port_from_outside_and_from_the_node_is_masqueraded() -> None:
    t = tracer(service(node_port=NODE_PORT, service_type="NodePort"))
    assert reach(t, CLIENT, NODE_IP, NODE_PORT) == dnat(BOTH, masq=True)
    assert reach(t, NODE_IP, NODE_IP, NODE_PORT, from_node=True) == dnat(BOTH, masq=True)


def test_node_port_on_loopback_only_with_localhost_nodeports() -> None:
    """kube-proxy's iptables mode: 127.0.0.1 NodePorts by default (--iptables-localhost-nodeports)."""
    served = tracer(service(node_port=NODE_PORT))
    assert reach(served, "127.0.0.1", "127.0.0.1", NODE_PORT, from_node=True) == dnat(BOTH, masq=True)
    off = tracer(service(node_port=NODE_PORT), config=ProxyConfig(hostname="node", localhost_nodeports=False))
    assert reach(off, "127.0.0.1", "127.0.0.1", NODE_PORT, from_node=True) == UNTOUCHED


def test_node_port_not_on_other_hosts() -> None:
    t = tracer(service(node_port=NODE_PORT))
    assert reach(t, CLIENT, "192.168.1.11", NODE_PORT) == UNTOUCHED
    assert reach(t, CLIENT, NODE_IP, NODE_PORT + 1) == UNTOUCHED


def test_nodeport_addresses_limit_the_node_addresses() -> None:
    node = NodeInfo(name="node", addresses=(ip(NODE_IP), ip("10.0.0.10")))
    config = ProxyConfig(hostname="node", nodeport_addresses=(net("192.168.1.0/24"),))
    rs = ruleset([service(node_port=NODE_PORT)], endpoints(LOCAL_EP), config, node)
    t = Tracer(rs, local_addresses=(NODE_IP, "10.0.0.10"))
    assert reach(t, CLIENT, NODE_IP, NODE_PORT) == dnat({f"{LOCAL_EP}:8080"}, masq=True)
    assert reach(t, CLIENT, "10.0.0.10", NODE_PORT) == UNTOUCHED
    # No node address in this family inside the CIDRs: no NodePorts at all.
    empty = ruleset([service(node_port=NODE_PORT)], endpoints(LOCAL_EP), config, NodeInfo(name="node"))
    assert not any(r[-1] == names.NODEPORTS for r in empty.chains("nat")[names.SERVICES])


# ---- externalTrafficPolicy: Local -------------------------------------------------------------

def etp_local(**kw: Any) -> ServicePort:
    return service(node_port=NODE_PORT, external_ips=(ip(EXT_IP),), external_traffic_policy="Local", **kw)


@pytest.mark.parametrize("dst,port", [(NODE_IP, NODE_PORT), (EXT_IP, 80)])
def test_etp_local_keeps_the_client_address_and_uses_local_endpoints(dst: str, port: int) -> None:
    assert reach(tracer(etp_local()), CLIENT, dst, port) == dnat({f"{LOCAL_EP}:8080"}, masq=False)


@pytest.mark.parametrize("dst,port", [(NODE_IP, NODE_PORT), (EXT_IP, 80)])
def test_etp_local_without_local_endpoints_drops_external_traffic(dst: str, port: int) -> None:
    t = tracer(etp_local(), endpoints(REMOTE_EP))
    assert reach(t, CLIENT, dst, port) == DROPPED
    # ... but the ClusterIP still works.
    assert reach(t, POD, CLUSTER_IP) == dnat({f"{REMOTE_EP}:8080"}, masq=False)


def test_etp_local_short_circuits_the_node_and_pods_to_every_endpoint() -> None:
    t = tracer(etp_local(), endpoints(REMOTE_EP))
    assert reach(t, NODE_IP, NODE_IP, NODE_PORT, from_node=True) == dnat({f"{REMOTE_EP}:8080"}, masq=True)
    assert reach(t, POD, EXT_IP) == dnat({f"{REMOTE_EP}:8080"}, masq=False)


def test_etp_cluster_external_ip_is_masqueraded() -> None:
    t = tracer(service(external_ips=(ip(EXT_IP),)))
    assert reach(t, CLIENT, EXT_IP) == dnat(BOTH, masq=True)


# ---- internalTrafficPolicy: Local ---------------------------------------------------------------

def test_itp_local_uses_local_endpoints_for_cluster_traffic_only() -> None:
    t = tracer(service(internal_traffic_policy="Local", node_port=NODE_PORT))
    assert reach(t, POD, CLUSTER_IP) == dnat({f"{LOCAL_EP}:8080"}, masq=False)
    assert reach(t, CLIENT, CLUSTER_IP) == dnat({f"{LOCAL_EP}:8080"}, masq=True)
    assert reach(t, CLIENT, NODE_IP, NODE_PORT) == dnat(BOTH, masq=True)  # external: every endpoint


def test_itp_local_without_local_endpoints_drops() -> None:
    t = tracer(service(internal_traffic_policy="Local"), endpoints(REMOTE_EP))
    assert reach(t, POD, CLUSTER_IP) == DROPPED


def test_itp_and_etp_local_share_the_local_chain_but_masquerade_only_cluster_traffic() -> None:
    t = tracer(etp_local(internal_traffic_policy="Local"),
               config=ProxyConfig(hostname="node", masquerade_all=True))
    assert reach(t, POD, CLUSTER_IP) == dnat({f"{LOCAL_EP}:8080"}, masq=True)
    assert reach(t, CLIENT, EXT_IP) == dnat({f"{LOCAL_EP}:8080"}, masq=False)


# ---- loadBalancerSourceRanges ------------------------------------------------------------------

def test_source_ranges_restrict_the_lb_ip_only() -> None:
    t = tracer(service(load_balancer_ips=(ip(LB_IP),), source_ranges=(net("172.16.0.0/24"),),
                       node_port=NODE_PORT))
    assert reach(t, CLIENT, LB_IP) == dnat(BOTH, masq=True)
    assert reach(t, "172.17.0.7", LB_IP) == DROPPED
    assert reach(t, "172.17.0.7", NODE_IP, NODE_PORT) == dnat(BOTH, masq=True)
    assert reach(t, "172.17.0.7", CLUSTER_IP) == dnat(BOTH, masq=True)


def test_lb_ip_without_source_ranges_is_open() -> None:
    t = tracer(service(load_balancer_ips=(ip(LB_IP),)))
    assert reach(t, "172.17.0.7", LB_IP) == dnat(BOTH, masq=True)


# ---- no endpoints, unknown ports -----------------------------------------------------------------

@pytest.mark.parametrize("dst,port", [(CLUSTER_IP, 80), (NODE_IP, NODE_PORT), (EXT_IP, 80), (LB_IP, 80)])
def test_no_endpoints_are_refused_everywhere(dst: str, port: int) -> None:
    t = tracer(service(node_port=NODE_PORT, external_ips=(ip(EXT_IP),), load_balancer_ips=(ip(LB_IP),)), ())
    assert reach(t, CLIENT, dst, port) == REFUSED


def test_unknown_port_on_an_active_cluster_ip_is_refused() -> None:
    t = tracer(service())
    assert reach(t, POD, CLUSTER_IP, 81) == REFUSED
    assert reach(t, POD, "10.96.0.11", 80) == UNTOUCHED  # not a service address: not ours


def test_multi_port_service_refuses_only_unknown_ports() -> None:
    web = service()
    other = ServicePort(ServicePortName("default", "web", "https"), "TCP", 443, 8443, (ip(CLUSTER_IP),))
    t = Tracer(ruleset([web, other], endpoints(LOCAL_EP)), local_addresses=(NODE_IP,))
    assert reach(t, POD, CLUSTER_IP, 443) == {Outcome("accept", f"{LOCAL_EP}:8080", False)}
    assert reach(t, POD, CLUSTER_IP, 8443) == REFUSED
    catch_all = [r for r in t.ruleset.chains("filter")[names.SERVICES] if "--dport" not in r and "--match-set" in r]
    assert len(catch_all) == 1  # once per address, not once per port


# ---- affinity, dual-stack ----------------------------------------------------------------------

def test_affinity_sticks_after_the_first_choice() -> None:
    t = tracer(service(affinity="ClientIP"))
    first = Packet(POD, CLUSTER_IP, 80)
    assert t.endpoints(first) == BOTH
    t.remember(first)  # one choice made and recorded
    (chosen,) = [name for name in t.members if t.members[name]]
    (ep,) = t.endpoints(first)
    assert ep is not None and t.endpoints(first) == {ep}  # it sticks
    # Recorded under (client, proto:service port, service address), in its endpoint's slot set.
    assert t.members[chosen] == {(int(ip(POD)), 6, 80, int(ip(CLUSTER_IP)))}
    assert t.endpoints(Packet(CLIENT, CLUSTER_IP, 80)) == BOTH  # another client still chooses


def test_ipv6_renders_beside_ipv4() -> None:
    dual = service(cluster_ips=(ip(CLUSTER_IP), ip("fd00::10")), node_port=NODE_PORT)
    eps = endpoints(LOCAL_EP) + (Endpoint(ip("fd01::5"), 8080, node_name="node"),)
    node = NodeInfo(name="node", addresses=(ip(NODE_IP), ip("fd10::10")))
    v6 = Tracer(ruleset([dual], eps, node=node, family=6,
                        config=ProxyConfig(hostname="node", cluster_cidrs=(net("fd01::/64"),))),
                local_addresses=("fd10::10",))
    assert v6.trace(Packet("fd01::99", "fd00::10", 80)) == {Outcome("accept", "[fd01::5]:8080", False)}
    assert v6.trace(Packet("fd99::1", "fd10::10", NODE_PORT)) == {Outcome("accept", "[fd01::5]:8080", True)}
    assert v6.trace(Packet("fd01::99", "fd00::10", 81)) == REFUSED
    assert v6.trace(Packet("::1", "::1", NODE_PORT, from_node=True)) == UNTOUCHED
    reject = [r for r in v6.ruleset.chains("filter")[names.SERVICES] if "REJECT" in r]
    assert reject and all(r[-1] == "icmp6-port-unreachable" for r in reject)


def test_endpoints_of_the_other_family_are_ignored() -> None:
    svc4 = service()
    rs: Optional[FamilyRuleset] = ruleset([svc4], (Endpoint(ip("fd01::5"), 8080),))
    assert rs is not None
    assert reach(Tracer(rs, local_addresses=(NODE_IP,)), POD, CLUSTER_IP) == REFUSED


def test_hairpin_checks_only_endpoints_that_can_hairpin_through_this_node() -> None:
    unknown = Endpoint(ip("10.244.9.9"), 8080)  # no nodeName: kept, it might be behind this node
    rs = ruleset([service()], endpoints(LOCAL_EP, REMOTE_EP) + (unknown,))
    hairpin = {(str(ipaddress.ip_address(a)), port) for a, _, port, _ in rs.hairpin}
    assert hairpin == {(LOCAL_EP, 8080), ("10.244.9.9", 8080)}
    # An endpoint on another node reaches the service through its own node's proxy, never through ours.
    assert reach(Tracer(rs), "10.244.9.9", CLUSTER_IP) >= {Outcome("accept", "10.244.9.9:8080", True)}


def test_no_hairpin_jump_when_no_endpoint_can_hairpin() -> None:
    rs = ruleset([service()], endpoints(REMOTE_EP))
    assert not any("--match-set" in r for r in rs.chains("nat")[names.POSTROUTING]) and not rs.hairpin
