"""The one-shot load's typed shortcuts for plain IPv4 EndpointSlices and plain Services
(netproxy/source/plainslice.py, plainservice.py) against the general conversion of the decoded dict:
the same answers, whatever the item holds."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from netproxy.source import plainservice, plainslice
from netproxy.source.convert import HEADLESS, SERVICE_PROXY_NAME, TRIGGER_TIME
from netproxy.source.files import Loaded, convert_object, load

_ABSENT = object()

_ENDPOINTS: List[Any] = [  # the first five are plain; the rest valid-but-not-plain or invalid
    {"addresses": ["10.244.1.1"]},
    {"addresses": ["10.244.1.19"], "conditions": {"ready": True, "serving": True, "terminating": False},
     "nodeName": "node-a"},
    {"addresses": ["10.244.1.2"], "conditions": {"ready": False, "serving": True, "terminating": True},
     "nodeName": "node-a", "zone": "zone-1"},
    {"addresses": ["10.244.1.3"], "conditions": {"ready": None, "serving": None, "terminating": None},
     "nodeName": None, "zone": None, "hints": None},
    {"addresses": ["10.244.1.4"], "conditions": None, "nodeName": "node-b", "extra": {"x": [1, 2]}},
    {"addresses": ["10.244.1.5"], "conditions": {"ready": 1}},
    {"addresses": ["10.244.1.6"], "conditions": "ready"},
    {"addresses": ["10.244.1.7"], "nodeName": "Node_A"},
    {"addresses": ["10.244.1.8"], "nodeName": ""},
    {"addresses": ["10.244.1.9"], "zone": "a zone"},
    {"addresses": ["10.244.1.10"], "zone": ""},
    {"addresses": ["10.244.1.11"], "nodeName": 7},
    {"addresses": ["10.244.1.12", "10.244.1.13"]},
    {"addresses": []},
    {"conditions": {"ready": True}},
    {"addresses": "10.244.1.14"},
    {"addresses": ["10.244.01.15"]},
    {"addresses": ["10.244.1.256"]},
    {"addresses": ["fd00::1"]},
    {"addresses": ["10.244.1.16\x00"]},
    {"addresses": [1234]},
    {"addresses": [None]},
    {"addresses": ["10.244.1.17"], "hints": {"forZones": [{"name": "zone-1"}]}},
    {"addresses": ["10.244.1.18"], "hints": {}},
    "an endpoint",
    None,
]
_PORTS: List[Any] = [
    [{"name": "http", "port": 8080, "protocol": "TCP"}], [{"port": 53, "protocol": "UDP"}], [], None, _ABSENT,
    [{"name": "a", "port": 1}, {"name": "b", "port": 2, "protocol": None}], [{"name": None, "port": 80}],
    [{"name": "http", "port": 0}], [{"name": "http", "port": "80"}], [{"name": "http", "port": 80.0}],
    [{"name": "Http", "port": 80}], [{"port": 80, "protocol": "tcp"}], [{"port": True}], [{"port": None}], "x",
]
_META: Dict[str, List[Any]] = {
    "name": ["web-abc12", "web.x-1", _ABSENT, None, "", "Web", 5, "a" * 254],
    "namespace": ["shop", _ABSENT, None, "", "Shop", 5],
    "labels": [{"kubernetes.io/service-name": "web"}, {"kubernetes.io/service-name": "web", "app": "x"},
               {"kubernetes.io/service-name": "web", "other": 5}, {}, None, _ABSENT, "x",
               {"kubernetes.io/service-name": "Web"}, {"kubernetes.io/service-name": None},
               {"kubernetes.io/service-name": "web", HEADLESS: ""},
               {"kubernetes.io/service-name": "web", "note": "EndpointSlice"},  # the kind's name, not as the kind
               {"kubernetes.io/service-name": "web", SERVICE_PROXY_NAME: "other"}],
    "annotations": [_ABSENT, None, {}, {TRIGGER_TIME: "2026-12-06T21:00:00Z"}, {TRIGGER_TIME: "not a time"},
                    {TRIGGER_TIME: 5}, {"other": {"deep": [1]}}, "x", []],
}
_TOP: Dict[str, List[Any]] = {
    "kind": ["EndpointSlice", _ABSENT, "Service", None, ""],
    "addressType": ["IPv4", _ABSENT, "IPv6", "FQDN", None, "ipv4", 4],
    "metadata": ["built", None, _ABSENT, "x", {}],
}


def _drop_absent(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_absent(v) for k, v in value.items() if v is not _ABSENT}
    if isinstance(value, list):
        return [_drop_absent(v) for v in value]
    return value


def _random_slice(rng: random.Random) -> str:
    """A slice's JSON text: plain most of the time in each field, sometimes with a key given twice."""
    plain = rng.random() < 0.5  # half the slices use only each field's first (plain) variants

    def pick(values: List[Any], n_plain: int = 1) -> Any:
        return rng.choice(values[:n_plain] if plain or rng.random() < 0.7 else values)

    meta = {k: pick(v, 4 if k == "annotations" else 2) for k, v in _META.items()}
    top = {k: pick(v) for k, v in _TOP.items()}
    obj: Dict[str, Any] = {"apiVersion": "discovery.k8s.io/v1", "kind": top["kind"],
                           "metadata": meta if top["metadata"] == "built" else top["metadata"],
                           "addressType": top["addressType"], "ports": pick(_PORTS, 2),
                           "endpoints": [pick(_ENDPOINTS, 5) for _ in range(rng.randint(0, 5))]}
    if rng.random() < 0.05:
        obj["endpoints"] = rng.choice([None, "x", {}])
    text = json.dumps(_drop_absent(obj))
    if rng.random() < 0.15:  # a key given twice: the last one counts, in both paths
        key, value = rng.choice([("nodeName", '"node-z"'), ("nodeName", "7"), ("addressType", '"IPv6"'),
                                 ("ready", '"yes"'), ("ready", "false"), ("kind", '"Service"'), ("port", "0")])
        first = text.find(f'"{key}": ')
        if first >= 0:
            text = text[:first] + f'"{key}": {value}, ' + text[first:]
    return text


def _answer(converted: Any) -> Any:
    """A conversion with its endpoints' field types (True == 1) and the trigger time, which the
    EndpointSet's equality leaves out."""
    if converted is None or converted.kind != "EndpointSlice" or converted.value is None:
        return converted
    value = converted.value
    return (converted.ref, value, value.trigger_time, [[type(v) for v in e] for e in value.endpoints],
            [type(p.port) for p in value.ports])


def _differential(rng: random.Random, count: int, make: Callable[[random.Random], str],
                  fast: Callable[[bytes], Any], answer: Callable[[Any], Any], kind: str) -> Tuple[int, int]:
    """``count`` random items of ``kind``: whatever the typed shortcut ``fast`` takes, the general
    conversion of the decoded dict answers the same (compared through ``answer``).  Returns (taken
    by the shortcut, valid but left to the general path)."""
    from netproxy.source.files import Converted

    taken = general_only = 0
    for _ in range(count):
        text = make(rng)
        general = convert_object(json.loads(text), "", remember_addresses=False)
        got = fast(text.encode())
        if got is None:
            general_only += general.kind == kind and general.error is None
            continue
        taken += 1
        assert answer(Converted(kind, *got)) == answer(general), text
    return taken, general_only


def test_typed_slices_convert_as_the_general_path() -> None:
    """Random slices mixing plain, valid-but-not-plain and invalid values (and keys given twice):
    whatever the shortcut takes, the general conversion of the decoded dict gives the same
    endpoints, ports, service, reference and trigger time, with the same field types."""
    taken, general_only = _differential(random.Random(40), 3000, _random_slice, plainslice.converted, _answer,
                                        "EndpointSlice")
    assert taken > 1000 and general_only > 100, (taken, general_only)  # ~1,540 and ~140


def _random_service_text(rng: random.Random) -> str:
    """A Service's JSON text (tests/unit/test_convert.py's random Services, in any namespace and
    name, labels sometimes), sometimes with a key given twice."""
    from tests.unit.test_convert import _random_service

    obj = _random_service(rng)
    meta = {k: rng.choice(v[:2] if rng.random() < 0.8 else v) for k, v in _META.items() if k != "annotations"}
    meta["name"] = rng.choice(["web", "db", "Web", "web.x", None, 5] if rng.random() < 0.2 else ["web", "db"])
    obj["metadata"] = _drop_absent(meta)
    obj["kind"] = rng.choice(["Service"] * 8 + [None, "", _ABSENT, "EndpointSlice"])
    text = json.dumps(_drop_absent(obj))
    if rng.random() < 0.15:
        key, value = rng.choice([("port", '"80"'), ("port", "443"), ("clusterIP", '"None"'), ("type", '"ExternalName"'),
                                 ("protocol", '"UDP"'), ("name", '"other"'), ("kind", '"Service"'), ("ingress", "[]")])
        first = text.find(f'"{key}": ')
        if first >= 0:
            text = text[:first] + f'"{key}": {value}, ' + text[first:]
    return text


def _service_answer(converted: Any) -> Any:
    if converted is None or converted.kind != "Service" or converted.error is not None:
        return converted
    import dataclasses

    return (converted.ref, converted.value, [[type(getattr(p, f.name)) for f in dataclasses.fields(p)]
                                             for p in converted.value])


def test_typed_services_convert_as_the_general_path() -> None:
    """Random Services (plain, valid-but-not-plain, invalid values in every field; odd names,
    proxy labels, no kind, keys given twice): whatever the typed shortcut takes, the general
    conversion of the decoded dict gives the same service ports, reference and field types."""
    taken, general_only = _differential(random.Random(42), 4000, _random_service_text, plainservice.converted,
                                        _service_answer, "Service")
    assert taken > 250 and general_only > 250, (taken, general_only)  # ~360 and ~410


def _list_file(tmp_path: Path, items: List[str]) -> str:
    path = tmp_path / "cluster.json"
    path.write_text('{"apiVersion": "v1", "kind": "List", "items": [' + ", ".join(items) + "]}", encoding="utf-8")
    return str(path)


def _summary(loaded: Loaded) -> Any:
    return (loaded.services, {k: (v, v.trigger_time) for k, v in loaded.endpoints.items()},
            sorted(str(e) for e in loaded.errors), loaded.skipped)


def test_the_one_shot_load_answers_as_the_cached_load(tmp_path: Path) -> None:
    """files.load without the address cache (the one-shot commands: the typed slices and
    services, the IPv4 shortcut) against the load with it (``run``'s, which takes neither): the
    same services, endpoints, rejections (as worded) and skipped objects, for lists of random
    slices and services, names repeated (the later slice wins, a Service defined twice is refused)."""
    rng = random.Random(41)
    for _ in range(60):
        items = [_random_slice(rng) for _ in range(rng.randint(1, 30))]
        items += [_random_service_text(rng) for _ in range(rng.randint(1, 10))]
        rng.shuffle(items)
        path = _list_file(tmp_path, items)
        one_shot, cached = load(path, remember_addresses=False), load(path, remember_addresses=True)
        assert _summary(one_shot) == _summary(cached), items


def test_the_typed_shortcut_takes_the_bench_slices_and_shares_their_ports() -> None:
    """A generated cluster's slices are all taken (so the speed measured is the shortcut's), and
    slices with the same port list share one tuple of SlicePorts (memory at 100k slices)."""
    from bench import gen

    slices = [o for o in gen.cluster(50, "uniform") if o["kind"] == "EndpointSlice"]
    got: List[Optional[Any]] = [plainslice.converted(json.dumps(o).encode()) for o in slices]
    assert all(g is not None for g in got)
    assert len({id(g[1].ports) for g in got if g is not None}) == 1
    assert sum(len(g[1].endpoints) for g in got if g is not None) == 500
