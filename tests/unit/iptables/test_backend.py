"""IptablesBackend's sync logic (full vs partial, failure → full) against the fake kernel, which parses
the restore text the restore writer would send."""

from __future__ import annotations

import ipaddress
from typing import List

import pytest

from netproxy.backends.base import SyncError
from netproxy.backends.iptables import MAX_SKIPS, IptablesBackend, names
from netproxy.backends.iptables.fake import Commit, FakeIptables
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, ServicePort, ServicePortName, Snapshot
from tests.unit.fakewatch import FakeWatch

ip = ipaddress.ip_address


def snapshot(n: int, moved: int = -1) -> Snapshot:
    services, endpoints = [], {}
    for i in range(n):
        name = ServicePortName("default", f"s{i}", "")
        services.append(ServicePort(name, "TCP", 80, 80, (ip(f"10.96.0.{i + 1}"),)))
        last = 200 if i == moved else 1
        endpoints[name] = [Endpoint(ip(f"10.1.{i}.1"), 80), Endpoint(ip(f"10.1.{i}.{last + 1}"), 80)]
    return Snapshot.build(services, endpoints)


@pytest.fixture()
def kernel() -> FakeIptables:
    return FakeIptables()


@pytest.fixture()
def backend(kernel: FakeIptables) -> IptablesBackend:
    return IptablesBackend(ProxyConfig(hostname="node"), kernel=kernel)


def commits_since(kernel: FakeIptables, before: int, table: str) -> List[Commit]:
    return [c for c in kernel.commits[before:] if c.table == table]


def svc_chain(i: int) -> str:
    return names.service_chain(ServicePortName("default", f"s{i}", ""), "TCP")


def test_first_sync_is_full_then_partial_writes_only_what_changed(backend: IptablesBackend,
                                                                  kernel: FakeIptables) -> None:
    result = backend.sync(snapshot(5), Changes(full=False))  # start: full whatever the hint
    assert result.full and kernel.reads == 2
    before = len(kernel.commits)
    result = backend.sync(snapshot(5, moved=3), Changes(full=False, services=frozenset()))
    assert not result.full and result.services_written == 1
    # The service's chain only: the hairpin check names a set, whose elements follow the endpoints.
    (nat,) = commits_since(kernel, before, "nat")
    assert nat.written == {svc_chain(3)} and nat.deleted == () and nat.inserted == ()
    assert not commits_since(kernel, before, "filter")
    assert kernel.chains(4, "nat")[svc_chain(3)][-1][-2:] == ("--to-destination", "10.1.3.201:80")
    hairpin = backend.ipsets.elements("NETPROXY-HAIRPIN-4")
    assert (int(ip("10.1.3.201")), 6, 80, int(ip("10.1.3.201"))) in hairpin
    assert (int(ip("10.1.3.2")), 6, 80, int(ip("10.1.3.2"))) not in hairpin
    # Nothing changed: nothing written.
    applied = len(kernel.texts)
    backend.sync(snapshot(5, moved=3), Changes(full=False))
    assert len(kernel.texts) == applied


def test_removed_service_chain_is_deleted(backend: IptablesBackend, kernel: FakeIptables) -> None:
    backend.sync(snapshot(3), Changes(full=True))
    backend.sync(snapshot(2), Changes(full=False))
    assert svc_chain(2) not in kernel.chains(4, "nat")
    assert svc_chain(1) in kernel.chains(4, "nat")


def test_failure_forces_a_full_resync(backend: IptablesBackend, kernel: FakeIptables) -> None:
    backend.sync(snapshot(2), Changes(full=True))
    kernel.fail_next = "-A X"
    with pytest.raises(SyncError) as err:
        backend.sync(snapshot(2, moved=0), Changes(full=False))
    assert err.value.line == "-A X"
    reads = kernel.reads
    assert backend.sync(snapshot(2, moved=0), Changes(full=False)).full
    assert kernel.reads == reads + 2


def test_full_sync_removes_stale_owned_chains_left_by_a_previous_run(backend: IptablesBackend,
                                                                     kernel: FakeIptables) -> None:
    kernel.restore(4, "*nat\n:KUBE-SVC-STALE - [0:0]\n:KUBE-SEP-STALE - [0:0]\n:DOCKER - [0:0]\n"
                      "-A DOCKER -j RETURN\nCOMMIT\n")
    backend.sync(snapshot(1), Changes(full=True))
    nat = kernel.chains(4, "nat")
    assert "KUBE-SVC-STALE" not in nat and "KUBE-SEP-STALE" not in nat and nat["DOCKER"] == (("-j", "RETURN"),)


def test_plan_has_both_families_with_headers(backend: IptablesBackend, kernel: FakeIptables) -> None:
    text = backend.plan(snapshot(1))
    v4, v6 = text.split("# IPv6")
    assert v4.startswith("# IPv4") and "-A KUBE-SERVICES -d 10.96.0.1/32" in v4
    assert "*nat" in v6 and "10.96.0.1" not in v6
    assert text.count("-j KUBE-SERVICES") == 2 * 2 + 2 * 3  # nat PREROUTING/OUTPUT, filter INPUT/FORWARD/OUTPUT


def test_libiptc_writer_refuses_nf_tables_nodes() -> None:
    from netproxy.backends.base import BackendUnavailable
    from netproxy.backends.iptables.kernel.libiptc import LibiptcWriter

    with pytest.raises(BackendUnavailable, match="nf_tables"):
        LibiptcWriter("nft").probe()


def test_periodic_full_sync_of_untouched_tables_writes_nothing(backend: IptablesBackend, kernel: FakeIptables) -> None:
    assert backend.sync(snapshot(4), Changes(full=True)).bytes_written > 0
    applied = len(kernel.texts)
    skipped = backend.sync(snapshot(4), Changes(full=True))
    assert skipped.full and skipped.bytes_written == 0 and len(kernel.texts) == applied
    # Someone else changed one of our chains: the fingerprint differs, the full sync repairs it.
    kernel.restore(4, f"*nat\n:{svc_chain(1)} - [0:0]\n-A {svc_chain(1)} -j ACCEPT\nCOMMIT\n")
    assert backend.sync(snapshot(4), Changes(full=True)).bytes_written > 0
    assert kernel.chains(4, "nat")[svc_chain(1)] != (("-j", "ACCEPT"),)
    assert backend.sync(snapshot(4), Changes(full=True)).bytes_written == 0


def test_full_sync_writes_when_the_rules_changed_or_a_partial_sync_came_between(backend: IptablesBackend,
                                                                                kernel: FakeIptables) -> None:
    backend.sync(snapshot(4), Changes(full=True))
    # A change seen only by a full sync (no partial one in between) is written.
    assert backend.sync(snapshot(4, moved=2), Changes(full=True)).bytes_written > 0
    # After a partial write the old fingerprint means nothing: the next full sync writes, the one after not.
    backend.sync(snapshot(4, moved=1), Changes(full=False))
    assert backend.sync(snapshot(4, moved=1), Changes(full=True)).bytes_written > 0
    assert backend.sync(snapshot(4, moved=1), Changes(full=True)).bytes_written == 0


def test_run_fingerprints_again_between_syncs_so_a_full_sync_after_partial_writes_writes_only_changes(
        backend: IptablesBackend, kernel: FakeIptables) -> None:
    """`run` (legacy): a partial write drops the fingerprint; the look between syncs takes it again, so
    the periodic full sync that coincides with a change writes that change, not every chain (the mixed
    10k cluster: ~8 s against ~1.5 s), and repairs the ipsets as a full sync does (test_sets)."""
    watch = FakeWatch()
    backend._watch = watch  # the real watch reads the host's tables
    backend.sync(snapshot(4), Changes(full=True))
    backend.sync(snapshot(4, moved=1), Changes(full=False))
    assert backend.tampered() is None  # the look between syncs: nobody else wrote, fingerprinted again
    before = len(kernel.commits)
    result = backend.sync(snapshot(4, moved=2), Changes(full=True))
    written = {c for commit in commits_since(kernel, before, "nat") for c in commit.declared}
    assert written == {svc_chain(1), svc_chain(2)}, written  # s1 back to its first endpoints, s2 moved
    assert result.bytes_written > 0 and not result.full
    assert backend.tampered() is None
    assert backend.sync(snapshot(4, moved=2), Changes(full=True)).bytes_written == 0  # then skipped


def test_a_fingerprint_that_cannot_be_had_is_asked_once_per_write_not_at_every_look(
        backend: IptablesBackend, kernel: FakeIptables) -> None:
    backend._watch = FakeWatch()
    backend.sync(snapshot(4), Changes(full=True))
    backend.sync(snapshot(4, moved=1), Changes(full=False))
    kernel.stamps = False  # the tables cannot be fingerprinted (the look every 0.5 s must not keep trying)
    asked: List[int] = []
    real = kernel.stamp
    kernel.stamp = lambda families, expect=None: asked.append(1) or real(families, expect)  # type: ignore[method-assign]
    for _ in range(5):
        assert backend.tampered() is None
    assert len(asked) == 1
    backend.sync(snapshot(4, moved=2), Changes(full=False))  # a new write: worth one more try
    backend.tampered()
    assert len(asked) == 2


def test_no_fingerprint_between_syncs_after_a_foreign_write_so_the_full_sync_rewrites(
        backend: IptablesBackend, kernel: FakeIptables) -> None:
    """A write by someone else since the last full sync (seen by the watch, harmless to the rule
    counts: an `iptables -R` keeps them) must not be vouched for by a new fingerprint."""
    watch = FakeWatch()
    backend._watch = watch
    backend.sync(snapshot(4), Changes(full=True))
    edited = f"*nat\n:{svc_chain(3)} - [0:0]\n" + "".join(f"-A {svc_chain(3)} -j ACCEPT\n" for _ in
                                                            kernel.chains(4, "nat")[svc_chain(3)]) + "COMMIT\n"
    kernel.restore(4, edited)  # same rule count, other rules
    watch.dirty = True
    assert backend.tampered() is None  # the counts match: not a repair now...
    backend.sync(snapshot(4, moved=1), Changes(full=False))
    assert backend.tampered() is None  # ...and no new fingerprint either
    before = len(kernel.commits)
    backend.sync(snapshot(4, moved=1), Changes(full=True))
    rewritten = {c for commit in commits_since(kernel, before, "nat") for c in commit.declared}
    assert svc_chain(3) in rewritten and kernel.chains(4, "nat")[svc_chain(3)] != (("-j", "ACCEPT"),)


def test_without_a_fingerprint_every_full_sync_writes(backend: IptablesBackend, kernel: FakeIptables) -> None:
    kernel.stamps = False  # a kernel whose tables (or nf_tables generation) cannot be read
    backend.sync(snapshot(3), Changes(full=True))
    assert backend.sync(snapshot(3), Changes(full=True)).bytes_written > 0


@pytest.fixture()
def nft_kernel() -> FakeIptables:
    return FakeIptables(flavour="nft")


@pytest.fixture()
def nft_backend(nft_kernel: FakeIptables) -> IptablesBackend:
    return IptablesBackend(ProxyConfig(hostname="node", iptables_flavour="nft"), kernel=nft_kernel)


def test_iptables_nft_full_sync_skips_by_the_nf_tables_generation(nft_backend: IptablesBackend,
                                                                    nft_kernel: FakeIptables) -> None:
    """iptables-nft: the nf_tables generation vouches for the tables (no fingerprint there): an
    unchanged generation skips the periodic full sync, any commit in between (anyone's) rewrites."""
    assert nft_backend.sync(snapshot(4), Changes(full=True)).bytes_written > 0
    written, reads = len(nft_kernel.texts), nft_kernel.reads
    skipped = nft_backend.sync(snapshot(4), Changes(full=True))
    assert skipped.full and skipped.bytes_written == 0
    assert len(nft_kernel.texts) == written and nft_kernel.reads == reads, "a skip reads and writes nothing"
    # Another writer commits (any table: the generation is the whole ruleset's): the next full sync
    # re-reads and rewrites, and repairs what it changed in ours.
    nft_kernel.restore(4, f"*nat\n:{svc_chain(1)} - [0:0]\n-A {svc_chain(1)} -j ACCEPT\nCOMMIT\n")
    assert nft_backend.sync(snapshot(4), Changes(full=True)).bytes_written > 0
    assert nft_kernel.chains(4, "nat")[svc_chain(1)] != (("-j", "ACCEPT"),)
    assert nft_backend.sync(snapshot(4), Changes(full=True)).bytes_written == 0


def test_iptables_nft_partial_sync_keeps_the_full_sync_skippable(nft_backend: IptablesBackend,
                                                                 nft_kernel: FakeIptables) -> None:
    """A partial write renews the generation stamp (one GETGEN), so the full sync after it need not
    rewrite the tables as the legacy fingerprint must (its blob is read only after full writes)."""
    nft_backend.sync(snapshot(4), Changes(full=True))
    assert nft_backend.sync(snapshot(4, moved=1), Changes(full=False)).bytes_written > 0
    assert nft_backend.sync(snapshot(4, moved=1), Changes(full=True)).bytes_written == 0
    # A change only a full sync sees is still written.
    assert nft_backend.sync(snapshot(4, moved=2), Changes(full=True)).bytes_written > 0


def test_skips_are_capped_and_cleanup_forgets_the_fingerprint(backend: IptablesBackend,
                                                               kernel: FakeIptables) -> None:
    backend.sync(snapshot(2), Changes(full=True))
    results = [backend.sync(snapshot(2), Changes(full=True)).bytes_written for _ in range(MAX_SKIPS + 2)]
    # MAX_SKIPS skipped, then one real write (the safety net), then skipping again.
    assert results == [0] * MAX_SKIPS + [results[MAX_SKIPS], 0] and results[MAX_SKIPS] > 0
    backend.cleanup()  # through the fake's save and restore, as on a node
    assert not [c for f in (4, 6) for t in ("nat", "filter") for c in kernel.chains(f, t) if names.is_owned(c)]
    assert not kernel.read(4)["nat"].jumps
    assert backend.sync(snapshot(2), Changes(full=True)).bytes_written > 0
    assert svc_chain(1) in kernel.chains(4, "nat")


def test_a_family_that_gains_services_is_written(backend: IptablesBackend, kernel: FakeIptables) -> None:
    backend.sync(snapshot(2), Changes(full=True))
    name = ServicePortName("default", "v6", "")
    v6 = ServicePort(name, "TCP", 80, 80, (ip("fd00::10"),))
    before = snapshot(2)
    eps = {n: list(e) for n, e in before.endpoints.items()}
    snap = Snapshot.build(list(before.services.values()) + [v6], {**eps, name: [Endpoint(ip("fd01::1"), 80)]})
    assert backend.sync(snap, Changes(full=True)).bytes_written > 0
    assert names.service_chain(name, "TCP") in kernel.chains(6, "nat")


def test_rules_that_did_not_land_in_the_fingerprinted_tables_are_never_trusted(backend: IptablesBackend,
                                                                               kernel: FakeIptables) -> None:
    kernel.misdirected = True  # e.g. an nf_tables iptables-restore behind a "legacy" name
    backend.sync(snapshot(3), Changes(full=True))
    assert backend.sync(snapshot(3), Changes(full=True)).bytes_written > 0


def test_a_render_that_rerenders_nothing_reuses_the_last_assembly_unless_a_node_wide_input_changed(
        backend: IptablesBackend, kernel: FakeIptables, monkeypatch: pytest.MonkeyPatch) -> None:
    """The periodic full sync with nothing changed skips the assembly of both families (30 of its
    ~50 ms at 10k); an input that no service port's render carries (the service CIDRs) still
    re-assembles, and the rule it adds reaches the kernel."""
    import netproxy.backends.iptables as module

    calls: List[int] = []
    real = module.assemble
    monkeypatch.setattr(module, "assemble", lambda family, *a, **k: calls.append(family) or real(family, *a, **k))
    backend.sync(snapshot(4), Changes(full=True))
    assert calls == [4, 6]
    assert backend.sync(snapshot(4), Changes(full=True)).bytes_written == 0
    assert calls == [4, 6], "nothing re-rendered: the last assembly is handed over"
    cidr = Snapshot(snapshot(4).services, snapshot(4).endpoints, service_cidrs=(ipaddress.ip_network("10.96.0.0/16"),))
    assert backend.sync(cidr, Changes(full=True)).bytes_written > 0
    assert calls == [4, 6, 4, 6]
    assert any("10.96.0.0/16" in rule for rule in kernel.chains(4, "filter")[names.SERVICES]), \
        kernel.chains(4, "filter")[names.SERVICES]
    # One service gone, none re-rendered: assembled again without it.
    backend.sync(Snapshot.build(list(snapshot(3).services.values()), snapshot(3).endpoints,
                                service_cidrs=cidr.service_cidrs), Changes(full=False))
    assert calls == [4, 6, 4, 6, 4, 6] and svc_chain(3) not in kernel.chains(4, "nat")
