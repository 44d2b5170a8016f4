"""Prometheus metrics (kube-proxy's names where one exists), served by ``netproxy run``."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

SYNC_DURATION = Histogram(
    "netproxy_sync_proxy_rules_duration_seconds", "Time of one sync of the proxy rules", ["mode"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
SYNC_TOTAL = Counter("netproxy_sync_proxy_rules_total", "Syncs of the proxy rules", ["result"])
LAST_SYNC = Gauge("netproxy_sync_proxy_rules_last_timestamp_seconds", "When the rules were last synced successfully")
REJECTED = Counter("netproxy_rejected_objects_total", "Source objects rejected by validation")
SERVICES = Gauge("netproxy_service_ports", "Service ports in the last synced snapshot")


def serve(address: str) -> None:
    """Serve /metrics on ``host:port``; a port already taken is logged, not fatal."""
    if not address:
        return
    host, _, port = address.rpartition(":")
    try:
        start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0")
    except (OSError, ValueError) as err:
        log.warning("metrics not served on %s: %s", address, err)
