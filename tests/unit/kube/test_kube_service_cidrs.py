"""The API source's ServiceCIDR list-watch (networking.k8s.io/v1, cluster-scoped) against the
stand-in: listed, added, changed, deleted and rejected objects reach the snapshot's service CIDRs."""

from __future__ import annotations

import ipaddress
from typing import Any, Dict, Tuple

from kubernetes import client

from netproxy.model import IPNetwork
from netproxy.source.kube import KubeSource
from tests.unit.kube.apiserver import ApiServer
from tests.unit.kube.kube_helpers import FAST, RecordingTracker, wait_for

net = ipaddress.ip_network


def service_cidr(name: str, *cidrs: str) -> Dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": name},
            "spec": {"cidrs": list(cidrs)}}


def cidrs_of(tracker: RecordingTracker) -> Tuple[IPNetwork, ...]:
    return tracker.take()[0].service_cidrs


def test_service_cidrs_follow_the_api(api: ApiServer, api_client: client.ApiClient) -> None:
    api.create("servicecidrs", service_cidr("kubernetes", "10.96.0.0/16", "fd00:10:96::/112"))
    tracker = RecordingTracker(service_cidrs=(net("10.200.0.0/24"),))  # --service-cluster-ip-range
    source = KubeSource(api_client, "node-a", settings=FAST)
    source.start(tracker)
    try:
        want = (net("10.96.0.0/16"), net("10.200.0.0/24"), net("fd00:10:96::/112"))
        wait_for(lambda: cidrs_of(tracker) == want, what="the listed ServiceCIDR")
        assert api.wait_watchers("servicecidrs")
        api.create("servicecidrs", service_cidr("extra", "10.100.0.0/24"))
        wait_for(lambda: net("10.100.0.0/24") in cidrs_of(tracker), what="an added ServiceCIDR")
        rejected = tracker.rejected
        api.replace("servicecidrs", service_cidr("extra", "10.100.0.0/99"))
        wait_for(lambda: net("10.100.0.0/24") not in cidrs_of(tracker), what="a ServiceCIDR turned invalid")
        assert tracker.rejected == rejected + 1
        api.delete("servicecidrs", "", "kubernetes")
        wait_for(lambda: cidrs_of(tracker) == (net("10.200.0.0/24"),), what="a deleted ServiceCIDR (the flag's stays)")
        paths = {path for _, path, _ in api.requests}
        assert "/apis/networking.k8s.io/v1/servicecidrs" in paths
    finally:
        source.stop()
