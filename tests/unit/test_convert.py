"""Kubernetes objects → model objects: Services, EndpointSlices and legacy Endpoints."""

from __future__ import annotations

import copy
import ipaddress
import sys
from typing import Any, Dict, List, Optional

import pytest

from netproxy.core.model import ServicePortName, ValidationError
from netproxy.source.convert import (
    EndpointSet,
    SlicePort,
    object_ref,
    parse_endpoint_slice,
    parse_endpoints,
    parse_service,
)

ip = ipaddress.ip_address


def service(name: str = "web", namespace: Optional[str] = "shop", **spec: Any) -> Dict[str, Any]:
    meta: Dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    body: Dict[str, Any] = {"clusterIP": "10.96.0.10",
                            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def endpoint_slice(name: str = "web-abc12", service_name: str = "web", namespace: str = "shop",
                   address_type: str = "IPv4", endpoints: Optional[List[Dict[str, Any]]] = None,
                   ports: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": address_type,
        "ports": ports if ports is not None else [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints if endpoints is not None else [{"addresses": ["10.244.1.1"]}],
    }


def rejected(fn: Any, obj: Dict[str, Any]) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        fn(obj)
    return info.value


# -- object_ref --------------------------------------------------------------------------------------

def test_object_ref_defaults_namespace() -> None:
    assert object_ref(service(namespace=None)) == ("Service", "default", "web")


def test_object_ref_allows_subdomain_names_only_for_slices() -> None:
    assert object_ref(endpoint_slice(name="web.x-1"))[2] == "web.x-1"
    err = rejected(parse_service, service(name="web.x"))
    assert (err.kind, err.ref, err.field_path) == ("Service", "shop/web.x", "metadata.name")


@pytest.mark.parametrize("bad", ['web"', "web\n", "web -j ACCEPT", "web;x", "web}", "x" * 64, "Web"])
def test_bad_names_rejected_with_object_and_field(bad: str) -> None:
    err = rejected(parse_service, service(name=bad))
    assert err.kind == "Service" and err.field_path == "metadata.name"
    # A name that could forge a log line (newline, quote, space) is shown quoted, as Python's repr.
    assert err.ref == (f"shop/{bad}" if bad.isalnum() else f"shop/{bad!r}")
    err = rejected(parse_service, service(namespace=bad))
    assert err.field_path == "metadata.namespace"


def test_missing_metadata_name_rejected() -> None:
    obj = service()
    del obj["metadata"]["name"]
    assert rejected(parse_service, obj).field_path == "metadata.name"
    obj["metadata"] = "nope"
    assert rejected(parse_service, obj).field_path == "metadata"


# -- Service -----------------------------------------------------------------------------------------

def test_multi_port_service() -> None:
    ports = parse_service(service(ports=[
        {"name": "http", "port": 80, "targetPort": "http"},
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
        {"name": "sig", "port": 3868, "protocol": "SCTP", "targetPort": "3868"},
    ]))
    assert [p.name for p in ports] == [ServicePortName("shop", "web", n) for n in ("http", "dns", "sig")]
    assert [(p.protocol, p.port, p.target_port) for p in ports] == [
        ("TCP", 80, "http"), ("UDP", 53, 5353), ("SCTP", 3868, 3868)]
    assert all(p.cluster_ips == (ip("10.96.0.10"),) for p in ports)


def test_single_unnamed_port_defaults() -> None:
    (p,) = parse_service(service(ports=[{"port": 80}]))
    assert p.name == ServicePortName("shop", "web", "")
    assert (p.protocol, p.target_port, p.node_port, p.service_type) == ("TCP", 80, 0, "ClusterIP")
    assert (p.affinity, p.affinity_timeout) == ("None", 10800)
    assert (p.external_traffic_policy, p.internal_traffic_policy) == ("Cluster", "Cluster")


def test_node_port_external_ips_lb_ingress_source_ranges() -> None:
    obj = service(type="LoadBalancer", externalIPs=["203.0.113.10", "2001:db8::10"],
                  loadBalancerSourceRanges=["192.0.2.0/24", "198.51.100.7/32"],
                  externalTrafficPolicy="Local", internalTrafficPolicy="Local", healthCheckNodePort=32000,
                  ports=[{"name": "https", "port": 443, "targetPort": 8443, "nodePort": 30443}])
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}, {"hostname": "lb.example.com"}]}}
    (p,) = parse_service(obj)
    assert p.service_type == "LoadBalancer" and p.node_port == 30443
    assert p.external_ips == (ip("203.0.113.10"), ip("2001:db8::10"))
    assert p.load_balancer_ips == (ip("198.51.100.20"),)  # a hostname-only ingress has no IP to route
    assert p.source_ranges == (ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("198.51.100.7/32"))
    assert (p.external_traffic_policy, p.internal_traffic_policy) == ("Local", "Local")
    assert p.health_check_node_port == 32000


def test_dual_stack_cluster_ips() -> None:
    (p,) = parse_service(service(clusterIP="10.96.0.10", clusterIPs=["10.96.0.10", "fd00:10:96::10"],
                                 ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="PreferDualStack"))
    assert p.cluster_ips == (ip("10.96.0.10"), ip("fd00:10:96::10"))


def test_cluster_ip_alone_is_used_without_cluster_ips() -> None:
    obj = service(clusterIP="fd00::10")
    (p,) = parse_service(obj)
    assert p.cluster_ips == (ip("fd00::10"),)


@pytest.mark.parametrize("spec", [{"clusterIP": "None"}, {"clusterIP": "None", "clusterIPs": ["None"]},
                                  {"clusterIP": ""}, {"clusterIP": None}])
def test_headless_or_unallocated_service_has_no_ports(spec: Dict[str, Any]) -> None:
    obj = service(**spec)
    if spec.get("clusterIP") is None:
        del obj["spec"]["clusterIP"]
    assert parse_service(obj) == ()


def test_external_name_service_skipped_even_with_odd_fields() -> None:
    assert parse_service(service(type="ExternalName", externalName="db.example.com", clusterIP="")) == ()


def test_affinity_with_timeout() -> None:
    (p,) = parse_service(service(sessionAffinity="ClientIP",
                                 sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}))
    assert p.client_ip_affinity and p.affinity_timeout == 60


def test_affinity_timeout_defaults_to_10800() -> None:
    (p,) = parse_service(service(sessionAffinity="ClientIP"))
    assert p.affinity_timeout == 10800
    (p,) = parse_service(service(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {}}))
    assert p.affinity_timeout == 10800


@pytest.mark.parametrize("timeout, ok", [(1, True), (86400, True), (0, False), (86401, False), (-5, False),
                                         ("60", False), (True, False), (1.5, False)])
def test_affinity_timeout_range(timeout: object, ok: bool) -> None:
    obj = service(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": timeout}})
    if ok:
        assert parse_service(obj)[0].affinity_timeout == timeout
    else:
        err = rejected(parse_service, obj)
        assert err.field_path == "spec.sessionAffinityConfig.clientIP.timeoutSeconds"


@pytest.mark.parametrize("field, value", [
    ("sessionAffinity", "Cookie"), ("externalTrafficPolicy", "local"), ("internalTrafficPolicy", "Node"),
    ("type", "Ingress"),
])
def test_bad_choices_rejected(field: str, value: str) -> None:
    err = rejected(parse_service, service(**{field: value}))
    assert err.field_path == f"spec.{field}"
    assert repr(value) in str(err)


@pytest.mark.parametrize("ports, field", [
    ([{"name": "http", "port": 0}], "spec.ports[0].port"),
    ([{"name": "http", "port": 65536}], "spec.ports[0].port"),
    ([{"name": "http", "port": "80"}], "spec.ports[0].port"),
    ([{"name": "http", "port": 80, "protocol": "ICMP"}], "spec.ports[0].protocol"),
    ([{"name": "http", "port": 80, "nodePort": 70000}], "spec.ports[0].nodePort"),
    ([{"name": "http", "port": 80, "targetPort": 0}], "spec.ports[0].targetPort"),
    ([{"name": "http", "port": 80, "targetPort": "x" * 16}], "spec.ports[0].targetPort"),
    ([{"name": "http", "port": 80, "targetPort": "web -j ACCEPT"}], "spec.ports[0].targetPort"),
    ([{"name": "http", "port": 80, "targetPort": "\u00b2"}], "spec.ports[0].targetPort"),  # "²".isdigit()
    ([{"name": "Http", "port": 80}], "spec.ports[0].name"),
    ([{"name": 'h"', "port": 80}], "spec.ports[0].name"),
    ([{"name": "a", "port": 80}, {"port": 81}], "spec.ports[1].name"),
    ([{"name": "a", "port": 80}, {"name": "a", "port": 81}], "spec.ports[1].name"),
    ("80", "spec.ports"),
    ([80], "spec.ports[0]"),
])
def test_bad_ports_rejected_naming_the_field(ports: Any, field: str) -> None:
    err = rejected(parse_service, service(ports=ports))
    assert (err.kind, err.ref, err.field_path) == ("Service", "shop/web", field)
    assert f"Service shop/web: field {field}:" in str(err)


@pytest.mark.parametrize("spec, field", [
    ({"clusterIP": "10.96.0.300"}, "spec.clusterIP"),
    ({"clusterIPs": ["10.96.0.1", "nope"]}, "spec.clusterIPs[1]"),
    ({"clusterIPs": "10.96.0.1"}, "spec.clusterIPs"),
    ({"externalIPs": ["203.0.113.1 -j ACCEPT"]}, "spec.externalIPs[0]"),
    ({"externalIPs": "203.0.113.1"}, "spec.externalIPs"),
    ({"loadBalancerSourceRanges": ["10.0.0.0/40"]}, "spec.loadBalancerSourceRanges[0]"),
    ({"healthCheckNodePort": 99999}, "spec.healthCheckNodePort"),
    ({"sessionAffinityConfig": {"clientIP": "x"}}, "spec.sessionAffinityConfig.clientIP"),
])
def test_bad_addresses_rejected_naming_the_field(spec: Dict[str, Any], field: str) -> None:
    assert rejected(parse_service, service(**spec)).field_path == field


def test_bad_lb_ingress_ip_rejected() -> None:
    obj = service()
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}, {"ip": "1.2.3.4\n-A X"}]}}
    assert rejected(parse_service, obj).field_path == "status.loadBalancer.ingress[1].ip"


def test_spec_not_a_mapping_rejected() -> None:
    obj = service()
    obj["spec"] = ["x"]
    assert rejected(parse_service, obj).field_path == "spec"


def test_parse_service_does_not_modify_its_input() -> None:
    obj = service(ports=[{"name": "a", "port": 80}, {"name": "b", "port": 81}])
    before = copy.deepcopy(obj)
    parse_service(obj)
    assert obj == before


# -- EndpointSlice -----------------------------------------------------------------------------------

def test_slice_condition_defaults() -> None:
    eps = parse_endpoint_slice(endpoint_slice(endpoints=[
        {"addresses": ["10.244.1.1"]},                                            # nil ready → ready
        {"addresses": ["10.244.1.2"], "conditions": {"ready": False}},            # nil serving → serving
        {"addresses": ["10.244.1.3"], "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": ["10.244.1.4"], "conditions": {"ready": False, "terminating": True}},  # still the fallback
        {"addresses": ["10.244.1.5"], "conditions": {"ready": False, "serving": False, "terminating": True}},
    ]))
    assert eps is not None
    got = [(str(e.ip), e.ready, e.serving, e.terminating) for e in eps.endpoints]
    assert got == [("10.244.1.1", True, True, False), ("10.244.1.2", False, True, False),
                   ("10.244.1.3", False, True, True), ("10.244.1.4", False, True, True),
                   ("10.244.1.5", False, False, True)]


def test_slice_node_name_zone_and_service_label() -> None:
    eps = parse_endpoint_slice(endpoint_slice(endpoints=[
        {"addresses": ["10.244.1.1", "10.244.1.9"], "nodeName": "node-a.example", "zone": "eu-west-1b"}]))
    assert eps is not None
    assert (eps.namespace, eps.service) == ("shop", "web")
    assert [(str(e.ip), e.node_name, e.zone) for e in eps.endpoints] == [
        ("10.244.1.1", "node-a.example", "eu-west-1b"), ("10.244.1.9", "node-a.example", "eu-west-1b")]
    assert eps.ports == (SlicePort("http", "TCP", 8080),)


def test_for_port_matches_name_and_protocol_and_sets_the_port() -> None:
    eps = parse_endpoint_slice(endpoint_slice(ports=[
        {"name": "dns", "port": 5353, "protocol": "UDP"}, {"name": "dns-tcp", "port": 5354, "protocol": "TCP"}]))
    assert eps is not None
    assert [(str(e.ip), e.port) for e in eps.for_port("dns", "UDP")] == [("10.244.1.1", 5353)]
    assert [e.port for e in eps.for_port("dns-tcp", "TCP")] == [5354]
    assert eps.for_port("dns", "TCP") == ()
    assert eps.for_port("http", "TCP") == ()


def test_ipv6_slice() -> None:
    eps = parse_endpoint_slice(endpoint_slice(address_type="IPv6", endpoints=[{"addresses": ["fd00::1"]}]))
    assert eps is not None and eps.endpoints[0].ip == ip("fd00::1")


def test_address_type_filtering() -> None:
    v6 = endpoint_slice(address_type="IPv6", endpoints=[{"addresses": ["fd00::1"]}])
    assert parse_endpoint_slice(v6, families=("IPv4",)) is None
    assert parse_endpoint_slice(endpoint_slice(), families=("IPv6",)) is None
    assert parse_endpoint_slice(endpoint_slice(), families=("IPv4",)) is not None


def test_fqdn_slice_is_skipped() -> None:
    fqdn = endpoint_slice(address_type="FQDN", endpoints=[{"addresses": ["db.example.com"]}])
    assert parse_endpoint_slice(fqdn) is None


@pytest.mark.parametrize("mutate, field", [
    (lambda o: o.update(addressType="IPv5"), "addressType"),
    (lambda o: o["metadata"].pop("labels"), "metadata.labels[kubernetes.io/service-name]"),
    (lambda o: o["metadata"]["labels"].update({"kubernetes.io/service-name": "web x"}),
     "metadata.labels[kubernetes.io/service-name]"),
    (lambda o: o["endpoints"][0].update(addresses=["fd00::1"]), "endpoints[0].addresses[0]"),
    (lambda o: o["endpoints"][0].update(addresses=["10.244.1.1", "10.244.1.1;"]), "endpoints[0].addresses[1]"),
    (lambda o: o["endpoints"][0].update(conditions={"ready": "yes"}), "endpoints[0].conditions.ready"),
    (lambda o: o["endpoints"][0].update(nodeName="node a"), "endpoints[0].nodeName"),
    (lambda o: o["endpoints"][0].update(nodeName="node-a\n"), "endpoints[0].nodeName"),
    (lambda o: o["endpoints"][0].update(zone='z"1'), "endpoints[0].zone"),
    (lambda o: o["ports"][0].update(port=0), "ports[0].port"),
    (lambda o: o["ports"][0].update(protocol="tcp"), "ports[0].protocol"),
    (lambda o: o["ports"][0].update(name="HTTP"), "ports[0].name"),
    (lambda o: o.update(endpoints={"addresses": []}), "endpoints"),
], ids=lambda v: v.replace("kubernetes.io/", "") if isinstance(v, str) else "mutated")
def test_bad_slices_rejected_naming_the_field(mutate: Any, field: str) -> None:
    obj = endpoint_slice()
    mutate(obj)
    err = rejected(parse_endpoint_slice, obj)
    assert (err.kind, err.ref, err.field_path) == ("EndpointSlice", "shop/web-abc12", field)


# -- legacy Endpoints --------------------------------------------------------------------------------

def legacy(subsets: List[Dict[str, Any]], name: str = "web") -> Dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": name, "namespace": "shop"},
            "subsets": subsets}


def test_legacy_endpoints_with_not_ready_addresses() -> None:
    eps = parse_endpoints(legacy([{
        "addresses": [{"ip": "10.244.1.1", "nodeName": "node-a"}, {"ip": "10.244.1.2"}],
        "notReadyAddresses": [{"ip": "10.244.1.3"}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }]))
    assert isinstance(eps, EndpointSet)
    assert (eps.namespace, eps.service) == ("shop", "web")
    assert [(str(e.ip), e.ready, e.serving, e.node_name) for e in eps.endpoints] == [
        ("10.244.1.1", True, True, "node-a"), ("10.244.1.2", True, True, None),
        ("10.244.1.3", False, False, None)]
    assert [e.port for e in eps.for_port("http", "TCP")] == [8080, 8080, 8080]


def test_legacy_endpoints_subsets_with_same_ports_are_merged() -> None:
    ports = [{"port": 80}]
    eps = parse_endpoints(legacy([{"addresses": [{"ip": "10.0.0.1"}], "ports": ports},
                                  {"addresses": [{"ip": "10.0.0.2"}], "ports": ports}]))
    assert [str(e.ip) for e in eps.for_port("", "TCP")] == ["10.0.0.1", "10.0.0.2"]


def test_legacy_endpoints_empty() -> None:
    eps = parse_endpoints(legacy([]))
    assert eps.endpoints == () and eps.ports == ()


@pytest.mark.parametrize("subsets, field", [
    ([{"addresses": [{"ip": "10.0.0.300"}], "ports": [{"port": 80}]}], "subsets[0].addresses[0].ip"),
    ([{"notReadyAddresses": [{"ip": "x"}], "ports": [{"port": 80}]}], "subsets[0].notReadyAddresses[0].ip"),
    ([{"addresses": [{"ip": "10.0.0.1", "nodeName": "a b"}]}], "subsets[0].addresses[0].nodeName"),
    ([{"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 80}]},
      {"addresses": [{"ip": "10.0.0.2"}], "ports": [{"port": 81}]}], "subsets"),
    ([{"ports": [{"port": -1}]}], "subsets[0].ports[0].port"),
])
def test_bad_legacy_endpoints_rejected(subsets: List[Dict[str, Any]], field: str) -> None:
    err = rejected(parse_endpoints, legacy(subsets))
    assert (err.kind, err.ref, err.field_path) == ("Endpoints", "shop/web", field)


# -- anything a source may hold: a result or a ValidationError, never another exception ---------------

ODD_VALUES = [None, 0, -1, True, "", "x", "\u00b2", "None", [], {}, [1], [None], {"a": 1}, 1.5, "10.0.0.1"]


def _paths(obj: Any, prefix: tuple = ()) -> List[tuple]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.extend(_paths(v, prefix + (i,)))
    return out


def _with(obj: Dict[str, Any], path: tuple, value: Any) -> Dict[str, Any]:
    out = copy.deepcopy(obj)
    node: Any = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _full_service() -> Dict[str, Any]:
    obj = service(type="LoadBalancer", clusterIPs=["10.96.0.10"], externalIPs=["203.0.113.1"],
                  loadBalancerSourceRanges=["10.0.0.0/8"], sessionAffinity="ClientIP",
                  sessionAffinityConfig={"clientIP": {"timeoutSeconds": 5}}, externalTrafficPolicy="Local",
                  healthCheckNodePort=30000,
                  ports=[{"name": "a", "port": 80, "targetPort": "web", "nodePort": 30080, "protocol": "TCP"}])
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}
    return obj


@pytest.mark.parametrize("fn, obj", [
    (parse_service, _full_service()),
    (parse_endpoint_slice, endpoint_slice(endpoints=[
        {"addresses": ["10.244.1.1"], "conditions": {"ready": True, "serving": True, "terminating": False},
         "nodeName": "n", "zone": "z", "hints": {"forZones": [{"name": "z"}]}}])),
    (parse_endpoints, legacy([{"addresses": [{"ip": "10.0.0.1", "nodeName": "n"}],
                               "notReadyAddresses": [{"ip": "10.0.0.2"}], "ports": [{"name": "a", "port": 80}]}])),
], ids=["Service", "EndpointSlice", "Endpoints"])
def test_odd_values_anywhere_give_a_result_or_a_validation_error(fn: Any, obj: Dict[str, Any]) -> None:
    fn(obj)  # the unmodified object is valid
    for path in _paths(obj):
        for value in ODD_VALUES:
            try:
                fn(_with(obj, path, value))
            except ValidationError:
                pass
            except Exception as err:  # pragma: no cover - the assertion below reports it
                pytest.fail(f"{'.'.join(map(str, path))} = {value!r}: {type(err).__name__}: {err}")


# -- the IPv4 endpoints' shortcut -----------------------------------------------------------------

def _converted(obj: Dict[str, Any], cache: bool) -> Any:
    """The slice's endpoints with their field types (True == 1, so types are compared too), or the
    refusal's field and message."""
    try:
        eps = parse_endpoint_slice(copy.deepcopy(obj), cache=cache)
    except ValidationError as err:
        return ("refused", err.field_path, err.message)
    assert eps is not None
    return [(e, [type(v) for v in e]) for e in eps.endpoints]


_ENDPOINT_VARIANTS: List[Any] = [
    {"addresses": ["10.244.1.1"]},
    {"addresses": ["10.244.1.2"], "conditions": {"ready": False, "serving": True, "terminating": True}},
    {"addresses": ["10.244.1.3"], "conditions": {"ready": None}},
    {"addresses": ["10.244.1.4"], "conditions": {"ready": 1}},
    {"addresses": ["10.244.1.5"], "conditions": "ready"},
    {"addresses": ["10.244.1.6"], "conditions": None, "nodeName": "node-a", "zone": "zone-1"},
    {"addresses": ["10.244.1.7"], "nodeName": "Node_A"},
    {"addresses": ["10.244.1.8"], "zone": "a zone"},
    {"addresses": ["10.244.1.9"], "nodeName": 7},
    {"addresses": ["10.244.1.10", "10.244.1.11"]},
    {"addresses": []},
    {"addresses": "10.244.1.12"},
    {"addresses": ["10.244.01.13"]},
    {"addresses": ["10.244.1.256"]},
    {"addresses": ["fd00::1"]},
    {"addresses": ["10.244.1.14\x00"]},
    {"addresses": [1234]},
    {"addresses": ["10.244.1.15"], "hints": {"forZones": [{"name": "zone-1"}]}},
    {"addresses": ["10.244.1.16"], "hints": None},
    {"addresses": ["10.244.1.17"], "nodeName": None, "zone": None},
    "an endpoint",
]


def test_ipv4_shortcut_agrees_with_the_general_conversion() -> None:
    """The one-shot load's shortcut for plain IPv4 endpoints (cache=False) against the general
    path (cache=True never takes it): the same endpoints, field types and refusals for slices
    mixing every variant, valid or not, in random orders and positions."""
    import random

    from netproxy.source import convert

    rng = random.Random(31)
    taken = 0
    for _ in range(400):
        picked = [rng.choice(_ENDPOINT_VARIANTS) for _ in range(rng.randint(1, 6))]
        obj = endpoint_slice(endpoints=picked)
        assert _converted(obj, cache=False) == _converted(obj, cache=True), picked
        out: List[Any] = []
        taken += convert._plain_v4_endpoints(copy.deepcopy(picked), 8080, out)
    assert taken > 50  # the shortcut did take endpoints, so the comparison above compared it


def test_ipv4_shortcut_takes_a_plain_slice_whole_and_stops_at_the_first_odd_endpoint() -> None:
    from netproxy.source import convert

    plain = [{"addresses": [f"10.244.2.{i}"], "conditions": {"ready": True}, "nodeName": "node-a"}
             for i in range(1, 6)]
    parse_endpoint_slice(endpoint_slice(endpoints=plain[:1]), cache=True)  # node-a checked once, remembered
    out: List[Any] = []
    assert convert._plain_v4_endpoints(plain, 8080, out) == 5
    assert [str(e) for e in out] == [f"10.244.2.{i}:8080" for i in range(1, 6)]
    odd = plain[:2] + [{"addresses": ["10.244.2.9"], "conditions": {"ready": "yes"}}] + plain[2:]
    assert convert._plain_v4_endpoints(odd, 8080, []) == 2
    assert convert._plain_v4_endpoints(odd, 8080, [], 3) == 6  # and takes up again after the odd one
    two = plain[:2] + [{"addresses": ["10.244.2.9", "10.244.2.8"]}] + plain[2:]  # valid, not plain
    got = parse_endpoint_slice(endpoint_slice(endpoints=two), cache=False)
    assert got is not None and [str(e) for e in got.endpoints] == [
        f"10.244.2.{i}:8080" for i in (1, 2, 9, 8, 3, 4, 5)]
    assert rejected(lambda o: parse_endpoint_slice(o, cache=False), endpoint_slice(endpoints=odd)).field_path == \
        "endpoints[2].conditions.ready"


# ---- pinned by mutation testing (scripts/mutation, docs/testing.md) ------------------------------


@pytest.mark.parametrize("extra", [
    {}, {"conditions": {}}, {"conditions": {"ready": False}}, {"conditions": {"serving": False, "terminating": True}},
    {"conditions": {"ready": True, "serving": True, "terminating": False}}, {"nodeName": "node-a"},
    {"zone": "zone-a"}, {"nodeName": "node-b", "zone": "zone-b", "conditions": {"ready": False, "terminating": True}},
])
def test_the_ipv4_shortcut_converts_an_endpoint_as_the_general_path(extra: Dict[str, Any]) -> None:
    """The shortcut (_plain_v4_endpoints) takes a plain endpoint; an empty ``hints`` sends the same
    endpoint through the general conversion. Both give the API's defaults and the node and zone."""
    endpoint = {"addresses": ["10.244.1.7"], **extra}
    # cache=False: the one-shot load, the only caller the shortcut serves (cache=True never takes it).
    fast = parse_endpoint_slice(endpoint_slice(endpoints=[endpoint]), cache=False).endpoints
    general = parse_endpoint_slice(endpoint_slice(endpoints=[{**endpoint, "hints": {}}]), cache=False).endpoints
    assert fast == general
    (e,) = fast
    cond = extra.get("conditions", {})
    assert (e.ip, e.port) == (ip("10.244.1.7"), 8080)
    assert (e.ready, e.serving, e.terminating) == (
        cond.get("ready", True), cond.get("serving", True), cond.get("terminating", False))
    assert (e.node_name, e.zone) == (extra.get("nodeName"), extra.get("zone"))


def test_a_hostname_only_ingress_is_skipped_not_the_end_of_the_list() -> None:
    obj = service(type="LoadBalancer")
    obj["status"] = {"loadBalancer": {"ingress": [{"hostname": "lb.example"}, {"ip": "198.51.100.7"},
                                                  {"ip": "198.51.100.8", "ipMode": "Proxy"}]}}
    (p,) = parse_service(obj)
    assert p.load_balancer_ips == (ip("198.51.100.7"),) and p.proxy_load_balancer_ips == (ip("198.51.100.8"),)


def test_absent_optional_fields_take_their_defaults() -> None:
    (p,) = parse_service(service())
    assert (p.health_check_node_port, p.traffic_distribution, p.load_balancer_ips) == (0, "", ())
    (q,) = parse_service(service(trafficDistribution="PreferClose", healthCheckNodePort=30999))
    assert (q.health_check_node_port, q.traffic_distribution) == (30999, "PreferClose")


def test_repeated_strings_of_the_model_are_one_object_each() -> None:
    """Namespaces, protocols, port names and the choice fields come out as one shared string each,
    not as the decoded document's copies: the model keeps them per service port (memory at 100k)."""
    import json

    doc = json.loads(json.dumps([service("a", type="ClusterIP"), service("b", type="ClusterIP"),
                                 endpoint_slice("a-1", "a"), endpoint_slice("b-1", "b")]))
    assert doc[0]["metadata"]["namespace"] is not doc[1]["metadata"]["namespace"]  # the decoder's copies
    (a,), (b,) = parse_service(doc[0]), parse_service(doc[1])
    for field in ("protocol", "service_type", "affinity", "external_traffic_policy"):
        assert getattr(a, field) is getattr(b, field), field
    assert a.name.namespace is b.name.namespace and a.name.port is b.name.port
    sa, sb = parse_endpoint_slice(doc[2]), parse_endpoint_slice(doc[3])
    assert sa is not None and sb is not None
    assert sa.namespace is sb.namespace is a.name.namespace
    assert sa.ports[0].name is sb.ports[0].name and sa.ports[0].protocol is sb.ports[0].protocol


# -- the Services' shortcut ---------------------------------------------------------------------------

_ABSENT = object()
"""A field left out of the object (as against one present with a null)."""

# Per field of a Service: values the shortcut may take (absent, or what the general path accepts at
# once), then values it must leave to the general path (valid but not plain, or invalid).
_SPEC_VARIANTS: Dict[str, Any] = {
    "type": ([_ABSENT, None, "", "ClusterIP", "NodePort", "LoadBalancer"],
             ["ExternalName", "clusterip", 1, ["ClusterIP"], {}]),
    "clusterIP": ([_ABSENT, "10.96.0.10", "fd00::10"],
                  [None, "", "None", "10.96.0.010", "10.96.0.256", "fe80::1%eth0", 5, "10.96.0.10\x00"]),
    "clusterIPs": ([_ABSENT, None, [], ["10.96.0.11"], ["10.96.0.11", "fd00::11"]],
                   [["None"], ["10.96.0.11", "x"], "10.96.0.11", [None], ["10.96.0.11"] * 3, [""], {}]),
    "externalIPs": ([_ABSENT, None, []], [["203.0.113.1"], "203.0.113.1", [5], {}]),
    "loadBalancerSourceRanges": ([_ABSENT, None, []], [["10.0.0.0/8"], ["bad"], {}, ""]),
    "sessionAffinity": ([_ABSENT, None, "", "None", "ClientIP"], ["clientip", 0, False, ["None"]]),
    "sessionAffinityConfig": (
        [_ABSENT, None, {}, {"clientIP": None}, {"clientIP": {}}, {"clientIP": {"timeoutSeconds": 600}},
         {"clientIP": {"timeoutSeconds": 86400}}, {"clientIP": {"timeoutSeconds": 1}}],
        [{"clientIP": {"timeoutSeconds": 0}}, {"clientIP": {"timeoutSeconds": True}}, "x", [], "",
         {"clientIP": {"timeoutSeconds": 86401}}, {"clientIP": {"timeoutSeconds": None}}, {"clientIP": "x"},
         {"clientIP": {"timeoutSeconds": 1.0}}, {"clientIP": {"timeoutSeconds": "600"}}]),
    "externalTrafficPolicy": ([_ABSENT, None, "", "Cluster", "Local"], ["local", 1, [], False]),
    "internalTrafficPolicy": ([_ABSENT, None, "", "Cluster", "Local"], ["local", 1, [], False]),
    "trafficDistribution": ([_ABSENT, None, "", "PreferClose", "PreferSameZone", "PreferSameNode"],
                            ["Other", 0, False, [], "preferclose"]),
    "healthCheckNodePort": ([_ABSENT, None, 0, 32000, 65535], [65536, -1, True, False, "32000", 1.0, 0.0]),
}
_STATUS_VARIANTS = ([_ABSENT, None, {}, {"loadBalancer": None}, {"loadBalancer": {}},
                     {"loadBalancer": {"ingress": None}}, {"loadBalancer": {"ingress": []}}],
                    [{"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}, "x", [],
                     {"loadBalancer": {"ingress": [{"hostname": "lb.example"}]}}, {"loadBalancer": "x"},
                     {"loadBalancer": {"ingress": "x"}}, {"loadBalancer": {"ingress": [{"ip": "x"}]}}])
_PORT_VARIANTS: Dict[str, Any] = {
    "name": ([_ABSENT, None, "", "http", "dns", "a"], [0, "Http", "a" * 64, "x y", 5, "web\n", []]),
    "port": ([80, 53, 1, 65535], [_ABSENT, 0, 65536, True, "80", None, 1.0]),
    "targetPort": ([_ABSENT, 8080, "http", "web", "a" * 15], [None, "8080", "08080", "123456", "\u00b2", "",
                                                             "a" * 16, True, 0, 65536, "Web", 8080.0]),
    "nodePort": ([_ABSENT, None, 0, 30080], [65536, -1, True, "30080", False, 1.5]),
    "protocol": ([_ABSENT, None, "TCP", "UDP", "SCTP"], ["tcp", "", 6, ["TCP"]]),
}


def _random_service(rng: Any) -> Dict[str, Any]:
    # How often a field takes an odd value, per Service; "one": a single field (or port field), so
    # that each odd value is also met in an otherwise plain Service.
    odds = rng.choice((0.0, "one", "one", 0.05, 0.2))
    fields = [*_SPEC_VARIANTS, *_PORT_VARIANTS, "status"]
    odd_one = rng.choice(fields) if odds == "one" else None

    def pick(variants: Any, field: str = "") -> Any:
        plain, odd = variants
        return rng.choice(odd if field == odd_one or (odds != "one" and rng.random() < odds) else plain)

    spec = {field: pick(variants, field) for field, variants in _SPEC_VARIANTS.items()}
    ports: Any = [{k: pick(v, k) for k, v in _PORT_VARIANTS.items()} for _ in range(rng.choice((1, 1, 1, 2, 3)))]
    if rng.random() < 0.1:
        ports = rng.choice([_ABSENT, None, [], "x", {}, ["x"], [None]])
    spec["ports"] = ports
    obj: Dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "shop", "name": "web"},
                           "spec": spec, "status": pick(_STATUS_VARIANTS, "status")}
    if rng.random() < 0.05:
        obj["spec"] = rng.choice([None, "x", [], {}])

    def drop_absent(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: drop_absent(v) for k, v in value.items() if v is not _ABSENT}
        if isinstance(value, list):
            return [drop_absent(v) for v in value]
        return value

    return drop_absent(obj)  # type: ignore[no-any-return]


def _service_answer(fn: Any, obj: Dict[str, Any]) -> Any:
    """The service ports with every field's type (True == 1, so types are compared too), or the
    refusal's field and message."""
    import dataclasses

    try:
        ports = fn(copy.deepcopy(obj))
    except ValidationError as err:
        return ("refused", err.field_path, err.message)
    return [(p, [type(getattr(p, f.name)) for f in dataclasses.fields(p)]) for p in ports]


def test_service_shortcut_agrees_with_the_general_conversion() -> None:
    """The shortcut for plain Services (_plain_service) against the general path (_service_ports):
    for random Services mixing plain values with valid-but-not-plain and invalid ones in every
    field, whatever the shortcut takes, the general path converts to the same service ports and
    field types; and parse_service (shortcut first) answers as the general path alone, refusals
    included."""
    import random

    from netproxy.source import convert

    def general(obj: Dict[str, Any]) -> Any:
        return convert._guard("Service", "shop/web", lambda: convert._service_ports("shop", "web", obj))

    rng = random.Random(40)
    taken = refused = 0
    for _ in range(4000):
        obj = _random_service(rng)
        expected = _service_answer(general, obj)
        assert _service_answer(parse_service, obj) == expected, obj
        fast = convert._plain_service("shop", "web", copy.deepcopy(obj))
        if fast is not None:
            taken += 1
            assert _service_answer(lambda _, taken_ports=fast: taken_ports, obj) == expected, obj
        refused += expected[:1] == ("refused",)
    # Every side was exercised (~650 taken, ~2,700 refused, ~640 valid but left to the general path).
    assert taken > 500 and refused > 2000 and 4000 - taken - refused > 400, (taken, refused)


def test_service_shortcut_takes_the_common_shapes() -> None:
    """ClusterIP, NodePort and LoadBalancer Services as kubectl prints them (a status with an empty
    loadBalancer, named target ports, dual stack) are taken by the shortcut, with the model's
    shared strings; a load balancer's ingress or an external IP is left to the general path."""
    from netproxy.source import convert

    common = [
        service(),
        service(type="NodePort", ports=[{"name": "http", "port": 80, "targetPort": "web", "nodePort": 30080}],
                externalTrafficPolicy="Local", sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 600}}),
        service(clusterIPs=["10.96.0.10", "fd00::10"], ipFamilies=["IPv4", "IPv6"], selector={"app": "web"}),
        {**service(type="LoadBalancer", healthCheckNodePort=31000), "status": {"loadBalancer": {}}},
        service(ports=[{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53}]),
    ]
    for obj in common:
        fast = convert._plain_service("shop", "web", obj)
        assert fast is not None and fast == convert._service_ports("shop", "web", obj), obj
        assert all(p.protocol is convert.PROTOCOLS[convert.PROTOCOLS.index(p.protocol)] for p in fast)
    (p,) = convert._plain_service("shop", "web", common[1]) or ()
    assert p.target_port == "web" and p.name.port is sys.intern("http") and p.service_type == "NodePort"
    ingress = {**service(type="LoadBalancer"), "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}]}}}
    for not_plain in (ingress, service(externalIPs=["203.0.113.1"])):
        assert convert._plain_service("shop", "web", not_plain) is None
        assert parse_service(not_plain)[0].addresses()[1:] == (ip("203.0.113.1") if "externalIPs" in
                                                               not_plain["spec"] else ip("198.51.100.7"),)
