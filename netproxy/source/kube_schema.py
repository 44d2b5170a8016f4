"""The parts of API objects that netproxy reads, as typed shapes for the list and watch decoder.

A list page of EndpointSlices from a real API server is mostly what netproxy never reads:
``managedFields``, owner references, uids, every endpoint's ``targetRef``.  Decoding pages with
msgspec into these ``TypedDict`` shapes skips those fields in C, before a Python object is made for
them, and still gives :mod:`netproxy.source.convert` the plain dicts it reads from manifests.
Measured on 10,000 realistic slices (docs/performance.md, "The API path"): stdlib ``json`` 0.87 s,
orjson 0.59 s, msgspec untyped 0.59 s, msgspec with these shapes 0.32 s.

Only containers are typed; every value netproxy validates stays ``Any`` so that validation keeps
one home (convert.py) and one set of messages.  A page whose containers do not have these shapes
(an ``endpoints`` that is no list, say) is decoded again untyped by the reflector, so that the
conversion rejects exactly the object at fault and names the field.  A field added to what
convert.py reads must be added here too: tests/unit/kube/test_kube_schema.py converts every
object of the examples and of the parity manifests both ways and compares.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, TypedDict


class Meta(TypedDict, total=False):
    name: Any
    namespace: Any
    labels: Any
    annotations: Any
    resourceVersion: Any
    deletionTimestamp: Any


class Service(TypedDict, total=False):
    kind: Any
    metadata: Optional[Meta]
    spec: Any
    status: Any


class SliceEndpoint(TypedDict, total=False):
    addresses: Any
    conditions: Any
    nodeName: Any
    zone: Any
    hints: Any


class EndpointSlice(TypedDict, total=False):
    kind: Any
    metadata: Optional[Meta]
    addressType: Any
    ports: Any
    endpoints: Optional[List[SliceEndpoint]]


class ServiceList(TypedDict, total=False):
    metadata: Any
    items: Optional[List[Service]]


class EndpointSliceList(TypedDict, total=False):
    metadata: Any
    items: Optional[List[EndpointSlice]]


class ServiceEvent(TypedDict, total=False):
    type: Any
    object: Service


class EndpointSliceEvent(TypedDict, total=False):
    type: Any
    object: EndpointSlice


SHAPES: Dict[str, Any] = {"Service": (ServiceList, ServiceEvent),
                          "EndpointSlice": (EndpointSliceList, EndpointSliceEvent)}
"""kind → (list page shape, watch event shape); other kinds are decoded whole."""
