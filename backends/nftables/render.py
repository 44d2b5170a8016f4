"""Pure rendering: one service port (in one family) to the nftables objects it owns.

The fixed part of the tables and the shared pick chains are in :mod:`layout` (its docstring has the
packet path).  A service port owns:

- its dispatch elements: ``service-ips`` (``address . protocol . port``) and ``service-nodeports``
  (``protocol . nodePort``) -> ``goto <kind>-<proto>[-nodeport]-pick-<N>``, shared by every service
  port with N endpoints of that kind, or -> its own affinity chain;
- its endpoints: one :class:`~objects.ElementRun` per dispatch key in the pick chain's map
  (``address . port . i`` or ``nodePort . i`` -> ``endpoint . port``);
- externalTrafficPolicy Local: a second run and an ``exempt-ips``/``exempt-nodeports`` element
  that the ``local`` pick chain sends pods' and the node's own traffic through (every endpoint);
- refusals: ``no-endpoint-services``/``no-endpoint-nodeports`` (reject; drop for internalTrafficPolicy
  Local without a local endpoint);
- loadBalancerSourceRanges: ``firewall-ips`` and ``firewall-allow`` elements;
- elements other service ports may hold too (reference-counted by the backend): its cluster IPs in
  ``cluster-ips`` (reject other ports: ``refs``) and ``endpoint . endpoint`` pairs in ``hairpin``
  (``hairpin``: the endpoint addresses alone, the elements made only when written).

Eligible endpoints come from :mod:`netproxy.core.endpoints` only.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import operator
import socket
import struct
from dataclasses import dataclass, field
from sys import intern
from types import MappingProxyType
from typing import Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple, overload

from netproxy.backends.nftables import names
from netproxy.backends.nftables import stmt as st
from netproxy.backends.nftables.layout import (
    ADDR_TYPE,
    CLUSTER,
    EXEMPT,
    EXTERNAL,
    LOCAL,
    VERSIONS,
    Pick,
    Record,
    Shared,
    affinity_families,
    exemption_rules,
    masquerade_rule,
)
from netproxy.backends.nftables.objects import V4_WIDTH, V6_WIDTH, Element, ElementRun, PackedKeys, Rule, Set
from netproxy.core.config import ProxyConfig
from netproxy.core.endpoints import cluster_endpoints, external_endpoints
from netproxy.core.firewall import firewall_sources
from netproxy.core.model import SLOTS, Endpoint, IPAddress, NodeInfo, ServicePort

WIDTHS = {"ip": V4_WIDTH, "ip6": V6_WIDTH}
"""The bytes of one endpoints map value per family (:class:`~objects.ElementRun`)."""

_NO_CHAINS: Mapping[str, Tuple[Rule, ...]] = MappingProxyType({})
_NO_SETS: Mapping[str, Set] = MappingProxyType({})

RunKey = Tuple[str, str]
"""(role, dispatch key) of an endpoint run: role "main" (the dispatch element's own endpoints) or
"exempt" (externalTrafficPolicy Local's every-endpoint exception)."""


@dataclass(**SLOTS)
class ServiceObjects:
    """Everything one service port owns in one family's table.  Slotted: a ``__dict__`` each was
    ~3 MB of a 10k-service sync's record (there is one per service port and family)."""

    elements: Dict[Tuple[str, str], Element] = field(default_factory=dict)
    """Verdict-map and set elements it alone owns, keyed by (set, key)."""
    runs: Dict[RunKey, ElementRun] = field(default_factory=dict)
    """Endpoint-map elements per (role, dispatch key)."""
    chains: Mapping[str, Tuple[Rule, ...]] = field(default_factory=lambda: _NO_CHAINS)
    """Its own chains (ClientIP affinity outside the shared maps): none for nearly every port, which
    then shares one empty mapping (two empty dicts per port were 1.2 MB at 10k services)."""
    sets: Mapping[str, Set] = field(default_factory=lambda: _NO_SETS)
    shared: FrozenSet[Shared] = frozenset()
    """The shared chains its elements jump to (pick chains, affinity record chains): :attr:`uses`'s."""
    uses: Dict[str, Tuple[Shared, ...]] = field(default_factory=dict)
    """The shared chains the elements of each dispatch key jump to: what stays in use when another
    service port owns some of its keys (never read back out of the elements' ``goto`` text)."""
    dispatch_keys: Tuple[str, ...] = ()
    """``address . protocol . port`` and ``protocol . nodePort`` keys it claims (one owner per key)."""
    refs: Tuple[Element, ...] = ()
    """Elements (set and key only) it needs that other service ports may need too (reference-counted).
    Elements already, not (set, key) pairs: a full sync's transaction adds these very objects, where
    it used to make one Element per pair (140k at the mixed 10k cluster: 13 MB at the sync's peak)."""
    hairpin: Tuple[int, ...] = ()
    """The endpoint addresses (as integers, the model's own objects) whose ``a . a`` pair it needs in
    ``hairpin``, reference-counted by address as ``refs`` are by element.  Not an Element and a text
    per pair: those were 23.5 MiB of the mixed 10k cluster's one-shot sync at its peak (142k pairs);
    :func:`hairpin_element` makes one when it is written."""

    def is_empty(self) -> bool:
        return not (self.elements or self.runs or self.chains or self.sets or self.refs or self.hairpin)


def family_of(ip: IPAddress) -> str:
    return "ip" if ip.version == 4 else "ip6"


def ip_text(ip: IPAddress) -> str:
    """``str(ip)``, several times faster for IPv4: ipaddress formats in pure Python (and ``int()``
    and ``.version`` are Python-level too; ``_ip``, as stamp.py reads it, is the int itself)."""
    if type(ip) is _V4:
        return _ntoa(_address(ip).to_bytes(4, "big"))
    return str(ip)


_ntoa = socket.inet_ntoa
_address = operator.attrgetter("_ip")
"""An address's int, read in C (a unit test pins ``_ip`` to ``int()``, as stamp.py's)."""


_Choice = Tuple[bytes, Endpoint]
"""An endpoint and its ``address . port`` as the endpoints map's value bytes (address, then the port
padded to 4 bytes, as the kernel's registers hold them); lists of these are sorted on the bytes:
numeric order, address then port, and no text made for it (the text, formatted and sorted for
every endpoint, was a fifth of a 10k-service render, and the netlink writer parsed it back)."""

_first = operator.itemgetter(0)
_V4 = ipaddress.IPv4Address
_pack_v4 = struct.Struct(">IH2x").pack
_pack_v6 = struct.Struct(">QQH2x").pack
_ip_port = operator.attrgetter("ip._ip", "port")


def endpoint_value(ep: Endpoint) -> bytes:
    """An endpoint as an endpoints map's value: ``address . port`` as the kernel holds it."""
    address, port = _ip_port(ep)
    if type(ep.ip) is _V4:
        return _pack_v4(address, port)
    return _pack_v6(address >> 64, address & 0xFFFFFFFFFFFFFFFF, port)


_ip_int = operator.attrgetter("ip._ip")
"""An endpoint's address as the int its ipaddress object holds (the object itself, no new one: the
record keeps it, as adoption's ``_endpoint_int``); a unit test pins it to ``int()``."""
_port = operator.attrgetter("port")


def _choices(eps: Sequence[Endpoint], v4: bool) -> Tuple[_Choice, ...]:
    """``eps`` (all of one family: ``v4`` or not) with their values, sorted on them."""
    if v4:  # endpoint_value() in C for IPv4: once per endpoint, 100k times in a 10k-service sync
        return tuple(sorted(zip(map(_pack_v4, map(_ip_int, eps), map(_port, eps)), eps), key=_first))
    return tuple(sorted(zip(map(endpoint_value, eps), eps), key=_first))


def _run(set_name: str, prefix: str, choices: Sequence[_Choice], family: str) -> ElementRun:
    return ElementRun.of_packed(set_name, prefix, b"".join([v for v, _ in choices]), WIDTHS[family])


@functools.lru_cache(maxsize=4096)
def _pick(kind: str, proto: str, size: int, nodeport: bool, sticky: bool) -> Tuple[Pick, str, str]:
    """A shared pick chain, its dispatch verdict and its map's name: one of each per distinct chain
    (a few dozen), not per service port.  Interned: the record keeps a reference per port (one
    copy each was 1.4 MB of a 10k-service render); bounded for odd clusters."""
    pick = Pick(kind, proto, size, nodeport, sticky)
    return pick, intern(f"goto {pick.chain}"), intern(pick.map)


class _Port:
    """One service port in one family while it renders: its inputs and what it has produced so far.
    Slotted, its attributes set once here: one per service port and family of every full sync."""

    __slots__ = ("svc", "family", "config", "choices", "has_endpoints", "elements", "runs", "chains", "sets", "uses",
                 "keys", "proto", "comment")

    def __init__(self, svc: ServicePort, family: str, config: ProxyConfig, choices: Dict[str, Tuple[_Choice, ...]],
                 has_endpoints: bool) -> None:
        self.svc, self.family, self.config, self.has_endpoints = svc, family, config, has_endpoints
        self.choices = choices
        """Eligible endpoints per kind of traffic (netproxy/core/endpoints.py's answers)."""
        self.elements: Dict[Tuple[str, str], Element] = {}
        self.runs: Dict[RunKey, ElementRun] = {}
        self.chains: Dict[str, Tuple[Rule, ...]] = {}
        """Its own chains, if any (else the objects get the shared empty mapping)."""
        self.sets: Dict[str, Set] = {}
        self.uses: Dict[str, List[Shared]] = {}
        self.keys: List[str] = []
        self.proto = svc.protocol.lower()
        self.comment = names.service_comment(svc.name)
        """Every own element's comment (made once, not once per element)."""

    def put(self, set_name: str, key: str, value: Optional[str] = None) -> None:
        self.elements[(set_name, key)] = Element(set_name, key, value, self.comment)

    def dispatch(self, key: str, run_prefix: str, kind: str, nodeport: bool) -> None:
        """Route ``key`` (``address . proto . port`` or ``proto . nodePort``) for traffic of ``kind``."""
        if key in self.keys:
            return  # the same address listed twice (e.g. as external and LB IP): the first wins
        self.keys.append(key)
        choices = self.choices[kind]
        refuse = names.NO_ENDPOINT_NODEPORTS if nodeport else names.NO_ENDPOINTS
        if not self.has_endpoints:
            self.put(refuse, key, f"goto {names.REJECT}")
            return
        if kind == CLUSTER and not choices:  # internalTrafficPolicy Local, no endpoint on this node
            self.put(refuse, key, "drop")
            return
        sticky = self.svc.client_ip_affinity
        if sticky and self.family not in affinity_families(self.config):
            verdict = f"goto {self.affinity_chain(kind)}"
        else:
            if kind == LOCAL:
                self.exempt(key, run_prefix, nodeport)
            pick, verdict, emap = _pick(kind, self.proto, len(choices), nodeport, sticky)
            self.uses.setdefault(key, []).append(pick)
            if choices:
                self.runs[("main", key)] = _run(emap, run_prefix, choices, self.family)
            if sticky:
                record = Record(self.proto, self.svc.affinity_timeout)
                self.uses[key].append(record)
                self.put(names.AFFINITY_NODEPORTS if nodeport else names.AFFINITY_SERVICES, key,
                         intern(f"goto {record.chain}"))
        self.put(names.SERVICE_NODEPORTS if nodeport else names.SERVICE_IPS, key, verdict)

    def exempt(self, key: str, run_prefix: str, nodeport: bool) -> None:
        """externalTrafficPolicy Local's exception path for ``key``: every endpoint, via exempt-*."""
        choices = self.choices[EXEMPT]
        pick, verdict, emap = _pick(EXEMPT, self.proto, len(choices), nodeport, self.svc.client_ip_affinity)
        self.uses.setdefault(key, []).append(pick)
        self.put(names.EXEMPT_NODEPORTS if nodeport else names.EXEMPT_IPS, key, verdict)
        self.runs[("exempt", key)] = _run(emap, run_prefix, choices, self.family)

    def affinity_chain(self, kind: str) -> str:
        """The per-service ClientIP affinity chain for ``kind`` (built once)."""
        cname: str = names.affinity_chain(self.svc.name, kind)
        if cname not in self.chains:
            to_all = self.affinity_chain(EXEMPT) if kind == LOCAL else None
            eps = [ep for _, ep in self.choices[kind]]
            self.chains[cname] = _affinity_rules(self.svc, cname, kind, eps, self.family, self.config, to_all)
            for ep in eps:
                aff = names.affinity_set(self.svc.name, ip_text(ep.ip), ep.port)
                self.sets[aff] = Set(aff, ADDR_TYPE[self.family], flags=("dynamic", "timeout"),
                                     timeout=self.svc.affinity_timeout,
                                     comment=f"{self.svc.name} clients of {ip_text(ep.ip)} port {ep.port}")
        return cname


def _affinity_rules(svc: ServicePort, cname: str, kind: str, eps: Sequence[Endpoint], family: str,
                    config: ProxyConfig, to_all: Optional[str]) -> Tuple[Rule, ...]:
    """One service port's ClientIP affinity chain for traffic of ``kind``, in families outside
    :func:`~layout.affinity_families` (IPv6 on a node whose nft is older than 1.1: see there why).

    kube-proxy's nftables shape: one dynamic set of client addresses per endpoint, first one rule per
    endpoint "this client is in its set: refresh it and DNAT there", then the random choice as
    iptables' statistic rules, rule i taken with probability 1/(N-i), each adding the client to its
    endpoint's set before the DNAT.  The chains of one service port (cluster, external, and
    externalTrafficPolicy Local's exceptions) share its sets, as iptables' KUBE-SVC-/KUBE-SVL- do.
    Keyed by the client alone, every rule reads back from ``nft list`` as nft itself would write it
    (an earlier per-service set keyed ``client . endpoint . port`` needed constants inside a looked-up
    concatenation, which nft lists in a form it cannot load again), and an endpoint that leaves takes
    its clients with its set.
    """
    rules: List[Rule] = []
    masq = masquerade_rule(cname, kind, family, config)
    if masq is not None:
        rules.append(masq)
    if to_all is not None:
        rules.extend(exemption_rules(cname, family, config, st.goto(to_all)))
    proto = st.l4proto(svc.protocol.lower())
    client = (st.addr(family, "saddr"),)
    steps = []
    for ep in eps:
        addr = ip_text(ep.ip)
        note = f"{svc.name} endpoint {addr} port {ep.port}"
        aff = names.affinity_set(svc.name, addr, ep.port)
        steps.append((ep, addr, note, aff))
        rules.append(st.rule(cname, proto, st.lookup(client, aff), st.remember(family, aff),
                             st.dnat_to(family, addr, ep.port), comment=note))
    n = len(steps)
    for i, (ep, addr, note, aff) in enumerate(steps):
        chance = (st.numgen_is_zero(n - i),) if i < n - 1 else ()
        rules.append(st.rule(cname, proto, *chance, st.remember(family, aff), st.dnat_to(family, addr, ep.port),
                             comment=note))
    if not steps:
        rules.append(st.rule(cname, st.DROP, comment="no local endpoint"))
    return tuple(rules)


def _hairpin(node: NodeInfo, choices: Sequence[Tuple[_Choice, ...]]) -> Tuple[int, ...]:
    """``hairpin``'s addresses: endpoints that can reach their own service *through this node* (on
    this node, or of unknown node), as the iptables backend (docs/parity.md).  An endpoint on another
    node reaches its services through its own node's proxy; listing it here would be dead weight.
    Each once, in the order of the choices (numeric)."""
    return tuple(dict.fromkeys(_ip_int(ep) for group in choices for _, ep in group
                               if not ep.node_name or ep.node_name == node.name))


def hairpin_key(address: int, family: str) -> str:
    """The ``hairpin`` key of an endpoint address: ``a . a``, the address as render writes it."""
    text = socket.inet_ntoa(address.to_bytes(4, "big")) if family == "ip" else str(ipaddress.IPv6Address(address))
    return f"{text} . {text}"


def hairpin_element(address: int, family: str) -> Element:
    return Element(names.HAIRPIN, hairpin_key(address, family))


class HairpinElements(PackedKeys):
    """``hairpin``'s elements for a sorted list of addresses, each made when it is read: how a full
    sync's transaction carries them (:class:`~objects.Elements`), so that the writers expand them one
    at a time rather than the record holding 142k Elements and texts at the mixed 10k cluster.  The
    netlink writer reads no Element at all: :meth:`packed_keys` gives it every pair's bytes."""

    __slots__ = ("family", "addresses")

    def __init__(self, family: str, addresses: Sequence[int]) -> None:
        self.family = family
        self.addresses = addresses

    def packed_keys(self) -> bytes:
        if self.family == "ip":
            raw = struct.pack(f">{len(self.addresses)}I", *self.addresses)
            width = 4
        else:
            raw = b"".join([a.to_bytes(16, "big") for a in self.addresses])
            width = 16
        # Each address twice (``a . a``): the two fields of every key, interleaved in C.
        out = bytearray(2 * len(raw))
        for k in range(width):
            column = raw[k::width]
            out[k::2 * width] = column
            out[width + k::2 * width] = column
        return bytes(out)

    def __len__(self) -> int:
        return len(self.addresses)

    @overload
    def __getitem__(self, i: int) -> Element: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Element]: ...

    def __getitem__(self, i: object) -> object:
        if isinstance(i, slice):
            return [hairpin_element(a, self.family) for a in self.addresses[i]]
        if isinstance(i, int):
            return hairpin_element(self.addresses[i], self.family)
        raise TypeError(f"HairpinElements indices must be integers or slices, not {type(i).__name__}")

    def __iter__(self) -> Iterator[Element]:
        family = self.family
        return (hairpin_element(a, family) for a in self.addresses)

    def __eq__(self, other: object) -> bool:
        # As a tuple of the same elements would compare (tests compare transactions' operations).
        if isinstance(other, HairpinElements):
            return (self.family, self.addresses) == (other.family, other.addresses)
        return isinstance(other, (tuple, list)) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"HairpinElements({self.family!r}, {list(self.addresses)!r})"


def shared_keys(objs: ServiceObjects, family: str) -> Iterator[Tuple[str, str]]:
    """(set, key) of every element ``objs`` needs that other service ports may need too: ``refs``
    and the ``hairpin`` pairs (what adoption compares with the kernel's)."""
    for r in objs.refs:
        yield r.set, r.key
    for a in objs.hairpin:
        yield names.HAIRPIN, hairpin_key(a, family)


def dispatch_keys(svc: ServicePort, family: str) -> Tuple[str, ...]:
    """The keys ``svc`` claims in ``family`` (``address . protocol . port``, ``protocol . nodePort``),
    in the order :func:`render_service` claims them, without rendering it: what restart by adoption
    needs of every service port to know which keys another one owns (stamp.py).  Empty: the port
    renders nothing in ``family``."""
    version = VERSIONS[family]
    addrs = [ip for ip in svc.addresses() if ip.version == version]
    if not addrs:
        return ()
    proto, port = svc.protocol.lower(), svc.port
    keys = dict.fromkeys(f"{ip_text(ip)} . {proto} . {port}" for ip in addrs)  # the first of a twice-listed address
    if svc.node_port:
        keys[f"{proto} . {svc.node_port}"] = None
    return tuple(keys)


def render_service(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo, family: str,
                   config: ProxyConfig) -> ServiceObjects:
    """The objects one service port owns in ``family``'s table (empty if it has no such address)."""
    version = VERSIONS[family]
    v4 = version == 4  # type() rather than the Python-level .version property, per address
    cluster_addrs = [ip for ip in svc.cluster_ips if (type(ip) is _V4) is v4]
    ext_addrs = [ip for ip in svc.external_ips + svc.load_balancer_ips if (type(ip) is _V4) is v4] \
        if svc.external_ips or svc.load_balancer_ips else []
    if not cluster_addrs and not ext_addrs:
        return ServiceObjects()
    fam_eps = [e for e in endpoints if (type(e.ip) is _V4) is v4]
    internal = cluster_endpoints(svc, fam_eps, node)
    # Every eligible endpoint, whatever internalTrafficPolicy says: what external traffic with
    # policy Cluster and policy Local's exceptions reach (kube-proxy's cluster-policy chain).
    everyone = internal if svc.internal_traffic_policy != "Local" else cluster_endpoints(
        dataclasses.replace(svc, internal_traffic_policy="Cluster"), fam_eps, node)
    has_external = bool(ext_addrs or svc.node_port)
    ext_kind = LOCAL if svc.external_traffic_policy == "Local" else EXTERNAL
    choices = {CLUSTER: _choices(internal, v4)}
    if has_external:
        choices[ext_kind] = _choices(external_endpoints(svc, fam_eps, node), v4)
        choices[EXEMPT] = choices[CLUSTER] if everyone is internal else _choices(everyone, v4)
    p = _Port(svc, family, config, choices, bool(everyone))
    proto, port = p.proto, svc.port
    refs: List[Element] = []
    for ip in cluster_addrs:
        addr = ip_text(ip)
        p.dispatch(f"{addr} . {proto} . {port}", f"{addr} . {port}", CLUSTER, nodeport=False)
        refs.append(Element(names.CLUSTER_IPS, addr))
    for ip in ext_addrs:
        addr = ip_text(ip)
        p.dispatch(f"{addr} . {proto} . {port}", f"{addr} . {port}", ext_kind, nodeport=False)
    if svc.node_port:
        p.dispatch(f"{proto} . {svc.node_port}", str(svc.node_port), ext_kind, nodeport=True)
    if svc.source_ranges and svc.load_balancer_ips:
        _firewall(p, [ip for ip in svc.load_balancer_ips if ip.version == version], node)
    uses = {k: _same_uses(tuple(used)) for k, used in p.uses.items()}
    # All fields given: a ServiceObjects' default factories (three dicts, two lambdas) would make
    # objects only to be replaced, once per service port and family.
    # refs: a tuple, not a frozenset: 20k frozensets of ~11 refs held 7 MB at 10k services (with
    # the hairpin pairs then), and the refs are only counted up and down, never looked up.
    # (dict.fromkeys: each counted once.)
    return ServiceObjects(elements=p.elements, runs=p.runs, chains=p.chains or _NO_CHAINS, sets=p.sets or _NO_SETS,
                          shared=_same_shared(tuple(uses.values())), uses=uses, dispatch_keys=tuple(p.keys),
                          refs=tuple(dict.fromkeys(refs)),
                          hairpin=_hairpin(node, list(choices.values())) if p.has_endpoints else ())


# Service ports use a few dozen distinct combinations of shared chains: one tuple and one frozenset
# per combination instead of per service port (a frozenset of one pick chain is 216 bytes: 2 MB of
# a 10k-service render, 20 MB at 100k).  Immutable, so sharing them is safe; bounded for odd clusters.
@functools.lru_cache(maxsize=4096)
def _same_uses(used: Tuple[Shared, ...]) -> Tuple[Shared, ...]:
    return used


@functools.lru_cache(maxsize=4096)
def _same_shared(uses: Tuple[Tuple[Shared, ...], ...]) -> FrozenSet[Shared]:
    return frozenset(s for used in uses for s in used)


def _firewall(p: _Port, lb_addrs: Sequence[IPAddress], node: NodeInfo) -> None:
    """loadBalancerSourceRanges: traffic to the LB IPs from outside the ranges is dropped (nat
    prerouting/output, before DNAT); the ClusterIP and NodePort are not restricted.  Who is allowed
    is decided in netproxy/core/firewall.py (the ranges, and the LB IPs when a range covers the node)."""
    svc = p.svc
    if not svc.source_ranges or not lb_addrs:
        return
    ranges = [str(r) for r in firewall_sources(svc, node, VERSIONS[p.family])]
    for ip in lb_addrs:
        key = f"{ip_text(ip)} . {p.proto} . {svc.port}"
        p.put(names.FIREWALL_IPS, key)
        for r in ranges:
            p.put(names.FIREWALL_ALLOW, f"{key} . {r}")
