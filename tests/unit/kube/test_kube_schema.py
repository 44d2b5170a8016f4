"""The shaped decoder (netproxy/source/kube_schema.py) reads what the plain one reads: every Service
and EndpointSlice of the example cluster, of a hostile batch and of a realistic controller-made
slice converts to the same result (or the same rejection) through a list page decoded both ways, and
through a watch event.  A field that convert.py starts reading without kube_schema.py keeping it
fails here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import yaml

from netproxy.core.model import ValidationError
from netproxy.source.convert import parse_endpoint_slice, parse_service
from netproxy.source.kube_reflector import Decoder
from tests.unit.hostile_cases import batch

EXAMPLE = Path(__file__).parents[3] / "examples" / "cluster.yaml"


def _objects() -> List[Dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    flat = [o for d in docs for o in (d.get("items") or [d])]
    out = [o for o in flat if o.get("kind") in ("Service", "EndpointSlice")]
    out += [case.obj for case in batch(200, seed=11)]
    out.append(_controller_slice())
    return out


def _controller_slice() -> Dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it: every field netproxy skips, and
    every field it reads (hints, conditions, zone, trigger time, a deletion in progress)."""
    return {"kind": "EndpointSlice", "metadata": {
        "name": "web-x7k2p", "generateName": "web-", "namespace": "shop", "uid": "0b7e", "resourceVersion": "81",
        "deletionTimestamp": "2026-12-01T10:00:00Z",
        "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "x"},
        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-01T09:59:58Z"},
        "ownerReferences": [{"kind": "Service", "name": "web", "uid": "1"}],
        "managedFields": [{"manager": "kube-controller-manager", "fieldsV1": {"f:endpoints": {}}}]},
        "addressType": "IPv4", "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": ["10.244.1.5"],
                       "conditions": {"ready": False, "serving": True, "terminating": True},
                       "hostname": "web-0", "targetRef": {"kind": "Pod", "name": "web-0"}, "nodeName": "node-a",
                       "zone": "z1", "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "node-a"}]},
                       "deprecatedTopology": {"a": "b"}},
                      {"addresses": ["10.244.2.5"], "conditions": {}}]}


def _convert(obj: Any) -> Tuple[str, Any]:
    if not isinstance(obj, dict):
        return "not an object", None
    try:
        if obj.get("kind") == "Service":
            return "ok", parse_service(obj)
        return "ok", parse_endpoint_slice(obj, ("IPv4", "IPv6"))
    except ValidationError as err:
        return "rejected", str(err)


@pytest.mark.parametrize("kind", ["Service", "EndpointSlice"])
def test_a_page_decoded_to_the_shapes_converts_as_the_whole_page_does(kind: str) -> None:
    objects = [o for o in _objects() if o.get("kind") == kind]
    assert len(objects) > 50
    page = json.dumps({"kind": f"{kind}List", "metadata": {"resourceVersion": "9"},
                       "items": [{k: v for k, v in o.items() if k != "kind"} for o in objects]}).encode()
    shaped, whole = Decoder(kind).page(page)["items"], json.loads(page)["items"]
    assert len(shaped) == len(whole) == len(objects)
    for s, w in zip(shaped, whole):
        if isinstance(s, dict):
            s["kind"] = kind
        if isinstance(w, dict):
            w["kind"] = kind
        assert _convert(s) == _convert(w)


def test_a_page_of_another_shape_is_decoded_whole_so_that_only_the_bad_object_is_rejected() -> None:
    good = _controller_slice()
    bad = dict(good, endpoints="everything")
    page = json.dumps({"metadata": {}, "items": [good, bad]}).encode()
    items = Decoder("EndpointSlice").page(page)["items"]
    assert [_convert(i)[0] for i in items] == ["ok", "rejected"]
    assert "endpoints" in _convert(items[1])[1]


def test_watch_events_are_shaped_but_an_error_event_is_read_whole() -> None:
    d = Decoder("EndpointSlice")
    event = d.event(json.dumps({"type": "MODIFIED", "object": _controller_slice()}).encode())
    assert "managedFields" not in event["object"]["metadata"] and "targetRef" not in event["object"]["endpoints"][0]
    assert _convert(event["object"]) == _convert(_controller_slice())
    error = d.event(b'{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old"}}')
    assert error["object"]["code"] == 410 and error["object"]["message"] == "too old"
