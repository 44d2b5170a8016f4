"""Snapshot → iptables rules, without I/O: tables → chains → rules as argument lists.

Layout (README.md has the why and the measurements):

- ``KUBE-SERVICES`` (nat, jumped to from ``PREROUTING`` and ``OUTPUT``) dispatches on destination
  address, protocol and port.  With many services it is a small tree instead of one flat list:
  ``-d <prefix> -j KUBE-SVCS-<hash>`` jumps split the addresses 16 ways per level until a chain holds
  at most :data:`LEAF_SIZE` services, so a packet checks tens of rules at 10k services, not 10k.
- ``KUBE-SVC-<hash>`` per service port (kube-proxy's name) holds the endpoint choice inline:
  ``-m statistic --probability 1/(n-i)`` + ``DNAT`` per endpoint, last one unconditional.  There are no
  per-endpoint ``KUBE-SEP-`` chains (PERF-NOTES.md: 8.5 s against 1.55 s at 10k), but ClientIP
  affinity uses ``KUBE-SEP-<hash>`` as each endpoint's ``-m recent`` list name, as the seed did.
- ``KUBE-EXT-<hash>`` for external and load-balancer IPs: marks for masquerade and jumps to the
  service chain (externalTrafficPolicy Cluster), or picks among local endpoints (Local).
- A service port without endpoints is rejected in the filter table's ``KUBE-SERVICES`` so that clients
  get "connection refused" instead of a silent timeout.

Every service rule carries ``-m comment --comment "<ns>/<name>:<port>"``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from netproxy.backends.iptables import names
from netproxy.config import ProxyConfig
from netproxy.endpoints import cluster_endpoints, external_endpoints
from netproxy.model import Endpoint, IPAddress, NodeInfo, ServicePort

Rule = Tuple[str, ...]
"""One rule's arguments after ``-A <chain>``, e.g. ``("-d", "10.0.0.1/32", "-p", "tcp", ...)``."""

Chains = Dict[str, Tuple[Rule, ...]]
"""Chain name → its rules, in write order."""

LEAF_SIZE = 32
"""At most this many services' rules in one dispatch chain before it is split further."""
FANOUT_BITS = 4
"""Each dispatch level splits on this many more address bits (16 ways)."""
MAX_COMMENT = 255
"""XT_MAX_COMMENT_LEN - 1: the kernel's comment buffer holds 256 bytes with the NUL."""

SERVICE_PORTALS = "kubernetes service portals"
NAT_JUMPS: Tuple[Tuple[str, str, Rule], ...] = (
    ("PREROUTING", names.SERVICES, ("-m", "comment", "--comment", SERVICE_PORTALS, "-j", names.SERVICES)),
    ("OUTPUT", names.SERVICES, ("-m", "comment", "--comment", SERVICE_PORTALS, "-j", names.SERVICES)),
    ("POSTROUTING", names.POSTROUTING,
     ("-m", "comment", "--comment", "kubernetes postrouting rules", "-j", names.POSTROUTING)),
)
_NEW = ("-m", "conntrack", "--ctstate", "NEW")
FILTER_JUMPS: Tuple[Tuple[str, str, Rule], ...] = tuple(
    (hook, names.SERVICES, _NEW + ("-m", "comment", "--comment", SERVICE_PORTALS, "-j", names.SERVICES))
    for hook in ("INPUT", "FORWARD", "OUTPUT"))
JUMPS: Dict[str, Tuple[Tuple[str, str, Rule], ...]] = {"nat": NAT_JUMPS, "filter": FILTER_JUMPS}
"""Per table: (built-in chain, target chain, rule) — the jump rules netproxy adds once, at the top."""

TABLES = ("nat", "filter")


def safe_comment(text: str) -> str:
    """A comment that cannot end itself or the payload line: no control characters, no NUL, at most
    255 bytes.  Validation already forbids such names; this keeps the writer safe on its own."""
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text)
    raw = cleaned.encode()[:MAX_COMMENT]
    return raw.decode(errors="ignore")


_probabilities: Dict[int, str] = {}


def probability(remaining: int) -> str:
    """``1/remaining`` with 10 decimals, as kube-proxy prints it: enough that 1/n and 1/(n+1) differ in
    text for every n up to 100,000 (their gap, ~1/n², stays above 1e-10).  Cached: a 10k-service
    render asks for the same ten values 10,000 times."""
    text = _probabilities.get(remaining)
    if text is None:
        text = _probabilities[remaining] = f"{1.0 / remaining:0.10f}"
    return text


def destination(ep: Endpoint) -> str:
    """"ip:port", or "[ip6]:port"; IPv4 formatted from the integer (ipaddress's str is the slow part)."""
    if ep.ip.version == 4:
        n = int(ep.ip)
        return f"{n >> 24}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}:{ep.port}"
    return f"[{ep.ip}]:{ep.port}"


def host_net(addr: IPAddress) -> str:
    return f"{addr}/{addr.max_prefixlen}"


@dataclass(frozen=True)
class DispatchEntry:
    """One (address, protocol, port) → chain rule of ``KUBE-SERVICES``."""

    address: int
    rule: Rule


@dataclass(frozen=True)
class ServiceRules:
    """Everything one service port contributes to one family's tables."""

    nat: Chains
    dispatch: Tuple[DispatchEntry, ...]
    rejects: Tuple[Rule, ...]


@dataclass
class FamilyRuleset:
    """The desired state of the netproxy-owned chains of one family (4 or 6)."""

    family: int
    tables: Dict[str, Chains] = field(default_factory=dict)

    def chains(self, table: str) -> Chains:
        return self.tables.setdefault(table, {})


def _endpoint_rules(chain_proto: str, comment: Rule, eps: Sequence[Endpoint], svc: ServicePort,
                    sep_names: Sequence[str]) -> List[Rule]:
    """Inline endpoint choice: affinity checks first, then 1/(n-i) odds, the last rule unconditional."""
    proto: Rule = ("-p", chain_proto)
    rules: List[Rule] = []
    affinity = svc.client_ip_affinity
    if affinity:
        seconds = str(svc.affinity_timeout)
        for ep, sep in zip(eps, sep_names):
            # --rcheck then --set in one rule: a returning client refreshes its timestamp, as the seed's
            # KUBE-SEP chain did by running --set after the KUBE-SVC chain's --rcheck.
            rules.append(proto + comment + ("-m", "recent", "--name", sep, "--rcheck", "--seconds", seconds,
                                            "--reap", "-m", "recent", "--name", sep, "--set",
                                            "-j", "DNAT", "--to-destination", destination(ep)))
    n = len(eps)
    for i, (ep, sep) in enumerate(zip(eps, sep_names)):
        args = proto + comment
        if i < n - 1:
            args += ("-m", "statistic", "--mode", "random", "--probability", probability(n - i))
        if affinity:
            args += ("-m", "recent", "--name", sep, "--set")
        rules.append(args + ("-j", "DNAT", "--to-destination", destination(ep)))
    return rules


def _sep_names(svc: ServicePort, eps: Sequence[Endpoint]) -> List[str]:
    if not svc.client_ip_affinity:
        return [""] * len(eps)
    return [names.endpoint_name(svc.name, svc.protocol, ep) for ep in eps]


def _masq_rules(comment: Rule, family: int, config: ProxyConfig) -> List[Rule]:
    if config.masquerade_all:
        return [comment + ("-j", names.MARK_MASQ)]
    for cidr in config.cluster_cidrs:
        if cidr.version == family:
            # Traffic from outside the cluster CIDR needs SNAT so that replies come back through us.
            return [("!", "-s", str(cidr)) + comment + ("-j", names.MARK_MASQ)]
    return []


def render_service(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo, family: int,
                   config: ProxyConfig) -> Optional[ServiceRules]:
    """One service port's chains, dispatch rules and reject rules for one family; None if it has no
    address in that family."""
    cluster_addrs = [a for a in svc.cluster_ips if a.version == family]
    ext_addrs = [a for a in svc.external_ips + svc.load_balancer_ips if a.version == family]
    if not cluster_addrs and not ext_addrs:
        return None
    proto = svc.protocol.lower()
    comment: Rule = ("-m", "comment", "--comment", safe_comment(str(svc.name)))
    port_match: Rule = ("-m", proto, "--dport", str(svc.port))
    eps = [e for e in cluster_endpoints(svc, endpoints, node) if e.ip.version == family]
    svc_chain = names.service_chain(svc.name, svc.protocol)
    nat: Dict[str, Tuple[Rule, ...]] = {}
    dispatch: List[DispatchEntry] = []
    rejects: List[Rule] = []

    def route(addr: IPAddress, chain: Optional[str]) -> None:
        match = ("-d", host_net(addr), "-p", proto) + comment + port_match
        if chain is None:
            reject = "icmp-port-unreachable" if family == 4 else "icmp6-port-unreachable"
            rejects.append(match + ("-j", "REJECT", "--reject-with", reject))
        else:
            dispatch.append(DispatchEntry(int(addr), match + ("-j", chain)))

    if eps:
        nat[svc_chain] = tuple(_masq_rules(comment, family, config)
                               + _endpoint_rules(proto, comment, eps, svc, _sep_names(svc, eps)))
    for addr in cluster_addrs:
        route(addr, svc_chain if eps else None)
    if ext_addrs:
        ext_chain: Optional[str] = names.service_chain(svc.name, svc.protocol, names.EXT_PREFIX)
        assert ext_chain is not None
        if svc.external_traffic_policy == "Local":
            local = [e for e in external_endpoints(svc, endpoints, node) if e.ip.version == family]
            if local:
                nat[ext_chain] = tuple(_endpoint_rules(proto, comment, local, svc, _sep_names(svc, local)))
            else:
                ext_chain = None
        elif eps:
            nat[ext_chain] = (comment + ("-j", names.MARK_MASQ), comment + ("-j", svc_chain))
        else:
            ext_chain = None
        for addr in ext_addrs:
            route(addr, ext_chain)
    return ServiceRules(nat, tuple(dispatch), tuple(rejects))


def build_dispatch(entries: Iterable[DispatchEntry], family: int) -> Tuple[Tuple[Rule, ...], Chains]:
    """``KUBE-SERVICES`` rules and the second-level ``KUBE-SVCS-`` chains, as a prefix tree.

    Deterministic in the set of addresses, so a one-service change rewrites only the chains on that
    service's path (a leaf splitting aside).  Per packet: at most 16 jump rules per level plus one leaf.
    """
    bits = 32 if family == 4 else 128
    ordered = sorted(entries, key=lambda e: (e.address, e.rule))
    sub: Dict[str, Tuple[Rule, ...]] = {}

    def node(group: Sequence[DispatchEntry]) -> Tuple[Rule, ...]:
        if len(group) <= LEAF_SIZE:
            return tuple(e.rule for e in group)
        common = bits - (group[0].address ^ group[-1].address).bit_length()
        if common == bits:  # one address with many ports: nothing to split on
            return tuple(e.rule for e in group)
        split = min(bits, common + FANOUT_BITS)
        shift = bits - split
        rules: List[Rule] = []
        start = 0
        while start < len(group):
            key = group[start].address >> shift
            end = start
            while end < len(group) and group[end].address >> shift == key:
                end += 1
            part = group[start:end]
            if len(part) <= 2:  # a jump would cost as much as the rules themselves
                rules.extend(e.rule for e in part)
            else:
                net = ipaddress.ip_network((key << shift, split)) if family == 4 else \
                    ipaddress.IPv6Network((key << shift, split))
                chain = names.dispatch_chain(str(net))
                sub[chain] = node(part)
                rules.append(("-d", str(net), "-m", "comment", "--comment", f"services in {net}", "-j", chain))
            start = end
        return tuple(rules)

    return node(ordered), sub


def base_chains(config: ProxyConfig) -> Chains:
    """The nat chains that exist whatever the services: masquerade marking and SNAT."""
    mark = f"{config.masquerade_mark:#x}"
    return {
        names.MARK_MASQ: (("-j", "MARK", "--or-mark", mark),),
        names.POSTROUTING: (
            ("-m", "mark", "!", "--mark", f"{mark}/{mark}", "-j", "RETURN"),
            ("-j", "MARK", "--xor-mark", mark),
            ("-m", "comment", "--comment", "kubernetes service traffic requiring SNAT", "-j", "MASQUERADE"),
        ),
    }


def assemble(family: int, services: Iterable[ServiceRules], config: ProxyConfig) -> FamilyRuleset:
    """One family's desired state from its services' rules (already rendered, possibly cached)."""
    rendered = list(services)
    top, sub = build_dispatch((e for s in rendered for e in s.dispatch), family)
    out = FamilyRuleset(family)
    nat = out.chains("nat")
    nat[names.SERVICES] = top
    nat.update(base_chains(config))
    nat.update(sub)
    for s in rendered:
        nat.update(s.nat)
    out.chains("filter")[names.SERVICES] = tuple(r for s in rendered for r in s.rejects)
    return out
