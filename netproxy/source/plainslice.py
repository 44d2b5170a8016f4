"""The one-shot load's shortcut for plain IPv4 EndpointSlices: decoded by msgspec into typed
structs, in C, and converted without the dict path's per-field checks.

A 10k-service JSON source is 10k EndpointSlices of ~10 endpoints: decoding them into dicts (two
per endpoint) and reading those back field by field was most of ``netproxy sync``'s load stage
(docs/performance.md, the eighth pass).  Here msgspec decodes a slice straight into the structs
below, whose field types are the plain shape's (a boolean condition, a string node name, one
list of string addresses...), so their checks are done in C as the item is read.

Accept-only, as :func:`netproxy.source.convert._plain_v4_endpoints`: a slice is taken here only
when it decodes into these types *and* every value passes the checks the general path would make
at once (one canonical dotted quad an endpoint, node name and zone known or accepted by the same
check functions, no hints, no proxy label); anything else, valid or not, returns None and goes the
general way (:func:`netproxy.source.convert.parse_endpoint_slice` on the decoded dict), which stays
the one place that decides and words a refusal.  Fields the general path does not read are left
unread here too (a struct ignores unknown keys); a key given twice is, as in a dict, its last
value (msgspec checks each).  The randomized test in tests/unit/test_typed_items.py holds both
paths to the same answers.
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import msgspec

from netproxy.core.model import (
    READY,
    SERVING,
    TERMINATING,
    Endpoint,
    EndpointSet,
    FieldError,
    SlicePort,
    check_label,
    check_subdomain,
    check_zone,
    new_v4,
)
from netproxy.source.convert import (
    _NAMES,  # the general path's node names and zones already checked, and how it checks a new one
    PROXY_LABELS,
    SERVICE_NAME_LABEL,
    TRIGGER_TIME,
    _known,
    namespace,
    slice_ports,
    trigger_stamp,
)


class _Conditions(msgspec.Struct, gc=False):
    ready: Optional[bool] = None
    serving: Optional[bool] = None
    terminating: Optional[bool] = None


class _Endpoint(msgspec.Struct, gc=False):
    addresses: List[str]
    conditions: Optional[_Conditions] = None
    nodeName: Optional[str] = None
    zone: Optional[str] = None
    hints: None = None
    """Hints are the general path's: a slice with any is not plain."""


class _Port(msgspec.Struct, gc=False):
    name: Optional[str] = None
    protocol: Optional[str] = None
    port: Optional[int] = None


class _Metadata(msgspec.Struct, gc=False):
    name: Optional[str] = None
    namespace: Optional[str] = None
    labels: Optional[Dict[str, Any]] = None
    annotations: Optional[Dict[str, Any]] = None


class _Slice(msgspec.Struct, tag_field="kind", tag="EndpointSlice", gc=False):
    metadata: Optional[_Metadata] = None
    addressType: str = "IPv4"
    ports: Optional[List[_Port]] = None
    endpoints: Optional[List[_Endpoint]] = None


class _Missing(msgspec.Struct, tag_field="kind", tag="", gc=False):
    """Decoded alone, a tagged struct takes an object without a ``kind``; in a union with this
    one, such an object is refused (and an empty kind decodes to it, which is no Slice)."""


_DECODER = msgspec.json.Decoder(Union[_Slice, _Missing])

Ref = Tuple[str, str]


def converted(text: bytes) -> Optional[Tuple[Ref, EndpointSet]]:
    """One item of a JSON ``List`` (its bytes) as ((namespace, name), its endpoints) when it is a
    plain IPv4 EndpointSlice, else None (the caller decodes it and converts it the general way)."""
    try:
        obj = _DECODER.decode(text)
    except (msgspec.MsgspecError, RecursionError):
        return None
    return _convert(obj) if isinstance(obj, _Slice) else None


def _convert(obj: _Slice) -> Optional[Tuple[Ref, EndpointSet]]:
    meta = obj.metadata
    if meta is None or obj.addressType != "IPv4":
        return None
    labels = meta.labels or {}
    if any(label in labels for label in PROXY_LABELS):
        return None  # skipped by the general path (not for this proxy)
    try:
        ns = namespace(meta.namespace or "default")
        name = check_subdomain(meta.name, "metadata.name")
        service = check_label(labels.get(SERVICE_NAME_LABEL), "")
        ports = _ports(obj.ports)
    except FieldError:
        return None
    port0 = ports[0].port if len(ports) == 1 else 0
    endpoints = _endpoints(obj.endpoints or (), port0)
    if endpoints is None:
        return None
    stamp = trigger_stamp(meta.annotations.get(TRIGGER_TIME) if meta.annotations else None)
    return (ns, name), EndpointSet(ns, service, ports, endpoints, stamp)


_PORTS: Dict[Tuple[Tuple[Optional[str], Optional[str], Optional[int]], ...], Tuple[SlicePort, ...]] = {}
"""Slice port lists already converted: 10k slices of one service shape have one list, and each
its own SlicePort objects (150 bytes each) cost memory as well as the conversion.  Bounded."""
_PORTS_MAX = 1 << 12


def _ports(raw: Optional[List[_Port]]) -> Tuple[SlicePort, ...]:
    """The slice's ports, as :func:`convert.slice_ports` converts them (for which an absent and a
    null field are the same); raises :class:`FieldError`."""
    key = tuple([(p.name, p.protocol, p.port) for p in raw or ()])
    hit = _PORTS.get(key)
    if hit is None:
        hit = slice_ports([{"name": n, "protocol": pr, "port": p} for n, pr, p in key], "ports")
        if len(_PORTS) < _PORTS_MAX:
            _PORTS[key] = hit
    return hit


_NEW = tuple.__new__


def _checked(name: str, kind: str, check: Callable[[Any, str], Optional[str]]) -> Optional[str]:
    """A node name or zone seen for the first time: checked (and remembered) as the general path
    does, None when refused."""
    try:
        return _known(name, kind, check)
    except FieldError:
        return None


def _endpoints(raw: Any, port: int) -> Optional[Tuple[Endpoint, ...]]:
    """The endpoints, as :func:`convert._plain_v4_endpoints` takes them (and the general path
    converts them), or None when one is not plain."""
    pton, ntop, inet = socket.inet_pton, socket.inet_ntop, socket.AF_INET
    from_bytes, v4 = int.from_bytes, new_v4
    nodes, zones = _NAMES["nodeName"], _NAMES["zone"]
    out = []
    for e in raw:
        addrs = e.addresses
        if len(addrs) != 1:
            return None
        cond = e.conditions
        if cond is None:
            bits = READY | SERVING  # the API's defaults for absent conditions
        else:  # an absent (null) ready or serving is true, an absent terminating false
            bits = ((READY if cond.ready is not False else 0) | (SERVING if cond.serving is not False else 0)
                    | (TERMINATING if cond.terminating else 0))
        node, zone = e.nodeName, e.zone
        if node is not None:
            node = nodes.get(node) or _checked(node, "nodeName", check_subdomain)
            if node is None:
                return None
        if zone is not None:
            zone = zones.get(zone) or _checked(zone, "zone", check_zone)
            if zone is None:
                return None
        addr = addrs[0]
        if len(addr) > 15:
            return None
        # The canonical-dotted-quad check of model._parse_ip, inlined as _plain_v4_endpoints does.
        try:
            packed = pton(inet, addr)
        except (OSError, ValueError):
            return None
        if ntop(inet, packed) != addr:
            return None
        out.append(_NEW(Endpoint, (v4(from_bytes(packed, "big")), port, bits, node, zone, ())))
    return tuple(out)
