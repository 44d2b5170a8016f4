"""A tracker fed the smallest synced cluster (one TCP service, one endpoint): the unit tests of the
proxier and of the wiring start from it."""

from __future__ import annotations

import ipaddress

from netproxy.core.model import Endpoint, EndpointSet, ServicePort, ServicePortName, SlicePort
from netproxy.core.tracker import ChangeTracker


def feed_web(tracker: ChangeTracker) -> None:
    """default/web: cluster IP 10.96.0.1:80 → 10.0.0.1:8080; both lists synced."""
    name = ServicePortName("default", "web", "")
    tracker.update_service("default", "web", (ServicePort(name, "TCP", 80, 8080,
                                                          cluster_ips=(ipaddress.ip_address("10.96.0.1"),)),))
    tracker.update_endpoints("default", "web-1", EndpointSet("default", "web", (SlicePort("", "TCP", 8080),),
                                                             (Endpoint(ipaddress.ip_address("10.0.0.1"), 0),)))
    tracker.services_synced()
    tracker.endpoints_synced()
