"""KubeSource against the API stand-in, through the official client: lists, watches, recovery."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from typing import Iterator, List, Tuple

import pytest
from kubernetes import client

from netproxy.core.model import ServicePortName
from netproxy.source.kube import KubeSource
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import FAST, RecordingTracker, endpoint_slice, node, service, wait_for

SLOW_BACKOFF = replace(FAST, backoff_initial=0.4, backoff_cap=0.4)


@pytest.fixture
def tracker() -> RecordingTracker:
    return RecordingTracker()


def start(api_client: client.ApiClient, tracker: RecordingTracker, **kwargs: object) -> KubeSource:
    kwargs.setdefault("settings", FAST)
    source = KubeSource(api_client, "node-a", **kwargs)  # type: ignore[arg-type]
    source.start(tracker)
    return source


@pytest.fixture
def running(api: ApiServer, api_client: client.ApiClient, tracker: RecordingTracker) -> Iterator[KubeSource]:
    """A source started on a small cluster (three services, two slices, this node) and synced."""
    api.create("nodes", node("node-a", zone="zone-1"))
    api.create("nodes", node("node-b", zone="zone-2"))
    for i in range(3):
        api.create("services", service(f"svc{i}", f"10.0.0.{i + 1}"))
    api.create("endpointslices", endpoint_slice("svc0-abc", "svc0", ["10.1.0.1", "10.1.0.2"]))
    api.create("endpointslices", endpoint_slice("svc1-abc", "svc1", ["10.1.1.1"]))
    source = start(api_client, tracker)
    try:
        wait_for(lambda: tracker.ready, what="both lists")
        # Every reflector's watch, ServiceCIDRs' too: a watch not yet open when a test expires or
        # drops the others would escape the fault (the relist test then timed out now and then).
        for plural in ("services", "endpointslices", "nodes", "servicecidrs"):
            assert api.wait_watchers(plural), plural
        yield source
    finally:
        source.stop()


def snapshot_ips(tracker: RecordingTracker) -> dict:
    snap, _ = tracker.take()
    return {str(k): sorted(str(e.ip) for e in v) for k, v in snap.endpoints.items()}


def services_of(tracker: RecordingTracker) -> List[str]:
    snap, _ = tracker.take()
    return sorted(str(k) for k in snap.services)


def watch_requests(api: ApiServer, plural: str) -> List[dict]:
    return [q for m, path, q in api.requests if path.endswith("/" + plural) and q.get("watch") == "true"]


def test_initial_list_is_paginated_and_complete(running: KubeSource, api: ApiServer,
                                                tracker: RecordingTracker) -> None:
    lists = [q for m, p, q in api.requests if p == "/api/v1/services" and "watch" not in q]
    # Three services in pages of two: a first page and one continued page.
    assert [q.get("limit") for q in lists] == ["2", "2"]
    assert "continue" not in lists[0] and lists[1]["continue"]
    replaced = tracker.named("replace_services")[0][1]
    assert sorted(replaced) == [("default", "svc0"), ("default", "svc1"), ("default", "svc2")]
    assert replaced[("default", "svc2")][0].cluster_ips == (ipaddress.ip_address("10.0.0.3"),)
    assert snapshot_ips(tracker) == {"default/svc0:http": ["10.1.0.1", "10.1.0.2"],
                                     "default/svc1:http": ["10.1.1.1"], "default/svc2:http": []}
    # Only this node is watched (field selector), and its zone label reached the tracker.
    assert tracker.take()[0].node.zone == "zone-1"
    node_watch = watch_requests(api, "nodes")[0]
    assert node_watch["fieldSelector"] == "metadata.name=node-a"
    # Watches start at the list's version and ask for bookmarks.
    svc_watch = watch_requests(api, "services")[0]
    assert svc_watch["allowWatchBookmarks"] == "true"
    assert int(svc_watch["resourceVersion"]) >= 8


def test_synced_only_after_both_lists(api: ApiServer, api_client: client.ApiClient,
                                      tracker: RecordingTracker) -> None:
    api.create("services", service("svc0", "10.0.0.1"))
    api.fail_next(500, count=3, path="/endpointslices")
    source = start(api_client, tracker)
    try:
        wait_for(lambda: tracker.named("services_synced"), what="services synced")
        assert not tracker.ready  # endpoint lists still failing: the proxy must not write yet
        wait_for(lambda: tracker.ready, what="endpoints synced after retries")
        slices = [r for r in source.reflectors if r.kind == "EndpointSlice"][0]
        assert slices.errors == 3 and slices.lists == 1
    finally:
        source.stop()


def test_events_reach_tracker_in_order(running: KubeSource, api: ApiServer, tracker: RecordingTracker) -> None:
    mark = len(tracker.calls)
    api.create("services", service("svc3", "10.0.0.4"))
    api.create("endpointslices", endpoint_slice("svc3-abc", "svc3", ["10.1.3.1"]))
    api.replace("endpointslices", endpoint_slice("svc0-abc", "svc0", ["10.1.0.9"]))
    api.replace("services", service("svc1", "10.0.0.2", port=81))
    api.delete("services", "default", "svc2")
    api.delete("endpointslices", "default", "svc1-abc")
    wait_for(lambda: len(tracker.calls) >= mark + 6, what="six events")
    got = [(c[0], c[2], c[3] is None) for c in tracker.calls[mark:]]
    svc_events = [g for g in got if g[0] == "update_service"]
    ep_events = [g for g in got if g[0] == "update_endpoints"]
    # Per collection, exactly the server's order (the two collections are separate streams).
    assert svc_events == [("update_service", "svc3", False), ("update_service", "svc1", False),
                          ("update_service", "svc2", True)]
    assert ep_events == [("update_endpoints", "svc3-abc", False), ("update_endpoints", "svc0-abc", False),
                         ("update_endpoints", "svc1-abc", True)]
    assert snapshot_ips(tracker) == {"default/svc0:http": ["10.1.0.9"], "default/svc1:http": [],
                                     "default/svc3:http": ["10.1.3.1"]}
    snap, _ = tracker.take()
    assert snap.services[ServicePortName("default", "svc1", "http")].port == 81


def test_410_relists_and_removes_service_deleted_meanwhile(running: KubeSource, api: ApiServer,
                                                           tracker: RecordingTracker) -> None:
    svc_reflector = running.reflectors[0]
    old_rv = svc_reflector.resource_version
    # Cut the watch and make the first reconnect fail, so the client is away while svc2 is deleted
    # and the server compacts its history: the DELETED event is never seen by anyone.
    running.reflectors[0].backoff.initial = 0.4
    api.fail_next(500, path="/api/v1/services?", watch_only=True)
    api.drop_watches()
    api.delete("services", "default", "svc2")
    api.create("services", service("svc9", "10.0.0.9"))
    api.compact()
    wait_for(lambda: svc_reflector.lists == 2, what="a relist")
    wait_for(lambda: services_of(tracker) == ["default/svc0:http", "default/svc1:http", "default/svc9:http"],
             what="relisted state")
    # The resumed watch used the old version and got a 410 ERROR event in the stream, not an HTTP error.
    resumed = [q for q in watch_requests(api, "services") if q["resourceVersion"] == old_rv]
    assert len(resumed) == 3  # the first watch, the injected 500, the one answered with 410
    # svc2 went away through the relist's replacement, never through a DELETED event.
    assert not [c for c in tracker.named("update_service") if c[2] == "svc2"]
    assert ("default", "svc2") not in tracker.named("replace_services")[-1][1]


def test_expired_watch_stream_relists(running: KubeSource, api: ApiServer, tracker: RecordingTracker) -> None:
    assert api.expire_watches() == len(running.reflectors)
    for r in running.reflectors:
        wait_for(lambda r=r: r.lists == 2, what=f"{r.kind} relist")
    assert tracker.ready
    assert snapshot_ips(tracker)["default/svc0:http"] == ["10.1.0.1", "10.1.0.2"]


def test_dropped_watch_resumes_without_losing_an_event(running: KubeSource, api: ApiServer,
                                                       tracker: RecordingTracker) -> None:
    slices = running.reflectors[1]
    slices.backoff.initial = 0.4
    last_seen = slices.resource_version
    api.fail_next(500, path="/endpointslices?", watch_only=True)
    api.drop_watches()
    # Changes made while the client is away must all arrive once it is back.
    api.replace("endpointslices", endpoint_slice("svc0-abc", "svc0", ["10.1.0.3"]))
    api.create("endpointslices", endpoint_slice("svc2-abc", "svc2", ["10.1.2.1"]))
    api.delete("endpointslices", "default", "svc1-abc")
    wait_for(lambda: snapshot_ips(tracker) == {"default/svc0:http": ["10.1.0.3"], "default/svc1:http": [],
                                               "default/svc2:http": ["10.1.2.1"]}, what="the missed events")
    assert slices.lists == 1 and slices.errors >= 1  # resumed, not relisted
    resumed = watch_requests(api, "endpointslices")[-1]
    assert resumed["resourceVersion"] == last_seen
    names = [c[2] for c in tracker.named("update_endpoints")]
    assert names == ["svc0-abc", "svc2-abc", "svc1-abc"]


def test_dropped_mid_burst_replays_nothing_twice(running: KubeSource, api: ApiServer,
                                                 tracker: RecordingTracker) -> None:
    for i in range(20):
        api.replace("endpointslices", endpoint_slice("svc0-abc", "svc0", [f"10.1.0.{i + 10}"]))
        if i == 9:
            api.drop_watches()
    wait_for(lambda: snapshot_ips(tracker)["default/svc0:http"] == ["10.1.0.29"], what="the last event")
    ips = [str(c[3].endpoints[0].ip) for c in tracker.named("update_endpoints")]
    # Every change once, in order, whether it arrived before or after the drop.
    assert ips == [f"10.1.0.{i + 10}" for i in range(20)]


def test_bookmark_moves_the_resume_point(running: KubeSource, api: ApiServer, tracker: RecordingTracker) -> None:
    svc_reflector = running.reflectors[0]
    before = svc_reflector.resource_version
    # Writes to another collection move the cluster's version; only a bookmark tells the services watch.
    api.replace("endpointslices", endpoint_slice("svc0-abc", "svc0", ["10.1.0.5"]))
    api.bookmark()
    wait_for(lambda: svc_reflector.resource_version != before, what="a bookmark")
    assert int(svc_reflector.resource_version or 0) == api.rv
    # History up to the bookmark is compacted: a resume from the bookmark is still valid (no relist).
    api.compact()
    svc_reflector.backoff.initial = 0.01
    api.drop_watches()
    api.create("services", service("svc7", "10.0.0.7"))
    wait_for(lambda: "default/svc7:http" in services_of(tracker), what="svc7 after resume")
    assert svc_reflector.lists == 1


def test_a_watch_refused_with_http_410_relists(running: KubeSource, api: ApiServer,
                                               tracker: RecordingTracker) -> None:
    """410 as the watch request's own status (not an ERROR event in the stream): a relist, not a
    failure retried with the same, forever too old, resourceVersion."""
    svc_reflector = running.reflectors[0]
    lists, errors = svc_reflector.lists, svc_reflector.errors
    api.fail_next(410, path="/api/v1/services?", watch_only=True)
    api.drop_watches()
    api.create("services", service("svc9", "10.0.0.9"))
    wait_for(lambda: "default/svc9:http" in services_of(tracker), what="svc9 after the 410")
    assert svc_reflector.lists == lists + 1, "the 410 did not relist"
    # The dropped stream may count as one failed watch; the 410 itself is a relist, not a failure.
    assert svc_reflector.errors <= errors + 1, "a 410 is a relist, not a failure"


def test_server_errors_back_off_exponentially(running: KubeSource, api: ApiServer,
                                              tracker: RecordingTracker) -> None:
    svc_reflector = running.reflectors[0]
    delays: List[float] = []
    real_next = svc_reflector.backoff.next_delay

    def recording_next() -> float:
        delays.append(real_next())
        return delays[-1]

    svc_reflector.backoff.next_delay = recording_next  # type: ignore[method-assign]
    svc_reflector.backoff.initial = 0.02
    api.fail_next(503, count=4, path="/api/v1/services?", watch_only=True)
    api.drop_watches()
    api.create("services", service("svc8", "10.0.0.8"))
    wait_for(lambda: "default/svc8:http" in services_of(tracker), what="recovery")
    # The drop, then four 503s: doubling from 0.02 s, capped at FAST's 0.2 s (jitter off here).
    assert delays == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.2])
    assert svc_reflector.lists == 1  # 5xx resumes the watch; only 410 relists
    assert svc_reflector.backoff.failures == 0  # an event arrived: the next failure starts small again


def test_use_endpoints_reads_legacy_endpoints_only(api: ApiServer, api_client: client.ApiClient,
                                                   tracker: RecordingTracker) -> None:
    api.create("services", service("web", "10.0.0.1"))
    api.create("endpointslices", endpoint_slice("web-abc", "web", ["10.9.9.9"]))
    api.create("endpoints", {"metadata": {"name": "web", "namespace": "default"}, "subsets": [
        {"addresses": [{"ip": "10.2.0.1"}, {"ip": "fd00::1"}], "notReadyAddresses": [{"ip": "10.2.0.2"}],
         "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}]})
    source = start(api_client, tracker, use_endpoints=True, families=("IPv4",))
    try:
        wait_for(lambda: tracker.ready, what="sync")
        snap, _ = tracker.take()
        eps = snap.endpoints[ServicePortName("default", "web", "http")]
        assert [(str(e.ip), e.port, e.ready) for e in eps] == [("10.2.0.1", 8080, True), ("10.2.0.2", 8080, False)]
        assert not [p for m, p, q in api.requests if "endpointslices" in p]
        api.delete("endpoints", "default", "web")
        wait_for(lambda: snapshot_ips(tracker) == {"default/web:http": []}, what="endpoints deleted")
    finally:
        source.stop()


def test_stop_ends_every_thread_promptly(running: KubeSource) -> None:
    import time

    t0 = time.monotonic()
    running.stop()
    assert time.monotonic() - t0 < 2.0
    assert all(r._thread is not None and not r._thread.is_alive() for r in running.reflectors)


def _requests(api: ApiServer) -> List[Tuple[str, str]]:
    return [(m, p) for m, p, q in api.requests]


def test_read_node_gives_the_pod_cidrs_and_primary_ips(api: ApiServer, api_client: client.ApiClient) -> None:
    """What --detect-local-mode NodeCIDR and --nodeport-addresses primary read at start."""
    from netproxy.source.kube import read_node

    assert read_node(api_client, "node-a") is None
    obj = node("node-a", zone="zone-1")
    obj["spec"] = {"podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64"]}
    obj["status"] = {"addresses": [{"type": "InternalIP", "address": "192.168.1.10"},
                                   {"type": "InternalIP", "address": "fd00::10"}]}
    api.create("nodes", obj)
    api.create("nodes", node("node-b", zone="zone-2"))
    info = read_node(api_client, "node-a")
    assert info is not None and info.zone == "zone-1"
    assert [str(c) for c in info.pod_cidrs] == ["10.244.1.0/24", "fd00:10:244:1::/64"]
    assert info.ips == (ipaddress.ip_address("192.168.1.10"), ipaddress.ip_address("fd00::10"))
