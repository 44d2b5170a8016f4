"""One service port → its iptables rules for one family, without I/O (``assemble.py`` joins them).

Layout (README.md and docs/parity.md have the why and the measurements), as kube-proxy's iptables
mode names it:

- nat ``KUBE-SERVICES`` dispatches on destination address, protocol and port, as a prefix tree
  (``tree.py``); a cluster IP goes to the *internal* chain, an external or load-balancer IP to
  ``KUBE-EXT-`` (or ``KUBE-FW-`` with loadBalancerSourceRanges), a NodePort (through
  ``KUBE-NODEPORTS``) to ``KUBE-EXT-``.
- ``KUBE-SVC-<hash>`` (all eligible endpoints) and ``KUBE-SVL-<hash>`` (this node's endpoints, for the
  Local traffic policies) hold the endpoint choice inline: ``-m statistic --probability 1/(n-i)`` +
  ``DNAT`` per endpoint, the last unconditional.  No per-endpoint ``KUBE-SEP-`` chains (docs/performance.md:
  8.5 s against 1.55 s at 10k).  ClientIP affinity remembers clients in ipsets, one per endpoint
  *slot* (``affinity.py``, README "Sets").  Hairpin masquerade is not here: ``assemble.py`` checks
  "source is the endpoint" after the DNAT, in ``KUBE-POSTROUTING``, against the hairpin set.
- ``KUBE-EXT-<hash>``: externalTrafficPolicy Cluster marks for masquerade and goes to ``KUBE-SVC-``;
  Local sends pod (cluster CIDR) and node-local sources to ``KUBE-SVC-`` (node-local ones masqueraded)
  and everything else to ``KUBE-SVL-`` without masquerade.
- filter ``KUBE-SERVICES`` (new connections, from INPUT, FORWARD, OUTPUT) sees only packets that nat
  did not DNAT: REJECT for a port without endpoints, DROP for a Local policy without local endpoints
  and for sources outside loadBalancerSourceRanges, REJECT for any other port of an active cluster IP.

Every service rule carries ``-m comment --comment "<ns>/<name>:<port>"``, but endpoint rules above
1,000 endpoints (kube-proxy's large-cluster mode).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from netproxy.backends.iptables import affinity, ipset, names
from netproxy.backends.iptables.tree import Chains, DispatchEntry, Rule, port_key
from netproxy.core.config import ProxyConfig
from netproxy.core.endpoints import cluster_endpoints, external_endpoints, local_endpoints
from netproxy.core.firewall import firewall_sources
from netproxy.core.model import Endpoint, IPAddress, NodeInfo, ServicePort

__all__ = ["Chains", "DispatchEntry", "Rule", "ServiceRules", "FamilyRuleset", "render_service"]

MAX_COMMENT = 255
"""XT_MAX_COMMENT_LEN - 1: the kernel's comment buffer holds 256 bytes with the NUL."""

# filter rule ranks for one address: firewall drops, then per-port verdicts, then the catch-all.
RANK_FIREWALL, RANK_PORT = 0, 1


def safe_comment(text: str) -> str:
    """A comment that cannot end itself or the payload line: no control characters, no NUL, at most
    255 bytes.  Validation already forbids such names; this keeps the writer safe on its own."""
    if text.isascii() and text.isprintable() and len(text) <= MAX_COMMENT:
        return text  # the usual case, without the per-character walk
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text)
    raw = cleaned.encode()[:MAX_COMMENT]
    return raw.decode(errors="ignore")


PROBABILITIES_CACHED = 4096
"""``probability`` keeps the texts of 1/1 … 1/4096 (~0.3 MB at most): a service with more endpoints
is rare, and a larger n is formatted each time rather than kept for the life of the process."""
_probabilities: Dict[int, str] = {}


def probability(remaining: int) -> str:
    """``1/remaining`` with 10 decimals, as kube-proxy prints it: enough that 1/n and 1/(n+1) differ in
    text for every n up to 100,000 (their gap, ~1/n², stays above 1e-10).  Cached (up to
    PROBABILITIES_CACHED): a 10k-service render asks for the same ten values 10,000 times."""
    text = _probabilities.get(remaining)
    if text is None:
        text = f"{1.0 / remaining:0.10f}"
        if remaining <= PROBABILITIES_CACHED:
            _probabilities[remaining] = text
    return text


def destination(ep: Endpoint) -> str:
    """"ip:port", or "[ip6]:port"; IPv4 formatted from the integer (ipaddress's str is the slow part)."""
    if ep.ip.version == 4:
        n = int(ep.ip)
        return f"{n >> 24}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}:{ep.port}"
    return f"[{ep.ip}]:{ep.port}"


def host_net(addr: IPAddress) -> str:
    if addr.version == 4:
        n = int(addr)
        return f"{n >> 24}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}/32"
    return f"{addr}/128"


def interface_match(local_interface: Tuple[str, bool]) -> str:
    """``-i`` 's argument for kube-proxy's interface detectors: ``br0``, or ``veth+`` for a prefix."""
    name, prefix = local_interface
    return name + "+" if prefix else name


def reject_target(family: int) -> Rule:
    return ("-j", "REJECT", "--reject-with", "icmp-port-unreachable" if family == 4 else "icmp6-port-unreachable")


@dataclass(frozen=True)
class ServiceRules:
    """Everything one service port contributes to one family's tables."""

    nat: Chains
    """Its own chains: KUBE-SVC-, KUBE-SVL-, KUBE-EXT-, KUBE-FW-."""
    dispatch: Tuple[DispatchEntry, ...]
    """nat KUBE-SERVICES: address/protocol/port → its chain."""
    nodeports: Tuple[DispatchEntry, ...] = ()
    """nat KUBE-NODEPORTS: protocol/nodePort → KUBE-EXT- (keyed by ``tree.port_key``)."""
    filter: Tuple[DispatchEntry, ...] = ()
    """filter KUBE-SERVICES: REJECT/DROP for addresses nat left alone."""
    filter_nodeports: Tuple[DispatchEntry, ...] = ()
    """filter KUBE-EXTERNAL-SERVICES: REJECT/DROP for NodePorts nat left alone (keyed like nodeports)."""
    hairpin: Tuple[ipset.Element, ...] = ()
    """(ip, proto, port, ip) of the endpoints this service DNATs to that can hairpin through this node
    (elements of the hairpin set that ``KUBE-POSTROUTING`` checks)."""
    affinity_slots: Tuple[Tuple[int, affinity.EndpointKey], ...] = ()
    """ClientIP affinity: (slot, endpoint) of every endpoint in its rules."""
    affinity_keys: Tuple[Tuple[int, int, int], ...] = ()
    """ClientIP affinity: (proto, port, address) its clients are remembered under; address 0 for a
    NodePort (any node address)."""
    cluster_ips: Tuple[ipset.Element, ...] = ()
    """Its cluster IPs, as elements of the cluster-IP set (filter refuses their other ports)."""


@dataclass
class FamilyRuleset:
    """The desired state of the netproxy-owned chains of one family (4 or 6)."""

    family: int
    tables: Dict[str, Chains] = field(default_factory=dict)
    hairpin: FrozenSet[ipset.Element] = frozenset()
    """Elements of the family's hairpin set."""
    cluster_ips: FrozenSet[ipset.Element] = frozenset()
    """Elements of the family's cluster-IP set."""
    sets: Dict[str, bool] = field(default_factory=dict)
    """The ipsets its rules name → whether each needs per-element timeouts (affinity)."""
    affinity: Dict[int, FrozenSet[Tuple[int, int, int]]] = field(default_factory=dict)
    """Affinity slot → the (proto, port, address) keys its elements may have (address 0: a NodePort)."""

    def chains(self, table: str) -> Chains:
        return self.tables.setdefault(table, {})


def _endpoint_rules(chain_proto: str, comment: Rule, eps: Sequence[Endpoint], svc: ServicePort,
                    sets: Sequence[str]) -> List[Rule]:
    """Inline endpoint choice: 1/(n-i) odds per endpoint, the last rule unconditional.

    With ClientIP affinity (``sets``: each endpoint's slot set, ``affinity.py``) every endpoint first
    gets the remembered-client check — refresh the client's timeout, then DNAT — and the random
    choice records the client in the chosen endpoint's set before it DNATs.  The checks come before
    any choice: a client remembered by the third endpoint must not be drawn by the first.
    """
    proto: Rule = ("-p", chain_proto)
    rules: List[Rule] = []
    n = len(eps)
    if svc.client_ip_affinity:
        seconds = str(svc.affinity_timeout)
        key = "src,dst,dst"  # client, proto:service port, service address (before the DNAT)

        def remember(s: str) -> Rule:
            return ("-j", "SET", "--add-set", s, key, "--exist", "--timeout", seconds)

        def hold(s: str, ep: Endpoint) -> Rule:
            return proto + comment + ("-m", "set", "--match-set", s, key, "-j", "DNAT",
                                      "--to-destination", destination(ep))

        for ep, s in zip(eps, sets):
            rules.append(proto + comment + ("-m", "set", "--match-set", s, key) + remember(s))
            rules.append(hold(s, ep))
        for i, (ep, s) in enumerate(zip(eps, sets)):
            odds: Rule = ("-m", "statistic", "--mode", "random", "--probability", probability(n - i)) \
                if i < n - 1 else ()
            rules.append(proto + comment + odds + remember(s))
            # Not the last: DNAT only if the record took (a full set records nothing: the next odds
            # decide).  The last DNATs whatever happened, so that no packet leaves un-DNAT-ed.
            rules.append(hold(s, ep) if i < n - 1 else
                         proto + comment + ("-j", "DNAT", "--to-destination", destination(ep)))
        return rules
    for i, ep in enumerate(eps):
        args = proto + comment
        if i < n - 1:
            args += ("-m", "statistic", "--mode", "random", "--probability", probability(n - i))
        rules.append(args + ("-j", "DNAT", "--to-destination", destination(ep)))
    return rules


@dataclass
class _Port:
    """What every rule of one service port in one family shares, and what it has collected so far."""

    svc: ServicePort
    family: int
    config: ProxyConfig
    proto: str
    comment: Rule
    port_match: Rule
    nat: Dict[str, Tuple[Rule, ...]] = field(default_factory=dict)
    dispatch: List[DispatchEntry] = field(default_factory=list)
    filter: List[DispatchEntry] = field(default_factory=list)
    endpoint_comment: Rule = ()
    """The comment on endpoint rules: none in large clusters (kube-proxy's largeClusterMode)."""
    slots: Dict[affinity.EndpointKey, int] = field(default_factory=dict)

    def match(self, addr: IPAddress) -> Rule:
        return ("-d", host_net(addr), "-p", self.proto) + self.comment + self.port_match

    def route(self, addr: IPAddress, chain: str) -> None:
        self.dispatch.append(DispatchEntry(int(addr), self.match(addr) + ("-j", chain)))

    def refuse(self, addr: IPAddress, drop: bool, rank: int = RANK_PORT) -> None:
        verdict: Rule = ("-j", "DROP") if drop else reject_target(self.family)
        self.filter.append(DispatchEntry(int(addr), self.match(addr) + verdict, rank))

    def endpoints_chain(self, chain: str, eps: Sequence[Endpoint], masq: Sequence[Rule] = ()) -> str:
        sets = [ipset.affinity_set(self.family, self.slots[(int(e.ip), e.port)]) for e in eps] \
            if self.svc.client_ip_affinity else []
        self.nat[chain] = tuple(masq) + tuple(_endpoint_rules(self.proto, self.endpoint_comment, eps, self.svc,
                                                              sets))
        return chain


def _cluster_masq(p: _Port, addrs: Sequence[IPAddress]) -> List[Rule]:
    """kube-proxy's mark for cluster traffic, in the internal chain and qualified by the cluster IP and
    port so that external traffic passing through the same chain is not affected by it."""
    config, family = p.config, p.family
    cidrs = [c for c in config.local_cidrs if c.version == family]
    if config.masquerade_all:
        qualifier: Rule = ("-j", names.MARK_MASQ)
    elif config.local_interface is not None:
        qualifier = ("!", "-i", interface_match(config.local_interface), "-j", names.MARK_MASQ)
    elif len(cidrs) == 1:
        qualifier = ("!", "-s", str(cidrs[0]), "-j", names.MARK_MASQ)
    elif cidrs:
        qualifier = ("-j", names.MASQ_NONCLUSTER)  # outside all of them: RETURNs there for each CIDR
    else:
        return []
    return [p.match(a) + qualifier for a in addrs]


def _external_chain(p: _Port, svc_chain: Optional[str], svl_chain: Optional[str]) -> str:
    """KUBE-EXT-: what external traffic goes through, by externalTrafficPolicy."""
    ext: str = names.service_chain(p.svc.name, p.svc.protocol, names.EXT_PREFIX)
    c = p.comment
    rules: List[Rule] = []
    if p.svc.external_traffic_policy != "Local":
        # Cluster: the endpoint may be on another node; SNAT so that the reply comes back through us.
        rules.append(c + ("-j", names.MARK_MASQ))
        if svc_chain:
            rules.append(c + ("-j", svc_chain))
    else:
        if svc_chain:
            # Pods reaching an external address are treated as cluster traffic (no policy), as if they
            # had gone out to the load balancer and come back.
            if p.config.local_interface is not None:
                rules.append(("-i", interface_match(p.config.local_interface)) + c + ("-j", svc_chain))
            else:
                rules.extend(("-s", str(cidr)) + c + ("-j", svc_chain)
                             for cidr in p.config.local_cidrs if cidr.version == p.family)
            # The node itself: its source address would be the external address's own; masquerade it
            # and let it reach every endpoint so that NodePorts work from the node.
            local_src: Rule = ("-m", "addrtype", "--src-type", "LOCAL")
            rules.append(c + local_src + ("-j", names.MARK_MASQ))
            rules.append(c + local_src + ("-j", svc_chain))
        if svl_chain:
            rules.append(c + ("-j", svl_chain))
        # No local endpoint: nothing more here; filter KUBE-SERVICES/KUBE-EXTERNAL-SERVICES drops it.
    p.nat[ext] = tuple(rules)
    return ext


def _firewall_chain(p: _Port, ext: str, node: NodeInfo) -> str:
    """KUBE-FW-: allowed sources (netproxy/core/firewall.py: the ranges, and the LB IPs when a range
    covers the node) continue to KUBE-EXT-; the rest is dropped in filter."""
    fw: str = names.service_chain(p.svc.name, p.svc.protocol, names.FW_PREFIX)
    p.nat[fw] = tuple(("-s", str(r)) + p.comment + ("-j", ext)
                      for r in firewall_sources(p.svc, node, p.family))
    return fw


def _hairpin_candidates(node: NodeInfo, proto: int, *chains: Sequence[Endpoint]) -> Tuple[ipset.Element, ...]:
    """Endpoints that can hairpin *through this node*: those on this node, and those whose node is
    unknown.  An endpoint on another node reaches a service through its own node's proxy, which DNATs
    it there; its packets never come through our PREROUTING with a service address (README.md,
    "Hairpin")."""
    found = {(int(e.ip), proto, e.port, int(e.ip)) for eps in chains for e in eps
             if not e.node_name or e.node_name == node.name}
    return tuple(sorted(found)) if len(found) > 1 else tuple(found)


@dataclass(frozen=True)
class _Eligible:
    """One service port's endpoints in one family, by who may reach them (netproxy/core/endpoints.py)."""

    everyone: Tuple[Endpoint, ...]
    """Every eligible endpoint whatever internalTrafficPolicy says: the cluster-policy chain's (external
    traffic and ETP Local's short-circuits use it too, as kube-proxy's clusterPolicyChain)."""
    internal: Tuple[Endpoint, ...]
    """What cluster-IP traffic reaches (internalTrafficPolicy applied)."""
    local: Tuple[Endpoint, ...]
    external: Tuple[Endpoint, ...]
    """What external traffic reaches (externalTrafficPolicy applied)."""

    @property
    def any(self) -> bool:
        return bool(self.everyone or self.local)


def _eligible(svc: ServicePort, fam_eps: Sequence[Endpoint], node: NodeInfo) -> _Eligible:
    internal = tuple(cluster_endpoints(svc, fam_eps, node))
    everyone = internal if svc.internal_traffic_policy != "Local" else \
        tuple(cluster_endpoints(dataclasses.replace(svc, internal_traffic_policy="Cluster"), fam_eps, node))
    external = tuple(external_endpoints(svc, fam_eps, node)) if svc.external_traffic_policy == "Local" else everyone
    return _Eligible(everyone, internal, tuple(local_endpoints(fam_eps, node)), external)


@dataclass(frozen=True)
class _EndpointChains:
    """The endpoint chains one service port writes: KUBE-SVC- (every eligible endpoint) and KUBE-SVL-
    (the node's own), each "" when not written."""

    svc: str
    svl: str

    def endpoints(self, eps: _Eligible) -> Tuple[Endpoint, ...]:
        """The endpoints these chains DNAT to (affinity bookkeeping)."""
        return (eps.everyone if self.svc else ()) + (eps.local if self.svl else ())


def _endpoint_chains(p: _Port, eps: _Eligible, masq: Sequence[Rule], has_external: bool) -> _EndpointChains:
    svc = p.svc
    itp_local = svc.internal_traffic_policy == "Local"
    etp_local = svc.external_traffic_policy == "Local"
    svc_chain = ""
    if eps.everyone and (not itp_local or (has_external and eps.any)):
        svc_chain = names.service_chain(svc.name, svc.protocol)
        p.endpoints_chain(svc_chain, eps.everyone, () if itp_local else masq)
    svl_chain = ""
    # Only Local policies use KUBE-SVL- (a name is a sha256 + base32: not for every service).
    if eps.local and (itp_local or (etp_local and has_external)):
        svl_chain = names.service_chain(svc.name, svc.protocol, names.SVL_PREFIX)
        p.endpoints_chain(svl_chain, eps.local, masq if itp_local else ())
    return _EndpointChains(svc_chain, svl_chain)


@dataclass(frozen=True)
class _NodePortRules:
    nat: Tuple[DispatchEntry, ...] = ()
    """nat KUBE-NODEPORTS: the NodePort → its KUBE-EXT- chain."""
    filter: Tuple[DispatchEntry, ...] = ()
    """filter KUBE-EXTERNAL-SERVICES: DROP/REJECT when no endpoint serves external traffic; ACCEPT of
    the health-check NodePort."""


def _external(p: _Port, eps: _Eligible, chains: _EndpointChains, ext_addrs: Sequence[IPAddress],
              lb_addrs: Sequence[IPAddress], node: NodeInfo) -> _NodePortRules:
    """External IPs, load-balancer IPs (behind KUBE-FW- with source ranges) and the NodePort."""
    svc = p.svc
    ext = _external_chain(p, chains.svc or None, chains.svl or None) if eps.any else None
    fw = _firewall_chain(p, ext, node) if ext and lb_addrs and svc.source_ranges else None
    for addr in list(ext_addrs) + list(lb_addrs):
        target = fw if fw and addr in lb_addrs else ext
        if target:
            p.route(addr, target)
        if fw and addr in lb_addrs:
            p.refuse(addr, drop=True, rank=RANK_FIREWALL)
        if not eps.external:
            p.refuse(addr, drop=eps.any)
    health = _health_check_accept(p)
    if not svc.node_port:
        return _NodePortRules((), health)
    key = port_key(p.proto, svc.node_port)
    match = ("-p", p.proto) + p.comment + ("-m", p.proto, "--dport", str(svc.node_port))
    nat = (DispatchEntry(key, match + ("-j", ext)),) if ext else ()
    if eps.external:
        return _NodePortRules(nat, health)
    verdict = ("-j", "DROP") if eps.any else reject_target(p.family)
    return _NodePortRules(nat, (DispatchEntry(key, match + verdict),) + health)


def _health_check_accept(p: _Port) -> Tuple[DispatchEntry, ...]:
    """An externalTrafficPolicy: Local service's healthCheckNodePort (TCP) accepted in filter, on the
    node addresses NodePorts take, whether or not this node has a local endpoint: the load balancer
    must be able to ask every node.  kube-proxy's iptables mode accepts it too (filter KUBE-NODEPORTS
    from INPUT), so that a node whose INPUT policy drops still answers its health checks."""
    port = p.svc.health_check_node_port
    if not port:
        return ()
    comment = ("-m", "comment", "--comment", safe_comment(f"{p.svc.name} health check node port"))
    return (DispatchEntry(port_key("tcp", port), ("-p", "tcp") + comment + ("-m", "tcp", "--dport", str(port))
                          + ("-j", "ACCEPT")),)


AffinitySlots = Tuple[Tuple[int, affinity.EndpointKey], ...]
AffinityKeys = Tuple[Tuple[int, int, int], ...]


def _affinity(p: _Port, served: Sequence[Endpoint], addrs: Sequence[IPAddress],
              proto_num: int) -> Tuple[AffinitySlots, AffinityKeys]:
    """ClientIP affinity: (slot, endpoint) of every endpoint in the rules, and the (proto, port,
    address) keys its clients are remembered under (address 0: the NodePort, any node address)."""
    svc = p.svc
    if not svc.client_ip_affinity or not served:
        return (), ()
    slots = tuple(sorted((p.slots[k], k) for k in {(int(e.ip), e.port) for e in served}))
    keys = {(proto_num, svc.port, int(a)) for a in addrs}
    if svc.node_port:
        keys.add((proto_num, svc.node_port, 0))
    return slots, tuple(sorted(keys))


def render_service(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo, family: int,
                   config: ProxyConfig, comments: bool = True) -> Optional[ServiceRules]:
    """One service port's chains, dispatch rules and filter rules for one family; None if it has no
    address in that family.  ``comments=False`` (more than 1,000 endpoints on the node, as kube-proxy's
    largeClusterMode decides) leaves the comment off the endpoint rules: they are most of the table,
    and a comment is 256 bytes of every rule that the kernel copies and checks on every write."""
    cluster_addrs = [a for a in svc.cluster_ips if a.version == family]
    ext_addrs = [a for a in svc.external_ips if a.version == family]
    lb_addrs = [a for a in svc.load_balancer_ips if a.version == family]
    if not cluster_addrs and not ext_addrs and not lb_addrs:
        return None
    proto = svc.protocol.lower()
    comment: Rule = ("-m", "comment", "--comment", safe_comment(str(svc.name)))
    p = _Port(svc, family, config, proto, comment, ("-m", proto, "--dport", str(svc.port)),
              endpoint_comment=comment if comments else ())
    fam_eps = [e for e in endpoints if e.ip.version == family]
    if svc.client_ip_affinity:
        p.slots = affinity.slots((int(e.ip), e.port) for e in fam_eps)
    eps = _eligible(svc, fam_eps, node)
    has_external = bool(ext_addrs or lb_addrs or svc.node_port)
    chains = _endpoint_chains(p, eps, _cluster_masq(p, cluster_addrs), has_external)

    internal_chain = (chains.svl if svc.internal_traffic_policy == "Local" else chains.svc) if eps.internal else ""
    for addr in cluster_addrs:
        if internal_chain:
            p.route(addr, internal_chain)
        else:  # ITP Local without a local endpoint drops; no endpoint at all refuses
            p.refuse(addr, drop=eps.any)
        # Any other port of a cluster IP is refused: by one rule for all of them, an element of the
        # cluster-IP set each (assemble.py), as kube-proxy's nftables mode does with its set.
    nodeports = _external(p, eps, chains, ext_addrs, lb_addrs, node) if has_external else _NodePortRules()
    proto_num = ipset.PROTOS[proto]
    slots, keys = _affinity(p, chains.endpoints(eps), cluster_addrs + ext_addrs + lb_addrs, proto_num)
    hairpin = _hairpin_candidates(node, proto_num, eps.everyone if chains.svc else (), eps.local if chains.svl else ())
    return ServiceRules(nat=p.nat, dispatch=tuple(p.dispatch), nodeports=nodeports.nat, filter=tuple(p.filter),
                        filter_nodeports=nodeports.filter, hairpin=hairpin, affinity_slots=slots,
                        affinity_keys=keys, cluster_ips=tuple(ipset.address(int(a)) for a in cluster_addrs))
