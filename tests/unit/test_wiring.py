"""netproxy/wiring.py: `netproxy run`'s graph, built from one ProxyConfig, is joined the way the
proxy relies on (a change asks for a sync and starts /healthz's clock, a failed write schedules the
runner's retry, a changed pod CIDR stops the proxy), and every backend is made by new_backend."""

from __future__ import annotations

import ipaddress
from typing import Any, List, Optional, Tuple

import pytest

from netproxy import backends, wiring
from netproxy.backends.fake import FakeBackend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import NodeInfo
from netproxy.core.tracker import ChangeTracker
from tests.unit.trackers import feed_web

ip, net = ipaddress.ip_address, ipaddress.ip_network


class Quiet:
    """A source that delivers nothing by itself: the test feeds the tracker."""

    def __init__(self) -> None:
        self.started: Optional[ChangeTracker] = None
        self.stopped = False

    def start(self, tracker: ChangeTracker) -> None:
        self.started = tracker

    def stop(self) -> None:
        self.stopped = True


def build(**settings: Any) -> Tuple[wiring.Proxy, FakeBackend, Quiet]:
    settings.setdefault("min_sync_period", 0.0)  # the runner may sync again at once: steps need no clock
    config = ProxyConfig(backend="fake", hostname="node-a", metrics_bind_address="", healthz_bind_address="",
                         **settings)
    backend, source = FakeBackend(config), Quiet()
    return wiring.build_proxy(config, backend, source), backend, source


def test_a_change_asks_for_a_sync_and_starts_the_health_clock() -> None:
    proxy, backend, source = build()
    proxy.runner.step()  # the first, requested at start: the tracker is not ready, nothing is written
    assert backend.state == {} and not proxy.runner.step()
    feed_web(proxy.tracker)
    assert proxy.health.oldest_queued is not None
    assert proxy.runner.step(), "the change did not ask the runner for a sync"
    assert [str(e) for _, eps in backend.state.values() for e in eps] == ["10.0.0.1:8080"]
    assert proxy.health.oldest_queued is None and proxy.health.last_ok is not None  # the after-sync hook


def test_a_failed_write_schedules_the_runners_retry() -> None:
    proxy, backend, _ = build()
    feed_web(proxy.tracker)
    backend.fail_next = "line 1: refused"
    proxy.runner.step()
    assert proxy.proxier.last_error is not None
    assert proxy.runner._retry_at is not None, "the proxier's retry does not reach the runner"


def test_start_and_close_drive_the_source() -> None:
    proxy, _, source = build()
    proxy.start()
    proxy.close()
    assert source.started is proxy.tracker and source.stopped


def test_a_changed_pod_cidr_stops_the_proxy_with_a_reason() -> None:
    proxy, _, _ = build(detect_local_mode="NodeCIDR", node_pod_cidrs=(net("10.244.1.0/24"),))
    feed_web(proxy.tracker)
    proxy.tracker.set_node(NodeInfo(name="node-a", pod_cidrs=(net("10.244.9.0/24"),)))
    proxy.runner.step()
    assert proxy.stop.is_set() and "10.244.9.0/24" in proxy.failures[0]


def test_halt_tells_the_backend_so_that_a_lock_wait_ends() -> None:
    """The stop (SIGTERM) reaches the backend at once, not after the sync under way: an iptables sync
    waiting for the xtables lock gives up (test_xtlock.py) instead of delaying the exit."""
    proxy, backend, _ = build()
    assert not backend.halted
    proxy.halt()
    assert backend.halted and proxy.stop.is_set()


def test_the_fake_backend_needs_no_kernel_cleanup() -> None:
    proxy, _, _ = build()
    assert not wiring.is_kernel(proxy.backend)
    assert len(proxy.proxier.after_sync) == 4  # no conntrack reconciler: leftovers, services, healthz x2


def test_new_backend_gives_the_lock_waits_to_a_backend_that_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    class Locking(FakeBackend):
        def __init__(self, config: ProxyConfig) -> None:
            super().__init__(config)
            self.on_lock_wait = lambda seconds: None

    monkeypatch.setattr(backends, "create", lambda name, config: Locking(config))
    waits: List[float] = []
    backend = wiring.new_backend("iptables", ProxyConfig(hostname="n"), waits.append)
    backend.on_lock_wait(0.5)  # type: ignore[attr-defined]
    assert waits == [0.5]
