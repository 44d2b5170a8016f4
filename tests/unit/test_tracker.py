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


# ---- pinned by mutation testing (scripts/mutation, docs/testing.md): each test names what a
# surviving mutant of netproxy/core/tracker.py changed without any test failing ----------------


def test_a_fresh_tracker_is_not_ready_has_nothing_pending_and_counted_nothing() -> None:
    t = ChangeTracker()
    assert t.ready is False and t.pending() is False
    assert (t.service_changes, t.endpoint_changes, t.pending_changes()) == (0, 0, (0, 0))
    assert t.last_trigger_times == ()
    snap, changes = t.take()
    assert changes.full is False and changes.services == frozenset() and snap.node.addresses == ()
    t.set_node_addresses(())  # no addresses, as before: no change
    assert t.pending() is False
    t.services_synced()
    assert t.ready is False, "endpoints not yet synced"
    t.update_service("default", "web", ())  # a service with no ports that was never there: no change
    t.update_service_cidr("never-seen", None)  # deleting an unknown ServiceCIDR: no change, no error
    assert t.service_changes == 0 and t.pending() is False


def test_changes_are_counted_once_each_and_pending_until_taken() -> None:
    t = ChangeTracker()
    web = svc("web", "http")
    t.update_service("default", "web", web)
    t.update_service("default", "web", web)  # the same object again: no change
    t.update_service("default", "api", svc("api", cluster_ip="10.96.0.2"))
    t.update_endpoints("default", "web-1", eps("web", "10.0.0.1", port_names=("http",)))
    t.update_endpoints("default", "web-1", eps("web", "10.0.0.1", port_names=("http",)))  # equal: no change
    t.update_endpoints("default", "api-1", eps("api", "10.0.1.1"))
    assert (t.service_changes, t.endpoint_changes, t.pending_changes()) == (2, 2, (2, 2))
    t.take()
    assert t.pending_changes() == (0, 0) and (t.service_changes, t.endpoint_changes) == (2, 2)
    t.update_service("default", "api", None)
    t.update_service("default", "gone", None)  # never seen: no change
    assert (t.service_changes, t.pending_changes()) == (3, (1, 0))


def test_every_update_calls_on_change() -> None:
    calls: List[str] = []
    t = ChangeTracker(on_change=lambda: calls.append("x"))
    t.update_service("default", "web", svc("web"))
    t.update_endpoints("default", "web-1", eps("web", "10.0.0.1"))
    t.services_synced()
    t.endpoints_synced()
    assert len(calls) == 4 and t.ready is True


def test_node_addresses_reach_the_snapshot_and_ask_for_a_full_sync_once() -> None:
    t = ChangeTracker(node=NodeInfo("node-a"))
    t.expect_node_addresses()
    t.services_synced()
    t.endpoints_synced()
    assert t.ready is False, "the first sync waits for the expected addresses"
    t.take()
    addresses = (ip("192.0.2.1"), ip("2001:db8::1"))
    t.set_node_addresses(addresses)
    assert t.ready is True and t.pending() is True
    snap, changes = t.take()
    assert changes.full is True and snap.node == NodeInfo("node-a", addresses=addresses)
    t.set_node_addresses(addresses)
    assert t.pending() is False
    assert t.take()[1].full is False


def test_a_node_keeps_its_own_addresses_until_some_are_set() -> None:
    own = (ip("192.0.2.5"),)
    assert ChangeTracker(node=NodeInfo("node-a", addresses=own)).take()[0].node.addresses == own


def test_external_ips_are_kept_unless_the_gate_drops_them() -> None:
    def external(t: ChangeTracker) -> Tuple[object, ...]:
        port = service_port("web", "default", "", cluster_ip="10.96.0.1", external_ips=(ip("192.0.2.9"),))
        t.update_service("default", "web", (port,))
        return t.take()[0].services[port.name].external_ips

    assert external(ChangeTracker()) == (ip("192.0.2.9"),)
    assert external(ChangeTracker(external_ips=False)) == ()


@pytest.mark.parametrize("ready_first", [True, False])
def test_an_address_in_two_slices_counts_once_and_the_ready_copy_wins(ready_first: bool) -> None:
    t = ChangeTracker()
    t.update_service("default", "web", svc("web"))
    ready, not_ready = eps("web", "10.0.0.1"), eps("web", "10.0.0.1", ready=False)
    t.update_endpoints("default", "web-a", ready if ready_first else not_ready)
    t.update_endpoints("default", "web-b", not_ready if ready_first else ready)
    (only,) = t.take()[0].endpoints_of(ServicePortName("default", "web", ""))
    assert only.ready is True


def test_of_two_not_ready_copies_the_first_slices_stays() -> None:
    t = ChangeTracker()
    t.update_service("default", "web", svc("web"))
    ports = (SlicePort("", "TCP", 8080),)
    for name, node in (("web-a", "node-a"), ("web-b", "node-b")):
        endpoint = Endpoint(ip("10.0.0.1"), 0, False, False, node_name=node)
        t.update_endpoints("default", name, EndpointSet("default", "web", ports, (endpoint,)))
    (only,) = t.take()[0].endpoints_of(ServicePortName("default", "web", ""))
    assert only.node_name == "node-a"


def test_a_trigger_time_at_the_start_counts_and_one_before_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("netproxy.core.tracker.time.time", lambda: 1000.0)
    t = ChangeTracker()
    ports = (SlicePort("", "TCP", 8080),)
    for name, stamp in (("a", 1000.0), ("b", 999.5)):
        t.update_endpoints("default", name, EndpointSet("default", "web", ports, (Endpoint(ip("10.0.0.1"), 0),),
                                                        trigger_time=stamp))
    t.take()
    assert t.last_trigger_times == (1000.0,)


def test_service_cidr_objects_join_the_flag_in_order_and_leave() -> None:
    calls: List[str] = []
    net = ipaddress.ip_network
    t = ChangeTracker(service_cidrs=(net("10.96.0.0/16"),), on_change=lambda: calls.append("x"))
    t.update_service_cidr("b", (net("fd00::/108"), net("10.0.0.0/16")))
    t.update_service_cidr("a", (net("10.0.0.0/8"),))
    snap, changes = t.take()
    assert snap.service_cidrs == (net("10.0.0.0/8"), net("10.0.0.0/16"), net("10.96.0.0/16"), net("fd00::/108"))
    assert changes.full is True and len(calls) == 2
    t.update_service_cidr("a", (net("10.0.0.0/8"),))  # the same again: nothing to sync
    assert len(calls) == 2 and t.pending() is False
    t.update_service_cidr("b", None)
    assert t.take()[0].service_cidrs == (net("10.0.0.0/8"), net("10.96.0.0/16")) and len(calls) == 3


def test_a_rejection_is_logged_with_its_error_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    t = ChangeTracker()
    t.reject(ValidationError("Service", "ns/web", "spec.ports[0].port", "must be 1-65535"))
    assert t.rejected == 1
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "rejected Service ns/web: field spec.ports[0].port: must be 1-65535")]



def test_a_snapshot_is_not_changed_by_what_the_tracker_takes_in_after_it(tracker: ChangeTracker) -> None:
    """Snapshots share the tracker's maps copy-on-write (netproxy/core/cowmap.py): a sync still
    working on one must not see the next change, nor a deletion."""
    first, _ = tracker.take()
    before = {str(n): [str(e) for e in first.endpoints_of(n)] for n in first.sorted_names()}
    tracker.update_service("default", "api", None)
    tracker.update_endpoints("default", "web-1", eps("web", "10.0.0.9", port_names=("http", "metrics")))
    second, changes = tracker.take()
    assert {str(n): [str(e) for e in first.endpoints_of(n)] for n in first.sorted_names()} == before
    assert len(first.services) == 3 and names("default/api") <= set(first.services)
    assert set(second.services) == names("default/web:http", "default/web:metrics")
    assert [str(e) for e in second.endpoints_of(ServicePortName("default", "web", "http"))] == ["10.0.0.9:8080"]
    assert changes.services == names("default/api", "default/web:http", "default/web:metrics")


def _merged(slice_eps: Tuple[Endpoint, ...]) -> Tuple[Endpoint, ...]:
    """What the tracker's merge makes of one slice's endpoints, written out the slow way: each
    (version, address, port) once, a ready copy over a not-ready one, ordered by that key."""
    seen: Dict[Tuple[int, int, int], Endpoint] = {}
    for e in slice_eps:
        k = (e.ip.version, int(e.ip), e.port)
        if k not in seen or (e.ready and not seen[k].ready):
            seen[k] = e
    return tuple(seen[k] for k in sorted(seen))


@pytest.mark.parametrize("seed", range(60))
def test_one_slice_resolves_as_the_merge_does(seed: int) -> None:
    """The one-slice shortcut (the slice's own tuple when already in order) gives the merge's answer,
    for slices in order, out of order, with repeats, both families mixed (a legacy Endpoints
    subset list), several ports and endpoints whose own port differs."""
    import random

    rnd = random.Random(seed)
    # IPv6 addresses as small as "::3" order before every IPv4 address by their number alone.
    pool = [ip(f"10.0.{rnd.randrange(3)}.{rnd.randrange(1, 6)}") for _ in range(6)] + \
        [ip(f"{rnd.choice(('fd00', ''))}::{rnd.randrange(1, 6)}") for _ in range(rnd.choice((0, 0, 3)))]
    n = rnd.randrange(0, 8)
    chosen = [rnd.choice(pool) for _ in range(n)]
    order = seed % 5
    if order in (0, 1):
        chosen = sorted(set(chosen), key=lambda a: (a.version, int(a)))  # the common case: in order
    elif order == 2:
        chosen = sorted(chosen, key=lambda a: (a.version, int(a)))  # in order, with repeats
    elif order == 3:
        chosen = sorted(set(chosen) | {ip("::3"), pool[0]}, key=int)  # by number alone: "::3" first
    ports = (SlicePort("http", "TCP", 8080),) + ((SlicePort("http", "TCP", 8081),) if rnd.random() < 0.2 else ())
    own_port = 8080 if rnd.random() < 0.8 else rnd.choice((0, 8080, 9090))
    listed = tuple(Endpoint(a, own_port, rnd.random() < 0.8) for a in chosen)
    t = ChangeTracker()
    t.update_service("default", "web", svc("web", "http"))
    t.update_endpoints("default", "web-1", EndpointSet("default", "web", ports, listed))
    snap, _ = t.take()
    got = snap.endpoints_of(ServicePortName("default", "web", "http"))
    assert got == _merged(EndpointSet("default", "web", ports, listed).for_port("http", "TCP"))  # readiness too
