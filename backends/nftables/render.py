"""Pure rendering: a snapshot (or one service port of it) to the nftables objects netproxy wants.

Layout (PERF-NOTES.md's compact layout; README.md has the picture):

- ``services`` (jumped to from nat prerouting and output) does one lookup in the ``service-ips``
  verdict map, ``address . protocol . port`` -> ``goto <kind>-pick-<N>``, whatever the number of
  services;
- ``<kind>-<proto>-pick-<N>`` is shared by every service address with N endpoints: it marks for
  masquerade when ``kind`` needs it and DNATs through its own ``<kind>-<proto>-endpoints-<N>`` map,
  keyed by ``address . port . numgen random mod N`` -- equal odds, one lookup.  The protocol picks
  the map rather than being a key field: each concatenated field costs libnftables ~3 us per
  element, 0.3 s of a 10k-service sync (measured: 4 fields 1.8 s, 3 fields 1.45 s).  One map per pick
  chain (rather than one for all) because nft 1.0.x cannot add a rule that refers to a ``typeof``
  map holding ``th dport`` once that map is in the kernel ("conflicting protocols specified: ip vs.
  th" when it rebuilds the type from the kernel), so a pick chain's rule is only ever added in the
  transaction that creates its map;
- ClientIP affinity: the address goes to a per-service chain instead, which checks one dynamic
  timeout set per endpoint (as iptables ``recent --rcheck --seconds T``) before the random choice,
  and each endpoint chain refreshes its set (``recent --set``) before the DNAT;
- an address without endpoints goes into ``no-endpoint-services`` (filter hooks): reject, or drop
  for externalTrafficPolicy Local.

Few chains and few rules bound to each map keep the kernel's transaction cost linear.
"""

from __future__ import annotations

import ipaddress
import operator
import socket
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

from netproxy.backends.nftables import names
from netproxy.backends.nftables.objects import Chain, Element, ElementRun, Hook, Rule, Set, Table
from netproxy.config import ProxyConfig
from netproxy.endpoints import cluster_endpoints, external_endpoints
from netproxy.model import Endpoint, IPAddress, NodeInfo, ServicePort

FAMILIES = ("ip", "ip6")
_ADDR_TYPE = {"ip": "ipv4_addr", "ip6": "ipv6_addr"}
VERSIONS = {"ip": 4, "ip6": 6}

CLUSTER, EXTERNAL, LOCAL = "cluster", "external", "local"
"""Kinds of service address: a ClusterIP; an external/LB IP with externalTrafficPolicy Cluster
(masqueraded); the same with policy Local (client address kept, local endpoints only)."""

NAT_PRIORITY_DSTNAT = -100
NAT_PRIORITY_SRCNAT = 100
# Before DNAT (-100), so that the no-endpoints check sees the service address.
FILTER_PRIORITY = -110

TABLE_COMMENT = "managed by netproxy: changes made here are overwritten"


@dataclass
class ServiceObjects:
    """Everything one service port owns in one family's table."""

    elements: Dict[Tuple[str, str], Element] = field(default_factory=dict)
    """``service-ips`` and ``no-endpoint-services`` elements, keyed by (map, key)."""
    runs: Dict[str, ElementRun] = field(default_factory=dict)
    """Endpoint-map elements per dispatch key (``address . protocol . port``)."""
    chains: Dict[str, Tuple[Rule, ...]] = field(default_factory=dict)
    sets: Dict[str, Set] = field(default_factory=dict)
    shared: FrozenSet[str] = frozenset()
    """Names of the shared pick chains this service's map elements jump to."""
    dispatch_keys: Tuple[str, ...] = ()
    """``address . protocol . port`` keys this service claims (one owner per key)."""

    def is_empty(self) -> bool:
        return not (self.elements or self.runs or self.chains or self.sets)


def family_of(ip: IPAddress) -> str:
    return "ip" if ip.version == 4 else "ip6"


def table(family: str) -> Table:
    return Table(family, names.TABLE, TABLE_COMMENT)


def base_chains(family: str) -> List[Tuple[Chain, Tuple[Rule, ...]]]:
    """The chains every table has, with their rules (rendered as a whole on each full sync)."""
    fam = family
    dispatch = f"{fam} daddr . meta l4proto . th dport"
    no_ep = Rule("", f"ct state new {dispatch} vmap @{names.NO_ENDPOINTS}")
    out = [
        (Chain(names.NAT_PREROUTING, Hook("nat", "prerouting", NAT_PRIORITY_DSTNAT)),
         (Rule(names.NAT_PREROUTING, f"jump {names.SERVICES}"),)),
        (Chain(names.NAT_OUTPUT, Hook("nat", "output", NAT_PRIORITY_DSTNAT)),
         (Rule(names.NAT_OUTPUT, f"jump {names.SERVICES}"),)),
        (Chain(names.NAT_POSTROUTING, Hook("nat", "postrouting", NAT_PRIORITY_SRCNAT)), ()),
        (Chain(names.FILTER_INPUT, Hook("filter", "input", FILTER_PRIORITY)),
         (no_ep._replace(chain=names.FILTER_INPUT),)),
        (Chain(names.FILTER_FORWARD, Hook("filter", "forward", FILTER_PRIORITY)),
         (no_ep._replace(chain=names.FILTER_FORWARD),)),
        (Chain(names.FILTER_OUTPUT, Hook("filter", "output", FILTER_PRIORITY)),
         (no_ep._replace(chain=names.FILTER_OUTPUT),)),
        (Chain(names.SERVICES), (Rule(names.SERVICES, f"{dispatch} vmap @{names.SERVICE_IPS}"),)),
        (Chain(names.REJECT), (Rule(names.REJECT, "reject"),)),
    ]
    return out


def postrouting_rules(config: ProxyConfig) -> Tuple[Rule, ...]:
    mark = config.masquerade_mark
    return (Rule(names.NAT_POSTROUTING,
                 f"meta mark & {mark:#010x} == {mark:#010x} meta mark set meta mark ^ {mark:#010x} "
                 "masquerade fully-random", "masquerade traffic marked by netproxy"),)


def base_sets(family: str) -> List[Set]:
    addr = _ADDR_TYPE[family]
    dispatch = f"{addr} . inet_proto . inet_service"
    return [
        Set(names.SERVICE_IPS, dispatch, "verdict", comment="service address . protocol . port"),
        Set(names.NO_ENDPOINTS, dispatch, "verdict", comment="service ports without endpoints"),
    ]


class Pick(NamedTuple):
    """What a shared pick chain serves: a kind of address, a protocol, a number of endpoints."""

    kind: str
    proto: str
    size: int
    """The number of endpoints."""

    @property
    def chain(self) -> str:
        name: str = names.pick_chain(self.kind, self.proto, self.size)
        return name

    @property
    def map(self) -> str:
        name: str = names.endpoints_map(self.kind, self.proto, self.size)
        return name


def parse_pick_chain(name: str) -> Optional[Pick]:
    """The :class:`Pick` a shared chain name stands for, or None."""
    head, sep, count = name.partition("-pick-")
    kind, _, proto = head.partition("-")
    if sep and kind in (CLUSTER, EXTERNAL, LOCAL) and proto in ("tcp", "udp", "sctp") and count.isdigit():
        return Pick(kind, proto, int(count))
    return None


def endpoints_map(pick: Pick, family: str) -> Set:
    """The map a pick chain DNATs through: ``address . port . index`` -> ``endpoint . port``."""
    return Set(pick.map, f"{family} daddr . th dport . numgen random mod 1", f"{family} daddr . th dport",
               typeof=True, comment=f"{pick.kind} {pick.proto} service address . port . index: endpoint")


def _masquerade_rule(chain: str, kind: str, family: str, config: ProxyConfig) -> Optional[Rule]:
    mark = f"meta mark set meta mark | {config.masquerade_mark:#010x}"
    if kind == EXTERNAL or (kind == CLUSTER and config.masquerade_all):
        return Rule(chain, mark)
    if kind == CLUSTER:
        cidrs = [str(c) for c in config.cluster_cidrs if c.version == VERSIONS[family]]
        if cidrs:
            return Rule(chain, f"{family} saddr != {{ {', '.join(cidrs)} }} {mark}")
    return None


def pick_chain(pick: Pick, family: str, config: ProxyConfig) -> Tuple[Chain, Tuple[Rule, ...], Set]:
    """The shared chain (with its rules and its map) for ``pick``."""
    name = pick.chain
    rules: List[Rule] = []
    masq = _masquerade_rule(name, pick.kind, family, config)
    if masq is not None:
        rules.append(masq)
    emap = endpoints_map(pick, family)
    # The protocol match gives nft the context a DNAT to a port needs (the key has no protocol).
    rules.append(Rule(name, f"meta l4proto {pick.proto} dnat {family} to {family} daddr . th dport . "
                            f"numgen random mod {pick.size} map @{emap.name}"))
    return Chain(name), tuple(rules), emap


def ip_text(ip: IPAddress) -> str:
    """``str(ip)``, several times faster for IPv4: ipaddress formats in pure Python, and a
    10k-service render formats 110k addresses."""
    if ip.version == 4:
        return socket.inet_ntoa(int(ip).to_bytes(4, "big"))
    return str(ip)


_Choice = Tuple[str, Endpoint]
"""An endpoint and its ``address . port`` text; lists of these are sorted on the text (a C string
sort: Endpoint's generated ``__lt__`` compares ipaddress objects in Python and cost 0.2 s at 10k)."""

_first = operator.itemgetter(0)
_V4 = ipaddress.IPv4Address


def _choices(eps: Sequence[Endpoint]) -> Tuple[_Choice, ...]:
    # ip_text() inlined for IPv4: this runs once per endpoint, 100k times in a 10k-service sync.
    ntoa = socket.inet_ntoa
    return tuple(sorted(((f"{ntoa(int(e.ip).to_bytes(4, 'big'))} . {e.port}" if type(e.ip) is _V4
                          else f"{e.ip} . {e.port}", e) for e in eps), key=_first))


def _dnat_target(ep: Endpoint) -> str:
    return f"[{ep.ip}]:{ep.port}" if ep.ip.version == 6 else f"{ip_text(ep.ip)}:{ep.port}"


_ZERO = {"ip": "0.0.0.0", "ip6": "::"}


def _affinity_objects(svc: ServicePort, kind: str, eps: Sequence[Endpoint], family: str,
                      config: ProxyConfig, out: ServiceObjects) -> str:
    """The per-service chain (and its set) for ClientIP affinity; returns the chain's name.

    The iptables backend's shape with one dynamic set per service port, keyed by
    ``client . endpoint address . endpoint port``: first one rule per endpoint "this client is
    remembered for this endpoint: refresh it and DNAT there" (``recent --rcheck --seconds T --reap``
    and ``--set``), then the random choice as iptables' statistic rules, rule i taken with
    probability 1/(N-i), each remembering the client before its DNAT.  Neither a chain nor a set per
    endpoint: the kernel looks sets up by name in a list, and 13k per-endpoint sets made a
    10k-service transaction take 30 s.

    nft cannot type a constant inside a concatenation that is looked up, so the endpoint's
    address and port are spelled ``(ip saddr & 0.0.0.0 | <address>)`` and ``(th dport & 0 | <port>)``:
    the kernel computes the constant (bitwise and-zero, xor-constant); ``nft list`` prints it
    oddly, hence the comment on each rule.
    """
    cname: str = names.affinity_chain(svc.name, external=kind != CLUSTER)
    aff: str = names.affinity_set(svc.name)
    out.sets[aff] = Set(aff, f"{_ADDR_TYPE[family]} . {_ADDR_TYPE[family]} . inet_service",
                        flags=("dynamic", "timeout"), timeout=svc.affinity_timeout, comment=str(svc.name))
    rules: List[Rule] = []
    masq = _masquerade_rule(cname, kind, family, config)
    if masq is not None:
        rules.append(masq)
    proto = svc.protocol.lower()
    steps = []
    for ep in eps:
        addr = ip_text(ep.ip)
        note = f"{svc.name} endpoint {addr} port {ep.port}"
        step = f"update @{aff} {{ {family} saddr . {addr} . {ep.port} }} dnat {family} to {_dnat_target(ep)}"
        steps.append((step, note))
        known = f"{family} saddr . ({family} saddr & {_ZERO[family]} | {addr}) . (th dport & 0 | {ep.port}) @{aff}"
        rules.append(Rule(cname, f"meta l4proto {proto} {known} {step}", note))
    n = len(steps)
    for i, (step, note) in enumerate(steps):
        chance = f"numgen random mod {n - i} == 0 " if i < n - 1 else ""
        rules.append(Rule(cname, f"meta l4proto {proto} {chance}{step}", note))
    out.chains[cname] = tuple(rules)
    return cname


def render_service(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo, family: str,
                   config: ProxyConfig) -> ServiceObjects:
    """The objects one service port owns in ``family``'s table (empty if it has no such address)."""
    out = ServiceObjects()
    version = VERSIONS[family]
    addrs = [(ip, CLUSTER) for ip in svc.cluster_ips if ip.version == version]
    ext_kind = LOCAL if svc.external_traffic_policy == "Local" else EXTERNAL
    if svc.external_ips or svc.load_balancer_ips:
        addrs += [(ip, ext_kind) for ip in svc.external_ips + svc.load_balancer_ips if ip.version == version]
    if not addrs:
        return out
    family_eps = [e for e in endpoints if e.ip.version == version]
    by_kind: Dict[str, Tuple[_Choice, ...]] = {}
    if any(k == CLUSTER for _, k in addrs):
        by_kind[CLUSTER] = _choices(cluster_endpoints(svc, family_eps, node))
    if any(k != CLUSTER for _, k in addrs):
        by_kind[ext_kind] = _choices(external_endpoints(svc, family_eps, node))
    note = names.service_comment(svc.name)
    proto = svc.protocol.lower()
    shared = set()
    keys: List[str] = []
    verdicts: Dict[str, str] = {}
    elements = out.elements
    for ip, kind in addrs:
        addr = ip_text(ip)
        key = f"{addr} . {proto} . {svc.port}"
        if key in keys:
            continue  # the same address listed twice (e.g. as external and LB IP): first wins
        keys.append(key)
        choices = by_kind[kind]
        if not choices:
            verdict = "drop" if kind == LOCAL else f"goto {names.REJECT}"
            elements[(names.NO_ENDPOINTS, key)] = Element(names.NO_ENDPOINTS, key, verdict, note)
            continue
        if svc.client_ip_affinity:
            if kind not in verdicts:
                eps = [ep for _, ep in choices]
                verdicts[kind] = f"goto {_affinity_objects(svc, kind, eps, family, config, out)}"
        else:
            pick = Pick(kind, proto, len(choices))
            shared.add(pick.chain)
            verdicts[kind] = f"goto {pick.chain}"
            out.runs[key] = ElementRun(pick.map, f"{addr} . {svc.port}", tuple(v for v, _ in choices))
        elements[(names.SERVICE_IPS, key)] = Element(names.SERVICE_IPS, key, verdicts[kind], note)
    out.shared = frozenset(shared)
    out.dispatch_keys = tuple(keys)
    return out
