"""kube-proxy's informer filter: Services and EndpointSlices are listed and watched with
``!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name``; the file source drops
the same objects.  A service of another proxy is never programmed, a headless service's slices never
reach the tracker, and a label added to a live service takes it away (the server's watch turns the
change into DELETED)."""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterator

import pytest
from kubernetes import client

from netproxy.source.convert import PROXY_LABEL_SELECTOR, not_for_this_proxy
from netproxy.source.files import parse_objects
from netproxy.source.kube import KubeSource
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import FAST, RecordingTracker, endpoint_slice, service, wait_for

OTHER_PROXY = {"service.kubernetes.io/service-proxy-name": "cilium"}
HEADLESS = {"service.kubernetes.io/headless": ""}


def labelled(obj: Dict[str, Any], labels: Dict[str, str]) -> Dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"].setdefault("labels", {}).update(labels)
    return out


def test_the_selector_is_kube_proxys() -> None:
    assert PROXY_LABEL_SELECTOR == "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
    assert not_for_this_proxy(labelled(service("a", "10.0.0.1"), OTHER_PROXY)) == \
        "service.kubernetes.io/service-proxy-name"
    assert not_for_this_proxy(service("a", "10.0.0.1")) is None
    assert not_for_this_proxy({"metadata": {"labels": "not a map"}}) is None  # validation's business


def test_the_file_source_skips_and_counts_what_the_informers_would_not_list() -> None:
    objects = [
        {"kind": "Service", **service("mine", "10.0.0.1")},
        {"kind": "EndpointSlice", **endpoint_slice("mine-1", "mine", ["10.1.0.1"])},
        {"kind": "Service", **labelled(service("theirs", "10.0.0.2"), OTHER_PROXY)},
        {"kind": "EndpointSlice", **labelled(endpoint_slice("theirs-1", "theirs", ["10.1.0.2"]), OTHER_PROXY)},
        {"kind": "EndpointSlice", **labelled(endpoint_slice("db-1", "db", ["10.1.0.3"]), HEADLESS)},
    ]
    loaded = parse_objects(iter(objects))
    assert sorted(loaded.services) == [("default", "mine")]
    assert sorted(loaded.endpoints) == [("default", "mine-1")]
    assert loaded.skipped == 3 and loaded.errors == []


@pytest.fixture
def source(api: ApiServer, api_client: client.ApiClient) -> Iterator[RecordingTracker]:
    api.create("services", service("mine", "10.0.0.1"))
    api.create("services", labelled(service("theirs", "10.0.0.2"), OTHER_PROXY))
    api.create("endpointslices", endpoint_slice("mine-1", "mine", ["10.1.0.1"]))
    api.create("endpointslices", labelled(endpoint_slice("theirs-1", "theirs", ["10.1.0.2"]), OTHER_PROXY))
    api.create("endpointslices", labelled(endpoint_slice("db-1", "db", ["10.1.0.3"]), HEADLESS))
    tracker = RecordingTracker()
    src = KubeSource(api_client, "node-a", settings=FAST)
    src.start(tracker)
    try:
        wait_for(lambda: tracker.ready, what="both lists")
        for plural in ("services", "endpointslices"):
            assert api.wait_watchers(plural), plural
        yield tracker
    finally:
        src.stop()


def test_lists_and_watches_carry_the_selector_and_hold_only_this_proxys_objects(
        source: RecordingTracker, api: ApiServer) -> None:
    for plural in ("services", "endpointslices"):
        sent = [q for _, path, q in api.requests if path.endswith("/" + plural)]
        assert sent and all(q.get("labelSelector") == PROXY_LABEL_SELECTOR for q in sent), (plural, sent)
    snap, _ = source.take()
    assert sorted(str(k) for k in snap.services) == ["default/mine:http"]
    assert sorted(str(k) for k in snap.endpoints) == ["default/mine:http"]
    # A headless service's slice changing wakes nothing: the server never sends it.
    before = len(source.calls)
    api.replace("endpointslices", labelled(endpoint_slice("db-1", "db", ["10.1.0.4"]), HEADLESS))
    api.replace("endpointslices", endpoint_slice("mine-1", "mine", ["10.1.0.9"]))
    wait_for(lambda: any(c[0] == "update_endpoints" and c[2] == "mine-1" for c in source.calls[before:]),
             what="the change to mine-1")
    assert not [c for c in source.calls[before:] if c[0] == "update_endpoints" and c[2] == "db-1"]


def test_a_service_handed_to_another_proxy_goes_away(source: RecordingTracker, api: ApiServer) -> None:
    api.replace("services", labelled(service("mine", "10.0.0.1"), OTHER_PROXY))
    wait_for(lambda: not source.take()[0].services, what="the service to leave")
    api.replace("services", service("mine", "10.0.0.1"))  # and back: ADDED again
    wait_for(lambda: [str(k) for k in source.take()[0].services] == ["default/mine:http"],
             what="the service to return")
