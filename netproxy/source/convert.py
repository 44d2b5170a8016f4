"""Kubernetes objects (as parsed dicts) → model objects.

One conversion for every source: a manifest file and an API object are read by the same code, so
they can never be read differently.  Each function raises :class:`ValidationError` naming the
object's kind, namespace/name and the failing field.
"""

from __future__ import annotations

import datetime
import re
import socket
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

if TYPE_CHECKING:  # typing.TypeGuard is 3.10+; the Debian 11 guest runs 3.9 (annotations are not evaluated)
    from typing import TypeGuard

from netproxy.core.model import (
    AFFINITIES,
    DEFAULT_AFFINITY_TIMEOUT,
    MAX_AFFINITY_TIMEOUT,
    PROTOCOLS,
    READY,
    SERVING,
    TRAFFIC_POLICIES,
    Endpoint,
    EndpointSet,
    FieldError,
    IPAddress,
    IPNetwork,
    NodeInfo,
    ServicePort,
    ServicePortName,
    SlicePort,
    ValidationError,
    check_choice,
    check_cidr,
    check_ip,
    check_label,
    check_port,
    check_protocol,
    check_subdomain,
    check_zone,
    new_v4,
    shown,
    valid_ip,
)

T = TypeVar("T")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")


def is_mapping(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)``, a plain dict first: typing's and abc's instance checks cost
    microseconds, and a 10k-service list asks them 100k times."""
    return type(value) is dict or isinstance(value, Mapping)


def object_ref(obj: Mapping[str, Any]) -> Tuple[str, str, str]:
    """(kind, namespace, name) of an object, validated, for keys and error messages."""
    if not is_mapping(obj):
        raise ValidationError("object", "?", "(root)", f"{shown(obj)} is not a Kubernetes object")
    raw_kind = obj.get("kind")
    kind = raw_kind if isinstance(raw_kind, str) and raw_kind.isidentifier() and len(raw_kind) <= 63 else "?"
    meta = obj.get("metadata") or {}
    if not is_mapping(meta):
        raise ValidationError(kind, "?", "metadata", "must be a mapping")
    raw_ns = meta.get("namespace") or "default"
    raw_name = meta.get("name")
    try:
        ns = namespace(raw_ns)
        name = (check_subdomain if kind == "EndpointSlice" else check_label)(raw_name, "metadata.name")
    except FieldError as err:
        raise ValidationError(kind, f"{ref_part(raw_ns)}/{ref_part(raw_name)}", err.field_path,
                              err.message) from None
    return kind, ns, name


_NAMESPACES: Dict[str, str] = {}
"""Namespaces already checked, interned (bounded as :data:`_NAMES`): 20k objects name a few."""


def namespace(value: Any) -> str:
    """``metadata.namespace`` checked, interned: every object of a namespace names it, and the model
    keeps each copy (a ServicePortName per service port: 10 MB of one string at 100k services).
    Raises :class:`FieldError`."""
    hit = _NAMESPACES.get(value) if type(value) is str else None
    if hit is None:
        hit = sys.intern(check_label(value, "metadata.namespace"))
        if len(_NAMESPACES) < _NAMES_MAX:
            _NAMESPACES[hit] = hit
    return hit


def loose_ref(obj: Mapping[str, Any]) -> str:
    """namespace/name of an object for a message, whatever its metadata holds (nothing is checked)."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return f"{ref_part(meta.get('namespace') or 'default')}/{ref_part(meta.get('name'))}"


def ref_part(value: object) -> str:
    """A namespace or name for an error message: as is when it is a plausible name, else quoted and
    bounded (a name with a newline must not start a forged line in the log)."""
    if isinstance(value, str) and len(value) <= 253 and _PLAIN_NAME.match(value):
        return value
    return shown(value)


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][-A-Za-z0-9._]*\Z")


def _guard(kind: str, ref: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except FieldError as err:
        raise ValidationError(kind, ref, err.field_path, err.message) from None


def _list(value: Any, field_path: str) -> List[Any]:
    if type(value) is list:  # the common case first: typing.Mapping/abc checks are slow at 100k objects
        return value
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError(field_path, "must be a list")
    return value


def _map(value: Any, field_path: str) -> Mapping[str, Any]:
    if type(value) is dict:
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise FieldError(field_path, "must be a mapping")
    return value


def _ips(values: Any, field_path: str) -> Tuple[IPAddress, ...]:
    return tuple(check_ip(v, f"{field_path}[{i}]") for i, v in enumerate(_list(values, field_path)))


def parse_service(obj: Mapping[str, Any], checked_ref: Optional[Tuple[str, str, str]] = None
                  ) -> Tuple[ServicePort, ...]:
    """A v1 Service → its service ports.  Headless and ExternalName services have none (as in kube-proxy).
    ``checked_ref``: the object's :func:`object_ref`, when the caller has it already."""
    kind, ns, name = checked_ref or object_ref(obj)
    plain = _plain_service(ns, name, obj)
    if plain is not None:
        return plain
    return _guard(kind, f"{ns}/{name}", lambda: _service_ports(ns, name, obj))


def _cluster_ips(spec: Mapping[str, Any]) -> Tuple[IPAddress, ...]:
    raw = _list(spec.get("clusterIPs"), "spec.clusterIPs") or (
        [spec["clusterIP"]] if spec.get("clusterIP") else [])
    if any(v == "None" for v in raw):
        return ()
    if not spec.get("clusterIPs"):
        return (check_ip(raw[0], "spec.clusterIP"),) if raw else ()  # a scalar: no "[0]" in the error
    return _ips(raw, "spec.clusterIPs")


def _affinity(spec: Mapping[str, Any]) -> Tuple[str, int]:
    affinity = check_choice(spec.get("sessionAffinity"), "spec.sessionAffinity", AFFINITIES, "None")
    cfg = _map(_map(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig").get("clientIP"),
               "spec.sessionAffinityConfig.clientIP")
    timeout = cfg.get("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT)
    path = "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= MAX_AFFINITY_TIMEOUT:
        raise FieldError(path, f"{shown(timeout)} is outside 1..{MAX_AFFINITY_TIMEOUT}")
    return affinity, timeout


def _service_ports(ns: str, name: str, obj: Mapping[str, Any]) -> Tuple[ServicePort, ...]:
    spec = _map(obj.get("spec"), "spec")
    svc_type = check_choice(spec.get("type"), "spec.type", SERVICE_TYPES, "ClusterIP")
    if svc_type == "ExternalName":
        return ()
    cluster_ips = _cluster_ips(spec)
    external_ips = _ips(spec.get("externalIPs"), "spec.externalIPs")
    lb_ips, proxy_lb_ips = _load_balancer_ips(obj)
    ranges = tuple(check_cidr(v, f"spec.loadBalancerSourceRanges[{i}]")
                   for i, v in enumerate(_list(spec.get("loadBalancerSourceRanges"),
                                               "spec.loadBalancerSourceRanges")))
    affinity, timeout = _affinity(spec)
    etp = check_choice(spec.get("externalTrafficPolicy"), "spec.externalTrafficPolicy", TRAFFIC_POLICIES, "Cluster")
    itp = check_choice(spec.get("internalTrafficPolicy"), "spec.internalTrafficPolicy", TRAFFIC_POLICIES, "Cluster")
    distribution = spec.get("trafficDistribution") or ""
    if distribution not in ("", "PreferClose", "PreferSameZone", "PreferSameNode"):
        raise FieldError("spec.trafficDistribution", f"{shown(distribution)} is not PreferClose, PreferSameZone or "
                         "PreferSameNode")
    hc_port = spec.get("healthCheckNodePort") or 0
    hc_port = check_port(hc_port, "spec.healthCheckNodePort", allow_zero=True)
    raw_ports = _list(spec.get("ports"), "spec.ports")
    if not cluster_ips and raw_ports:
        # Headless (clusterIP: None) or not yet allocated: nothing to program, as kube-proxy skips it.
        return ()
    seen: Dict[str, int] = {}
    out: List[ServicePort] = []
    for i, raw in enumerate(raw_ports):
        path = f"spec.ports[{i}]"
        p = _map(raw, path)
        port_name = p.get("name") or ""
        if port_name:
            port_name = sys.intern(check_label(port_name, f"{path}.name"))  # a few names, 100k ports
        elif len(raw_ports) > 1:
            raise FieldError(f"{path}.name", "is required when a service has more than one port")
        if port_name in seen:
            raise FieldError(f"{path}.name", f"{shown(port_name)} is used by spec.ports[{seen[port_name]}] too")
        seen[port_name] = i
        port = check_port(p.get("port"), f"{path}.port")
        target = p.get("targetPort", port)
        # isascii: "²".isdigit() is true but int("²") raises ValueError, which no caller catches.
        if isinstance(target, str) and not (target.isascii() and target.isdigit()):
            target = check_label(target, f"{path}.targetPort", max_len=15)
        elif isinstance(target, str) and len(target) > 5:
            # int() of 5,000 digits raises ValueError (Python's digit limit), which no caller catches.
            raise FieldError(f"{path}.targetPort", f"{shown(target)} is outside 1..65535")
        else:
            target = check_port(int(target) if isinstance(target, str) else target, f"{path}.targetPort")
        node_port = check_port(p.get("nodePort") or 0, f"{path}.nodePort", allow_zero=True)
        out.append(ServicePort(
            name=ServicePortName(ns, name, port_name),
            protocol=check_protocol(p.get("protocol"), f"{path}.protocol"),
            port=port, target_port=target, cluster_ips=cluster_ips, node_port=node_port,
            external_ips=external_ips, load_balancer_ips=lb_ips, source_ranges=ranges,
            affinity=affinity, affinity_timeout=timeout, external_traffic_policy=etp,
            internal_traffic_policy=itp, health_check_node_port=hc_port, service_type=svc_type,
            traffic_distribution=str(distribution), proxy_load_balancer_ips=proxy_lb_ips,
        ))
    return tuple(out)


def _choices(choices: Tuple[str, ...], default: str) -> Dict[Optional[str], str]:
    """What :func:`check_choice` accepts, as a lookup: the absent and empty value mean ``default``."""
    return {None: default, "": default, **{c: c for c in choices}}


_PLAIN_TYPES = {k: v for k, v in _choices(SERVICE_TYPES, "ClusterIP").items() if v != "ExternalName"}
_PLAIN_AFFINITIES = _choices(AFFINITIES, "None")
_PLAIN_POLICIES = _choices(TRAFFIC_POLICIES, "Cluster")
_PLAIN_PROTOCOLS: Dict[Optional[str], str] = {None: PROTOCOLS[0], **{p: p for p in PROTOCOLS}}
_PLAIN_DISTRIBUTIONS: Dict[Optional[str], str] = {
    None: "", **{d: d for d in ("", "PreferClose", "PreferSameZone", "PreferSameNode")}}


def _plain_service(ns: str, name: str, obj: Mapping[str, Any]) -> Optional[Tuple[ServicePort, ...]]:
    """The service ports of a Service that needs no more than the common checks, else None.

    The accept-only shortcut of :func:`_service_ports`, which stays the one place that decides and
    words a refusal: a Service is taken here only when every field that function reads is absent or
    holds a value it accepts at once (IPv4 or IPv6 cluster IPs, no external or load-balancer
    addresses, no source ranges, known choices, integer ports, port names checked before); anything
    else, valid or not, is left to it.  Its per-field helpers, choice checks and field-path strings
    were half of the 13 us a one-port Service cost (docs/performance.md, the eighth pass); the
    randomized test in tests/unit/test_convert.py holds both to the same answers.  The values are
    judged by the ``_plain_*`` functions below, which the typed shortcut (:mod:`plainservice`)
    shares."""
    spec = obj.get("spec")
    if type(spec) is not dict:
        return None
    get = spec.get
    # Below, False stands for a value that is no mapping: left to the general path, as any other.
    status = obj.get("status")
    if status is not None:
        balancer = status.get("loadBalancer") if type(status) is dict else False
        if balancer is not None:
            ingress = balancer.get("ingress") if type(balancer) is dict else False
            if ingress is not None and (type(ingress) is not list or ingress):
                return None  # load-balancer addresses: the general path's
    for absent in ("externalIPs", "loadBalancerSourceRanges"):
        value = get(absent)
        if value is not None and (type(value) is not list or value):
            return None
    config = get("sessionAffinityConfig")
    timeout: Any = DEFAULT_AFFINITY_TIMEOUT
    if config is not None:
        client = config.get("clientIP") if type(config) is dict else False
        if client is not None:
            timeout = client.get("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT) if type(client) is dict else None
    settings = plain_settings(get("type"), get("sessionAffinity"), timeout, get("externalTrafficPolicy"),
                              get("internalTrafficPolicy"), get("trafficDistribution"), get("healthCheckNodePort"))
    if settings is None:
        return None
    raw_ips = get("clusterIPs")
    if raw_ips is None or (type(raw_ips) is list and not raw_ips):
        raw_ips = (get("clusterIP"),)
    elif type(raw_ips) is not list:
        return None
    raw_ports = get("ports")
    if raw_ports is None:
        raw_ports = []
    elif type(raw_ports) is not list:
        return None
    ports: List[PlainPort] = []
    for p in raw_ports:
        if type(p) is not dict:
            return None
        port = p.get("port")
        one = plain_port(p.get("name"), port, p.get("targetPort", port), p.get("nodePort"), p.get("protocol"),
                         len(raw_ports) > 1)
        if one is None:
            return None
        ports.append(one)
    return plain_service_ports(ns, name, raw_ips, settings, ports)


PlainSettings = Tuple[str, str, int, str, str, str, int]
"""A plain Service's type, affinity and its timeout, traffic policies (external, internal), traffic
distribution and health check node port."""


def plain_settings(svc_type: Any, affinity: Any, timeout: Any, etp: Any, itp: Any, distribution: Any,
                   hc_port: Any) -> Optional[PlainSettings]:
    """A Service's service-wide fields as :func:`_service_ports` takes them, when it accepts them at
    once (the absent ones as None), else None."""
    # Choice fields, looked up: a value that is no key (a number, a boolean, an unknown string) gets
    # None, one that cannot be a key (a list, a mapping) a TypeError; both go the general way.
    try:
        svc_type, affinity = _PLAIN_TYPES.get(svc_type), _PLAIN_AFFINITIES.get(affinity)
        etp, itp = _PLAIN_POLICIES.get(etp), _PLAIN_POLICIES.get(itp)
        distribution = _PLAIN_DISTRIBUTIONS.get(distribution)
    except TypeError:
        return None
    if svc_type is None or affinity is None or etp is None or itp is None or distribution is None:
        return None
    if type(timeout) is not int or not 1 <= timeout <= MAX_AFFINITY_TIMEOUT:
        return None
    hc_port = 0 if hc_port is None else hc_port
    if type(hc_port) is not int or not 0 <= hc_port <= 65535:
        return None
    return svc_type, affinity, timeout, etp, itp, distribution, hc_port


PlainPort = Tuple[str, str, int, Union[int, str], int]
"""A service port's name, protocol, port, target port and node port."""


def plain_port(port_name: Any, port: Any, target: Any, node_port: Any, protocol: Any, many: bool
               ) -> Optional[PlainPort]:
    """One of ``spec.ports`` as :func:`_service_ports` takes it (of ``many``), or None."""
    port_name = port_name or ""
    if port_name:
        port_name = _plain_label(port_name)
        if port_name is None:
            return None
    elif many:
        return None
    node_port = node_port or 0
    if type(port) is not int or type(node_port) is not int or not (1 <= port <= 65535 and 0 <= node_port <= 65535):
        return None
    if type(target) is not int or not 1 <= target <= 65535:
        if type(target) is not str or (target.isascii() and target.isdigit()) or len(target) > 15:
            return None
        target = _plain_label(target)  # a named target port: a label of at most 15
        if target is None:
            return None
    protocol = _PLAIN_PROTOCOLS.get(protocol) if protocol is None or type(protocol) is str else None
    if protocol is None:
        return None
    return port_name, protocol, port, target, node_port


def plain_service_ports(ns: str, name: str, raw_ips: Sequence[Any], settings: PlainSettings,
                        ports: List[PlainPort]) -> Optional[Tuple[ServicePort, ...]]:
    """A plain Service's service ports from its cluster IPs (as given: each must be an address),
    its settings and its ports, or None."""
    cluster_ips = []
    for addr in raw_ips:
        ip = valid_ip(addr, False)  # as check_ip decides (its dotted-quad fast path first), uncached
        if ip is None:
            return None  # "None" (headless), "" or null (not allocated), or invalid
        cluster_ips.append(ip)
    if len(ports) > 1 and len({p[0] for p in ports}) != len(ports):
        return None  # a name used twice: the general path words it
    svc_type, affinity, timeout, etp, itp, distribution, hc_port = settings
    ips = tuple(cluster_ips)
    out = []
    for port_name, protocol, port, target, node_port in ports:
        out.append(ServicePort(ServicePortName(ns, name, port_name), protocol, port, target, ips, node_port,
                               (), (), (), affinity, timeout, etp, itp, hc_port, svc_type, distribution))
    return tuple(out)


_PORT_NAMES: Dict[str, str] = {}
"""Service port names (and named target ports) :func:`check_label` accepted, interned: a few names
serve 100k service ports.  Bounded as :data:`_NAMES`."""


def _plain_label(value: Any) -> Optional[str]:
    """``value`` interned when :func:`check_label` accepts it, else None."""
    if type(value) is not str:
        return None
    hit = _PORT_NAMES.get(value)
    if hit is None:
        try:
            hit = sys.intern(check_label(value, "name"))
        except FieldError:
            return None
        if len(_PORT_NAMES) < _NAMES_MAX:
            _PORT_NAMES[hit] = hit
    return hit


LB_IP_MODES = ("VIP", "Proxy")


def _load_balancer_ips(obj: Mapping[str, Any]) -> Tuple[Tuple[IPAddress, ...], Tuple[IPAddress, ...]]:
    """``status.loadBalancer.ingress[].ip`` split by ``ipMode``: (VIP, the default: the node DNATs
    them as the service; Proxy: the load balancer proxies, the node leaves them alone)."""
    ingress = _list(_map(_map(obj.get("status"), "status").get("loadBalancer"),
                         "status.loadBalancer").get("ingress"), "status.loadBalancer.ingress")
    vip: List[IPAddress] = []
    proxy: List[IPAddress] = []
    for i, raw in enumerate(ingress):
        path = f"status.loadBalancer.ingress[{i}]"
        ing = _map(raw, path)
        mode = check_choice(ing.get("ipMode"), f"{path}.ipMode", LB_IP_MODES, "VIP")
        if not ing.get("ip"):
            if ing.get("ipMode") is not None:
                raise FieldError(f"{path}.ipMode", "is only allowed with an ip")
            continue  # a hostname-only ingress: nothing for the node
        (proxy if mode == "Proxy" else vip).append(check_ip(ing.get("ip"), f"{path}.ip"))
    return tuple(vip), tuple(proxy)


def parse_service_cidr(obj: Mapping[str, Any]) -> Tuple[str, Tuple[IPNetwork, ...]]:
    """A networking.k8s.io/v1 ServiceCIDR → (its name, ``spec.cidrs``): at most one CIDR per family,
    as the API server allows.  Cluster-scoped: the name alone identifies it."""
    kind = str(obj.get("kind") or "ServiceCIDR")
    meta = obj.get("metadata") or {}
    raw_name = meta.get("name") if isinstance(meta, Mapping) else None

    def build() -> Tuple[str, Tuple[IPNetwork, ...]]:
        name = check_subdomain(raw_name, "metadata.name")
        raw = _list(_map(obj.get("spec"), "spec").get("cidrs"), "spec.cidrs")
        if not raw:
            raise FieldError("spec.cidrs", "must list one CIDR (or one per family)")
        cidrs = tuple(check_cidr(v, f"spec.cidrs[{i}]") for i, v in enumerate(raw))
        if len(cidrs) > 2 or len({c.version for c in cidrs}) != len(cidrs):
            raise FieldError("spec.cidrs", "may hold at most one IPv4 and one IPv6 CIDR")
        return name, cidrs

    return _guard(kind, str(raw_name), build)


SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""An EndpointSlice's label naming its Service."""


def slice_ports(raw_ports: Any, path: str) -> Tuple[SlicePort, ...]:
    """An EndpointSlice's (or a legacy Endpoints subset's) ``ports``; raises :class:`FieldError`."""
    out = []
    for i, raw in enumerate(_list(raw_ports, path)):
        p = _map(raw, f"{path}[{i}]")
        port_name = p.get("name") or ""
        if port_name:
            port_name = sys.intern(check_label(port_name, f"{path}[{i}].name"))
        out.append(SlicePort(port_name, check_protocol(p.get("protocol"), f"{path}[{i}].protocol"),
                             check_port(p.get("port"), f"{path}[{i}].port")))
    return tuple(out)


def _bool(value: Any, default: bool, path: str) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise FieldError(path, f"{shown(value)} is not a boolean")
    return value


def parse_endpoint_slice(obj: Mapping[str, Any], families: Tuple[str, ...] = ("IPv4", "IPv6"),
                         cache: bool = True, checked_ref: Optional[Tuple[str, str, str]] = None
                         ) -> Optional[EndpointSet]:
    """A discovery.k8s.io/v1 EndpointSlice → its endpoints; None for an address type not served.

    ``cache``: parse addresses through the address cache.  The file source re-reads every address
    at each change of its files, and gains by it; the API source sees each address once (then one
    event per change), so the cache would only grow with pod churn: it passes False.
    ``checked_ref``: as :func:`parse_service`'s."""
    kind, ns, name = checked_ref or object_ref(obj)
    ref = f"{ns}/{name}"

    def build() -> Optional[EndpointSet]:
        labels = _map(_map(obj.get("metadata"), "metadata").get("labels"), "metadata.labels")
        service = check_label(labels.get(SERVICE_NAME_LABEL), f"metadata.labels[{SERVICE_NAME_LABEL}]")
        addr_type = obj.get("addressType", "IPv4")
        if addr_type not in ("IPv4", "IPv6", "FQDN"):
            raise FieldError("addressType", f"{shown(addr_type)} is not IPv4, IPv6 or FQDN")
        if addr_type not in families:
            return None
        ports = slice_ports(obj.get("ports"), "ports")
        # With one port (the common case) endpoints carry it already, so for_port needs no copies.
        port0 = ports[0].port if len(ports) == 1 else 0
        eps: List[Endpoint] = []
        raw_eps = _list(obj.get("endpoints"), "endpoints")
        plain = addr_type == "IPv4" and not cache
        i, n = 0, len(raw_eps)
        while i < n:
            if plain:
                i = _plain_v4_endpoints(raw_eps, port0, eps, i)  # as far as the endpoints are plain
                if i == n:
                    break
            try:
                _slice_endpoint(raw_eps[i], addr_type, port0, eps, cache)
            except FieldError as err:
                # Field paths are relative inside the loop and prefixed only on error: formatting
                # "endpoints[i]..." for every field of 100k endpoints cost more than parsing them.
                sub = f".{err.field_path}" if err.field_path else ""
                raise FieldError(f"endpoints[{i}]{sub}", err.message) from None
            i += 1
        return EndpointSet(ns, service, ports, tuple(eps), trigger_time(obj))

    return _guard(kind, ref, build)


_NAMES: Dict[str, Dict[str, str]] = {"nodeName": {}, "zone": {}}
"""Node names and zones already checked, interned, by kind: 100k endpoints name a few nodes and
zones, and checking each copy against its pattern cost a sixth of a slice's conversion.  Bounded: a
hostile source with a million names stops filling it, and checks those names every time."""
_NAMES_MAX = 1 << 15


def _known(value: Any, kind: str, check: Callable[[Any, str], Optional[str]]) -> Optional[str]:
    """``value`` checked by ``check`` (a node name or a zone), from :data:`_NAMES` when seen before."""
    if value is None:
        return None
    known = _NAMES[kind]
    if type(value) is str:
        hit = known.get(value)
        if hit is not None:
            return hit
    checked = check(value, kind)
    if checked is None:
        return None
    checked = sys.intern(checked)
    if len(known) < _NAMES_MAX:
        known[checked] = checked
    return checked


_NEW = tuple.__new__


def _plain_v4_endpoints(raw_eps: List[Any], port: int, out: List[Endpoint], start: int = 0) -> int:
    """The endpoints of an IPv4 slice from ``start`` on that need no more than the common checks,
    appended to ``out``; returns the index of the first one that does (``len(raw_eps)`` when none).

    The accept-only shortcut of :func:`_slice_endpoint`, which stays the one place that decides
    and words a refusal: an endpoint is taken here only when every check it would make passes at
    once (a dict with a dict of boolean conditions, one canonical dotted-quad address, node name
    and zone already checked, no hints); anything else, valid or not, is left to it.  The calls
    it inlines (a function per endpoint, two name lookups, three for the address, the named
    tuple's ``__new__``) were half of converting 100k endpoints."""
    nodes, zones = _NAMES["nodeName"], _NAMES["zone"]
    pton, ntop, inet = socket.inet_pton, socket.inet_ntop, socket.AF_INET
    from_bytes, v4 = int.from_bytes, new_v4
    for i in range(start, len(raw_eps)):
        e = raw_eps[i]
        if type(e) is not dict:
            return i
        cond, addrs = e.get("conditions"), e.get("addresses")
        if type(addrs) is not list or len(addrs) != 1 or "hints" in e:
            return i
        if cond is None:
            bits = READY | SERVING  # the API's defaults (see _slice_endpoint)
        elif type(cond) is dict:
            ready, serving, terminating = cond.get("ready", True), cond.get("serving", True), \
                cond.get("terminating", False)
            if type(ready) is not bool or type(serving) is not bool or type(terminating) is not bool:
                return i
            bits = (ready << 2) | (serving << 1) | terminating  # model.conditions(), inlined
        else:
            return i
        node, zone = e.get("nodeName"), e.get("zone")
        if node is not None:
            node = nodes.get(node) if type(node) is str else None
            if node is None:
                return i
        if zone is not None:
            zone = zones.get(zone) if type(zone) is str else None
            if zone is None:
                return i
        addr = addrs[0]
        if type(addr) is not str or len(addr) > 15:
            return i
        # The canonical-dotted-quad check of model._parse_ip, inlined on purpose: calling a shared
        # function per endpoint cost 0.05 s of the 0.6 s conversion (by hand); the randomized test
        # holds both to the same answers (leading zeros, 256, an embedded NUL).
        try:
            packed = pton(inet, addr)
        except (OSError, ValueError):
            return i
        if ntop(inet, packed) != addr:
            return i
        out.append(_NEW(Endpoint, (v4(from_bytes(packed, "big")), port, bits, node, zone, ())))
    return len(raw_eps)


def _slice_endpoint(raw: Any, addr_type: str, port: int, out: List[Endpoint], cache: bool = True) -> None:
    """One EndpointSlice endpoint → one Endpoint per address, appended to ``out``."""
    e = raw if type(raw) is dict else _map(raw, "")
    cond = e.get("conditions")
    cond = cond if type(cond) is dict else _map(cond, "conditions")
    # The API's defaults, as kube-proxy reads them (pkg/proxy/endpointslicecache.go): an absent
    # ready or serving is true, an absent terminating false.  (Serving is not "ready when absent":
    # a terminating endpoint whose controller sets no serving is still the fallback.)
    ready, serving, terminating = cond.get("ready"), cond.get("serving"), cond.get("terminating")
    ready = True if ready is None else ready
    serving = True if serving is None else serving
    terminating = False if terminating is None else terminating
    if type(ready) is not bool or type(serving) is not bool or type(terminating) is not bool:
        for name, value in (("ready", ready), ("serving", serving), ("terminating", terminating)):
            _bool(value, False, f"conditions.{name}")
    # Interned: JSON gives every endpoint its own copy of its node's name (100k copies of a few
    # names at 10k services, ~6 MB), and backends compare it with this node's name.
    node = _known(e.get("nodeName"), "nodeName", check_subdomain)
    zone = _known(e.get("zone"), "zone", check_zone)
    zone_hints: Tuple[str, ...] = ()
    node_hints: Tuple[str, ...] = ()
    hints = e.get("hints")
    if hints is not None:
        hint_map = _map(hints, "hints")
        for_zones = _list(hint_map.get("forZones"), "hints.forZones")
        zone_hints = tuple(_hint_name(z, f"hints.forZones[{k}]", check_zone) for k, z in enumerate(for_zones))
        for_nodes = _list(hint_map.get("forNodes"), "hints.forNodes")
        node_hints = tuple(sys.intern(_hint_name(n, f"hints.forNodes[{k}]", check_subdomain))
                           for k, n in enumerate(for_nodes))
    version = 6 if addr_type == "IPv6" else 4
    for j, addr in enumerate(_list(e.get("addresses"), "addresses")):
        ip = valid_ip(addr, cache)
        if ip is None:
            ip = check_ip(addr, f"addresses[{j}]")  # raises, naming the field
        if ip.version != version:
            raise FieldError(f"addresses[{j}]", f"{shown(addr)} is not of addressType {addr_type}")
        out.append(Endpoint(ip, port, ready, serving, terminating, node, zone, zone_hints, node_hints))


def _hint_name(raw: Any, path: str, check: Callable[[Any, str], Optional[str]]) -> str:
    """``hints.forZones[k].name`` / ``hints.forNodes[k].name``: required, and a zone / node name."""
    name = _map(raw, path).get("name")
    if name is None or name == "":
        raise FieldError(f"{path}.name", "is required")
    return check(name, f"{path}.name") or ""


def parse_endpoints(obj: Mapping[str, Any]) -> EndpointSet:
    """A legacy v1 Endpoints (--use-endpoints) → one EndpointSet; not-ready addresses are kept as not ready."""
    kind, ns, name = object_ref(obj)

    def build() -> EndpointSet:
        ports: List[SlicePort] = []
        eps: List[Endpoint] = []
        subsets = _list(obj.get("subsets"), "subsets")
        if len(subsets) > 1:
            # Subsets with different port sets cannot be flattened into one set faithfully.  Compared
            # parsed, not by repr: the repr of a YAML alias bomb never ends.
            port_sets = {slice_ports(_map(s, f"subsets[{i}]").get("ports"), f"subsets[{i}].ports")
                         for i, s in enumerate(subsets)}
            if len(port_sets) > 1:
                raise FieldError("subsets", "subsets with different ports are not supported; use EndpointSlices")
        for i, raw in enumerate(subsets):
            s = _map(raw, f"subsets[{i}]")
            if not ports:
                ports = list(slice_ports(s.get("ports"), f"subsets[{i}].ports"))
            for key, ready in (("addresses", True), ("notReadyAddresses", False)):
                for j, a in enumerate(_list(s.get(key), f"subsets[{i}].{key}")):
                    addr = _map(a, f"subsets[{i}].{key}[{j}]")
                    ip = check_ip(addr.get("ip"), f"subsets[{i}].{key}[{j}].ip")
                    node = addr.get("nodeName")
                    if node is not None:
                        check_subdomain(node, f"subsets[{i}].{key}[{j}].nodeName")
                    eps.append(Endpoint(ip, 0, ready, ready, False, node, None))
        return EndpointSet(ns, name, tuple(ports), tuple(eps))

    return _guard(kind, f"{ns}/{name}", build)


SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
"""A Service (or its slices) with this label belongs to another proxy: kube-proxy leaves it alone."""
HEADLESS = "service.kubernetes.io/headless"
"""The EndpointSlice controller's label on a headless service's slices: nothing to program."""
PROXY_LABELS = (HEADLESS, SERVICE_PROXY_NAME)
PROXY_LABEL_SELECTOR = ",".join(f"!{label}" for label in PROXY_LABELS)
"""kube-proxy's informer filter for Services and EndpointSlices (``cmd/kube-proxy``: the labels must
not exist), sent as the ``labelSelector`` of the API source's lists and watches."""


def not_for_this_proxy(obj: Mapping[str, Any]) -> Optional[str]:
    """The label of :data:`PROXY_LABELS` that ``obj`` carries (the file source's side of the
    informers' selector), or None.  Labels that are no mapping are left to validation."""
    meta = obj.get("metadata")
    labels = meta.get("labels") if is_mapping(meta) else None
    if not is_mapping(labels):
        return None
    return next((label for label in PROXY_LABELS if label in labels), None)


ZONE_LABEL = "topology.kubernetes.io/zone"
TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
"""The cluster autoscaler's taint on a node it is about to delete (kube-proxy's ToBeDeletedTaint)."""


def trigger_time(obj: Mapping[str, Any]) -> Optional[float]:
    """The object's last-change-trigger-time annotation (RFC 3339) as Unix seconds; None when absent
    or unreadable: it only feeds a metric, so a bad stamp is ignored rather than rejected."""
    meta = obj.get("metadata")
    notes = meta.get("annotations") if is_mapping(meta) else None
    return trigger_stamp(notes.get(TRIGGER_TIME) if notes and is_mapping(notes) else None)


def trigger_stamp(raw: Any) -> Optional[float]:
    """:func:`trigger_time` of the annotation's value."""
    if not isinstance(raw, str):
        return None
    try:
        stamp = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    return stamp.timestamp()


def node_eligible(obj: Mapping[str, Any]) -> bool:
    """False while the node is being deleted: a deletionTimestamp, or the autoscaler's taint
    (kube-proxy's SyncNode), so that /healthz sends load balancers elsewhere."""
    meta = obj.get("metadata")
    if isinstance(meta, Mapping) and meta.get("deletionTimestamp"):
        return False
    spec = obj.get("spec")
    taints = spec.get("taints") if isinstance(spec, Mapping) else None
    return not any(isinstance(t, Mapping) and t.get("key") == TO_BE_DELETED_TAINT for t in taints or ())


def parse_node(obj: Mapping[str, Any], node_name: str) -> NodeInfo:
    """This node's v1 Node → NodeInfo with its zone label (both sources read nodes through this)."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    raw = labels.get(ZONE_LABEL) if isinstance(labels, Mapping) else None
    try:
        zone = check_zone(raw, f"metadata.labels[{ZONE_LABEL}]")
        pod_cidrs = _pod_cidrs(obj.get("spec"))
        ips = node_ips(obj.get("status"))
    except FieldError as err:
        raise ValidationError("Node", node_name, err.field_path, err.message) from None
    return NodeInfo(name=node_name, zone=zone, pod_cidrs=pod_cidrs, ips=ips, eligible=node_eligible(obj))


def _pod_cidrs(spec: Any) -> Tuple[Any, ...]:
    """``spec.podCIDRs`` (or the older single ``spec.podCIDR``), validated."""
    if not isinstance(spec, Mapping):
        return ()
    raw = spec.get("podCIDRs")
    if raw is None:
        single = spec.get("podCIDR")
        return (check_cidr(single, "spec.podCIDR"),) if single else ()
    if not isinstance(raw, list):
        raise FieldError("spec.podCIDRs", f"{raw!r} is not a list of CIDRs")
    return tuple(check_cidr(c, f"spec.podCIDRs[{i}]") for i, c in enumerate(raw))


def node_ips(status: Any) -> Tuple[IPAddress, ...]:
    """kube-proxy's node IPs (GetNodeHostIPs): the InternalIPs, then the ExternalIPs; the first
    address, then the first of the other family.  Addresses that do not parse are an error."""
    if not isinstance(status, Mapping):
        return ()
    raw = status.get("addresses") or []
    if not isinstance(raw, list):
        raise FieldError("status.addresses", f"{raw!r} is not a list")
    found: Dict[str, List[IPAddress]] = {"InternalIP": [], "ExternalIP": []}
    for i, entry in enumerate(raw):
        if isinstance(entry, Mapping) and entry.get("type") in found:
            found[str(entry["type"])].append(check_ip(entry.get("address"), f"status.addresses[{i}].address"))
    ordered = found["InternalIP"] + found["ExternalIP"]
    if not ordered:
        return ()
    first = ordered[0]
    other = next((a for a in ordered if a.version != first.version), None)
    return (first,) if other is None else (first, other)
