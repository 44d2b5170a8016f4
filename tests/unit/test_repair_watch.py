"""Rules changed behind netproxy's back: noticed between syncs, counted, repaired by a full sync —
the proxier and runner over the fake backend, and each backend's ``tampered`` over its fakes."""

from __future__ import annotations

import ipaddress
import struct
from typing import Dict, List, Tuple

import pytest
from prometheus_client import REGISTRY

from netproxy.backends.fake import FakeBackend
from netproxy.backends.iptables import IptablesBackend, guard, names
from netproxy.backends.iptables.fake import FakeIptables
from netproxy.backends.nftables import NftablesBackend
from netproxy.backends.nftables.fake import FakeNft
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, ServicePort, ServicePortName, Snapshot
from netproxy.core.proxier import Proxier
from netproxy.core.runner import BoundedFrequencyRunner
from netproxy.core.tracker import ChangeTracker
from tests.unit.fakewatch import FakeWatch
from tests.unit.nlmsg import nlmsg
from tests.unit.trackers import feed_web

ip = ipaddress.ip_address


def _repairs(reason: str) -> float:
    return REGISTRY.get_sample_value("netproxy_sync_proxy_rules_repairs_total", {"reason": reason}) or 0.0


def _snapshot(n: int = 2) -> Snapshot:
    services, endpoints = [], {}
    for i in range(n):
        name = ServicePortName("default", f"s{i}", "")
        services.append(ServicePort(name, "TCP", 80, 80, (ip(f"10.96.0.{i + 1}"),)))
        endpoints[name] = [Endpoint(ip(f"10.1.{i}.1"), 80)]
    return Snapshot.build(services, endpoints)


# -- proxier and runner ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _proxier() -> Tuple[Proxier, FakeBackend, List[int]]:
    tracker = ChangeTracker()
    feed_web(tracker)
    backend = FakeBackend()
    proxier = Proxier(tracker, backend, ProxyConfig(hostname="n"), clock=Clock())
    requests: List[int] = []
    proxier.request = lambda: requests.append(1)
    return proxier, backend, requests


def test_no_look_before_the_first_sync_and_nothing_done_when_untouched() -> None:
    proxier, backend, requests = _proxier()
    backend.tamper = "rules-deleted"
    assert proxier.check_tampering() is None and backend.looks == 0  # nothing written yet
    proxier.sync()
    backend.tamper = None
    assert proxier.check_tampering() is None and backend.looks == 1 and requests == []


def test_a_tampered_backend_is_counted_and_repaired_by_a_full_sync_at_once() -> None:
    proxier, backend, requests = _proxier()
    proxier.sync()
    proxier.sync()  # nothing changed: no write
    assert len(backend.syncs) == 1
    before = _repairs("rules-deleted")
    backend.tamper = "rules-deleted"
    assert proxier.check_tampering() == "rules-deleted"
    assert _repairs("rules-deleted") == before + 1 and requests == [1]
    assert proxier.check_tampering() is None  # a full sync is already due: no second look, no double count
    proxier.sync()
    assert len(backend.syncs) == 2 and backend.syncs[-1].full


def test_the_runner_calls_its_idle_step_between_runs_every_interval() -> None:
    now = [0.0]
    looks: List[float] = []
    runner = BoundedFrequencyRunner(lambda: None, 1.0, 30.0, clock=lambda: now[0],
                                    idle=lambda: looks.append(now[0]), idle_interval=0.5)
    assert runner.idle_step() == 0.5 and looks == [0.0]
    now[0] = 0.3
    assert runner.idle_step() == pytest.approx(0.2) and looks == [0.0]
    now[0] = 0.5
    runner.idle_step()
    assert looks == [0.0, 0.5]


def test_a_failing_idle_step_does_not_stop_the_runner() -> None:
    def boom() -> None:
        raise RuntimeError("kernel unreadable")

    runner = BoundedFrequencyRunner(lambda: None, 1.0, 30.0, idle=boom)
    assert runner.idle_step() == 0.5


# -- iptables ---------------------------------------------------------------------------------------


def test_compare_names_what_is_missing() -> None:
    written: Dict[str, Tuple[object, ...]] = {"KUBE-SERVICES": ((), ()), "KUBE-SVC-X": ((),)}
    jumps = {("PREROUTING", names.SERVICES), ("OUTPUT", names.SERVICES), ("POSTROUTING", names.POSTROUTING)}
    assert guard.compare("nat", written, {"KUBE-SERVICES": 2, "KUBE-SVC-X": 1}, jumps) is None
    assert guard.compare("nat", written, {"KUBE-SERVICES": 2}, jumps) == "chain-deleted"
    assert guard.compare("nat", written, {"KUBE-SERVICES": 0, "KUBE-SVC-X": 1}, jumps) == "rules-deleted"
    assert guard.compare("nat", written, {"KUBE-SERVICES": 3, "KUBE-SVC-X": 1}, jumps) == "rules-added"
    assert guard.compare("nat", written, {"KUBE-SERVICES": 2, "KUBE-SVC-X": 1},
                         jumps - {("OUTPUT", names.SERVICES)}) == "jump-deleted"


def _iptables() -> Tuple[IptablesBackend, FakeWatch, FakeIptables]:
    """A backend over the fake kernel and a fake watch; a test plays another program by giving the
    fake kernel its own restore text."""
    kernel = FakeIptables()
    b = IptablesBackend(ProxyConfig(hostname="node"), kernel=kernel)
    watch = FakeWatch()
    b._watch = watch
    return b, watch, kernel


def test_iptables_looks_only_when_its_watch_suspects_and_repairs_only_a_real_difference() -> None:
    b, watch, kernel = _iptables()
    b.sync(_snapshot(), Changes(full=True))
    assert watch.rebases == 1  # the tables as just written are the reference
    assert b.tampered() is None
    kernel.restore(4, "*nat\n:DOCKER - [0:0]\n-A DOCKER -j RETURN\n-I PREROUTING 1 -j DOCKER\nCOMMIT\n")
    watch.dirty = True  # someone else wrote (Docker added its own chain and jump): ours are intact
    assert b.tampered() is None and not b._need_full and watch.rebases == 2
    kernel.restore(4, "*nat\n-F\nCOMMIT\n")  # iptables -t nat -F
    watch.dirty = True
    assert b.tampered() == "rules-deleted" and b._need_full
    reads = kernel.reads
    b.sync(_snapshot(), Changes(full=False))  # the next sync, even a partial one, re-reads and rewrites
    assert kernel.reads > reads
    assert kernel.chains(4, "nat") == {**kernel.chains(4, "nat"), **b._written[4]["nat"]}
    b._need_full = False
    watch.dirty = True
    assert b.tampered() is None  # as written again


def test_iptables_without_a_watch_never_claims_tampering() -> None:
    b, _, _ = _iptables()
    b._watch = None
    b.sync(_snapshot(), Changes(full=True))
    assert b.tampered() is None


def _transaction(pid: int, table: str, family: int = 2, msg: int = 8) -> bytes:
    """A DELRULE (8) on ``table`` and the NEWGEN (15) that ends its transaction, from ``pid``."""
    subsys = 10 << 8
    return (nlmsg(subsys | msg, family, {1: table.encode() + b"\0", 2: b"KUBE-SERVICES\0"})
            + nlmsg(subsys | 15, 0, {1: struct.pack(">I", 7), 2: struct.pack(">I", pid)}))


def test_nft_watch_suspects_only_other_processes_commits_to_nat_or_filter() -> None:
    watch = guard.NftWatch.__new__(guard.NftWatch)  # no socket: _scan is fed by hand
    watch.own = lambda: {4242}
    watch.tables = {b"nat", b"filter"}
    watch._open_touched = watch._found = False
    watch._scan(_transaction(4242, "nat"), {4242})  # our own iptables-nft-restore
    assert not watch._found
    watch._scan(_transaction(999, "firewalld"), {4242})  # someone else's table
    assert not watch._found
    watch._scan(_transaction(999, "filter", family=10), {4242})  # someone else, in ip6 filter
    assert watch._found


# -- nftables ---------------------------------------------------------------------------------------


def _nftables() -> Tuple[NftablesBackend, FakeNft]:
    fake = FakeNft()
    b = NftablesBackend(ProxyConfig(hostname="node"), kernel=fake)
    b.sync(_snapshot(), Changes(full=True))
    return b, fake


def test_nftables_ignores_others_writing_elsewhere() -> None:
    b, fake = _nftables()
    assert b.tampered() is None
    fake.foreign_write(ours=False)
    assert b.tampered() is None
    n = len(fake.transactions)
    b.sync(_snapshot(), Changes(full=True))
    assert len(fake.transactions) == n, "the record still holds: nothing to write"


def test_nftables_names_an_edit_and_a_deleted_table_and_the_next_sync_rewrites() -> None:
    b, fake = _nftables()
    fake.foreign_write(ours=True)
    assert b.tampered() == "rules-changed"
    b.sync(_snapshot(), Changes(full=True))
    assert any(op[0] == "add" and type(op[2]).__name__ == "Table" for op in fake.transactions[-1])
    assert b.tampered() is None
    fake.tables.clear()
    fake.foreign_write(ours=True)  # nft delete table ip netproxy
    assert b.tampered() == "table-deleted"
