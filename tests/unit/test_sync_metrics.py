"""kube-proxy's sync metrics move with real syncs of the proxier (fake backend, fake clocks)."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from prometheus_client import REGISTRY

from netproxy import metrics
from netproxy.backends.base import SyncResult
from netproxy.backends.fake import FakeBackend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Snapshot
from netproxy.core.proxier import Proxier
from netproxy.core.tracker import ChangeTracker
from netproxy.source.convert import parse_endpoint_slice, trigger_time
from tests.unit.test_proxier import eps, svc


def _value(name: str, **labels: str) -> float:
    """A sample of kube-proxy's metrics; every per-family one is looked up for IPv4 unless told."""
    if not name.startswith(("kubeproxy_sync_proxy_rules_endpoint", "kubeproxy_sync_proxy_rules_service",
                            "kubeproxy_proxy_")):
        labels.setdefault("ip_family", "IPv4")
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_programming_buckets_are_kube_proxys_merge_buckets() -> None:
    b = metrics.PROGRAMMING_BUCKETS
    # MergeBuckets(Linear(0.25,0.25,2), Linear(1,1,59), Linear(60,5,12), Linear(120,30,7)) from a 0.
    assert b[:4] == (0.0, 0.25, 0.5, 1.0) and b[61] == 59.0 and b[62:64] == (60.0, 65.0)
    assert b[-1] == 300.0 and len(b) == 1 + 2 + 59 + 12 + 7
    assert metrics.SYNC_BUCKETS[0] == 0.001 and metrics.SYNC_BUCKETS[-1] == 0.001 * 2 ** 14


def test_trigger_time_annotation_is_read_and_bad_ones_ignored() -> None:
    def obj(stamp: Optional[str]) -> dict:  # type: ignore[type-arg]
        notes = {} if stamp is None else {"endpoints.kubernetes.io/last-change-trigger-time": stamp}
        return {"kind": "EndpointSlice", "metadata": {"namespace": "default", "name": "web-1", "annotations": notes,
                                                     "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4", "ports": [{"port": 80}], "endpoints": [{"addresses": ["10.0.0.1"]}]}

    assert trigger_time(obj("2026-12-04T02:00:00Z")) == 1796349600.0
    assert trigger_time(obj("yesterday")) is None and trigger_time(obj(None)) is None
    a, b = parse_endpoint_slice(obj("2026-12-04T02:00:00Z")), parse_endpoint_slice(obj("2026-12-04T02:00:09Z"))
    assert a == b, "a new stamp alone is no endpoint change"


class CountingBackend(FakeBackend):
    """The fake, reporting rule counts by table the way a rule-counting backend does."""

    def sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        result = super().sync(snapshot, changes)
        return dataclasses.replace(result, rules_owned=(("IPv4", "nat", 3 * len(snapshot.services)),),
                                   rules_written=(("IPv4", "nat", result.services_written),))


def test_sync_metrics_move_with_syncs() -> None:
    wall = [time.time() + 50]
    tracker = ChangeTracker()
    proxier = Proxier(tracker, CountingBackend(), ProxyConfig(sync_period=30, hostname="n"), clock=lambda: wall[0],
                      wall=lambda: wall[0])
    tracker.update_service("default", "web", svc("web", "10.96.0.1"))
    tracker.update_endpoints("default", "web-1", eps("web"))
    tracker.services_synced()
    tracker.endpoints_synced()
    before = {n: _value(n) for n in ("kubeproxy_sync_proxy_rules_duration_seconds_count",
                                     "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
                                     "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
                                     "kubeproxy_network_programming_duration_seconds_count",
                                     "kubeproxy_network_programming_duration_seconds_sum")}
    proxier.sync()  # the first sync is full
    assert _value("kubeproxy_sync_full_proxy_rules_duration_seconds_count") == \
        before["kubeproxy_sync_full_proxy_rules_duration_seconds_count"] + 1
    assert _value("kubeproxy_sync_proxy_rules_iptables_total", table="nat") == 3
    # An endpoint change the EndpointSlice controller stamped 7 s before it is written: partial sync.
    stamped = dataclasses.replace(eps("web", "10.0.0.1"), trigger_time=wall[0] - 7)
    tracker.update_endpoints("default", "web-1", stamped)
    proxier.sync()
    assert _value("kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == \
        before["kubeproxy_sync_partial_proxy_rules_duration_seconds_count"] + 1
    assert _value("kubeproxy_sync_proxy_rules_duration_seconds_count") == \
        before["kubeproxy_sync_proxy_rules_duration_seconds_count"] + 2
    assert _value("kubeproxy_network_programming_duration_seconds_count") == \
        before["kubeproxy_network_programming_duration_seconds_count"] + 1
    assert _value("kubeproxy_network_programming_duration_seconds_sum") - \
        before["kubeproxy_network_programming_duration_seconds_sum"] == 7.0
    assert _value("kubeproxy_sync_proxy_rules_iptables_last", table="nat") == 1
    # A stamp from before the tracker started (a restart's initial list) is not a programming latency.
    old = dataclasses.replace(eps("web", "10.0.0.2"), trigger_time=time.time() - 3600)
    tracker.update_endpoints("default", "web-1", old)
    proxier.sync()
    assert _value("kubeproxy_network_programming_duration_seconds_count") == \
        before["kubeproxy_network_programming_duration_seconds_count"] + 1


def test_a_dual_stack_sync_is_recorded_under_both_families() -> None:
    """kube-proxy's per-family proxiers each record their sync with ip_family; netproxy's one pass
    over both families is recorded under each, and a Local service without local endpoints counts in
    the family of its addresses."""
    tracker = ChangeTracker()
    proxier = Proxier(tracker, FakeBackend(), ProxyConfig(sync_period=30, hostname="n"))
    v6 = tuple(dataclasses.replace(p, internal_traffic_policy="Local") for p in svc("web6", "fd00::10"))
    tracker.update_service("default", "web", svc("web", "10.96.0.1"))
    tracker.update_service("default", "web6", v6)
    tracker.update_endpoints("default", "web6-1", eps("web6", "fd00:1::5"))
    tracker.services_synced()
    tracker.endpoints_synced()
    before = {f: _value("kubeproxy_sync_proxy_rules_duration_seconds_count", ip_family=f) for f in ("IPv4", "IPv6")}
    proxier.sync()
    for family in ("IPv4", "IPv6"):
        assert _value("kubeproxy_sync_proxy_rules_duration_seconds_count", ip_family=family) == before[family] + 1
    assert _value("kubeproxy_sync_proxy_rules_no_local_endpoints_total", ip_family="IPv6",
                  traffic_policy="internal") == 1
    assert _value("kubeproxy_sync_proxy_rules_no_local_endpoints_total", ip_family="IPv4",
                  traffic_policy="internal") == 0
