"""The change tracker: snapshots, exactly which service ports changed, slices merged, readiness."""

from __future__ import annotations

import ipaddress
from typing import Dict, FrozenSet, List, Tuple

import pytest

from netproxy.core.model import (
    Endpoint,
    EndpointSet,
    NodeInfo,
    ServicePort,
    ServicePortName,
    SlicePort,
    ValidationError,
)
from netproxy.core.tracker import ChangeTracker
from netproxy_lab.manifests import service_port

ip = ipaddress.ip_address


def svc(name: str, *port_names: str, ns: str = "default", cluster_ip: str = "10.96.0.1",
        port: int = 80) -> Tuple[ServicePort, ...]:
    return tuple(service_port(name, ns, p, port=port + i, target_port=8080 + i, cluster_ip=cluster_ip)
                 for i, p in enumerate(port_names or ("",)))


def eps(service: str, *addresses: str, ns: str = "default", port_names: Tuple[str, ...] = ("",),
        ready: bool = True) -> EndpointSet:
    ports = tuple(SlicePort(p, "TCP", 8080 + i) for i, p in enumerate(port_names))
    return EndpointSet(ns, service, ports, tuple(Endpoint(ip(a), 0, ready, ready) for a in addresses))


def names(*specs: str) -> FrozenSet[ServicePortName]:
    """"ns/name:port" → ServicePortName set."""
    out = []
    for spec in specs:
        ref, _, port = spec.partition(":")
        ns, _, name = ref.partition("/")
        out.append(ServicePortName(ns, name, port))
    return frozenset(out)


def endpoints(tracker: ChangeTracker) -> Dict[str, List[str]]:
    snap, _ = tracker.take()
    return {str(n): [str(e) for e in snap.endpoints_of(n)] for n in snap.sorted_names()}


@pytest.fixture
def tracker() -> ChangeTracker:
    t = ChangeTracker()
    t.update_service("default", "web", svc("web", "http", "metrics"))
    t.update_service("default", "api", svc("api", cluster_ip="10.96.0.2"))
    t.update_endpoints("default", "web-1", eps("web", "10.0.0.1", port_names=("http", "metrics")))
    t.update_endpoints("default", "api-1", eps("api", "10.0.1.1"))
    t.take()
    return t


def test_first_take_reports_every_port() -> None:
    t = ChangeTracker()
    t.update_service("default", "web", svc("web", "http", "metrics"))
    t.update_endpoints("default", "web-1", eps("web", "10.0.0.1", port_names=("http",)))
    snap, changes = t.take()
    assert changes.services == names("default/web:http", "default/web:metrics")
    assert not changes.full
    assert [str(e) for e in snap.endpoints_of(ServicePortName("default", "web", "http"))] == ["10.0.0.1:8080"]
    assert snap.endpoints_of(ServicePortName("default", "web", "metrics")) == ()


def test_nothing_changed_reports_nothing(tracker: ChangeTracker) -> None:
    assert not tracker.pending()
    _, changes = tracker.take()
    assert changes.services == frozenset() and not changes.full


def test_re_sending_an_unchanged_object_reports_nothing(tracker: ChangeTracker) -> None:
    tracker.update_service("default", "web", svc("web", "http", "metrics"))
    tracker.update_endpoints("default", "api-1", eps("api", "10.0.1.1"))
    assert not tracker.pending()
    assert tracker.take()[1].services == frozenset()


def test_service_change_reports_exactly_its_ports(tracker: ChangeTracker) -> None:
    tracker.update_service("default", "api", svc("api", cluster_ip="10.96.0.22"))
    assert tracker.pending()
    snap, changes = tracker.take()
    assert changes.services == names("default/api")
    assert snap.services[ServicePortName("default", "api", "")].cluster_ips == (ip("10.96.0.22"),)
    assert tracker.take()[1].services == frozenset()  # cleared by take


def test_endpoints_only_change_is_reported(tracker: ChangeTracker) -> None:
    # An endpoints-only change syncs by itself; it must not wait for the periodic sync.
    tracker.update_endpoints("default", "api-1", eps("api", "10.0.1.1", "10.0.1.2"))
    assert tracker.pending()
    snap, changes = tracker.take()
    assert changes.services == names("default/api")
    assert [str(e) for e in snap.endpoints_of(ServicePortName("default", "api", ""))] == [
        "10.0.1.1:8080", "10.0.1.2:8080"]


def test_endpoints_change_notifies(tracker: ChangeTracker) -> None:
    calls: List[int] = []
    tracker.on_change = lambda: calls.append(1)
    tracker.update_endpoints("default", "api-1", eps("api", "10.0.1.3"))
    assert calls == [1]


def test_readiness_change_alone_is_reported(tracker: ChangeTracker) -> None:
    tracker.update_endpoints("default", "api-1", eps("api", "10.0.1.1", ready=False))
    snap, changes = tracker.take()
    assert changes.services == names("default/api")
    (ep,) = snap.endpoints_of(ServicePortName("default", "api", ""))
    assert not ep.ready


def test_a_port_removed_from_a_service_is_reported_and_gone(tracker: ChangeTracker) -> None:
    tracker.update_service("default", "web", svc("web", "http"))
    snap, changes = tracker.take()
    assert changes.services == names("default/web:http", "default/web:metrics")
    assert ServicePortName("default", "web", "metrics") not in snap.services
    assert ServicePortName("default", "web", "metrics") not in snap.endpoints


def test_slices_of_one_service_are_merged(tracker: ChangeTracker) -> None:
    tracker.update_endpoints("default", "api-2", eps("api", "10.0.1.9", "10.0.1.5"))
    got = endpoints(tracker)
    assert got["default/api"] == ["10.0.1.1:8080", "10.0.1.5:8080", "10.0.1.9:8080"]


def test_endpoints_are_sorted_v4_before_v6() -> None:
    t = ChangeTracker()
    t.update_service("default", "api", svc("api"))
    t.update_endpoints("default", "api-6", EndpointSet("default", "api", (SlicePort("", "TCP", 80),),
                                                        (Endpoint(ip("fd00::1"), 0),)))
    t.update_endpoints("default", "api-4", eps("api", "10.0.0.2", "10.0.0.10"))
    assert endpoints(t)["default/api"] == ["10.0.0.2:8080", "10.0.0.10:8080", "[fd00::1]:80"]


def test_an_endpoint_in_two_slices_counts_once_and_ready_wins(tracker: ChangeTracker) -> None:
    tracker.update_endpoints("default", "api-2", eps("api", "10.0.1.1", ready=False))
    tracker.update_endpoints("default", "api-0", eps("api", "10.0.1.7", ready=False))
    snap, _ = tracker.take()
    got = [(str(e), e.ready) for e in snap.endpoints_of(ServicePortName("default", "api", ""))]
    assert got == [("10.0.1.1:8080", True), ("10.0.1.7:8080", False)]


def test_the_same_address_on_different_ports_is_two_endpoints() -> None:
    t = ChangeTracker()
    t.update_service("default", "api", svc("api"))
    t.update_endpoints("default", "a", EndpointSet("default", "api", (SlicePort("", "TCP", 8080),),
                                                    (Endpoint(ip("10.0.0.1"), 0),)))
    t.update_endpoints("default", "b", EndpointSet("default", "api", (SlicePort("", "TCP", 9090),),
                                                    (Endpoint(ip("10.0.0.1"), 0),)))
    assert endpoints(t)["default/api"] == ["10.0.0.1:8080", "10.0.0.1:9090"]


def test_endpoints_match_port_name_and_protocol() -> None:
    t = ChangeTracker()
    udp = ServicePort(ServicePortName("kube-system", "dns", "dns"), "UDP", 53, 53, cluster_ips=(ip("10.96.0.10"),))
    tcp = ServicePort(ServicePortName("kube-system", "dns", "dns-tcp"), "TCP", 53, 53,
                      cluster_ips=(ip("10.96.0.10"),))
    t.update_service("kube-system", "dns", (udp, tcp))
    t.update_endpoints("kube-system", "dns-1", EndpointSet(
        "kube-system", "dns", (SlicePort("dns", "UDP", 5353), SlicePort("dns-tcp", "TCP", 5354),
                               SlicePort("dns", "TCP", 1)),
        (Endpoint(ip("10.0.0.1"), 0),)))
    assert endpoints(t) == {"kube-system/dns:dns": ["10.0.0.1:5353"], "kube-system/dns:dns-tcp": ["10.0.0.1:5354"]}


def test_deleting_a_slice(tracker: ChangeTracker) -> None:
    tracker.update_endpoints("default", "api-2", eps("api", "10.0.1.2"))
    tracker.take()
    tracker.update_endpoints("default", "api-1", None)
    snap, changes = tracker.take()
    assert changes.services == names("default/api")
    assert [str(e) for e in snap.endpoints_of(ServicePortName("default", "api", ""))] == ["10.0.1.2:8080"]
    tracker.update_endpoints("default", "api-2", None)
    snap, changes = tracker.take()
    assert changes.services == names("default/api")
    assert snap.endpoints_of(ServicePortName("default", "api", "")) == ()
    assert ServicePortName("default", "api", "") in snap.services  # the service stays, without endpoints


def test_deleting_an_unknown_slice_or_service_is_a_no_op(tracker: ChangeTracker) -> None:
    tracker.update_endpoints("default", "nope", None)
    tracker.update_service("default", "nope", None)
    assert not tracker.pending()


def test_deleting_a_service_reports_its_ports(tracker: ChangeTracker) -> None:
    tracker.update_service("default", "web", None)
    snap, changes = tracker.take()
    assert changes.services == names("default/web:http", "default/web:metrics")
    assert set(snap.services) == names("default/api")
    assert set(snap.endpoints) == names("default/api")


def test_a_service_with_no_ports_counts_as_deleted(tracker: ChangeTracker) -> None:
    tracker.update_service("default", "web", ())  # e.g. it became headless
    snap, changes = tracker.take()
    assert changes.services == names("default/web:http", "default/web:metrics")
    assert set(snap.services) == names("default/api")


def test_endpoints_that_arrive_before_their_service() -> None:
    t = ChangeTracker()
    t.update_endpoints("default", "api-1", eps("api", "10.0.0.1"))
    snap, changes = t.take()
    assert changes.services == frozenset() and snap.services == {}
    t.update_service("default", "api", svc("api"))
    snap, changes = t.take()
    assert changes.services == names("default/api")
    assert [str(e) for e in snap.endpoints_of(ServicePortName("default", "api", ""))] == ["10.0.0.1:8080"]


def test_a_slice_moving_to_another_service_reports_both(tracker: ChangeTracker) -> None:
    tracker.update_endpoints("default", "api-1", eps("web", "10.0.1.1", port_names=("http",)))
    snap, changes = tracker.take()
    assert changes.services == names("default/api", "default/web:http", "default/web:metrics")
    assert snap.endpoints_of(ServicePortName("default", "api", "")) == ()
    assert len(snap.endpoints_of(ServicePortName("default", "web", "http"))) == 2


def test_same_names_in_other_namespaces_are_separate(tracker: ChangeTracker) -> None:
    tracker.update_service("other", "api", svc("api", ns="other", cluster_ip="10.96.9.9"))
    tracker.update_endpoints("other", "api-1", eps("api", "10.9.9.9", ns="other"))
    snap, changes = tracker.take()
    assert changes.services == names("other/api")
    assert [str(e) for e in snap.endpoints_of(ServicePortName("default", "api", ""))] == ["10.0.1.1:8080"]
    assert [str(e) for e in snap.endpoints_of(ServicePortName("other", "api", ""))] == ["10.9.9.9:8080"]


def test_replace_services_removes_vanished(tracker: ChangeTracker) -> None:
    tracker.replace_services({("default", "api"): svc("api", cluster_ip="10.96.0.2"),
                              ("default", "new"): svc("new", cluster_ip="10.96.0.3")})
    snap, changes = tracker.take()
    assert changes.services == names("default/web:http", "default/web:metrics", "default/new")
    assert set(snap.services) == names("default/api", "default/new")


def test_replace_endpoints_removes_vanished(tracker: ChangeTracker) -> None:
    tracker.replace_endpoints({("default", "api-1"): eps("api", "10.0.1.1")})
    snap, changes = tracker.take()
    assert changes.services == names("default/web:http", "default/web:metrics")
    assert snap.endpoints_of(ServicePortName("default", "web", "http")) == ()
    assert len(snap.endpoints_of(ServicePortName("default", "api", ""))) == 1


def test_replace_with_the_same_state_reports_nothing(tracker: ChangeTracker) -> None:
    tracker.replace_services({("default", "web"): svc("web", "http", "metrics"),
                              ("default", "api"): svc("api", cluster_ip="10.96.0.2")})
    tracker.replace_endpoints({("default", "web-1"): eps("web", "10.0.0.1", port_names=("http", "metrics")),
                               ("default", "api-1"): eps("api", "10.0.1.1")})
    assert not tracker.pending()
    assert tracker.take()[1].services == frozenset()


def test_not_ready_until_both_synced() -> None:
    t = ChangeTracker()
    assert not t.ready
    t.services_synced()
    assert not t.ready
    t2 = ChangeTracker()
    t2.endpoints_synced()
    assert not t2.ready
    t.endpoints_synced()
    assert t.ready


def test_node_change_asks_for_a_full_sync(tracker: ChangeTracker) -> None:
    tracker.set_node(NodeInfo("node-a", "zone-1"))
    snap, changes = tracker.take()
    assert changes.full and snap.node == NodeInfo("node-a", "zone-1")
    tracker.set_node(NodeInfo("node-a", "zone-1"))
    assert not tracker.pending()
    assert not tracker.take()[1].full


def test_snapshots_are_not_changed_by_later_events(tracker: ChangeTracker) -> None:
    snap, _ = tracker.take()
    tracker.update_service("default", "api", None)
    tracker.update_endpoints("default", "web-1", None)
    tracker.take()
    assert ServicePortName("default", "api", "") in snap.services
    assert len(snap.endpoints_of(ServicePortName("default", "web", "http"))) == 1


def test_reject_counts() -> None:
    t = ChangeTracker()
    t.reject(ValidationError("Service", "default/x", "spec.ports[0].port", "bad"))
    t.reject(ValidationError("Service", "default/y", "spec.ports[0].port", "bad"))
    assert t.rejected == 2
    assert not t.pending()


def test_the_first_sync_waits_for_expected_node_addresses() -> None:
    """With --nodeport-addresses the node's addresses are part of the first snapshot: a first sync
    without them would be followed at once by a second full one (measured at 10k: 0.9 s)."""
    import ipaddress

    t = ChangeTracker()
    t.expect_node_addresses()
    t.services_synced()
    t.endpoints_synced()
    assert not t.ready
    t.set_node_addresses((ipaddress.ip_address("192.0.2.1"),))
    assert t.ready
    plain = ChangeTracker()
    plain.services_synced()
    plain.endpoints_synced()
    assert plain.ready  # nothing expected: services and endpoints are enough
