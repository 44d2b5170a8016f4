"""The proxier against the in-memory fake backend, with a fake clock."""

from __future__ import annotations

import ipaddress
from typing import Dict, List, Optional, Tuple

import pytest

from netproxy.backends.fake import FakeBackend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import (
    Changes,
    Endpoint,
    EndpointSet,
    NodeInfo,
    ServicePort,
    ServicePortName,
    SlicePort,
    Snapshot,
)
from netproxy.core.perport import Changed
from netproxy.core.proxier import Proxier
from netproxy.core.runner import BoundedFrequencyRunner
from netproxy.core.tracker import ChangeTracker
from netproxy_lab.manifests import service_port

ip = ipaddress.ip_address
WEB = ServicePortName("default", "web", "")
API = ServicePortName("default", "api", "")


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def svc(name: str, cluster_ip: str) -> Tuple[ServicePort, ...]:
    return (service_port(name, port_name="", cluster_ip=cluster_ip),)


def eps(service: str, *addresses: str) -> EndpointSet:
    return EndpointSet("default", service, (SlicePort("", "TCP", 8080),),
                       tuple(Endpoint(ip(a), 0) for a in addresses))


class Setup:
    def __init__(self, sync_period: float = 30.0, ready: bool = True) -> None:
        self.clock = Clock()
        self.tracker = ChangeTracker()
        self.backend = FakeBackend()
        self.proxier = Proxier(self.tracker, self.backend, ProxyConfig(sync_period=sync_period, hostname="node-a"),
                               clock=self.clock)
        self.retries: List[float] = []
        self.proxier.retry = self.retries.append
        self.tracker.update_service("default", "web", svc("web", "10.96.0.1"))
        self.tracker.update_service("default", "api", svc("api", "10.96.0.2"))
        self.tracker.update_endpoints("default", "web-1", eps("web", "10.0.0.1"))
        self.tracker.update_endpoints("default", "api-1", eps("api", "10.0.1.1"))
        if ready:
            self.tracker.services_synced()
            self.tracker.endpoints_synced()

    def state(self) -> Dict[str, List[str]]:
        return {str(n): [str(e) for e in entry[1]] for n, entry in sorted(self.backend.state.items())}

    def last(self) -> Changes:
        return self.backend.syncs[-1]


def test_no_write_before_services_and_endpoints_were_seen() -> None:
    s = Setup(ready=False)
    s.proxier.sync()
    s.tracker.services_synced()
    s.proxier.sync()
    assert s.backend.syncs == []
    s.tracker.endpoints_synced()
    s.proxier.sync()
    assert len(s.backend.syncs) == 1


def test_no_write_with_only_endpoints_synced() -> None:
    s = Setup(ready=False)
    s.tracker.endpoints_synced()
    s.proxier.sync()
    assert s.backend.syncs == []


def test_first_sync_is_full() -> None:
    s = Setup()
    s.proxier.sync()
    assert s.last().full
    assert s.state() == {"default/api": ["10.0.1.1:8080"], "default/web": ["10.0.0.1:8080"]}
    assert s.proxier.last_result is not None and s.proxier.last_result.services_written == 2


def test_later_syncs_are_partial_with_the_changed_names() -> None:
    s = Setup()
    s.proxier.sync()
    s.clock.now += 1
    s.tracker.update_endpoints("default", "api-1", eps("api", "10.0.1.1", "10.0.1.2"))
    s.proxier.sync()
    assert s.last() == Changes(full=False, services=frozenset({API}))
    assert s.state()["default/api"] == ["10.0.1.1:8080", "10.0.1.2:8080"]
    assert s.proxier.last_result is not None and s.proxier.last_result.services_written == 1


def test_a_deleted_service_is_named_and_removed() -> None:
    s = Setup()
    s.proxier.sync()
    s.tracker.update_service("default", "web", None)
    s.proxier.sync()
    assert s.last() == Changes(full=False, services=frozenset({WEB}))
    assert list(s.state()) == ["default/api"]


def test_nothing_changed_means_no_write() -> None:
    s = Setup()
    s.proxier.sync()
    s.clock.now += 5
    s.proxier.sync()
    assert len(s.backend.syncs) == 1


def test_periodic_full_sync_every_sync_period() -> None:
    s = Setup(sync_period=30)
    s.proxier.sync()                                   # t=0 full
    s.clock.now += 10
    s.tracker.update_endpoints("default", "web-1", eps("web", "10.0.0.2"))
    s.proxier.sync()                                   # t=10 partial: does not restart the period
    s.clock.now += 19.5
    s.proxier.sync()                                   # t=29.5: nothing changed, not due
    s.clock.now += 0.5
    s.proxier.sync()                                   # t=30: full, with nothing changed
    s.clock.now += 29
    s.proxier.sync()                                   # t=59: not due
    s.clock.now += 1
    s.proxier.sync()                                   # t=60: full
    assert [c.full for c in s.backend.syncs] == [True, False, True, True]


def test_a_node_change_makes_the_sync_full() -> None:
    s = Setup()
    s.proxier.sync()
    s.tracker.set_node(NodeInfo("node-a", "zone-2"))
    s.proxier.sync()
    assert s.last().full


def test_failure_keeps_the_old_state_and_the_next_sync_is_full() -> None:
    s = Setup()
    s.proxier.sync()
    before = dict(s.backend.state)
    s.tracker.update_endpoints("default", "api-1", eps("api", "10.0.1.9"))
    s.backend.fail_next = "-A KUBE-SVC-XYZ -j KUBE-SEP-ABC"
    s.proxier.sync()
    assert s.backend.state == before
    assert s.proxier.last_error is not None and s.proxier.last_error.line == "-A KUBE-SVC-XYZ -j KUBE-SEP-ABC"
    assert s.retries == [1.0]
    s.clock.now += 1
    s.proxier.sync()  # nothing new in the tracker: the retry is full, so the lost change is written
    assert s.last().full
    assert s.state()["default/api"] == ["10.0.1.9:8080"]
    assert s.proxier.last_error is None


def test_backoff_grows_and_is_capped_by_the_sync_period() -> None:
    s = Setup(sync_period=10)
    for _ in range(6):
        s.backend.fail_next = "x"
        s.proxier.sync()
        s.clock.now += 1
    assert s.retries == [1, 2, 4, 8, 10, 10]
    assert all(c.full for c in s.backend.syncs)
    s.proxier.sync()  # succeeds
    s.backend.fail_next = "x"
    s.tracker.update_service("default", "web", svc("web", "10.96.0.9"))
    s.proxier.sync()
    assert s.retries[-1] == 1  # a success resets the backoff


def test_after_sync_hooks_see_previous_current_and_changed_and_cannot_break_the_sync() -> None:
    s = Setup()
    seen: List[Tuple[Optional[Snapshot], Snapshot, Changed]] = []

    def broken(prev: Optional[Snapshot], cur: Snapshot, changed: Changed) -> None:
        raise RuntimeError("hook failed")

    s.proxier.after_sync.extend([broken, lambda prev, cur, changed: seen.append((prev, cur, changed))])
    s.proxier.sync()
    s.tracker.update_service("default", "web", None)
    s.proxier.sync()
    assert len(seen) == 2
    assert seen[0][0] is None and set(seen[0][1].services) == {API, WEB}
    assert seen[0][2] is None  # the first sync is full: anything may have changed
    assert seen[1][0] is seen[0][1] and set(seen[1][1].services) == {API}
    assert seen[1][2] == frozenset({WEB})  # a partial sync names the ports it changed, deleted ones too
    assert s.proxier.last_error is None


def test_hooks_do_not_run_after_a_failed_sync() -> None:
    s = Setup()
    calls: List[int] = []
    s.proxier.after_sync.append(lambda prev, cur, changed: calls.append(1))
    s.backend.fail_next = "x"
    s.proxier.sync()
    assert calls == []


# -- with the runner: events drive syncs, failures drive retries ------------------------------------------

@pytest.mark.parametrize("failures, expected_runs", [(0, [0.0]), (3, [0.0, 1.0, 3.0, 7.0])])
def test_runner_and_proxier_retry_with_backoff(failures: int, expected_runs: List[float]) -> None:
    s = Setup()
    runner = BoundedFrequencyRunner(s.proxier.sync, 0.5, 30, clock=s.clock)
    s.proxier.retry = runner.retry_after
    s.tracker.on_change = runner.request
    fail = [failures]
    real_sync = s.backend.sync

    def flaky(snapshot: Snapshot, changes: Changes):  # type: ignore[no-untyped-def]
        if fail[0]:
            fail[0] -= 1
            s.backend.fail_next = "refused"
        return real_sync(snapshot, changes)

    s.backend.sync = flaky  # type: ignore[method-assign]
    start = s.clock.now
    runs: List[float] = []
    while s.clock.now < start + 20:
        if runner.step():
            runs.append(s.clock.now - start)
        s.clock.now += 0.25
    assert runs == expected_runs
    assert s.state() == {"default/api": ["10.0.1.1:8080"], "default/web": ["10.0.0.1:8080"]}


def test_an_endpoint_event_triggers_a_run_through_the_runner() -> None:
    s = Setup()
    runner = BoundedFrequencyRunner(s.proxier.sync, 1, 30, clock=s.clock)
    s.tracker.on_change = runner.request
    assert runner.step()
    s.clock.now += 2
    assert not runner.step()  # nothing requested, not yet max_interval
    s.tracker.update_endpoints("default", "web-1", eps("web", "10.0.0.5"))
    assert runner.step()
    assert s.last() == Changes(full=False, services=frozenset({WEB}))
    assert s.state()["default/web"] == ["10.0.0.5:8080"]
