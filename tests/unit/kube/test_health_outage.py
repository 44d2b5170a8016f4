"""/healthz through an API outage (fault 6 of the fault suite), the whole `run` loop in process: the real source
against the stand-in, the tracker, the proxier and its runner, a fake backend.

While the API is down nothing is pending, so /healthz stays 200; a change that arrives and cannot be
written turns it 503 once it has waited the healthz timeout, and it is 200 again by itself once the
write succeeds.  (The kernel side of the outage is tests/faults/test_api.py.)
"""

from __future__ import annotations

import threading
import time
from typing import Any, List

from kubernetes import client

from netproxy.backends.base import SyncError, SyncResult
from netproxy.backends.fake import FakeBackend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, NodeInfo, Snapshot
from netproxy.core.proxier import Proxier
from netproxy.core.runner import BoundedFrequencyRunner
from netproxy.core.tracker import ChangeTracker
from netproxy.observe.healthcheck import ProxyHealth
from netproxy.source.kube import KubeSource
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import FAST, endpoint_slice, node, service, wait_for

TIMEOUT = 1.0


class Refusing(FakeBackend):
    """A fake backend whose writes fail while ``refuse`` is set (a kernel that says no)."""

    refuse = False

    def sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        if self.refuse:
            raise SyncError("refused for the test")
        return super().sync(snapshot, changes)


def endpoints(backend: FakeBackend) -> List[str]:
    return sorted(str(e) for _, eps in backend.state.values() for e in eps)


def test_healthz_through_an_outage_and_a_change_that_cannot_be_written(api: ApiServer,
                                                                       api_client: client.ApiClient) -> None:
    api.create("services", service("web", "10.96.0.10"))
    api.create("endpointslices", endpoint_slice("web-a", "web", ["10.244.1.10"]))
    api.create("nodes", node("node-a"))
    config = ProxyConfig(backend="fake", hostname="node-a", min_sync_period=0.05, sync_period=3.0)
    tracker = ChangeTracker(NodeInfo(name="node-a"))
    backend = Refusing(config)
    proxier = Proxier(tracker, backend, config)
    health = ProxyHealth(TIMEOUT)
    proxier.health = health  # as `netproxy run` wires them
    proxier.after_sync.append(lambda prev, cur, changed: health.synced())
    runner = BoundedFrequencyRunner(proxier.sync, config.min_sync_period, config.sync_period)
    proxier.retry = runner.retry_after

    def queued() -> None:  # what wiring.QueuedChanges does for health
        health.queued()
        runner.request()

    tracker.on_change = queued
    stop = threading.Event()
    loop = threading.Thread(target=runner.loop, args=(stop,), daemon=True)
    source = KubeSource(api_client, "node-a", settings=FAST)
    loop.start()
    source.start(tracker)
    codes: List[Any] = []
    try:
        wait_for(lambda: endpoints(backend) == ["10.244.1.10:8080"], what="the first sync")
        api.go_down(2.0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            codes.append(health.status()[0])
            time.sleep(0.05)
        assert set(codes) == {200}, "unhealthy during an outage with nothing pending"
        backend.refuse = True
        wait_for(lambda: api.store.down_until < time.monotonic(), what="the API back")
        api.replace("endpointslices", endpoint_slice("web-a", "web", ["10.244.1.11"]))
        wait_for(lambda: health.oldest_queued is not None, timeout=10, what="the change to arrive")
        queued_at = time.monotonic()
        assert health.status()[0] == 200, "unhealthy before the timeout"
        wait_for(lambda: health.status()[0] == 503, timeout=5, what="503 once the change waited the timeout")
        assert time.monotonic() - queued_at >= TIMEOUT * 0.9
        backend.refuse = False
        wait_for(lambda: health.status()[0] == 200, timeout=10, what="200 again by itself")
        assert endpoints(backend) == ["10.244.1.11:8080"]
    finally:
        source.stop()
        stop.set()
        runner.wake()
        loop.join(timeout=5)


def test_an_event_that_changes_nothing_is_not_left_pending() -> None:
    """A node re-sent as it was reaches the tracker (and /healthz's queue) but changes no rule: the
    sync that finds nothing to write must still count it handled, or /healthz turns 503 once the
    timeout is shorter than the time to the next full sync."""
    config = ProxyConfig(backend="fake", hostname="node-a", sync_period=3600.0)
    tracker = ChangeTracker(NodeInfo(name="node-a"))
    proxier = Proxier(tracker, FakeBackend(config), config)
    health = ProxyHealth(TIMEOUT)
    proxier.health = health
    tracker.services_synced()
    tracker.endpoints_synced()
    proxier.sync()  # the first, full sync
    tracker.on_change = health.queued
    tracker.set_node(NodeInfo(name="node-a"))  # no news
    assert health.oldest_queued is not None
    proxier.sync()
    assert health.oldest_queued is None
