"""The one-shot load's shortcut for plain Services: decoded by msgspec into typed structs, in C,
and converted by the same judges as the dict path's shortcut (:func:`convert._plain_service`).

As :mod:`plainslice` does for EndpointSlices: the structs' field types are the plain shape's, so
what they take is already of the right type when :func:`convert.plain_settings`,
:func:`convert.plain_port` and :func:`convert.plain_service_ports` judge the values; a Service
that does not decode into them, or that those judges do not take, returns None and goes the
general way (decoded as a dict, :func:`convert.parse_service`), which stays the one place that
decides and words a refusal.  Fields the general path does not read are left unread (a struct
ignores unknown keys); a key given twice is its last value, as in a dict.  The randomized test in
tests/unit/test_typed_items.py holds both paths to the same answers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import msgspec

from netproxy.core.model import DEFAULT_AFFINITY_TIMEOUT, FieldError, ServicePort, check_label
from netproxy.source.convert import (
    PROXY_LABELS,
    PlainPort,
    namespace,
    plain_port,
    plain_service_ports,
    plain_settings,
)


class _ClientIP(msgspec.Struct, gc=False):
    timeoutSeconds: int = DEFAULT_AFFINITY_TIMEOUT


class _AffinityConfig(msgspec.Struct, gc=False):
    clientIP: Optional[_ClientIP] = None


class _Port(msgspec.Struct, gc=False):
    port: int
    name: Optional[str] = None
    protocol: Optional[str] = None
    targetPort: Union[int, str, None, msgspec.UnsetType] = msgspec.UNSET
    """Absent: the port itself; null: refused (by the general path)."""
    nodePort: Optional[int] = None


class _Spec(msgspec.Struct, gc=False):
    type: Optional[str] = None
    clusterIP: Optional[str] = None
    clusterIPs: Optional[List[str]] = None
    ports: Optional[List[_Port]] = None
    externalIPs: Optional[List[Any]] = None
    loadBalancerSourceRanges: Optional[List[Any]] = None
    sessionAffinity: Optional[str] = None
    sessionAffinityConfig: Optional[_AffinityConfig] = None
    externalTrafficPolicy: Optional[str] = None
    internalTrafficPolicy: Optional[str] = None
    trafficDistribution: Optional[str] = None
    healthCheckNodePort: Optional[int] = None


class _LoadBalancer(msgspec.Struct, gc=False):
    ingress: Optional[List[Any]] = None


class _Status(msgspec.Struct, gc=False):
    loadBalancer: Optional[_LoadBalancer] = None


class _Metadata(msgspec.Struct, gc=False):
    name: Optional[str] = None
    namespace: Optional[str] = None
    labels: Optional[Dict[str, Any]] = None


class _Service(msgspec.Struct, tag_field="kind", tag="Service", gc=False):
    metadata: Optional[_Metadata] = None
    spec: Optional[_Spec] = None
    status: Optional[_Status] = None


class _Missing(msgspec.Struct, tag_field="kind", tag="", gc=False):
    """Decoded alone, a tagged struct takes an object without a ``kind``; in a union with this
    one, such an object is refused (and an empty kind decodes to it, which is no Service)."""


_DECODER = msgspec.json.Decoder(Union[_Service, _Missing])

Ref = Tuple[str, str]


def converted(text: bytes) -> Optional[Tuple[Ref, Tuple[ServicePort, ...]]]:
    """One item of a JSON ``List`` (its bytes) as ((namespace, name), its service ports) when it is
    a plain Service, else None (the caller decodes it and converts it the general way)."""
    try:
        obj = _DECODER.decode(text)
    except (msgspec.MsgspecError, RecursionError):
        return None
    return _convert(obj) if isinstance(obj, _Service) else None


def _convert(obj: _Service) -> Optional[Tuple[Ref, Tuple[ServicePort, ...]]]:
    meta, spec, status = obj.metadata, obj.spec, obj.status
    if meta is None or spec is None:
        return None
    if meta.labels and any(label in meta.labels for label in PROXY_LABELS):
        return None  # skipped by the general path (not for this proxy)
    if status is not None and status.loadBalancer is not None and status.loadBalancer.ingress:
        return None  # load-balancer addresses: the general path's
    if spec.externalIPs or spec.loadBalancerSourceRanges:
        return None
    try:
        ns, name = namespace(meta.namespace or "default"), check_label(meta.name, "metadata.name")
    except FieldError:
        return None
    config = spec.sessionAffinityConfig
    client = config.clientIP if config is not None else None
    settings = plain_settings(spec.type, spec.sessionAffinity,
                              client.timeoutSeconds if client is not None else DEFAULT_AFFINITY_TIMEOUT,
                              spec.externalTrafficPolicy, spec.internalTrafficPolicy, spec.trafficDistribution,
                              spec.healthCheckNodePort)
    if settings is None:
        return None
    raw_ports = spec.ports or ()
    ports: List[PlainPort] = []
    for p in raw_ports:
        target = p.port if p.targetPort is msgspec.UNSET else p.targetPort
        one = plain_port(p.name, p.port, target, p.nodePort, p.protocol, len(raw_ports) > 1)
        if one is None:
            return None
        ports.append(one)
    service_ports = plain_service_ports(ns, name, spec.clusterIPs or (spec.clusterIP,), settings, ports)
    return None if service_ports is None else ((ns, name), service_ports)
