"""Kubernetes objects → model objects, pinned where mutation testing found nothing watching
(``make mutation``'s ``convert`` group, docs/testing.md): each refusal's whole text (object, field and
what is wrong), the node, ServiceCIDR, trigger-time and label readers, the endpoint hints, the
address and name caches and the IPv4 shortcut's own defaults."""

from __future__ import annotations

import copy
import datetime
import ipaddress
import os
import sys
import time
import types
from typing import Any, Callable, Dict, Iterator, List

import pytest

from netproxy.core import model
from netproxy.core.model import NodeInfo, ValidationError
from netproxy.source import convert
from netproxy.source.convert import (
    HEADLESS,
    SERVICE_PROXY_NAME,
    TRIGGER_TIME,
    ZONE_LABEL,
    is_mapping,
    loose_ref,
    node_eligible,
    not_for_this_proxy,
    object_ref,
    parse_endpoint_slice,
    parse_endpoints,
    parse_node,
    parse_service,
    parse_service_cidr,
    ref_part,
    trigger_time,
)
from tests.unit.test_convert import endpoint_slice, legacy, service

ip = ipaddress.ip_address
net = ipaddress.ip_network


@pytest.fixture(autouse=True)
def cold_name_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no node name or zone remembered: a name another test (or the process
    the test runner forked from) checked before would otherwise hide what the cache does."""
    monkeypatch.setattr(convert, "_NAMES", {"nodeName": {}, "zone": {}})
    yield


def _refusal(fn: Callable[[Any], Any], obj: Any) -> str:
    with pytest.raises(ValidationError) as info:
        fn(obj)
    return str(info.value)


def _with(obj: Dict[str, Any], edit: Callable[[Dict[str, Any]], Any]) -> Dict[str, Any]:
    out = copy.deepcopy(obj)
    edit(out)
    return out


def _spec(**fields: Any) -> Callable[[Dict[str, Any]], Any]:
    return lambda o: o["spec"].update(fields)


def _status(status: Any) -> Callable[[Dict[str, Any]], Any]:
    return lambda o: o.update(status=status)


def _endpoint(**fields: Any) -> Callable[[Dict[str, Any]], Any]:
    return lambda o: o["endpoints"][0].update(fields)


# -- every refusal names the object, the field and what is wrong, in so many words ----------------

SVC = "Service shop/web: field "


@pytest.mark.parametrize("edit, text", [
    (_spec(sessionAffinityConfig="x"), SVC + "spec.sessionAffinityConfig: must be a mapping"),
    (_spec(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}),
     SVC + "spec.sessionAffinityConfig.clientIP.timeoutSeconds: 0 is outside 1..86400"),
    (_status("x"), SVC + "status: must be a mapping"),
    (_status({"loadBalancer": "x"}), SVC + "status.loadBalancer: must be a mapping"),
    (_status({"loadBalancer": {"ingress": "x"}}), SVC + "status.loadBalancer.ingress: must be a list"),
    (_status({"loadBalancer": {"ingress": [{"hostname": "lb.example", "ipMode": "Proxy"}]}}),
     SVC + "status.loadBalancer.ingress[0].ipMode: is only allowed with an ip"),
    (_spec(trafficDistribution="Nearby"),
     SVC + "spec.trafficDistribution: 'Nearby' is not PreferClose, PreferSameZone or PreferSameNode"),
    (_spec(ports=[{"name": "a", "port": 80}, {"port": 81}]),
     SVC + "spec.ports[1].name: is required when a service has more than one port"),
    (_spec(ports=[{"name": "a", "port": 80}, {"name": "b", "port": 81}, {"name": "a", "port": 82}]),
     SVC + "spec.ports[2].name: 'a' is used by spec.ports[0] too"),
    # Digits past five are refused as the string given (int() of thousands of digits raises);
    # five digits are read as the number they spell.
    (_spec(ports=[{"port": 80, "targetPort": "123456"}]),
     SVC + "spec.ports[0].targetPort: '123456' is outside 1..65535"),
    (_spec(ports=[{"port": 80, "targetPort": "99999"}]), SVC + "spec.ports[0].targetPort: 99999 is outside 1..65535"),
    (_spec(loadBalancerSourceRanges="10.0.0.0/8"), SVC + "spec.loadBalancerSourceRanges: must be a list"),
    (lambda o: o["metadata"].update(name="Web"),
     "Service shop/Web: field metadata.name: 'Web' is not a DNS-1123 label (a-z, 0-9, '-', at most 63)"),
], ids=lambda v: "" if callable(v) else v.split(": ")[1])
def test_a_service_refusal_says_which_field_and_why(edit: Callable[[Dict[str, Any]], Any], text: str) -> None:
    assert _refusal(parse_service, _with(service(), edit)) == text


SLICE = "EndpointSlice shop/web-abc12: field "


@pytest.mark.parametrize("edit, text", [
    (lambda o: o.update(endpoints=["an endpoint"]), SLICE + "endpoints[0]: must be a mapping"),
    (_endpoint(conditions="ready"), SLICE + "endpoints[0].conditions: must be a mapping"),
    (_endpoint(conditions={"ready": 1}), SLICE + "endpoints[0].conditions.ready: 1 is not a boolean"),
    (_endpoint(conditions={"serving": "yes"}), SLICE + "endpoints[0].conditions.serving: 'yes' is not a boolean"),
    (_endpoint(conditions={"terminating": "yes"}),
     SLICE + "endpoints[0].conditions.terminating: 'yes' is not a boolean"),
    (_endpoint(hints="x"), SLICE + "endpoints[0].hints: must be a mapping"),
    (_endpoint(hints={"forZones": "x"}), SLICE + "endpoints[0].hints.forZones: must be a list"),
    (_endpoint(hints={"forNodes": "x"}), SLICE + "endpoints[0].hints.forNodes: must be a list"),
    (_endpoint(hints={"forZones": ["x"]}), SLICE + "endpoints[0].hints.forZones[0]: must be a mapping"),
    (_endpoint(hints={"forZones": [{"name": "z"}, {}]}), SLICE + "endpoints[0].hints.forZones[1].name: is required"),
    (_endpoint(hints={"forZones": [{"name": ""}]}), SLICE + "endpoints[0].hints.forZones[0].name: is required"),
    (_endpoint(hints={"forNodes": [{"name": None}]}), SLICE + "endpoints[0].hints.forNodes[0].name: is required"),
    (_endpoint(hints={"forZones": [{"name": "a zone"}]}),
     SLICE + "endpoints[0].hints.forZones[0].name: 'a zone' is not a valid zone label value"),
    (_endpoint(hints={"forNodes": [{"name": "Node A"}]}),
     SLICE + "endpoints[0].hints.forNodes[0].name: 'Node A' is not a DNS-1123 subdomain"),
    (_endpoint(addresses="10.244.1.1"), SLICE + "endpoints[0].addresses: must be a list"),
    (_endpoint(addresses=["nope"]), SLICE + "endpoints[0].addresses[0]: 'nope' is not an IP address"),
    (_endpoint(addresses=["fd00::1"]), SLICE + "endpoints[0].addresses[0]: 'fd00::1' is not of addressType IPv4"),
    (lambda o: o["metadata"].update(labels="x"), SLICE + "metadata.labels: must be a mapping"),
    (lambda o: o.update(addressType="IPv5"), SLICE + "addressType: 'IPv5' is not IPv4, IPv6 or FQDN"),
    (lambda o: o.update(ports="x"), SLICE + "ports: must be a list"),
    (lambda o: o.update(ports=["x"]), SLICE + "ports[0]: must be a mapping"),
], ids=lambda v: "" if callable(v) else v.split(": ")[1])
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "one-shot"])
def test_a_slice_refusal_says_which_field_and_why(edit: Callable[[Dict[str, Any]], Any], text: str,
                                                  cache: bool) -> None:
    """The same words whether the one-shot load's IPv4 shortcut (cache=False) saw the endpoint first."""
    assert _refusal(lambda o: parse_endpoint_slice(o, cache=cache), _with(endpoint_slice(), edit)) == text


EPS = "Endpoints shop/web: field "


@pytest.mark.parametrize("subsets, text", [
    ("x", EPS + "subsets: must be a list"),
    (["x"], EPS + "subsets[0]: must be a mapping"),
    ([{"addresses": "x"}], EPS + "subsets[0].addresses: must be a list"),
    ([{"notReadyAddresses": ["x"]}], EPS + "subsets[0].notReadyAddresses[0]: must be a mapping"),
    ([{"ports": [{"port": 80}]}, "x"], EPS + "subsets[1]: must be a mapping"),
    ([{"ports": [{"port": 80}]}, {"ports": [{"port": 0}]}], EPS + "subsets[1].ports[0].port: 0 is outside 1..65535"),
    ([{"ports": [{"port": 80}]}, {"ports": [{"port": 81}]}],
     EPS + "subsets: subsets with different ports are not supported; use EndpointSlices"),
])
def test_a_legacy_endpoints_refusal_says_which_field_and_why(subsets: Any, text: str) -> None:
    assert _refusal(parse_endpoints, legacy(subsets)) == text


def test_what_is_no_object_is_refused_as_such() -> None:
    assert _refusal(object_ref, "x") == "object ?: field (root): 'x' is not a Kubernetes object"
    assert _refusal(object_ref, {"kind": "Service", "metadata": "x"}) == "Service ?: field metadata: must be a mapping"


# -- what is accepted ---------------------------------------------------------------------------------

def test_a_five_digit_target_port_string_is_the_port_it_spells() -> None:
    (p,) = parse_service(service(ports=[{"port": 80, "targetPort": "65535"}]))
    assert p.target_port == 65535


@pytest.mark.parametrize("distribution", ["PreferClose", "PreferSameZone", "PreferSameNode"])
def test_every_traffic_distribution_kubernetes_defines_is_taken(distribution: str) -> None:
    (p,) = parse_service(service(trafficDistribution=distribution))
    assert p.traffic_distribution == distribution


def test_an_external_name_service_is_left_alone_whatever_else_it_holds() -> None:
    """kube-proxy skips ExternalName services outright: not even a cluster IP and ports make one."""
    obj = service(type="ExternalName", externalName="db.example.com", clusterIP="10.96.0.20")
    assert parse_service(obj) == ()


def test_a_slice_without_an_address_type_is_ipv4() -> None:
    obj = endpoint_slice()
    del obj["addressType"]
    got = parse_endpoint_slice(obj, families=("IPv4",))
    assert got is not None and [str(e.ip) for e in got.endpoints] == ["10.244.1.1"]


def test_object_ref_keeps_a_kind_only_when_it_is_a_plausible_name() -> None:
    meta = {"name": "web", "namespace": "shop"}
    assert object_ref({"kind": "K" * 63, "metadata": meta})[0] == "K" * 63
    assert object_ref({"kind": "K" * 64, "metadata": meta})[0] == "?"
    assert object_ref({"kind": "Ser vice", "metadata": meta})[0] == "?"
    # Any mapping is an object, not only a dict (a read-only view, a YAML loader's own type).
    assert object_ref(types.MappingProxyType({"kind": "Service", "metadata": meta})) == ("Service", "shop", "web")
    assert is_mapping(types.MappingProxyType({})) and not is_mapping([("a", 1)])


def test_ref_part_shows_a_long_or_odd_name_quoted() -> None:
    assert ref_part("a" * 253) == "a" * 253
    assert ref_part("a" * 254) == repr("a" * 60)[:-1] + "...' (254 characters)"
    assert ref_part("web\n-A X") == repr("web\n-A X")


def test_loose_ref_names_whatever_the_metadata_holds() -> None:
    assert loose_ref({"metadata": {"namespace": "shop", "name": "web"}}) == "shop/web"
    assert loose_ref({"metadata": {"name": "web"}}) == "default/web"
    assert loose_ref({"metadata": {"namespace": "shop"}}) == "shop/None"
    assert loose_ref({"metadata": "x"}) == "default/None"
    assert loose_ref({"metadata": {"namespace": "a b", "name": "web"}}) == "'a b'/web"


def test_not_for_this_proxy_names_the_label_that_hands_the_object_to_someone_else() -> None:
    def labelled(labels: Any) -> Dict[str, Any]:
        return {"metadata": {"name": "web", "labels": labels}}

    assert not_for_this_proxy(labelled({HEADLESS: ""})) == HEADLESS
    assert not_for_this_proxy(labelled({SERVICE_PROXY_NAME: "other", "app": "web"})) == SERVICE_PROXY_NAME
    assert not_for_this_proxy(labelled({"app": "web"})) is None
    assert not_for_this_proxy(labelled("x")) is None  # left to validation
    assert not_for_this_proxy({"metadata": "x"}) is None
    assert not_for_this_proxy(types.MappingProxyType({"metadata": {"labels": {HEADLESS: ""}}})) == HEADLESS


# -- EndpointSlice details ----------------------------------------------------------------------------

def test_an_endpoints_topology_hints_are_kept_apart() -> None:
    got = parse_endpoint_slice(endpoint_slice(endpoints=[{
        "addresses": ["10.244.1.1", "10.244.1.2"],
        "hints": {"forZones": [{"name": "zone-a"}, {"name": "zone-b"}], "forNodes": [{"name": "node-a"}]}}]))
    assert got is not None
    assert [(e.zone_hints, e.node_hints) for e in got.endpoints] == [(("zone-a", "zone-b"), ("node-a",))] * 2
    got = parse_endpoint_slice(endpoint_slice(endpoints=[{"addresses": ["10.244.1.1"], "hints": {}}]))
    assert got is not None and (got.endpoints[0].zone_hints, got.endpoints[0].node_hints) == ((), ())


def test_an_endpoints_trigger_time_reaches_its_set() -> None:
    obj = endpoint_slice()
    obj["metadata"]["annotations"] = {TRIGGER_TIME: "2026-01-02T03:04:05Z"}
    got = parse_endpoint_slice(obj)
    assert got is not None and got.trigger_time == datetime.datetime(2026, 1, 2, 3, 4, 5,
                                                                      tzinfo=datetime.timezone.utc).timestamp()


def test_legacy_endpoints_are_never_terminating() -> None:
    eps = parse_endpoints(legacy([{"addresses": [{"ip": "10.0.0.1"}], "notReadyAddresses": [{"ip": "10.0.0.2"}],
                                   "ports": [{"port": 80}]}]))
    assert [(e.ready, e.serving, e.terminating) for e in eps.endpoints] == [(True, True, False), (False, False, False)]
    assert all(e.terminating is False for e in eps.endpoints)


def _general_calls(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Counts the endpoints that reach the general conversion (convert._slice_endpoint)."""
    calls: List[int] = []
    general = convert._slice_endpoint

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        general(*args, **kwargs)

    monkeypatch.setattr(convert, "_slice_endpoint", counted)
    return calls


def test_the_one_shot_load_takes_plain_ipv4_endpoints_by_the_shortcut_and_remembers_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cache=False (the API source's load) converts plain IPv4 endpoints without the per-endpoint
    function; a node name or zone is checked once by the general conversion, then taken as known."""
    calls = _general_calls(monkeypatch)
    node = "".join(["node-", "q"])  # built at run time: not interned already
    plain = [{"addresses": [f"10.244.3.{i}"], "nodeName": node, "zone": "zone-q"} for i in range(1, 4)]
    got = parse_endpoint_slice(endpoint_slice(endpoints=plain), cache=False)
    assert got is not None
    assert [(str(e.ip), e.node_name, e.zone) for e in got.endpoints] == [
        (f"10.244.3.{i}", "node-q", "zone-q") for i in range(1, 4)]
    assert len(calls) == 1  # the first, which taught the node and zone; the rest by the shortcut
    assert got.endpoints[0].node_name is sys.intern(node)
    assert convert._NAMES == {"nodeName": {"node-q": "node-q"}, "zone": {"zone-q": "zone-q"}}
    del calls[:]
    assert parse_endpoint_slice(endpoint_slice(endpoints=plain), cache=True) is not None
    assert len(calls) == 3  # the cached (file source's) conversion never takes the shortcut
    del calls[:]
    v6 = endpoint_slice(address_type="IPv6", endpoints=[{"addresses": ["fd00::1"]}])
    assert parse_endpoint_slice(v6, cache=False) is not None and len(calls) == 1


def test_the_name_cache_stops_growing_at_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert, "_NAMES_MAX", 2)
    endpoints = [{"addresses": [f"10.244.4.{i}"], "nodeName": f"node-{i}"} for i in range(1, 5)]
    got = parse_endpoint_slice(endpoint_slice(endpoints=endpoints))
    assert got is not None and [e.node_name for e in got.endpoints] == [f"node-{i}" for i in range(1, 5)]
    assert sorted(convert._NAMES["nodeName"]) == ["node-1", "node-2"]


@pytest.mark.parametrize("field", ["nodeName", "zone"])
def test_an_unhashable_node_name_or_zone_is_refused_not_a_crash(field: str) -> None:
    """The shortcut looks names up in its cache only when they are strings: a list is no key."""
    obj = endpoint_slice(endpoints=[{"addresses": ["10.244.1.1"], field: ["node-a"]}])
    with pytest.raises(ValidationError) as info:
        parse_endpoint_slice(obj, cache=False)
    assert info.value.field_path == f"endpoints[0].{field}"


@pytest.mark.parametrize("conditions", [
    {}, {"ready": False}, {"serving": False}, {"terminating": True}, {"serving": False, "terminating": True},
    {"ready": True, "serving": True, "terminating": False},
])
def test_the_shortcut_reads_the_apis_defaults_for_absent_conditions(conditions: Dict[str, bool],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An absent ready or serving is true, an absent terminating false (kube-proxy's reading of the
    API), by the shortcut as by the general conversion."""
    calls = _general_calls(monkeypatch)
    got = parse_endpoint_slice(endpoint_slice(endpoints=[{"addresses": ["10.244.1.7"], "conditions": conditions}]),
                               cache=False)
    assert got is not None and not calls  # the shortcut took it
    (e,) = got.endpoints
    assert (e.ready, e.serving, e.terminating) == (
        conditions.get("ready", True), conditions.get("serving", True), conditions.get("terminating", False))


def test_the_address_cache_is_used_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """cache=False (the API source: each address seen once) leaves the address cache alone, so it
    does not grow with pod churn; the default (the file source, re-reading every address at each
    change) fills it."""
    model.forget_parsed_addresses()
    v6 = endpoint_slice(address_type="IPv6", endpoints=[{"addresses": ["fd00::7", "fd00::8"]}])
    v4 = endpoint_slice(endpoints=[{"addresses": ["10.244.5.1", "10.244.5.2"]}])  # two addresses: not plain
    for obj in (v6, v4):
        assert parse_endpoint_slice(obj, cache=False) is not None
    assert model._parse_ip.cache_info().currsize == 0
    for obj in (v6, v4):
        assert parse_endpoint_slice(obj) is not None
    assert model._parse_ip.cache_info().currsize == 4
    model.forget_parsed_addresses()


# -- Node, ServiceCIDR, trigger time ------------------------------------------------------------------

def _node(**parts: Any) -> Dict[str, Any]:
    obj: Dict[str, Any] = {"kind": "Node", "metadata": {"name": "node-a", "labels": {ZONE_LABEL: "zone-a"}},
                           "spec": {"podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"]},
                           "status": {"addresses": [{"type": "Hostname", "address": "node-a"},
                                                    {"type": "ExternalIP", "address": "203.0.113.5"},
                                                    {"type": "InternalIP", "address": "192.168.1.10"},
                                                    {"type": "InternalIP", "address": "fd00::10"}]}}
    obj.update(parts)
    return obj


def test_a_node_gives_its_zone_pod_ranges_and_primary_addresses() -> None:
    assert parse_node(_node(), "node-a") == NodeInfo(
        name="node-a", zone="zone-a", pod_cidrs=(net("10.244.1.0/24"), net("fd00:244:1::/64")),
        ips=(ip("192.168.1.10"), ip("fd00::10")), eligible=True)
    single = parse_node(_node(spec={"podCIDR": "10.244.2.0/24"}, metadata={"name": "node-a"}), "node-a")
    assert (single.zone, single.pod_cidrs) == (None, (net("10.244.2.0/24"),))


@pytest.mark.parametrize("edit, text", [
    (lambda o: o["metadata"]["labels"].update({ZONE_LABEL: "a zone"}),
     f"Node node-a: field metadata.labels[{ZONE_LABEL}]: 'a zone' is not a valid zone label value"),
    (lambda o: o.update(spec={"podCIDRs": "10.244.1.0/24"}),
     "Node node-a: field spec.podCIDRs: '10.244.1.0/24' is not a list of CIDRs"),
    (lambda o: o.update(spec={"podCIDR": "nope"}), "Node node-a: field spec.podCIDR: 'nope' is not a CIDR"),
    (lambda o: o.update(status={"addresses": "x"}), "Node node-a: field status.addresses: 'x' is not a list"),
])
def test_a_node_refusal_says_which_field_and_why(edit: Callable[[Dict[str, Any]], Any], text: str) -> None:
    assert _refusal(lambda o: parse_node(o, "node-a"), _with(_node(), edit)) == text


@pytest.mark.parametrize("parts, eligible", [
    ({}, True),
    ({"metadata": {"name": "node-a", "deletionTimestamp": "2026-01-01T00:00:00Z"}}, False),
    ({"spec": {"taints": [{"key": "node.kubernetes.io/unschedulable"},
                          {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}, False),
    ({"spec": {"taints": [{"key": "node.kubernetes.io/unschedulable"}, "x"]}}, True),
    ({"spec": "x", "metadata": "x"}, True),
])
def test_a_node_being_deleted_is_not_eligible(parts: Dict[str, Any], eligible: bool) -> None:
    assert node_eligible(_node(**parts)) is eligible
    assert parse_node(_node(**parts), "node-a").eligible is eligible


def _service_cidr(**parts: Any) -> Dict[str, Any]:
    obj: Dict[str, Any] = {"kind": "ServiceCIDR", "metadata": {"name": "kubernetes"},
                           "spec": {"cidrs": ["10.96.0.0/16", "fd00:96::/112"]}}
    obj.update(parts)
    return obj


def test_a_service_cidr_gives_its_name_and_ranges() -> None:
    assert parse_service_cidr(_service_cidr()) == ("kubernetes", (net("10.96.0.0/16"), net("fd00:96::/112")))


@pytest.mark.parametrize("obj, text", [
    ({"metadata": {}}, "ServiceCIDR None: field metadata.name: must be a non-empty string"),
    ({"metadata": "x"}, "ServiceCIDR None: field metadata.name: must be a non-empty string"),
    ({"kind": "Other", "metadata": {"name": "A"}}, "Other A: field metadata.name: 'A' is not a DNS-1123 subdomain"),
    ({"metadata": {"name": "c1"}, "spec": "x"}, "ServiceCIDR c1: field spec: must be a mapping"),
    ({"metadata": {"name": "c1"}, "spec": {"cidrs": "10.96.0.0/16"}},
     "ServiceCIDR c1: field spec.cidrs: must be a list"),
    ({"metadata": {"name": "c1"}, "spec": {"cidrs": []}},
     "ServiceCIDR c1: field spec.cidrs: must list one CIDR (or one per family)"),
    ({"metadata": {"name": "c1"}, "spec": {"cidrs": ["10.96.0.0/16", "10.97.0.0/16"]}},
     "ServiceCIDR c1: field spec.cidrs: may hold at most one IPv4 and one IPv6 CIDR"),
])
def test_a_service_cidr_refusal_says_which_field_and_why(obj: Dict[str, Any], text: str) -> None:
    assert _refusal(parse_service_cidr, obj) == text


def _annotated(notes: Any) -> Dict[str, Any]:
    return {"metadata": {"name": "web", "annotations": notes}}


def _utc(*fields: int) -> float:
    return datetime.datetime(*fields, tzinfo=datetime.timezone.utc).timestamp()  # type: ignore[misc]


@pytest.mark.parametrize("stamp, seconds", [
    ("2026-01-02T03:04:05Z", _utc(2026, 1, 2, 3, 4, 5)),
    ("2026-01-02T03:04:05+02:00", _utc(2026, 1, 2, 1, 4, 5)),
    ("2026-01-02T03:04:05", _utc(2026, 1, 2, 3, 4, 5)),  # no zone: UTC, whatever the node's own
    ("yesterday", None),
    (1767323045, None),
])
def test_the_trigger_time_is_read_as_utc_and_a_bad_one_ignored(stamp: Any, seconds: Any) -> None:
    zone = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"  # a node whose local time is not UTC
    time.tzset()
    try:
        assert trigger_time(_annotated({TRIGGER_TIME: stamp})) == seconds
    finally:
        if zone is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = zone
        time.tzset()


@pytest.mark.parametrize("obj", [_annotated(None), _annotated("x"), _annotated(["x"]), _annotated({}),
                                 {"metadata": "x"}, {}])
def test_no_trigger_time_where_there_is_no_annotation(obj: Dict[str, Any]) -> None:
    assert trigger_time(obj) is None

