"""The API source's ServiceCIDR list-watch (networking.k8s.io/v1, cluster-scoped) against the
stand-in: listed, added, changed, deleted and rejected objects reach the snapshot's service CIDRs."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import replace
from typing import Any, Dict, Tuple

import pytest
from kubernetes import client

from netproxy.core.model import IPNetwork
from netproxy.source.kube import KubeSource
from netproxy_lab.apiserver import ApiServer
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


@pytest.mark.parametrize("status", [404, 403])
def test_a_server_without_service_cidrs_gets_one_line_and_a_slow_recheck(
        api: ApiServer, api_client: client.ApiClient, status: int, caplog: pytest.LogCaptureFixture) -> None:
    """An older server (404) or an account without the RBAC rule (403): one WARNING naming the
    resource and what netproxy does instead, no ERROR, re-checked every ``absent_recheck``; services
    and endpoints sync as ever, the flag's CIDRs stand; the resource appearing later is picked up."""
    api.store.unserved["servicecidrs"] = status
    tracker = RecordingTracker(service_cidrs=(net("10.200.0.0/24"),))
    source = KubeSource(api_client, "node-a", settings=replace(FAST, absent_recheck=0.5))
    caplog.set_level(logging.DEBUG, logger="netproxy.source.kube_reflector")
    source.start(tracker)
    try:
        wait_for(lambda: tracker.ready, what="services and endpoints, without the ServiceCIDRs")
        wait_for(lambda: len([q for _, p, q in api.requests if p.endswith("/servicecidrs")]) >= 3,
                 what="three checks of the ServiceCIDRs")
        said = [r for r in caplog.records if "ServiceCIDR" in r.getMessage()]
        loud = [r for r in said if r.levelno >= logging.WARNING]
        assert len(loud) == 1 and loud[0].levelno == logging.WARNING, [r.getMessage() for r in said]
        assert f"HTTP {status}" in loud[0].getMessage()
        assert "--service-cluster-ip-range" in loud[0].getMessage() and "every 0.5s" in loud[0].getMessage()
        assert cidrs_of(tracker) == (net("10.200.0.0/24"),)
        # The cluster is upgraded (or the role fixed): the next check lists it.
        api.create("servicecidrs", service_cidr("kubernetes", "10.96.0.0/16"))
        del api.store.unserved["servicecidrs"]
        wait_for(lambda: net("10.96.0.0/16") in cidrs_of(tracker), what="the ServiceCIDR once served")
    finally:
        source.stop()
