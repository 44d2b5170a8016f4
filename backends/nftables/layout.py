"""The fixed part of netproxy's nftables tables: base chains, shared sets and maps, and the shared
pick chains (pure; :mod:`render` fills the sets and maps per service port).

Packet path (docs/parity.md is the contract, README.md the picture):

- nat ``prerouting``/``output``: loadBalancerSourceRanges (``firewall-ips``/``firewall-allow``: drop
  a source outside the ranges, before DNAT), then ``services``;
- ``services``: ``address . protocol . port vmap @service-ips``, then, for a node address,
  ``protocol . port vmap @service-nodeports``; both ``goto`` a shared pick chain (or a per-service
  affinity chain);
- ``<kind>-<proto>[-nodeport]-pick-<N>``: marks for masquerade as ``kind`` says and DNATs through
  its own endpoints map keyed by ``address . port`` (or ``nodePort``) ``. numgen random mod N``;
- nat ``postrouting``: hairpin (``hairpin`` set of ``endpoint . endpoint`` pairs, only DNAT-ed
  connections) gets the mark; marked packets are masqueraded and the bit cleared;
- filter ``input``/``forward``/``output`` (new connections that nat did not DNAT): ``reject`` (or
  ``drop``) through ``no-endpoint-services``/``no-endpoint-nodeports``, then ``reject`` for any
  other port of an active ClusterIP (``cluster-ips``).  ``filter-output`` sits after nat output's
  DNAT (priority -90) so that a valid ClusterIP port, DNAT-ed already, is not caught by the
  cluster-IP reject; input and forward come after prerouting's DNAT anyway.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from netproxy.backends.nftables import names
from netproxy.backends.nftables.objects import Chain, Hook, Rule, Set, Table
from netproxy.config import ProxyConfig

FAMILIES = ("ip", "ip6")
ADDR_TYPE = {"ip": "ipv4_addr", "ip6": "ipv6_addr"}
VERSIONS = {"ip": 4, "ip6": 6}
LOOPBACK = {"ip": "127.0.0.0/8", "ip6": "::1"}

CLUSTER, EXTERNAL, LOCAL, EXEMPT = "cluster", "external", "local", "exempt"
"""Kinds of traffic a pick chain serves:

- ``cluster``: to a ClusterIP; marked with ``--masquerade-all`` or from outside ``--cluster-cidr``;
- ``external``: to a NodePort, external or LB IP with externalTrafficPolicy Cluster; always marked;
- ``local``: the same with policy Local: local endpoints only, client address kept, dropped when
  there is none -- except traffic from inside ``--cluster-cidr`` or from the node itself, which the
  chain sends on through ``exempt-ips``/``exempt-nodeports`` (node-local traffic marked first);
- ``exempt``: that exception: every endpoint, no mark of its own.
"""
KINDS = (CLUSTER, EXTERNAL, LOCAL, EXEMPT)
PROTOCOLS = ("tcp", "udp", "sctp")

NAT_PRIORITY_DSTNAT = -100
NAT_PRIORITY_SRCNAT = 100
FILTER_PRIORITY = -110
FILTER_OUTPUT_PRIORITY = -90
"""After nat output's DNAT (-100): see the module docstring."""

TABLE_COMMENT = "managed by netproxy: changes made here are overwritten"


def table(family: str) -> Table:
    return Table(family, names.TABLE, TABLE_COMMENT)


def dispatch_expr(family: str) -> str:
    return f"{family} daddr . meta l4proto . th dport"


NODEPORT_EXPR = "meta l4proto . th dport"


def nodeport_match(family: str, config: ProxyConfig) -> str:
    """Which destinations are node addresses for NodePorts: every local one but loopback (kube-proxy
    >= 1.28), or with ``--nodeport-addresses`` those in ``nodeport-ips`` (the node's addresses in
    the CIDRs, which the core keeps current)."""
    if config.nodeport_addresses:
        return f"{family} daddr @{names.NODEPORT_IPS}"
    return f"fib daddr type local {family} daddr != {LOOPBACK[family]}"


def mark_rule_text(config: ProxyConfig) -> str:
    return f"meta mark set meta mark | {config.masquerade_mark:#010x}"


def base_chains(family: str, config: ProxyConfig) -> List[Tuple[Chain, Tuple[Rule, ...]]]:
    """The chains every table has, with their rules (rendered as a whole on each full sync)."""
    fam = family
    dispatch = dispatch_expr(fam)
    nodeports = nodeport_match(fam, config)
    mark = config.masquerade_mark
    firewall = (f"{dispatch} @{names.FIREWALL_IPS} {dispatch} . {fam} saddr != @{names.FIREWALL_ALLOW} drop",
                "loadBalancerSourceRanges")

    def filter_rules(chain: str, with_nodeports: bool) -> Tuple[Rule, ...]:
        rules = [Rule(chain, f"ct state new {dispatch} vmap @{names.NO_ENDPOINTS}")]
        if with_nodeports:
            rules.append(Rule(chain, f"ct state new {nodeports} {NODEPORT_EXPR} vmap @{names.NO_ENDPOINT_NODEPORTS}"))
        rules.append(Rule(chain, f"ct state new {fam} daddr @{names.CLUSTER_IPS} reject",
                          "other ports of active cluster IPs"))
        return tuple(rules)

    return [
        (Chain(names.NAT_PREROUTING, Hook("nat", "prerouting", NAT_PRIORITY_DSTNAT)),
         (Rule(names.NAT_PREROUTING, *firewall), Rule(names.NAT_PREROUTING, f"jump {names.SERVICES}"))),
        (Chain(names.NAT_OUTPUT, Hook("nat", "output", NAT_PRIORITY_DSTNAT)),
         (Rule(names.NAT_OUTPUT, *firewall), Rule(names.NAT_OUTPUT, f"jump {names.SERVICES}"))),
        (Chain(names.NAT_POSTROUTING, Hook("nat", "postrouting", NAT_PRIORITY_SRCNAT)), (
            Rule(names.NAT_POSTROUTING, f"ct status dnat {fam} saddr . {fam} daddr @{names.HAIRPIN} "
                                        f"{mark_rule_text(config)}", "hairpin"),
            Rule(names.NAT_POSTROUTING,
                 f"meta mark & {mark:#010x} == {mark:#010x} meta mark set meta mark ^ {mark:#010x} "
                 "masquerade fully-random", "masquerade traffic marked by netproxy"))),
        (Chain(names.FILTER_INPUT, Hook("filter", "input", FILTER_PRIORITY)),
         filter_rules(names.FILTER_INPUT, True)),
        (Chain(names.FILTER_FORWARD, Hook("filter", "forward", FILTER_PRIORITY)),
         filter_rules(names.FILTER_FORWARD, False)),
        (Chain(names.FILTER_OUTPUT, Hook("filter", "output", FILTER_OUTPUT_PRIORITY)),
         filter_rules(names.FILTER_OUTPUT, True)),
        (Chain(names.SERVICES), (
            Rule(names.SERVICES, f"{dispatch} vmap @{names.SERVICE_IPS}"),
            Rule(names.SERVICES, f"{nodeports} {NODEPORT_EXPR} vmap @{names.SERVICE_NODEPORTS}"))),
        (Chain(names.REJECT), (Rule(names.REJECT, "reject"),)),
    ]


def base_sets(family: str) -> List[Set]:
    addr = ADDR_TYPE[family]
    dispatch = f"{addr} . inet_proto . inet_service"
    nodeport = "inet_proto . inet_service"
    return [
        Set(names.SERVICE_IPS, dispatch, "verdict", comment="service address . protocol . port"),
        Set(names.SERVICE_NODEPORTS, nodeport, "verdict", comment="protocol . nodePort"),
        Set(names.NO_ENDPOINTS, dispatch, "verdict", comment="service ports without endpoints"),
        Set(names.NO_ENDPOINT_NODEPORTS, nodeport, "verdict", comment="nodePorts without endpoints"),
        Set(names.EXEMPT_IPS, dispatch, "verdict", comment="externalTrafficPolicy Local: pods and node"),
        Set(names.EXEMPT_NODEPORTS, nodeport, "verdict", comment="externalTrafficPolicy Local: pods and node"),
        Set(names.CLUSTER_IPS, addr, comment="active cluster IPs"),
        Set(names.NODEPORT_IPS, addr, comment="--nodeport-addresses"),
        Set(names.FIREWALL_IPS, dispatch, comment="load-balancer IPs with source ranges"),
        Set(names.FIREWALL_ALLOW, f"{dispatch} . {addr}", flags=("interval",),
            comment="load-balancer IP . protocol . port . allowed source range"),
        Set(names.HAIRPIN, f"{addr} . {addr}", comment="endpoint . endpoint: hairpin"),
    ]


class Pick(NamedTuple):
    """What a shared pick chain serves: a kind of traffic, a protocol, a number of endpoints, and
    whether it is keyed by the destination address and port or by the nodePort alone."""

    kind: str
    proto: str
    size: int
    """The number of endpoints (0 only for ``local``: no local endpoint, drop)."""
    nodeport: bool = False

    @property
    def chain(self) -> str:
        name: str = names.pick_chain(self.kind, self.proto, self.size, self.nodeport)
        return name

    @property
    def map(self) -> str:
        name: str = names.endpoints_map(self.kind, self.proto, self.size, self.nodeport)
        return name


def parse_pick_chain(name: str) -> Optional[Pick]:
    """The :class:`Pick` a shared chain name stands for, or None."""
    head, sep, count = name.partition("-pick-")
    nodeport = head.endswith("-nodeport")
    if nodeport:
        head = head[:-len("-nodeport")]
    kind, _, proto = head.partition("-")
    if sep and kind in KINDS and proto in PROTOCOLS and count.isdigit():
        return Pick(kind, proto, int(count), nodeport)
    return None


def endpoints_map(pick: Pick, family: str) -> Set:
    """The map a pick chain DNATs through: ``address . port . index`` (``nodePort . index``) ->
    ``endpoint . port``."""
    key = "th dport" if pick.nodeport else f"{family} daddr . th dport"
    what = "nodePort" if pick.nodeport else "service address . port"
    return Set(pick.map, f"{key} . numgen random mod 1", f"{family} daddr . th dport", typeof=True,
               comment=f"{pick.kind} {pick.proto} {what} . index: endpoint")


def masquerade_rule(chain: str, kind: str, family: str, config: ProxyConfig) -> Optional[Rule]:
    """The masquerade mark a chain of ``kind`` sets first (None: it sets none)."""
    mark = mark_rule_text(config)
    if kind == EXTERNAL or (kind == CLUSTER and config.masquerade_all):
        return Rule(chain, mark)
    if kind == CLUSTER:
        cidrs = cluster_cidrs(family, config)
        if cidrs:
            return Rule(chain, f"{family} saddr != {cidrs} {mark}")
    return None


def cluster_cidrs(family: str, config: ProxyConfig) -> Optional[str]:
    """``--cluster-cidr`` of ``family`` as an nft anonymous set, or None."""
    cidrs = [str(c) for c in config.cluster_cidrs if c.version == VERSIONS[family]]
    return f"{{ {', '.join(cidrs)} }}" if cidrs else None


def exemption_rules(chain: str, family: str, config: ProxyConfig, to: str) -> List[Rule]:
    """externalTrafficPolicy Local's exceptions (kube-proxy's): traffic from inside
    ``--cluster-cidr`` and from the node itself is cluster traffic, reaching every endpoint; the
    node's own is masqueraded (its source would be the destination's own address).  ``to`` is the
    statement that sends it there (a vmap lookup, or a goto for per-service affinity chains)."""
    rules = []
    cidrs = cluster_cidrs(family, config)
    if cidrs:
        rules.append(Rule(chain, f"{family} saddr {cidrs} {to}", "externalTrafficPolicy Local: pods"))
    rules.append(Rule(chain, f"fib saddr type local {mark_rule_text(config)} {to}",
                      "externalTrafficPolicy Local: the node itself"))
    return rules


def pick_chain(pick: Pick, family: str, config: ProxyConfig) -> Tuple[Chain, Tuple[Rule, ...], Optional[Set]]:
    """The shared chain (with its rules and its endpoints map, if it has one) for ``pick``."""
    name = pick.chain
    rules: List[Rule] = []
    masq = masquerade_rule(name, pick.kind, family, config)
    if masq is not None:
        rules.append(masq)
    if pick.kind == LOCAL:
        lookup = (f"{NODEPORT_EXPR} vmap @{names.EXEMPT_NODEPORTS}" if pick.nodeport
                  else f"{dispatch_expr(family)} vmap @{names.EXEMPT_IPS}")
        rules.extend(exemption_rules(name, family, config, lookup))
    if pick.size == 0:
        rules.append(Rule(name, "drop", "no local endpoint"))
        return Chain(name), tuple(rules), None
    emap = endpoints_map(pick, family)
    key = "th dport" if pick.nodeport else f"{family} daddr . th dport"
    # The protocol match gives nft the context a DNAT to a port needs (the key has no protocol).
    rules.append(Rule(name, f"meta l4proto {pick.proto} dnat {family} to {key} . "
                            f"numgen random mod {pick.size} map @{emap.name}"))
    return Chain(name), tuple(rules), emap
