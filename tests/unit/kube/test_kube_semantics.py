"""What the API source makes of Services, EndpointSlices and the Node: kube-proxy's reading of them."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

import pytest
from kubernetes import client

from netproxy.core.model import NodeInfo, ServicePortName
from netproxy.source.kube import KubeSource
from netproxy.source.kube_reflector import Reflector
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import FAST, RecordingTracker, endpoint_slice, node, service, wait_for

WEB = ServicePortName("default", "web", "http")


@pytest.fixture
def tracker() -> RecordingTracker:
    return RecordingTracker()


@pytest.fixture
def source(api_client: client.ApiClient, tracker: RecordingTracker) -> Iterator[KubeSource]:
    src = KubeSource(api_client, "node-a", families=("IPv4",), settings=FAST)
    yield src
    src.stop()


def synced(src: KubeSource, tracker: RecordingTracker) -> None:
    src.start(tracker)
    wait_for(lambda: tracker.ready, what="sync")


def endpoints(tracker: RecordingTracker, name: ServicePortName = WEB) -> list:
    snap, _ = tracker.take()
    return [(str(e.ip), e.port, e.ready, e.serving, e.terminating, e.node_name, e.zone)
            for e in snap.endpoints.get(name, ())]


def test_slices_of_a_service_merge_and_dedupe(api: ApiServer, source: KubeSource,
                                              tracker: RecordingTracker) -> None:
    api.create("services", service("web", "10.0.0.1"))
    a = endpoint_slice("web-a", "web", ["10.1.0.1", "10.1.0.2"])
    a["endpoints"][0].update(nodeName="node-a", zone="zone-1")
    api.create("endpointslices", a)
    # The same address in a second slice, not ready there (a rebalance in progress): counted once, ready.
    b = endpoint_slice("web-b", "web", ["10.1.0.2", "10.1.0.3"], ready=False, serving=True, terminating=True)
    api.create("endpointslices", b)
    synced(source, tracker)
    assert endpoints(tracker) == [
        ("10.1.0.1", 8080, True, True, False, "node-a", "zone-1"),
        ("10.1.0.2", 8080, True, True, False, None, None),
        ("10.1.0.3", 8080, False, True, True, None, None),
    ]
    api.delete("endpointslices", "default", "web-a")
    wait_for(lambda: len(endpoints(tracker)) == 2, what="slice a gone")
    assert [e[0] for e in endpoints(tracker)] == ["10.1.0.2", "10.1.0.3"]


def test_address_types_the_node_does_not_serve_are_ignored(api: ApiServer, source: KubeSource,
                                                           tracker: RecordingTracker) -> None:
    api.create("services", service("web", "10.0.0.1"))
    api.create("endpointslices", endpoint_slice("web-v4", "web", ["10.1.0.1"]))
    api.create("endpointslices", endpoint_slice("web-v6", "web", ["fd00::1"], address_type="IPv6"))
    fqdn = endpoint_slice("web-fqdn", "web", [], address_type="FQDN")
    fqdn["endpoints"] = [{"addresses": ["db.example.com"]}]
    api.create("endpointslices", fqdn)
    synced(source, tracker)
    assert [e[0] for e in endpoints(tracker)] == ["10.1.0.1"]
    assert not tracker.errors  # ignored, not rejected
    assert sorted(tracker.named("replace_endpoints")[0][1]) == [("default", "web-v4")]


def test_headless_and_external_name_services_program_nothing(api: ApiServer, source: KubeSource,
                                                             tracker: RecordingTracker) -> None:
    api.create("services", service("headless", "None", clusterIPs=["None"]))
    api.create("services", {"metadata": {"name": "ext", "namespace": "default"},
                            "spec": {"type": "ExternalName", "externalName": "db.example.com"}})
    api.create("services", service("web", "10.0.0.1"))
    api.create("endpointslices", endpoint_slice("headless-a", "headless", ["10.1.0.5"]))
    synced(source, tracker)
    snap, _ = tracker.take()
    assert sorted(str(k) for k in snap.services) == ["default/web:http"]
    assert not tracker.errors


def test_selectorless_service_with_manual_slices(api: ApiServer, source: KubeSource,
                                                 tracker: RecordingTracker) -> None:
    # No spec.selector: the user manages the slice; it names the service by the usual label.
    api.create("services", service("legacy-db", "10.0.0.9", port=5432))
    manual = endpoint_slice("legacy-db-manual", "legacy-db", ["192.168.50.10"], port=5432)
    manual["ports"][0]["name"] = "http"
    api.create("endpointslices", manual)
    synced(source, tracker)
    assert endpoints(tracker, ServicePortName("default", "legacy-db", "http")) == [
        ("192.168.50.10", 5432, True, True, False, None, None)]


def test_invalid_objects_are_rejected_alone(api: ApiServer, source: KubeSource,
                                            tracker: RecordingTracker) -> None:
    api.create("services", service("web", "10.0.0.1"))
    api.create("services", service("bad", "10.0.0.2", port=70000))
    api.create("endpointslices", endpoint_slice("web-a", "web", ["10.1.0.1"]))
    synced(source, tracker)
    assert [str(e) for e in tracker.errors] == [
        "Service default/bad: field spec.ports[0].port: 70000 is outside 1..65535"]
    assert [e[0] for e in endpoints(tracker)] == ["10.1.0.1"]
    # A valid service turned invalid by an update is removed, not kept in its stale form.
    api.replace("services", service("web", "10.0.0.1", port=0))
    wait_for(lambda: len(tracker.errors) == 2, what="second rejection")
    wait_for(lambda: not tracker.take()[0].services, what="web removed")
    assert tracker.named("update_service")[-1][1:] == ("default", "web", None)
    api.replace("services", service("web", "10.0.0.1"))
    wait_for(lambda: WEB in tracker.take()[0].services, what="web back")


def test_slice_names_are_subdomains_in_lists(api: ApiServer, source: KubeSource, tracker: RecordingTracker) -> None:
    # List items carry no kind; the source must still read them as EndpointSlices (dots are legal).
    api.create("services", service("web", "10.0.0.1"))
    api.create("endpointslices", endpoint_slice("web.v1-x", "web", ["10.1.0.1"]))
    synced(source, tracker)
    assert not tracker.errors
    assert [e[0] for e in endpoints(tracker)] == ["10.1.0.1"]


def test_node_zone_follows_the_label_and_ignores_noise(api: ApiServer, source: KubeSource,
                                                       tracker: RecordingTracker) -> None:
    api.create("nodes", node("node-b", zone="zone-9"))
    synced(source, tracker)
    wait_for(lambda: tracker.named("set_node"), what="the node list")  # its own reflector: not part of ready
    # The node does not exist yet: a name, no zone.
    assert tracker.named("set_node") == [("set_node", NodeInfo("node-a"))]
    api.create("nodes", node("node-a", zone="zone-1"))
    wait_for(lambda: tracker.take()[0].node.zone == "zone-1", what="zone")
    api.replace("nodes", node("node-a", zone="zone-1", role="worker"))  # a change that is not the zone
    api.replace("nodes", node("node-b", zone="zone-3"))  # another node
    api.replace("nodes", node("node-a", zone="zone-2"))
    wait_for(lambda: tracker.take()[0].node.zone == "zone-2", what="new zone")
    assert [c[1].zone for c in tracker.named("set_node")] == [None, "zone-1", "zone-2"]
    api.replace("nodes", node("node-a", zone="not a zone!"))
    wait_for(lambda: tracker.errors, what="rejection")
    assert tracker.take()[0].node == NodeInfo("node-a")
    assert "Node node-a: field metadata.labels[topology.kubernetes.io/zone]" in str(tracker.errors[0])


class Collecting:
    def __init__(self) -> None:
        self.replaced: list = []
        self.events: list = []

    def replace(self, items: Iterator[dict]) -> None:
        names = [i["metadata"]["name"] for i in items]  # consumed fully before anything is kept
        self.replaced.append(names)

    def apply(self, event_type: str, obj: dict) -> None:
        self.events.append((event_type, obj["metadata"]["name"]))


def test_expired_continue_token_restarts_the_list(api: ApiServer, api_client: client.ApiClient) -> None:
    for i in range(5):
        api.create("services", service(f"svc{i}", f"10.0.0.{i + 1}"))
    api.fail_next(410, path="continue=")  # the second page's token has expired
    handler = Collecting()
    core = client.CoreV1Api(api_client)
    r = Reflector("Service", core.list_service_for_all_namespaces, handler, FAST)
    r.start()
    try:
        wait_for(lambda: handler.replaced, what="a complete list")
        # The partial first attempt was never handed over; the complete one was, once.
        assert handler.replaced == [["svc0", "svc1", "svc2", "svc3", "svc4"]]
        pages = [q for m, p, q in api.requests if "watch" not in q]
        assert ["continue" in q for q in pages] == [False, True, False, True, True]
        assert r.errors == 0  # 410 is a relist, not a failure
    finally:
        r.stop()


def test_lists_that_keep_expiring_back_off(api: ApiServer, api_client: client.ApiClient) -> None:
    for i in range(3):
        api.create("services", service(f"svc{i}", f"10.0.0.{i + 1}"))
    api.fail_next(410, count=3, path="continue=")
    handler = Collecting()
    core = client.CoreV1Api(api_client)
    settings = replace(FAST, backoff_initial=0.1, backoff_cap=1.0)
    r = Reflector("Service", core.list_service_for_all_namespaces, handler, settings)
    t0 = time.monotonic()
    r.start()
    try:
        wait_for(lambda: handler.replaced, what="a complete list")
        # Three expired attempts waited 0.1 + 0.2 + 0.4 s before the fourth list went through.
        assert time.monotonic() - t0 >= 0.7
        assert handler.replaced == [["svc0", "svc1", "svc2"]]
        assert r.backoff.failures == 0  # reset by the list that succeeded
    finally:
        r.stop()
