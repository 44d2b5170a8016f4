"""IptablesBackend's sync logic (full vs partial, failure → full) against a recording writer."""

from __future__ import annotations

import ipaddress
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import pytest

from netproxy.backends.base import SyncError
from netproxy.backends.iptables import MAX_SKIPS, IptablesBackend, names
from netproxy.backends.iptables.diff import KernelTable, TableChange
from netproxy.config import ProxyConfig
from netproxy.model import Changes, Endpoint, ServicePort, ServicePortName, Snapshot

ip = ipaddress.ip_address


class RecordingWriter:
    """Applies changes to an in-memory kernel (chains → rules), all or nothing, like the real writers."""

    name = "recording"

    def __init__(self) -> None:
        self.kernel: Dict[Tuple[int, str], Dict[str, tuple]] = {}
        self.applied: List[Tuple[int, List[TableChange]]] = []
        self.reads = 0
        self.fail = False
        self.stamps = True
        self.stamp_calls = 0
        self.lost_write = False

    def probe(self) -> None:
        return None

    def read(self, family: int) -> Dict[str, KernelTable]:
        self.reads += 1
        return {t: KernelTable(frozenset(self.kernel.get((family, t), {}))) for t in ("nat", "filter")}

    def stamp(self, families: Sequence[int], expect: Optional[Mapping[Tuple[int, str], Mapping[str, int]]] = None
              ) -> Optional[Dict[Tuple[int, str], bytes]]:
        """Like the legacy fingerprint: changes with any change to the tables; None when it cannot
        tell or the tables do not hold ``expect``'s chains with those rule counts."""
        self.stamp_calls += 1
        if not self.stamps:
            return None
        for (f, t), chains in (expect or {}).items():
            if any(len(self.kernel.get((f, t), {}).get(c, ())) != n or c not in self.kernel.get((f, t), {})
                   for c, n in chains.items()):
                return None
        return {(f, t): repr(sorted(self.kernel.get((f, t), {}).items())).encode()
                for f in families for t in ("nat", "filter")}

    def apply(self, family: int, changes: List[TableChange],
              before_commit: Optional[Callable[[], None]] = None) -> int:
        if before_commit is not None:
            before_commit()
        if self.fail:
            raise SyncError("refused", line="-A X")
        if self.lost_write:  # the rules went to other tables than the ones the fingerprint reads
            self.applied.append((family, changes))
            return 1
        for change in changes:
            table = dict(self.kernel.get((family, change.table), {}))
            table.update(change.write)
            for chain in change.delete:
                del table[chain]
            self.kernel[(family, change.table)] = table
        self.applied.append((family, changes))
        return 1


def snapshot(n: int, moved: int = -1) -> Snapshot:
    services, endpoints = [], {}
    for i in range(n):
        name = ServicePortName("default", f"s{i}", "")
        services.append(ServicePort(name, "TCP", 80, 80, (ip(f"10.96.0.{i + 1}"),)))
        last = 200 if i == moved else 1
        endpoints[name] = [Endpoint(ip(f"10.1.{i}.1"), 80), Endpoint(ip(f"10.1.{i}.{last + 1}"), 80)]
    return Snapshot.build(services, endpoints)


@pytest.fixture()
def backend() -> IptablesBackend:
    b = IptablesBackend(ProxyConfig(hostname="node"))
    b.writer = RecordingWriter()
    return b


def svc_chain(i: int) -> str:
    return names.service_chain(ServicePortName("default", f"s{i}", ""), "TCP")


def test_first_sync_is_full_then_partial_writes_only_what_changed(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    result = backend.sync(snapshot(5), Changes(full=False))  # start: full whatever the hint
    assert result.full and writer.reads == 2
    result = backend.sync(snapshot(5, moved=3), Changes(full=False, services=frozenset()))
    assert not result.full and result.services_written == 1
    (_, changes), = [a for a in writer.applied[-1:]]
    nat = [c for c in changes if c.table == "nat"][0]
    # The service's chain only: the hairpin check names a set, whose elements follow the endpoints.
    assert set(nat.write) == {svc_chain(3)} and nat.delete == [] and nat.jumps == []
    hairpin = backend.ipsets.elements("NETPROXY-HAIRPIN-4")
    assert (int(ip("10.1.3.201")), 6, 80, int(ip("10.1.3.201"))) in hairpin
    assert (int(ip("10.1.3.2")), 6, 80, int(ip("10.1.3.2"))) not in hairpin
    # Nothing changed: nothing written.
    applied = len(writer.applied)
    backend.sync(snapshot(5, moved=3), Changes(full=False))
    assert len(writer.applied) == applied


def test_removed_service_chain_is_deleted(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    backend.sync(snapshot(3), Changes(full=True))
    backend.sync(snapshot(2), Changes(full=False))
    assert svc_chain(2) not in writer.kernel[(4, "nat")]
    assert svc_chain(1) in writer.kernel[(4, "nat")]


def test_failure_forces_a_full_resync(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    backend.sync(snapshot(2), Changes(full=True))
    writer.fail = True
    with pytest.raises(SyncError) as err:
        backend.sync(snapshot(2, moved=0), Changes(full=False))
    assert err.value.line == "-A X"
    writer.fail = False
    reads = writer.reads
    assert backend.sync(snapshot(2, moved=0), Changes(full=False)).full
    assert writer.reads == reads + 2


def test_full_sync_removes_stale_owned_chains_left_by_a_previous_run(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    writer.kernel[(4, "nat")] = {"KUBE-SVC-STALE": (), "KUBE-SEP-STALE": (), "DOCKER": (("-j", "RETURN"),)}
    backend.sync(snapshot(1), Changes(full=True))
    nat = writer.kernel[(4, "nat")]
    assert "KUBE-SVC-STALE" not in nat and "KUBE-SEP-STALE" not in nat and nat["DOCKER"] == (("-j", "RETURN"),)


def test_plan_has_both_families_with_headers(backend: IptablesBackend) -> None:
    text = backend.plan(snapshot(1))
    v4, v6 = text.split("# IPv6")
    assert v4.startswith("# IPv4") and "-A KUBE-SERVICES -d 10.96.0.1/32" in v4
    assert "*nat" in v6 and "10.96.0.1" not in v6
    assert text.count("-j KUBE-SERVICES") == 2 * 2 + 2 * 3  # nat PREROUTING/OUTPUT, filter INPUT/FORWARD/OUTPUT


def test_libiptc_writer_refuses_nf_tables_nodes() -> None:
    from netproxy.backends.base import BackendUnavailable
    from netproxy.backends.iptables.libiptc import LibiptcWriter

    with pytest.raises(BackendUnavailable, match="nf_tables"):
        LibiptcWriter("nft").probe()


def test_periodic_full_sync_of_untouched_tables_writes_nothing(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    assert backend.sync(snapshot(4), Changes(full=True)).bytes_written > 0
    applied = len(writer.applied)
    skipped = backend.sync(snapshot(4), Changes(full=True))
    assert skipped.full and skipped.bytes_written == 0 and len(writer.applied) == applied
    # Someone else changed one of our chains: the fingerprint differs, the full sync repairs it.
    writer.kernel[(4, "nat")][svc_chain(1)] = (("-j", "ACCEPT"),)
    assert backend.sync(snapshot(4), Changes(full=True)).bytes_written > 0
    assert writer.kernel[(4, "nat")][svc_chain(1)] != (("-j", "ACCEPT"),)
    assert backend.sync(snapshot(4), Changes(full=True)).bytes_written == 0


def test_full_sync_writes_when_the_rules_changed_or_a_partial_sync_came_between(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    backend.sync(snapshot(4), Changes(full=True))
    # A change seen only by a full sync (no partial one in between) is written.
    assert backend.sync(snapshot(4, moved=2), Changes(full=True)).bytes_written > 0
    # After a partial write the old fingerprint means nothing: the next full sync writes, the one after not.
    backend.sync(snapshot(4, moved=1), Changes(full=False))
    assert backend.sync(snapshot(4, moved=1), Changes(full=True)).bytes_written > 0
    assert backend.sync(snapshot(4, moved=1), Changes(full=True)).bytes_written == 0


def test_without_a_fingerprint_every_full_sync_writes(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    writer.stamps = False  # iptables-nft, or a kernel whose tables cannot be read
    backend.sync(snapshot(3), Changes(full=True))
    assert backend.sync(snapshot(3), Changes(full=True)).bytes_written > 0


def test_skips_are_capped_and_cleanup_forgets_the_fingerprint(backend: IptablesBackend,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    backend.sync(snapshot(2), Changes(full=True))
    results = [backend.sync(snapshot(2), Changes(full=True)).bytes_written for _ in range(MAX_SKIPS + 2)]
    # MAX_SKIPS skipped, then one real write (the safety net), then skipping again.
    assert results == [0] * MAX_SKIPS + [results[MAX_SKIPS], 0] and results[MAX_SKIPS] > 0
    import netproxy.backends.iptables as module

    monkeypatch.setattr(module.cleanup_mod, "cleanup", lambda tools: writer.kernel.clear())
    backend.cleanup()
    assert backend.sync(snapshot(2), Changes(full=True)).bytes_written > 0
    assert svc_chain(1) in writer.kernel[(4, "nat")]


def test_a_family_that_gains_services_is_written(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    backend.sync(snapshot(2), Changes(full=True))
    name = ServicePortName("default", "v6", "")
    v6 = ServicePort(name, "TCP", 80, 80, (ip("fd00::10"),))
    before = snapshot(2)
    eps = {n: list(e) for n, e in before.endpoints.items()}
    snap = Snapshot.build(list(before.services.values()) + [v6], {**eps, name: [Endpoint(ip("fd01::1"), 80)]})
    assert backend.sync(snap, Changes(full=True)).bytes_written > 0
    assert names.service_chain(name, "TCP") in writer.kernel[(6, "nat")]


def test_rules_that_did_not_land_in_the_fingerprinted_tables_are_never_trusted(backend: IptablesBackend) -> None:
    writer = backend.writer
    assert isinstance(writer, RecordingWriter)
    writer.lost_write = True  # e.g. an nf_tables iptables-restore behind a "legacy" name
    backend.sync(snapshot(3), Changes(full=True))
    assert backend.sync(snapshot(3), Changes(full=True)).bytes_written > 0
