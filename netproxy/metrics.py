"""Prometheus metrics under kube-proxy's names, types, labels and buckets (its
``pkg/proxy/metrics``), so that dashboards and alerts written for kube-proxy work unchanged; what
netproxy adds carries the ``netproxy_`` prefix.  Served by ``netproxy run`` on
``--metrics-bind-address``.
"""

from __future__ import annotations

import logging
from typing import Tuple

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

log = logging.getLogger(__name__)
# kube-proxy's Go client exposes no ``*_created`` series; prometheus_client adds one per counter and
# histogram unless told not to (the same names, nothing extra, is what "dashboards work unchanged" means).
disable_created_metrics()  # type: ignore[no-untyped-call]


def _exponential(start: float, factor: float, count: int) -> Tuple[float, ...]:
    return tuple(start * factor ** i for i in range(count))


def _linear(start: float, width: float, count: int) -> Tuple[float, ...]:
    return tuple(start + width * i for i in range(count))


SYNC_BUCKETS = _exponential(0.001, 2, 15)
"""kube-proxy's ExponentialBuckets(0.001, 2, 15): 1 ms … 16 s."""
PROGRAMMING_BUCKETS = (0.0,) + _linear(0.25, 0.25, 2) + _linear(1, 1, 59) + _linear(60, 5, 12) + _linear(120, 30, 7)
"""kube-proxy's MergeBuckets(...) of those linear runs; MergeBuckets starts from a 0 bucket."""

# -- kube-proxy's --------------------------------------------------------------------------------
SYNC_DURATION = Histogram("kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds",
                          ["ip_family"], buckets=SYNC_BUCKETS)
SYNC_FULL_DURATION = Histogram("kubeproxy_sync_full_proxy_rules_duration_seconds",
                               "SyncProxyRules latency in seconds for full resyncs", ["ip_family"],
                               buckets=SYNC_BUCKETS)
SYNC_PARTIAL_DURATION = Histogram("kubeproxy_sync_partial_proxy_rules_duration_seconds",
                                  "SyncProxyRules latency in seconds for partial resyncs", ["ip_family"],
                                  buckets=SYNC_BUCKETS)
LAST_SYNC = Gauge("kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                  "The last time proxy rules were successfully synced", ["ip_family"])
LAST_QUEUED = Gauge("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                    "The last time a sync of proxy rules was queued", ["ip_family"])
NETWORK_PROGRAMMING = Histogram("kubeproxy_network_programming_duration_seconds",
                                "In Cluster Network Programming Latency in seconds", ["ip_family"],
                                buckets=PROGRAMMING_BUCKETS)
ENDPOINT_CHANGES_PENDING = Gauge("kubeproxy_sync_proxy_rules_endpoint_changes_pending",
                                 "Pending proxy rules Endpoint changes")
ENDPOINT_CHANGES = Counter("kubeproxy_sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes")
SERVICE_CHANGES_PENDING = Gauge("kubeproxy_sync_proxy_rules_service_changes_pending",
                                "Pending proxy rules Service changes")
SERVICE_CHANGES = Counter("kubeproxy_sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes")
IPTABLES_RESTORE_FAILURES = Counter("kubeproxy_sync_proxy_rules_iptables_restore_failures",
                                    "Cumulative proxy iptables restore failures", ["ip_family"])
IPTABLES_PARTIAL_RESTORE_FAILURES = Counter("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
                                            "Cumulative proxy iptables partial restore failures", ["ip_family"])
NFTABLES_SYNC_FAILURES = Counter("kubeproxy_sync_proxy_rules_nftables_sync_failures",
                                 "Cumulative proxy nftables sync failures", ["ip_family"])
NFTABLES_CLEANUP_FAILURES = Counter("kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
                                    "Cumulative proxy nftables cleanup failures", ["ip_family"])
NO_LOCAL_ENDPOINTS = Gauge("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                           "Number of services with a Local traffic policy and no endpoints",
                           ["ip_family", "traffic_policy"])
IPTABLES_RULES = Gauge("kubeproxy_sync_proxy_rules_iptables_total",
                       "Total number of iptables rules owned by kube-proxy", ["ip_family", "table"])
IPTABLES_RULES_LAST = Gauge("kubeproxy_sync_proxy_rules_iptables_last",
                            "Number of iptables rules written by kube-proxy in last sync", ["ip_family", "table"])
HEALTHZ = Counter("kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", ["code"])
LIVEZ = Counter("kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", ["code"])
CONNTRACK_RECONCILE_DURATION = Histogram("kubeproxy_conntrack_reconciler_sync_duration_seconds",
                                         "ReconcileConntrackFlowsLatency latency in seconds", ["ip_family"],
                                         buckets=SYNC_BUCKETS)
CONNTRACK_RECONCILE_DELETED = Counter("kubeproxy_conntrack_reconciler_deleted_entries",
                                      "Cumulative conntrack flows deleted by conntrack reconciler", ["ip_family"])

# -- netproxy's own ------------------------------------------------------------------------------
SYNC_TOTAL = Counter("netproxy_sync_proxy_rules", "Syncs of the proxy rules, by result", ["result"])
REJECTED = Counter("netproxy_rejected_objects", "Source objects rejected by validation")
LAST_DURATION = Gauge("netproxy_sync_proxy_rules_last_duration_seconds",
                      "How long the last successful sync took (`netproxy status`)")
SERVICES = Gauge("netproxy_service_ports", "Service ports in the last synced snapshot")
BACKEND = Gauge("netproxy_backend_info", "The dataplane in use (value 1)", ["backend", "writer"])
IPTABLES_LOCK_WAIT = Histogram("netproxy_iptables_lock_wait_seconds",
                               "Seconds each legacy iptables write waited for the xtables lock held by another "
                               "program (a wait that hit --iptables-lock-timeout included)",
                               buckets=(0.001, 0.01, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30))
REPAIRS = Counter("netproxy_sync_proxy_rules_repairs",
                  "Full syncs forced because netproxy's rules were changed behind its back, by what was found",
                  ["reason"])


IPV4, IPV6 = "IPv4", "IPv6"
_families: Tuple[str, ...] = (IPV4,)


def set_families(families: Tuple[str, ...]) -> None:
    """The IP families the last snapshot served (kube-proxy's ``ip_family`` label values).

    kube-proxy runs one proxier per family and labels each one's metrics; netproxy syncs both
    families in one pass, so one sync is recorded under every family it served."""
    global _families
    _families = families or (IPV4,)
    for family in _families:  # every series present from the first scrape, at 0, so that rate() has a start
        for metric in (IPTABLES_RESTORE_FAILURES, IPTABLES_PARTIAL_RESTORE_FAILURES, NFTABLES_SYNC_FAILURES,
                       NFTABLES_CLEANUP_FAILURES, SYNC_DURATION, SYNC_FULL_DURATION, SYNC_PARTIAL_DURATION,
                       NETWORK_PROGRAMMING):
            metric.labels(family)


def families() -> Tuple[str, ...]:
    return _families


def record_failure(backend: str, full: bool) -> None:
    """A refused write, counted under kube-proxy's name for the backend's mode."""
    for family in _families:
        if backend == "nftables":
            NFTABLES_SYNC_FAILURES.labels(family).inc()
        elif backend == "iptables":
            IPTABLES_RESTORE_FAILURES.labels(family).inc()
            if not full:
                IPTABLES_PARTIAL_RESTORE_FAILURES.labels(family).inc()

