"""The model: immutable service ports and endpoints, and the checks their fields pass.

The constructors do not validate (plain dataclasses: there are 100k of them at 10k services).
Validation happens in one place, netproxy/source/convert.py, the one conversion of Kubernetes
objects into these (every source goes through it): it runs each field through the ``check_*``
functions here — names are DNS-1123, addresses are parsed by :mod:`ipaddress`, ports are
range-checked — and raises :class:`ValidationError` naming the object and field (the flags'
CIDRs go through the same ``check_cidr``, via config.parse_cidrs).  Sources hand
backends only objects built that way, never raw strings; code that builds them directly (tests,
benchmarks) is trusted to pass valid values.
"""

from __future__ import annotations

import functools
import ipaddress
import operator
import re
import socket
import sys
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

SLOTS = {"slots": True} if sys.version_info >= (3, 10) else {}
"""No per-instance ``__dict__`` for the objects there are 10k-100k of (Python >= 3.10: 40 MB at 10k
services x 10 endpoints); Python 3.9 (Debian 11) gets plain dataclasses.  ``@dataclass(**SLOTS)``."""

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

PROTOCOLS = ("TCP", "UDP", "SCTP")
TRAFFIC_POLICIES = ("Cluster", "Local")
AFFINITIES = ("None", "ClientIP")
DEFAULT_AFFINITY_TIMEOUT = 10800
MAX_AFFINITY_TIMEOUT = 86400

# Kubernetes' own limits: namespaces and service names are DNS-1123 labels (63),
# EndpointSlice names are DNS-1123 subdomains (253), port names are IANA_SVC_NAME-like labels (15
# for container ports; service port names are DNS-1123 labels).
# \Z, not $: "$" also matches before a trailing newline, which would let "web\n" through.
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_MAX_IP_TEXT = len("ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255")
_ZONE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")


class ValidationError(ValueError):
    """An object from a source is invalid; names the object and the field."""

    def __init__(self, kind: str, ref: str, field_path: str, message: str) -> None:
        self.kind = kind
        self.ref = ref
        self.field_path = field_path
        self.message = message
        super().__init__(f"{kind} {ref}: field {field_path}: {message}")


class FieldError(ValueError):
    """A field-level error raised by a check; the source adds the object it belongs to."""

    def __init__(self, field_path: str, message: str) -> None:
        self.field_path = field_path
        self.message = message
        super().__init__(f"{field_path}: {message}")


def shown(value: object, limit: int = 60) -> str:
    """``value`` for an error message, bounded: hostile input can be a 50 MB string or a YAML alias
    bomb whose repr never ends, and messages are printed and logged.  Strings are repr'd, so a newline
    or control character in a name cannot forge a log line."""
    if isinstance(value, str):
        text = repr(value[:limit])
        return text if len(value) <= limit else f"{text[:-1]}...{text[-1]} ({len(value)} characters)"
    if value is None or isinstance(value, (bool, int, float)):
        try:
            text = repr(value)
        except ValueError:  # an int past Python's digit limit for str()
            return "a very large integer"
        return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} digits)"
    if isinstance(value, Mapping):
        return f"a mapping of {len(value)} keys"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    return f"a {type(value).__name__}"


def check_label(value: object, field_path: str, max_len: int = 63) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(field_path, "must be a non-empty string")
    if len(value) > max_len or not _DNS1123_LABEL.match(value):
        raise FieldError(field_path, f"{shown(value)} is not a DNS-1123 label (a-z, 0-9, '-', at most {max_len})")
    return value


def check_subdomain(value: object, field_path: str) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(field_path, "must be a non-empty string")
    if len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
        raise FieldError(field_path, f"{shown(value)} is not a DNS-1123 subdomain")
    return value


def check_port(value: object, field_path: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field_path, f"{shown(value)} is not an integer port")
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise FieldError(field_path, f"{shown(value)} is outside {low}..65535")
    return value


def check_protocol(value: object, field_path: str) -> str:
    proto = "TCP" if value is None else value
    if proto not in PROTOCOLS:
        raise FieldError(field_path, f"{shown(value)} is not one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[PROTOCOLS.index(proto)]  # the constant, not the decoded copy: one per service port


def valid_ip(value: object, cache: bool = True) -> Optional[IPAddress]:
    """The address ``value`` spells if :func:`check_ip` accepts it, else None: the hot path's check,
    which builds no field path (at 100k endpoints formatting one per address costs more than this).
    ``cache=False`` parses without the address cache (see :func:`_parse_ip`)."""
    if type(value) is not str or len(value) > _MAX_IP_TEXT:
        return None  # length first: the parse cache must not keep a hostile 50 MB string as a key
    ip = _parse_ip(value) if cache else _parse_ip.__wrapped__(value)
    if ip is None or (ip.version == 6 and ip.scope_id is not None):
        return None
    return ip


def check_ip(value: object, field_path: str) -> IPAddress:
    ip = valid_ip(value)
    if ip is not None:
        return ip
    scoped = valid_ip(value.partition("%")[0]) if isinstance(value, str) and "%" in value else None
    if scoped is not None and scoped.version == 6 and len(value) <= _MAX_IP_TEXT:  # type: ignore[arg-type]
        # Python >= 3.9 accepts "fe80::1%<anything>" and keeps the text in str(ip); Kubernetes has no zones.
        raise FieldError(field_path, f"{shown(value)} is not an IP address (no %zone allowed)")
    raise FieldError(field_path, f"{shown(value)} is not an IP address")


def forget_parsed_addresses() -> None:
    """Drop the address cache (20 MB at 100k endpoints): for one-shot commands, once loaded."""
    _parse_ip.cache_clear()


def new_v4(number: int) -> ipaddress.IPv4Address:
    """``IPv4Address(number)`` for a number known to be in range: the class's Python-level
    ``__init__`` (type checks, range check) cost a third of parsing 100k endpoint addresses."""
    ip = _NEW_V4(ipaddress.IPv4Address)
    ip._ip = number  # type: ignore[attr-defined]  # its one field (__slots__ _ip, __weakref__), as __init__ sets it
    return ip


_NEW_V4 = object.__new__
_NEW_TUPLE = tuple.__new__
_PORT = operator.itemgetter(1)
"""An endpoint's port (:class:`Endpoint`'s second field), read in C."""


@functools.lru_cache(maxsize=1 << 18)
def _parse_ip(value: str) -> Optional[IPAddress]:
    # Cached: a watched file or a relist parses the same 100k endpoint addresses again, and
    # ipaddress' parser costs microseconds per address.  Addresses are immutable, so sharing is safe.
    try:
        # Fast path for canonical dotted quads (C-level, ~5x cheaper than ipaddress' parser); any
        # other spelling goes to ipaddress, which stays the authority on what is valid.
        packed = socket.inet_pton(socket.AF_INET, value)
        if socket.inet_ntop(socket.AF_INET, packed) == value:
            return new_v4(int.from_bytes(packed, "big"))
    except (OSError, ValueError):  # ValueError: an embedded NUL ("10.0.0.1\0..."), found by the fault suite
        pass
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def check_cidr(value: object, field_path: str) -> IPNetwork:
    if not isinstance(value, str):
        raise FieldError(field_path, f"{shown(value)} is not a CIDR")
    try:
        net = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise FieldError(field_path, f"{shown(value)} is not a CIDR") from None
    if getattr(net.network_address, "scope_id", None) is not None:
        raise FieldError(field_path, f"{shown(value)} is not a CIDR (no %zone allowed)")
    return net


def check_choice(value: object, field_path: str, choices: Tuple[str, ...], default: str) -> str:
    chosen = default if value is None or value == "" else value
    if chosen not in choices:
        raise FieldError(field_path, f"{shown(value)} is not one of {', '.join(choices)}")
    return choices[choices.index(chosen)]  # the constant: a decoded copy per object held ~50 bytes each


def check_zone(value: object, field_path: str) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 63 or not _ZONE.match(value):
        raise FieldError(field_path, f"{shown(value)} is not a valid zone label value")
    return value


@dataclass(frozen=True, order=True, **SLOTS)
class ServicePortName:
    """namespace/name:port — the identity of one service port, as kube-proxy's proxier keys it."""

    namespace: str
    name: str
    port: str = ""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every map of a sync is keyed by these: the generated __hash__ (a tuple of the three fields,
        # hashed again at each lookup) was ~40 % of a periodic full sync with nothing to change (the
        # iptables-nft resync: ~5 lookups per service port, ~20 ms at 10k).  Computed once here.
        object.__setattr__(self, "_hash", hash((self.namespace, self.name, self.port)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> Tuple[type, Tuple[str, str, str]]:
        return (ServicePortName, (self.namespace, self.name, self.port))  # str hashes differ per process

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.port}" if self.port else f"{self.namespace}/{self.name}"

    @property
    def service(self) -> Tuple[str, str]:
        return (self.namespace, self.name)


@dataclass(frozen=True, **SLOTS)
class ServicePort:
    """One port of one service, with everything a backend needs to route it.  Slotted: a
    ``__dict__`` each was 150 bytes of every service port (15 MB at 100k services)."""

    name: ServicePortName
    protocol: str
    port: int
    target_port: Union[int, str]
    cluster_ips: Tuple[IPAddress, ...] = ()
    node_port: int = 0
    external_ips: Tuple[IPAddress, ...] = ()
    load_balancer_ips: Tuple[IPAddress, ...] = ()
    source_ranges: Tuple[IPNetwork, ...] = ()
    affinity: str = "None"
    affinity_timeout: int = DEFAULT_AFFINITY_TIMEOUT
    external_traffic_policy: str = "Cluster"
    internal_traffic_policy: str = "Cluster"
    health_check_node_port: int = 0
    service_type: str = "ClusterIP"
    traffic_distribution: str = ""
    """``spec.trafficDistribution``: "PreferClose"/"PreferSameZone" prefer endpoints in the node's
    zone, "PreferSameNode" endpoints on this node (then the zone); see netproxy/core/endpoints.py."""
    proxy_load_balancer_ips: Tuple[IPAddress, ...] = ()
    """``status.loadBalancer.ingress[].ip`` with ``ipMode: Proxy``: the load balancer proxies to the
    node, so, as kube-proxy >= 1.30, the node has no rule for them and traffic to them leaves for the
    load balancer.  Kept for ``netproxy trace``/``status``; no backend renders them."""

    @property
    def client_ip_affinity(self) -> bool:
        return self.affinity == "ClientIP"

    def addresses(self) -> Tuple[IPAddress, ...]:
        """Every address that dispatches to this port's service chain."""
        return self.cluster_ips + self.external_ips + self.load_balancer_ips


READY, SERVING, TERMINATING = 4, 2, 1
"""The bits of :attr:`Endpoint.conditions`."""


def conditions(ready: bool, serving: bool, terminating: bool) -> int:
    """An endpoint's three conditions as :attr:`Endpoint.conditions`' bits (0..7: a cached small int)."""
    return (READY if ready else 0) | (SERVING if serving else 0) | (TERMINATING if terminating else 0)


class _EndpointFields(NamedTuple):
    ip: IPAddress
    port: int
    conditions: int
    """``READY | SERVING | TERMINATING``, as far as they hold (:func:`conditions`)."""
    node_name: Optional[str]
    zone: Optional[str]
    hints: Tuple[Tuple[str, ...], ...]
    """``()``, or (``zone_hints``, ``node_hints``) when either is set."""


class Endpoint(_EndpointFields):
    """One backend of a service port: an address and a (resolved) port.

    A named tuple rather than a frozen dataclass: a cluster has 100k of them, and a frozen slotted
    dataclass's ``__init__`` (one ``object.__setattr__`` per field) cost five times a tuple's
    construction — a fifth of converting an EndpointSlice list.  Immutable, hashable and ordered by
    its fields all the same.  Six fields, made and read as the nine they stand for (the three
    conditions as bits of one small int, the two hint lists as one field, empty for nearly every
    endpoint): 24 bytes an endpoint less (2.3 MB at 10k services x 10, 6 MB at the mixed cluster)."""

    __slots__ = ()

    def __new__(cls, ip: IPAddress, port: int, ready: bool = True, serving: bool = True, terminating: bool = False,
                node_name: Optional[str] = None, zone: Optional[str] = None, zone_hints: Tuple[str, ...] = (),
                node_hints: Tuple[str, ...] = ()) -> Endpoint:
        return _NEW_TUPLE(cls, (ip, port, conditions(ready, serving, terminating), node_name, zone,
                                (zone_hints, node_hints) if zone_hints or node_hints else ()))

    def __getnewargs__(self) -> Tuple[IPAddress, int, bool, bool, bool, Optional[str], Optional[str],
                                      Tuple[str, ...], Tuple[str, ...]]:
        return (self.ip, self.port, self.ready, self.serving, self.terminating, self.node_name, self.zone,
                self.zone_hints, self.node_hints)

    @property
    def ready(self) -> bool:
        return bool(self.conditions & READY)

    @property
    def serving(self) -> bool:
        return bool(self.conditions & SERVING)

    @property
    def terminating(self) -> bool:
        return bool(self.conditions & TERMINATING)

    @property
    def zone_hints(self) -> Tuple[str, ...]:
        """EndpointSlice ``hints.forZones``: the zones whose nodes should route to this endpoint."""
        return self.hints[0] if self.hints else ()

    @property
    def node_hints(self) -> Tuple[str, ...]:
        """EndpointSlice ``hints.forNodes`` (KEP-3015, PreferSameNode): the nodes that should route to it."""
        return self.hints[1] if self.hints else ()

    def __str__(self) -> str:
        if self.ip.version == 6:
            return f"[{self.ip}]:{self.port}"
        return f"{self.ip}:{self.port}"


@dataclass(frozen=True)
class SlicePort:
    name: str
    protocol: str
    port: int


@dataclass(frozen=True)
class EndpointSet:
    """The endpoints one EndpointSlice (or one legacy Endpoints subset list) holds for a service."""

    namespace: str
    service: str
    ports: Tuple[SlicePort, ...]
    endpoints: Tuple[Endpoint, ...]
    trigger_time: Optional[float] = field(default=None, compare=False)
    """The slice's ``endpoints.kubernetes.io/last-change-trigger-time`` (Unix seconds): when the
    change it carries began, for kube-proxy's network programming latency.  Not compared: a slice
    whose only difference is this stamp is no change to program."""

    def for_port(self, port_name: str, protocol: str) -> Tuple[Endpoint, ...]:
        """This set's endpoints with the port that ``port_name``/``protocol`` resolves to here.

        Memoised on the (immutable) set: a sync re-resolves every service whose slices changed, and
        a slice object that did not change resolves the same way.
        """
        cache: Dict[Tuple[str, str], Tuple[Endpoint, ...]] = self.__dict__.setdefault("_for_port", {})
        key = (port_name, protocol)
        hit = cache.get(key)
        if hit is None and len(self.ports) == 1:
            p = self.ports[0]
            # countOf over the ports read in C: a generator per slice was a third of this method.
            if p.name == port_name and p.protocol == protocol and \
                    operator.countOf(map(_PORT, self.endpoints), p.port) == len(self.endpoints):
                hit = cache[key] = self.endpoints
        if hit is None:
            out: List[Endpoint] = []
            for p in self.ports:
                if p.name == port_name and p.protocol == protocol:
                    out.extend(_NEW_TUPLE(Endpoint, (e.ip, p.port, *e[2:])) for e in self.endpoints)
            hit = cache[key] = tuple(out)
        return hit


@dataclass(frozen=True)
class NodeInfo:
    """What the proxy knows of the node it runs on (topology and traffic policies need it)."""

    name: str = ""
    zone: Optional[str] = None
    addresses: Tuple[IPAddress, ...] = ()
    """The node's local addresses that accept NodePorts (only used with --nodeport-addresses)."""
    pod_cidrs: Tuple[IPNetwork, ...] = ()
    """``spec.podCIDRs``: this node's pod ranges (``--detect-local-mode NodeCIDR``)."""
    ips: Tuple[IPAddress, ...] = ()
    """The node's primary IPs from ``status.addresses`` (first InternalIP, else ExternalIP, per family;
    the first one's family first), as kube-proxy takes them for ``--nodeport-addresses primary``."""
    eligible: bool = True
    """False while the node is being deleted (deletionTimestamp, or the cluster autoscaler's
    ToBeDeletedByClusterAutoscaler taint): /healthz then answers 503 so that load balancers drain it."""


@dataclass(frozen=True, eq=False)
class Snapshot:
    """What a backend syncs to: every service port and its endpoints.

    Keyed by :class:`ServicePortName` so that a backend can look up one service in O(1): a tuple
    scanned per service made a 10k-service render quadratic.
    """

    services: Mapping[ServicePortName, ServicePort] = field(default_factory=dict)
    endpoints: Mapping[ServicePortName, Tuple[Endpoint, ...]] = field(default_factory=dict)
    node: NodeInfo = NodeInfo()
    service_cidrs: Tuple[IPNetwork, ...] = ()
    """The cluster's service CIDRs (--service-cluster-ip-range and ServiceCIDR objects): traffic to
    an address inside them that no service owns is dropped, as kube-proxy's nftables mode does."""

    def endpoints_of(self, name: ServicePortName) -> Tuple[Endpoint, ...]:
        return self.endpoints.get(name, ())

    def sorted_names(self) -> List[ServicePortName]:
        """Service port names in a stable order, so rendered output does not depend on dict order."""
        return sorted(self.services)

    @classmethod
    def build(cls, services: Iterable[ServicePort],
              endpoints: Optional[Mapping[ServicePortName, Iterable[Endpoint]]] = None,
              node: NodeInfo = NodeInfo(), service_cidrs: Tuple[IPNetwork, ...] = ()) -> Snapshot:
        """Convenience constructor for tests and benchmarks."""
        eps = {k: tuple(v) for k, v in (endpoints or {}).items()}
        return cls({s.name: s for s in services}, eps, node, service_cidrs)


@dataclass(frozen=True)
class Changes:
    """What changed since the last sync, as a hint: a backend may always do more (a full sync).

    ``full`` (at start, every sync period, after a failure or a repair, when the node or the service
    CIDRs changed) tells the backend not to rely on ``services`` alone: everything it owns must end
    up matching the snapshot.  It need not rewrite it all: when its own check of the kernel (the
    iptables tables' fingerprint, the nftables ruleset generation) shows that nobody else touched its
    rules since its last write, it writes only what differs, or nothing.  ``services`` names the
    service ports whose service or endpoints changed, including ones that were deleted.
    """

    full: bool = True
    services: FrozenSet[ServicePortName] = frozenset()

    @classmethod
    def everything(cls) -> Changes:
        return cls(True, frozenset())
