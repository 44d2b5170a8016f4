"""The model's checks: the one place every string from a source is validated before a ruleset sees it."""

from __future__ import annotations

import ipaddress
from typing import Any, Callable

import pytest

from netproxy.core.model import (
    DEFAULT_AFFINITY_TIMEOUT,
    MAX_AFFINITY_TIMEOUT,
    Changes,
    Endpoint,
    FieldError,
    NodeInfo,
    ServicePort,
    ServicePortName,
    Snapshot,
    ValidationError,
    check_choice,
    check_cidr,
    check_ip,
    check_label,
    check_port,
    check_protocol,
    check_subdomain,
    check_zone,
)

# Strings that would change the meaning of an iptables-restore line or an nft command if they reached
# one: quotes, newlines, spaces, option injection, statement separators, block delimiters.
INJECTIONS = [
    'web"', "web'", "web\n", "web\n-A PREROUTING -j ACCEPT", "web -j ACCEPT", "-j", "web;drop",
    "web}", "web{", "web\t", " web", "web ", "web\r", "web\x00", "$(reboot)", "`id`", "web#x", "web/x",
    "web\\", "wеb",  # the last one has a Cyrillic "е"
]


def _rejects(check: Callable[..., Any], value: object, *args: Any) -> FieldError:
    with pytest.raises(FieldError) as info:
        check(value, "some.field", *args)
    assert info.value.field_path == "some.field"
    return info.value


# -- names -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["a", "web", "default-ns", "a1", "1a", "x" * 63, "a-b-c", "0"])
def test_label_accepts_dns1123_labels(value: str) -> None:
    assert check_label(value, "metadata.name") == value


@pytest.mark.parametrize("value", ["", "-web", "web-", "Web", "WEB", "web.example", "web_1", "x" * 64,
                                   None, 7, ["web"]])
def test_label_rejects_non_labels(value: object) -> None:
    _rejects(check_label, value)


def test_label_length_limit_is_configurable_for_target_port_names() -> None:
    # Kubernetes: container port names (and so named targetPorts) are IANA service names, at most 15.
    assert check_label("x" * 15, "f", 15) == "x" * 15
    _rejects(check_label, "x" * 16, 15)


@pytest.mark.parametrize("value", ["a", "web.example.com", "a-b.c-d", "x" * 253,
                                   ".".join(["x" * 63] * 3) + "." + "x" * 61])
def test_subdomain_accepts_dns1123_subdomains(value: str) -> None:
    assert len(value) <= 253
    assert check_subdomain(value, "metadata.name") == value


@pytest.mark.parametrize("value", ["", ".web", "web.", "web..x", "Web.x", "web_x", "x" * 254,
                                   ".".join(["x" * 63] * 4), None, 3])
def test_subdomain_rejects_non_subdomains(value: object) -> None:
    _rejects(check_subdomain, value)


@pytest.mark.parametrize("value", INJECTIONS)
def test_names_reject_injection_attempts(value: str) -> None:
    _rejects(check_label, value)
    _rejects(check_subdomain, value)


# -- ports, protocols, choices -----------------------------------------------------------------------

@pytest.mark.parametrize("value", [1, 80, 65535])
def test_port_accepts_range(value: int) -> None:
    assert check_port(value, "spec.ports[0].port") == value


@pytest.mark.parametrize("value", [0, -1, 65536, 1 << 32, "80", 80.0, None, True, False])
def test_port_rejects_out_of_range_and_non_integers(value: object) -> None:
    _rejects(check_port, value)


def test_port_zero_only_where_allowed() -> None:
    assert check_port(0, "spec.ports[0].nodePort", allow_zero=True) == 0
    _rejects(check_port, 0)
    with pytest.raises(FieldError):
        check_port(-1, "f", allow_zero=True)


@pytest.mark.parametrize("value", ["TCP", "UDP", "SCTP"])
def test_protocols(value: str) -> None:
    assert check_protocol(value, "protocol") == value


def test_protocol_defaults_to_tcp() -> None:
    assert check_protocol(None, "protocol") == "TCP"


@pytest.mark.parametrize("value", ["tcp", "ICMP", "", "TCP ", "TCP -j ACCEPT", 6])
def test_protocol_rejects_others(value: object) -> None:
    _rejects(check_protocol, value)


def test_choice_default_and_rejection() -> None:
    policies = ("Cluster", "Local")
    assert check_choice(None, "spec.externalTrafficPolicy", policies, "Cluster") == "Cluster"
    assert check_choice("", "spec.externalTrafficPolicy", policies, "Cluster") == "Cluster"
    assert check_choice("Local", "spec.externalTrafficPolicy", policies, "Cluster") == "Local"
    err = _rejects(check_choice, "local", policies, "Cluster")
    assert "'local'" in err.message


# -- addresses ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, version", [("10.0.0.1", 4), ("0.0.0.0", 4), ("255.255.255.255", 4),
                                            ("fd00::1", 6), ("::1", 6), ("2001:db8::10", 6)])
def test_ip_accepts_v4_and_v6(value: str, version: int) -> None:
    ip = check_ip(value, "spec.clusterIP")
    assert ip == ipaddress.ip_address(value)
    assert ip.version == version


@pytest.mark.parametrize("value", ["10.0.0", "10.0.0.256", "10.0.0.1/32", "fd00::1::2", "host.example", "",
                                   None, 167772161, "10.0.0.1 -j ACCEPT", "10.0.0.1\n", " 10.0.0.1",
                                   '10.0.0.1"', "10.0.0.1;", "fe80::1%eth0", 'fe80::1%x" -j ACCEPT',
                                   "fe80::1%x\n-A X"])
def test_ip_rejects_non_addresses_and_injections(value: object) -> None:
    err = _rejects(check_ip, value)
    assert repr(value) in err.message


def test_ip_never_carries_text_into_its_string_form() -> None:
    # What a backend prints is str(ip): it must be a bare address, whatever the source held.
    for raw in ("10.0.0.1", "2001:DB8::1", "::ffff:10.0.0.1"):
        text = str(check_ip(raw, "f"))
        assert all(c in "0123456789abcdef.:" for c in text), text


@pytest.mark.parametrize("value", ["10.0.0.0/8", "10.1.2.3/8", "192.168.1.1", "2001:db8::/32", " 10.0.0.0/8"])
def test_cidr_accepts_networks(value: str) -> None:
    net = check_cidr(value, "spec.loadBalancerSourceRanges[0]")
    assert net == ipaddress.ip_network(value.strip(), strict=False)


@pytest.mark.parametrize("value", ["10.0.0.0/33", "10.0.0.0/8 -j ACCEPT", "nope", "", None, '10.0.0.0/8"',
                                   "fe80::%eth0/64", 'fe80::%x" -j ACCEPT/64', "10.0.0.0/8\n-A X"])
def test_cidr_rejects_bad_networks(value: object) -> None:
    _rejects(check_cidr, value)


@pytest.mark.parametrize("value", ["us-east-1a", "zone_a", "Zone.A", "a", "x" * 63])
def test_zone_accepts_label_values(value: str) -> None:
    assert check_zone(value, "zone") == value


def test_zone_may_be_absent() -> None:
    assert check_zone(None, "zone") is None


@pytest.mark.parametrize("value", INJECTIONS[:-1] + ["", "x" * 64, "-a", "a-", 5])
def test_zone_rejects_bad_values(value: object) -> None:
    _rejects(check_zone, value)


# -- errors name the object and the field ------------------------------------------------------------

def test_validation_error_names_kind_object_and_field() -> None:
    err = ValidationError("Service", "shop/cart", "spec.ports[1].port", "70000 is outside 1..65535")
    text = str(err)
    assert (err.kind, err.ref, err.field_path) == ("Service", "shop/cart", "spec.ports[1].port")
    for part in ("Service", "shop/cart", "spec.ports[1].port", "70000"):
        assert part in text
    assert isinstance(err, ValueError)


# -- the dataclasses ---------------------------------------------------------------------------------

def _port(name: str = "http", **kw: Any) -> ServicePort:
    defaults: dict = dict(protocol="TCP", port=80, target_port=8080,
                          cluster_ips=(ipaddress.ip_address("10.96.0.1"),))
    defaults.update(kw)
    return ServicePort(name=ServicePortName("default", "web", name), **defaults)


def test_service_port_defaults_follow_upstream() -> None:
    sp = _port()
    assert sp.affinity == "None" and not sp.client_ip_affinity
    assert sp.affinity_timeout == DEFAULT_AFFINITY_TIMEOUT == 10800
    assert MAX_AFFINITY_TIMEOUT == 86400
    assert sp.external_traffic_policy == sp.internal_traffic_policy == "Cluster"
    assert sp.node_port == 0 and sp.service_type == "ClusterIP"


def test_service_port_is_immutable() -> None:
    sp = _port()
    with pytest.raises(AttributeError):
        sp.port = 81  # type: ignore[misc]


def test_addresses_lists_every_dispatching_address() -> None:
    ips = [ipaddress.ip_address(a) for a in ("10.96.0.1", "fd00::1", "203.0.113.1", "198.51.100.1")]
    sp = _port(cluster_ips=tuple(ips[:2]), external_ips=(ips[2],), load_balancer_ips=(ips[3],),
               affinity="ClientIP")
    assert sp.addresses() == tuple(ips)
    assert sp.client_ip_affinity


def test_service_port_name_str_and_order() -> None:
    assert str(ServicePortName("shop", "cart", "")) == "shop/cart"
    assert str(ServicePortName("shop", "cart", "http")) == "shop/cart:http"
    assert ServicePortName("shop", "cart", "http").service == ("shop", "cart")
    names = [ServicePortName("b", "a"), ServicePortName("a", "z", "y"), ServicePortName("a", "z", "x")]
    assert sorted(names) == [names[2], names[1], names[0]]


def test_endpoint_str_brackets_v6() -> None:
    assert str(Endpoint(ipaddress.ip_address("10.0.0.1"), 80)) == "10.0.0.1:80"
    assert str(Endpoint(ipaddress.ip_address("fd00::1"), 80)) == "[fd00::1]:80"
    ep = Endpoint(ipaddress.ip_address("10.0.0.1"), 80)
    assert (ep.ready, ep.serving, ep.terminating, ep.node_name, ep.zone) == (True, True, False, None, None)


def test_snapshot_build_and_lookup() -> None:
    a, b = _port("b"), _port("a")
    ep = Endpoint(ipaddress.ip_address("10.0.0.1"), 8080)
    snap = Snapshot.build([a, b], {a.name: [ep]}, NodeInfo("node-a", "z1"))
    assert snap.services == {a.name: a, b.name: b}
    assert snap.endpoints_of(a.name) == (ep,)
    assert snap.endpoints_of(b.name) == ()
    assert snap.sorted_names() == [b.name, a.name]
    assert snap.node == NodeInfo("node-a", "z1")


def test_changes_everything_is_full() -> None:
    assert Changes.everything() == Changes(full=True, services=frozenset())
    assert Changes().full


def test_an_endpoint_is_six_fields_made_and_read_as_nine() -> None:
    """Endpoint keeps its conditions as bits of one int and its two hint lists as one field (24 bytes
    an endpoint: docs/performance.md, the seventh pass), made and read as the nine fields it stands for."""
    import copy
    import itertools
    import pickle

    from netproxy.core.model import Endpoint

    ip = ipaddress.ip_address("10.1.0.1")
    for ready, serving, terminating in itertools.product((True, False), repeat=3):
        for zone_hints, node_hints in (((), ()), (("z1",), ()), ((), ("n1", "n2")), (("z1", "z2"), ("n1",))):
            e = Endpoint(ip, 80, ready=ready, serving=serving, terminating=terminating, node_name="n", zone="z",
                         zone_hints=zone_hints, node_hints=node_hints)
            assert (e.ready, e.serving, e.terminating) == (ready, serving, terminating)
            assert (e.zone_hints, e.node_hints, e.node_name, e.zone) == (zone_hints, node_hints, "n", "z")
            assert len(e) == 6 and type(e.conditions) is int and 0 <= e.conditions <= 7
            assert e == Endpoint(ip, 80, ready, serving, terminating, "n", "z", zone_hints, node_hints)
            assert pickle.loads(pickle.dumps(e)) == e and copy.deepcopy(e) == e
    assert Endpoint(ip, 80).hints == () and (Endpoint(ip, 80).ready, Endpoint(ip, 80).serving) == (True, True)
    assert Endpoint(ip, 80, ready=False) < Endpoint(ip, 80), "ordered by its conditions as the three booleans were"
