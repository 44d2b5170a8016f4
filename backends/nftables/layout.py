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
  other port of an active ClusterIP (``cluster-ips``), then (forward and output, as kube-proxy)
  ``drop`` for any other address inside a service CIDR (``service-cidrs``).  ``filter-output`` sits after nat output's
  DNAT (priority -90) so that a valid ClusterIP port, DNAT-ed already, is not caught by the
  cluster-IP reject; input and forward come after prerouting's DNAT anyway.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple, Union

from netproxy.backends.nftables import names
from netproxy.backends.nftables import stmt as st
from netproxy.backends.nftables.objects import Chain, Hook, Rule, Set, Table
from netproxy.core.config import ProxyConfig

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
PROTOCOLS = ("tcp", "udp", "sctp")

NAT_PRIORITY_DSTNAT = -100
NAT_PRIORITY_SRCNAT = 100
FILTER_PRIORITY = -110
FILTER_OUTPUT_PRIORITY = -90
"""After nat output's DNAT (-100): see the module docstring."""

TABLE_COMMENT = "managed by netproxy: changes made here are overwritten"


def table(family: str) -> Table:
    return Table(family, names.TABLE, TABLE_COMMENT)


def dispatch_fields(family: str) -> Tuple[st.Field, ...]:
    return (st.addr(family, "daddr"), st.L4PROTO, st.DPORT)


NODEPORT_FIELDS = (st.L4PROTO, st.DPORT)


def nodeport_match(family: str, config: ProxyConfig) -> Tuple[st.Stmt, ...]:
    """Which destinations are node addresses for NodePorts: every local one but loopback (kube-proxy
    >= 1.28), or with ``--nodeport-addresses`` those in ``nodeport-ips`` (the node's addresses in
    the CIDRs, which the core keeps current)."""
    if config.nodeport_addresses:
        return (st.lookup((st.addr(family, "daddr"),), names.NODEPORT_IPS),)
    return st.fib_local("daddr"), st.addr_not_in(family, "daddr", LOOPBACK[family])


def mark_stmt(config: ProxyConfig) -> st.Stmt:
    return st.mark_or(config.masquerade_mark)


def base_chains(family: str, config: ProxyConfig) -> List[Tuple[Chain, Tuple[Rule, ...]]]:
    """The chains every table has, with their rules (rendered as a whole on each full sync)."""
    fam = family
    dispatch = dispatch_fields(fam)
    nodeports = nodeport_match(fam, config)
    mark = config.masquerade_mark
    firewall = (st.lookup(dispatch, names.FIREWALL_IPS),
                st.lookup(dispatch + (st.addr(fam, "saddr"),), names.FIREWALL_ALLOW, invert=True),
                st.DROP)

    def filter_rules(chain: str, with_nodeports: bool, service_cidrs: bool = True) -> Tuple[Rule, ...]:
        rules = [st.rule(chain, st.CT_STATE_NEW, st.vmap(dispatch, names.NO_ENDPOINTS))]
        if with_nodeports:
            rules.append(st.rule(chain, st.CT_STATE_NEW, *nodeports,
                                 st.vmap(NODEPORT_FIELDS, names.NO_ENDPOINT_NODEPORTS)))
        rules.append(st.rule(chain, st.CT_STATE_NEW, st.lookup((st.addr(fam, "daddr"),), names.CLUSTER_IPS),
                             st.reject(fam), comment="other ports of active cluster IPs"))
        if service_cidrs:
            # kube-proxy's "drop traffic to unallocated ClusterIPs" (its cluster-ips-check chain, from
            # forward and output after DNAT): what is left inside a service CIDR has no service.
            rules.append(st.rule(chain, st.CT_STATE_NEW, st.lookup((st.addr(fam, "daddr"),), names.SERVICE_CIDRS),
                                 st.DROP, comment="service CIDRs: addresses no service owns"))
        return tuple(rules)

    chains = [
        (Chain(names.NAT_PREROUTING, Hook("nat", "prerouting", NAT_PRIORITY_DSTNAT)),
         (st.rule(names.NAT_PREROUTING, *firewall, comment="loadBalancerSourceRanges"),
          st.rule(names.NAT_PREROUTING, st.jump(names.SERVICES)))),
        (Chain(names.NAT_OUTPUT, Hook("nat", "output", NAT_PRIORITY_DSTNAT)),
         (st.rule(names.NAT_OUTPUT, *firewall, comment="loadBalancerSourceRanges"),
          st.rule(names.NAT_OUTPUT, st.jump(names.SERVICES)))),
        (Chain(names.NAT_POSTROUTING, Hook("nat", "postrouting", NAT_PRIORITY_SRCNAT)), (
            st.rule(names.NAT_POSTROUTING, st.CT_STATUS_DNAT,
                    st.lookup((st.addr(fam, "saddr"), st.addr(fam, "daddr")), names.HAIRPIN), mark_stmt(config),
                    comment="hairpin"),
            st.rule(names.NAT_POSTROUTING, st.mark_has(mark), st.mark_xor(mark), st.MASQUERADE_FULLY_RANDOM,
                    comment="masquerade traffic marked by netproxy"))),
        (Chain(names.FILTER_INPUT, Hook("filter", "input", FILTER_PRIORITY)),
         filter_rules(names.FILTER_INPUT, True, service_cidrs=False)),
        (Chain(names.FILTER_FORWARD, Hook("filter", "forward", FILTER_PRIORITY)),
         filter_rules(names.FILTER_FORWARD, False)),
        (Chain(names.FILTER_OUTPUT, Hook("filter", "output", FILTER_OUTPUT_PRIORITY)),
         filter_rules(names.FILTER_OUTPUT, True)),
        (Chain(names.SERVICES), (
            st.rule(names.SERVICES, st.vmap(dispatch, names.SERVICE_IPS)),
            st.rule(names.SERVICES, *nodeports, st.vmap(NODEPORT_FIELDS, names.SERVICE_NODEPORTS)))),
        (Chain(names.REJECT), (st.rule(names.REJECT, st.reject(fam)),)),
    ]
    if fam in affinity_families(config):
        chains.extend(affinity_record_chains(fam))
    return chains


def affinity_families(config: ProxyConfig) -> Tuple[str, ...]:
    """Families whose ClientIP affinity lives in the shared ``affinity-<proto>`` maps: IPv4 always,
    IPv6 when ``config.ipv6_affinity`` is "maps" (chosen at start from the node's nft).  Elsewhere
    IPv6 keeps one set per endpoint and a chain per service port: nft 1.0.x aborts (an assertion in
    netlink_linearize.c) on any ``update @map { ip6 ... : ip6 daddr . ... }``, so an operator's
    ``nft list`` / ``nft -f`` of the map layout fails there; nft 1.1 lists and loads it again."""
    return ("ip", "ip6") if config.ipv6_affinity == "maps" else ("ip",)


AFFINITY_RECORD_PRIORITY = NAT_PRIORITY_DSTNAT + 10


def affinity_record_chains(family: str) -> List[Tuple[Chain, Tuple[Rule, ...]]]:
    """Where a new DNAT-ed connection to a service with ClientIP affinity is remembered (or its
    client's entry refreshed): right after nat's DNAT (dstnat + 10), by the connection's original
    destination in ``affinity-services`` / ``affinity-nodeports``, which send it to the chain of its
    protocol and timeout.  A filter chain: nat chains after the one that DNAT-ed are not run."""
    out = []
    for hook in ("prerouting", "output"):
        name = f"affinity-{hook}"
        rules = []
        for proto in PROTOCOLS:
            original = (st.ct_daddr(family), st.L4PROTO, st.CT_PROTO_DST)
            rules.append(st.rule(name, st.CT_STATE_NEW, st.CT_STATUS_DNAT, st.l4proto(proto),
                                 st.vmap(original, names.AFFINITY_SERVICES)))
            rules.append(st.rule(name, st.CT_STATE_NEW, st.CT_STATUS_DNAT, st.l4proto(proto),
                                 st.vmap((st.L4PROTO, st.CT_PROTO_DST), names.AFFINITY_NODEPORTS)))
        out.append((Chain(name, Hook("filter", hook, AFFINITY_RECORD_PRIORITY)), tuple(rules)))
    return out


def base_sets(family: str, config: ProxyConfig) -> List[Set]:
    addr = ADDR_TYPE[family]
    dispatch = f"{addr} . inet_proto . inet_service"
    nodeport = "inet_proto . inet_service"
    sets = [
        Set(names.SERVICE_IPS, dispatch, "verdict", comment="service address . protocol . port"),
        Set(names.SERVICE_NODEPORTS, nodeport, "verdict", comment="protocol . nodePort"),
        Set(names.NO_ENDPOINTS, dispatch, "verdict", comment="service ports without endpoints"),
        Set(names.NO_ENDPOINT_NODEPORTS, nodeport, "verdict", comment="nodePorts without endpoints"),
        Set(names.EXEMPT_IPS, dispatch, "verdict", comment="externalTrafficPolicy Local: pods and node"),
        Set(names.EXEMPT_NODEPORTS, nodeport, "verdict", comment="externalTrafficPolicy Local: pods and node"),
        Set(names.CLUSTER_IPS, addr, comment="active cluster IPs"),
        Set(names.NODEPORT_IPS, addr, comment="--nodeport-addresses"),
        Set(names.CLUSTER_CIDRS, addr, flags=("interval",), comment="--cluster-cidr"),
        Set(names.SERVICE_CIDRS, addr, flags=("interval",),
            comment="service CIDRs: --service-cluster-ip-range and ServiceCIDR objects"),
        Set(names.FIREWALL_IPS, dispatch, comment="load-balancer IPs with source ranges"),
        Set(names.FIREWALL_ALLOW, f"{dispatch} . {addr}", flags=("interval",),
            comment="load-balancer IP . protocol . port . allowed source range"),
        Set(names.HAIRPIN, f"{addr} . {addr}", comment="endpoint . endpoint: hairpin"),
        Set(names.STAMP, "inet_service", comment="what netproxy built this table from: restart by adoption"),
        # Keyed by a 128-bit hash of the service port's name (an ipv6_addr in both tables): a plain set,
        # so that replacing a stamp at each endpoint change is not a verdict-map element, whose adds
        # make the kernel validate the whole table on commit (40 ms at 100k services, stamp.py).
        # Sixteen of them, by the key's first hex digit: a dump's cost grows with the square of its set.
        *(Set(name, "ipv6_addr", comment="service stamps: restart by adoption") for name in names.SERVICE_STAMP_SETS),
    ]
    if family in affinity_families(config):
        sets.append(Set(names.AFFINITY_SERVICES, dispatch, "verdict",
                        comment="ClientIP affinity: service address . protocol . port"))
        sets.append(Set(names.AFFINITY_NODEPORTS, nodeport, "verdict",
                        comment="ClientIP affinity: protocol . nodePort"))
        for proto in PROTOCOLS:
            sets.append(Set(names.affinity_map(proto), f"{addr} . {addr} . inet_service", f"{addr} . inet_service",
                            flags=("dynamic", "timeout"), size=AFFINITY_SIZE,
                            comment=f"ClientIP affinity {proto}: client . service address . port : endpoint"))
    return sets


AFFINITY_SIZE = 1 << 20
"""Remembered clients per protocol and family; past it new clients are not remembered (the kernel's
dynset stops adding), which kube-proxy's ``recent`` lists (also bounded) share."""


class Pick(NamedTuple):
    """What a shared pick chain serves: a kind of traffic, a protocol, a number of endpoints,
    whether it is keyed by the destination address and port or by the nodePort alone, and whether
    it first looks the client up in the ClientIP affinity map (``sticky``)."""

    kind: str
    proto: str
    size: int
    """The number of endpoints (0 only for ``local``: no local endpoint, drop)."""
    nodeport: bool = False
    sticky: bool = False

    @property
    def chain(self) -> str:
        name: str = names.pick_chain(self.kind, self.proto, self.size, self.nodeport, self.sticky)
        return name

    @property
    def map(self) -> str:
        name: str = names.endpoints_map(self.kind, self.proto, self.size, self.nodeport, self.sticky)
        return name


class Record(NamedTuple):
    """A shared chain that remembers ``proto`` clients for ``timeout`` seconds in ``affinity-<proto>``."""

    proto: str
    timeout: int

    @property
    def chain(self) -> str:
        return f"affinity-{self.proto}-{self.timeout}"


Shared = Union[Pick, Record]
"""A chain several service ports use, created with its first user and deleted after its last."""


def shared_chain(shared: Shared, family: str, config: ProxyConfig) -> Tuple[Chain, Tuple[Rule, ...], Optional[Set]]:
    if isinstance(shared, Record):
        fam = family
        # The endpoint's port as conntrack's reply source, not the packet's dport: see CT_REPLY_PROTO_SRC.
        update = st.update(names.affinity_map(shared.proto), (st.addr(fam, "saddr"), st.ct_daddr(fam), st.CT_PROTO_DST),
                           (st.addr(fam, "daddr"), st.CT_REPLY_PROTO_SRC), shared.timeout)
        return Chain(shared.chain), (st.rule(shared.chain, st.l4proto(shared.proto), update),), None
    return pick_chain(shared, family, config)


def endpoints_map(pick: Pick, family: str) -> Set:
    """The map a pick chain DNATs through: ``address . port . index`` (``nodePort . index``) ->
    ``endpoint . port``."""
    key = "th dport" if pick.nodeport else f"{family} daddr . th dport"
    what = "nodePort" if pick.nodeport else "service address . port"
    if pick.size == 1:
        # One endpoint: no random draw (kube-proxy 1.37, kubernetes #140723), so no index either.
        return Set(pick.map, key, f"{family} daddr . th dport", typeof=True,
                   comment=f"{pick.kind} {pick.proto} {what}: its one endpoint")
    return Set(pick.map, f"{key} . numgen random mod 1", f"{family} daddr . th dport", typeof=True,
               comment=f"{pick.kind} {pick.proto} {what} . index: endpoint")


def masquerade_rule(chain: str, kind: str, family: str, config: ProxyConfig) -> Optional[Rule]:
    """The masquerade mark a chain of ``kind`` sets first (None: it sets none)."""
    if kind == EXTERNAL or (kind == CLUSTER and config.masquerade_all):
        return st.rule(chain, mark_stmt(config))
    if kind == CLUSTER and config.local_interface is not None:
        name, prefix = config.local_interface
        return st.rule(chain, st.iifname(name, prefix, invert=True), mark_stmt(config))
    if kind == CLUSTER and has_cluster_cidrs(family, config):
        return st.rule(chain, st.lookup((st.addr(family, "saddr"),), names.CLUSTER_CIDRS, invert=True),
                       mark_stmt(config))
    return None


def has_cluster_cidrs(family: str, config: ProxyConfig) -> bool:
    """Whether ``family`` has local-pod CIDRs (``--cluster-cidr``, or the Node's pod CIDRs in
    NodeCIDR mode): the ``cluster-cidrs`` set holds them."""
    return any(c.version == VERSIONS[family] for c in config.local_cidrs)


def exemption_rules(chain: str, family: str, config: ProxyConfig, to: st.Stmt) -> List[Rule]:
    """externalTrafficPolicy Local's exceptions (kube-proxy's): traffic from inside
    ``--cluster-cidr`` and from the node itself is cluster traffic, reaching every endpoint; the
    node's own is masqueraded (its source would be the destination's own address).  ``to`` is the
    statement that sends it there (a vmap lookup, or a goto for per-service affinity chains)."""
    rules = []
    if config.local_interface is not None:
        name, prefix = config.local_interface
        rules.append(st.rule(chain, st.iifname(name, prefix), to, comment="externalTrafficPolicy Local: pods"))
    elif has_cluster_cidrs(family, config):
        rules.append(st.rule(chain, st.lookup((st.addr(family, "saddr"),), names.CLUSTER_CIDRS), to,
                             comment="externalTrafficPolicy Local: pods"))
    rules.append(st.rule(chain, st.fib_local("saddr"), mark_stmt(config), to,
                         comment="externalTrafficPolicy Local: the node itself"))
    return rules


def pick_chain(pick: Pick, family: str, config: ProxyConfig) -> Tuple[Chain, Tuple[Rule, ...], Optional[Set]]:
    """The shared chain (with its rules and its endpoints map, if it has one) for ``pick``."""
    name = pick.chain
    rules: List[Rule] = []
    masq = masquerade_rule(name, pick.kind, family, config)
    if masq is not None:
        rules.append(masq)
    if pick.kind == LOCAL:
        lookup = (st.vmap(NODEPORT_FIELDS, names.EXEMPT_NODEPORTS) if pick.nodeport
                  else st.vmap(dispatch_fields(family), names.EXEMPT_IPS))
        rules.extend(exemption_rules(name, family, config, lookup))
    if pick.size == 0:
        rules.append(st.rule(name, st.DROP, comment="no local endpoint"))
        return Chain(name), tuple(rules), None
    # The protocol match gives nft the context a DNAT to a port needs (the keys have no protocol).
    proto = st.l4proto(pick.proto)
    if pick.sticky:
        client = (st.addr(family, "saddr"), st.addr(family, "daddr"), st.DPORT)
        rules.append(st.rule(name, proto, st.dnat_map(family, client, names.affinity_map(pick.proto)),
                             comment="ClientIP affinity: a remembered client"))
    emap = endpoints_map(pick, family)
    key = (st.DPORT,) if pick.nodeport else (st.addr(family, "daddr"), st.DPORT)
    draw = (st.numgen(pick.size),) if pick.size > 1 else ()
    rules.append(st.rule(name, proto, st.dnat_map(family, key + draw, emap.name)))
    return Chain(name), tuple(rules), emap
