"""Restart by adoption on iptables against the fake kernel: a new backend (a new process) over tables a
previous one wrote and stamped writes only the chains that differ, and rewrites everything when the
stamp is missing, foreign, torn or stale, or the tables were changed behind its back (adopt.py)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import random
from typing import Dict, List, Tuple

import pytest

from netproxy.backends.iptables import IptablesBackend, adopt, names
from netproxy.backends.iptables.fake import Commit, FakeIptables
from netproxy.backends.iptables.kernel.stamp import stamp_value
from netproxy.backends.iptables.payload import table_text
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes, Endpoint, ServicePort, ServicePortName, Snapshot
from tests.unit.fakewatch import FakeWatch

ip = ipaddress.ip_address
CONFIG = ProxyConfig(hostname="node", one_shot=True)
RUN = dataclasses.replace(CONFIG, one_shot=False)
N = 40  # beyond 32 services: the dispatch tree has leaves, shared chains whose digests matter too


def snapshot(n: int = N, moved: int = -1) -> Snapshot:
    services, endpoints = [], {}
    for i in range(n):
        name = ServicePortName("default", f"s{i}", "")
        services.append(ServicePort(name, "TCP", 80, 80, (ip(f"10.96.0.{i + 1}"), ip(f"fd00::{i + 1:x}"))))
        last = 200 if i == moved else 1
        endpoints[name] = [Endpoint(ip(f"10.1.{i}.1"), 80), Endpoint(ip(f"10.1.{i}.{last + 1}"), 80),
                           Endpoint(ip(f"fd01::{i + 1:x}"), 80)]
    return Snapshot.build(services, endpoints)


def svc_chain(i: int) -> str:
    return names.service_chain(ServicePortName("default", f"s{i}", ""), "TCP")


def written(snap: Snapshot, flavour: str = "legacy", config: ProxyConfig = CONFIG) -> FakeIptables:
    """A kernel holding what a first ``netproxy sync`` wrote (and stamped) for ``snap``."""
    kernel = FakeIptables(flavour)
    IptablesBackend(dataclasses.replace(config, iptables_flavour=flavour), kernel=kernel).sync(snap, Changes())
    return kernel


def restart(kernel: FakeIptables, snap: Snapshot, config: ProxyConfig = CONFIG) -> List[Commit]:
    """A second process's first sync over ``kernel``: the blocks it committed to nat and filter."""
    before = len(kernel.commits)
    b = IptablesBackend(dataclasses.replace(config, iptables_flavour=kernel.flavour), kernel=kernel)
    assert b.sync(snap, Changes()).full
    return [c for c in kernel.commits[before:] if c.table != adopt.STAMP_TABLE]


def fresh(snap: Snapshot, flavour: str = "legacy") -> FakeIptables:
    return written(snap, flavour)


def rules(kernel: FakeIptables) -> object:
    """nat and filter of both families, chains sorted (the stamp is checked by the next restart adopting)."""
    return {k: sorted(v.items()) for k, v in kernel.tables.items() if k[1] in ("nat", "filter")}


def rewrote_all(commits: List[Commit], kernel: FakeIptables, family: int = 4) -> bool:
    """Whether ``commits`` rewrote every chain of ours in ``family``'s nat table."""
    nat = [c for c in commits if (c.family, c.table) == (family, "nat")]
    ours = {c for c in kernel.chains(family, "nat") if names.is_owned(c)}
    return len(nat) == 1 and nat[0].written == ours


@pytest.mark.parametrize("flavour", ["legacy", "nft"])
def test_the_same_input_is_adopted_without_a_write(flavour: str, caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot(), flavour)
    assert kernel.chains(4, adopt.STAMP_TABLE)[adopt.STAMP_CHAIN], "the first sync stamps its tables"
    texts, reads = len(kernel.texts), kernel.reads
    caplog.set_level(logging.INFO, logger="netproxy.backends.iptables")
    assert restart(kernel, snapshot()) == []
    assert len(kernel.texts) == texts, f"a restart with nothing changed wrote: {kernel.texts[texts:]}"
    # iptables-nft: with the stamp and the generation holding, nat and filter are not even read.
    assert kernel.reads == reads + (0 if flavour == "nft" else 2)
    assert "IPv4 tables adopted: 0 chains to write" in caplog.text
    assert rules(kernel) == rules(fresh(snapshot(), flavour))


@pytest.mark.parametrize("flavour", ["legacy", "nft"])
def test_one_endpoint_changed_writes_that_service_chain_only(flavour: str) -> None:
    kernel = written(snapshot(), flavour)
    commits = restart(kernel, snapshot(moved=3))
    assert [(c.family, c.table, c.written, c.deleted) for c in commits] == [(4, "nat", {svc_chain(3)}, ())]
    assert kernel.chains(4, "nat")[svc_chain(3)][-1][-2:] == ("--to-destination", "10.1.3.201:80")
    assert rules(kernel) == rules(fresh(snapshot(moved=3), flavour))
    assert restart(kernel, snapshot(moved=3)) == []


def test_a_service_gone_and_one_added_are_deleted_and_written() -> None:
    kernel = written(snapshot(N))
    services = dict(snapshot(N + 1).services)
    del services[ServicePortName("default", "s5", "")]
    new = Snapshot.build(list(services.values()), {n: snapshot(N + 1).endpoints_of(n) for n in services})
    commits = restart(kernel, new)
    (nat,) = [c for c in commits if (c.family, c.table) == (4, "nat")]
    assert svc_chain(N) in nat.written and svc_chain(5) in nat.deleted
    assert svc_chain(1) not in nat.written
    assert rules(kernel) == rules(fresh(new))
    assert restart(kernel, new) == []


def _rewrites(kernel: FakeIptables, snap: Snapshot, caplog: pytest.LogCaptureFixture, reason: str,
              config: ProxyConfig = CONFIG) -> None:
    caplog.clear()
    caplog.set_level(logging.INFO, logger="netproxy.backends.iptables")
    commits = restart(kernel, snap, config)
    assert rewrote_all(commits, kernel), [(c.table, sorted(c.written)[:3]) for c in commits]
    assert "not adopted, rewriting them all" in caplog.text and reason in caplog.text, caplog.text
    if config == CONFIG:
        assert rules(kernel) == rules(fresh(snap, kernel.flavour))
    assert restart(kernel, snap, config) == [], "the rewrite stamped its tables: the next restart adopts them"


def test_a_missing_stamp_rewrites_everything(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot())
    kernel.restore(4, f"*mangle\n:{adopt.STAMP_CHAIN} - [0:0]\n-X {adopt.STAMP_CHAIN}\nCOMMIT\n")
    _rewrites(kernel, snapshot(), caplog, "no KUBE-NP-STAMP chain")


def test_a_flushed_stamp_rewrites_everything(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot())
    kernel.restore(4, f"*mangle\n-F {adopt.STAMP_CHAIN}\nCOMMIT\n")
    _rewrites(kernel, snapshot(), caplog, "chain is empty")


def test_a_foreign_configuration_rewrites_everything(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot())
    other = dataclasses.replace(CONFIG, cluster_cidrs=parse_cidrs("10.244.0.0/16"))
    _rewrites(kernel, snapshot(), caplog, "another netproxy version, configuration or node", other)


def _stamp_rules(kernel: FakeIptables, family: int = 4) -> List[Tuple[str, ...]]:
    return list(kernel.chains(family, adopt.STAMP_TABLE)[adopt.STAMP_CHAIN])


def test_a_truncated_stamp_rewrites_everything(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot())
    n = len(_stamp_rules(kernel))
    assert n > 2
    kernel.restore(4, f"*mangle\n-D {adopt.STAMP_CHAIN} {n}\nCOMMIT\n")  # the last digests lost
    _rewrites(kernel, snapshot(), caplog, "the stamp is torn")


def test_an_edited_digest_rewrites_everything(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot())
    rules = _stamp_rules(kernel)
    comment = rules[1][-1]
    edited = comment[:-1] + ("0" if comment[-1] != "0" else "1")
    kernel.restore(4, f'*mangle\n-D {adopt.STAMP_CHAIN} 2\n-I {adopt.STAMP_CHAIN} 2 -m comment --comment '
                      f'"{edited}"\nCOMMIT\n')
    _rewrites(kernel, snapshot(), caplog, "the stamp is torn")


def test_an_unparsable_stamp_rewrites_everything(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot())
    kernel.restore(4, f'*mangle\n-D {adopt.STAMP_CHAIN} 1\n-I {adopt.STAMP_CHAIN} 1 -m comment --comment '
                      f'"netproxy-stamp 1 garbage"\nCOMMIT\n')
    _rewrites(kernel, snapshot(), caplog, "header does not parse")


@pytest.mark.parametrize("flavour", ["legacy", "nft"])
def test_a_rule_changed_behind_its_back_is_repaired(flavour: str, caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot(), flavour)
    chain = svc_chain(7)
    # iptables -t nat -R: the last endpoint DNATs elsewhere, same rule count (the stamp's digests unchanged).
    last = list(kernel.chains(4, "nat")[chain][-1])
    last[-1] = "10.9.9.9:80"
    n = len(kernel.chains(4, "nat")[chain])
    kernel.restore(4, f"*nat\n-D {chain} {n}\n-A {chain} {' '.join(last)}\nCOMMIT\n")
    _rewrites(kernel, snapshot(), caplog, "the tables changed since netproxy stamped them")
    assert kernel.chains(4, "nat")[chain][-1][-1] != "10.9.9.9:80"


def test_a_foreign_chain_is_seen_from_the_headers_without_fingerprinting_the_read(
        caplog: pytest.LogCaptureFixture) -> None:
    """Legacy: a stamp whose tables' headers (entry count, size) are not the tables' now is stale
    before any blob is walked: that family is read without its fingerprint, rewritten, stamped again;
    the other family's stamp still holds and is checked by its fingerprint as before."""
    kernel = written(snapshot())
    kernel.restore(4, "*nat\n:NP-FOREIGN - [0:0]\nCOMMIT\n")  # iptables -t nat -N NP-FOREIGN
    kernel.fingerprinted.clear()
    caplog.set_level(logging.INFO, logger="netproxy.backends.iptables")
    assert rewrote_all(restart(kernel, snapshot()), kernel)
    assert "IPv4 tables not adopted, rewriting them all: the tables changed since netproxy stamped them (their " \
        "headers" in caplog.text and "IPv6 tables adopted" in caplog.text
    assert kernel.fingerprinted == [("read", 6), ("stamp", 4)]  # IPv4's read not fingerprinted; its new stamp
    assert "NP-FOREIGN" in kernel.chains(4, "nat")  # not ours: left alone
    assert restart(kernel, snapshot()) == [], "the rewrite stamped its tables: the next restart adopts them"


def test_a_same_size_edit_keeps_the_headers_and_the_fingerprint_judges(caplog: pytest.LogCaptureFixture) -> None:
    """The headers alone never adopt: a rule edited to one of the same length (``iptables -R``) leaves
    them as stamped, and the fingerprint of the read refuses the stamp."""
    kernel = written(snapshot())
    chain = svc_chain(3)
    last = list(kernel.chains(4, "nat")[chain][-1])
    assert last[-1] == "10.1.3.2:80"
    last[-1] = "10.1.3.9:80"
    n = len(kernel.chains(4, "nat")[chain])
    headers = [kernel.header(4, t) for t in ("nat", "filter")]
    kernel.restore(4, f"*nat\n-D {chain} {n}\n-A {chain} {' '.join(last)}\nCOMMIT\n")  # as iptables -R
    assert [kernel.header(4, t) for t in ("nat", "filter")] == headers
    kernel.fingerprinted.clear()
    _rewrites(kernel, snapshot(), caplog, "the tables changed since netproxy stamped them (stamp fp:")
    assert kernel.fingerprinted[0] == ("read", 4)
    assert kernel.chains(4, "nat")[chain][-1][-1] == "10.1.3.2:80"


def _header_rule(kernel: FakeIptables, family: int, text: str) -> None:
    kernel.restore(family, f'*mangle\n-D {adopt.STAMP_CHAIN} 1\n-I {adopt.STAMP_CHAIN} 1 -m comment --comment '
                           f'"{text}"\nCOMMIT\n')


@pytest.mark.parametrize("family", [4, 6])
def test_a_stamp_of_format_1_is_never_adopted(family: int, caplog: pytest.LogCaptureFixture) -> None:
    """Format 1 (before the headers): its validator was the fingerprints alone; a stamp of it, even one
    whose fingerprints would match, means a full rewrite of that family, then a stamp of format 2."""
    kernel = written(snapshot())
    header = adopt.parse(kernel.save(family, adopt.STAMP_TABLE))
    rule = _stamp_rules(kernel, family)[0][-1]
    old_valid = header.validator.partition("/")[0]  # what format 1 carried
    _header_rule(kernel, family, rule.replace(f"netproxy-stamp {adopt.FORMAT} ", "netproxy-stamp 1 ")
                 .replace(header.validator, old_valid))
    caplog.clear()
    caplog.set_level(logging.INFO, logger="netproxy.backends.iptables")
    commits = restart(kernel, snapshot())
    assert rewrote_all(commits, kernel, family)
    assert f"IPv{family} tables not adopted, rewriting them all: the stamp has format 1, this netproxy writes 2" \
        in caplog.text
    assert adopt.parse(kernel.save(family, adopt.STAMP_TABLE)).validator.count("/") == 1
    assert restart(kernel, snapshot()) == []


def test_a_legacy_stamp_without_headers_is_not_adopted(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot())
    found = adopt.parse(kernel.save(4, adopt.STAMP_TABLE))
    rule = _stamp_rules(kernel)[0][-1]
    _header_rule(kernel, 4, rule.replace(found.validator, found.validator.partition("/")[0]))
    _rewrites(kernel, snapshot(), caplog, "the stamp has no legacy tables' headers")


def test_the_legacy_validator_carries_the_headers() -> None:
    digest = bytes(range(32))
    now = {(4, "nat"): stamp_value(digest, b"nat-head"), (4, "filter"): stamp_value(digest, b"filter-head")}
    valid = adopt.validator("legacy", now, 4)
    assert valid is not None and valid.startswith("fp:") and len(valid.split("/")[0]) == 3 + 16
    found = adopt.KernelStamp("c" * 16, valid, {})
    adopt.check_headers(found, "c" * 16, [b"nat-head", b"filter-head"])
    for headers in ([b"nat-head", b"filter-hea"], [b"filter-head", b"nat-head"], [b"nat-head", None]):
        with pytest.raises(adopt.NotAdoptable, match="their headers"):
            adopt.check_headers(found, "c" * 16, headers)
    with pytest.raises(adopt.NotAdoptable, match="another netproxy version"):
        adopt.check_headers(found, "d" * 16, [b"nat-head", b"filter-head"])
    # The headers are in the fingerprint part too: a stamp value with other headers is another validator.
    other = {**now, (4, "nat"): stamp_value(digest, b"nat-hea2")}
    assert adopt.validator("legacy", other, 4).split("/")[0] != valid.split("/")[0]  # type: ignore[union-attr]


def test_nft_any_foreign_commit_since_the_stamp_rewrites_everything(caplog: pytest.LogCaptureFixture) -> None:
    kernel = written(snapshot(), "nft")
    kernel.restore(4, "*raw\n:OTHER - [0:0]\nCOMMIT\n")  # another program's commit, to another table
    _rewrites(kernel, snapshot(), caplog, "the tables changed since netproxy stamped them")


def test_a_table_written_between_the_read_and_the_check_is_not_adopted(caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Legacy: the check uses the fingerprints of the full sync's read (before the render) if the
    tables' headers have not moved since; moved, someone wrote in between."""
    kernel = written(snapshot())
    b = IptablesBackend(CONFIG, kernel=kernel)
    render = b._render

    def meanwhile(snap: Snapshot) -> object:
        monkeypatch.setattr(kernel, "header", lambda family, table: b"moved")  # someone writes while it renders
        return render(snap)

    monkeypatch.setattr(b, "_render", meanwhile)
    caplog.set_level(logging.INFO, logger="netproxy.backends.iptables")
    before = len(kernel.commits)
    b.sync(snapshot(), Changes())
    assert rewrote_all([c for c in kernel.commits[before:] if c.table != adopt.STAMP_TABLE], kernel)
    assert "not adopted, rewriting them all: the nat table changed while netproxy read it" in caplog.text


def test_nft_a_commit_during_the_render_means_reading_the_tables_after_all_and_rewriting(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = written(snapshot(), "nft")
    b = IptablesBackend(dataclasses.replace(CONFIG, iptables_flavour="nft"), kernel=kernel)
    render = b._render

    def meanwhile(snap: Snapshot) -> object:
        kernel.restore(4, "*raw\n:OTHER - [0:0]\nCOMMIT\n")  # someone commits while netproxy renders
        return render(snap)

    monkeypatch.setattr(b, "_render", meanwhile)
    caplog.set_level(logging.INFO, logger="netproxy.backends.iptables")
    before, reads = len(kernel.commits), kernel.reads
    b.sync(snapshot(), Changes())
    assert kernel.reads == reads + 2, "the tables the stamp spared were read after all"
    assert rewrote_all([c for c in kernel.commits[before:] if c.table != adopt.STAMP_TABLE], kernel)
    assert "the tables changed since netproxy stamped them" in caplog.text


def test_a_partial_write_after_the_stamp_makes_it_stale(caplog: pytest.LogCaptureFixture) -> None:
    """``netproxy run`` killed (no stopping()) after a partial sync: its stamp describes the tables
    before that write; the next process must not trust it."""
    kernel = FakeIptables()
    b = IptablesBackend(RUN, kernel=kernel)
    b.sync(snapshot(), Changes())
    b.sync(snapshot(moved=3), Changes(full=False))
    _rewrites(kernel, snapshot(moved=3), caplog, "the tables changed since netproxy stamped them")


@pytest.mark.parametrize("flavour", ["legacy", "nft"])
def test_run_stamps_at_exit_after_partial_writes_and_the_next_process_adopts(flavour: str) -> None:
    kernel = FakeIptables(flavour)
    b = IptablesBackend(dataclasses.replace(RUN, iptables_flavour=flavour), kernel=kernel)
    b.sync(snapshot(), Changes())
    b._watch = FakeWatch()
    b.sync(snapshot(moved=3), Changes(full=False))
    b.stopping()
    texts = len(kernel.texts)
    assert restart(kernel, snapshot(moved=3)) == []
    assert len(kernel.texts) == texts


def test_run_does_not_stamp_at_exit_what_was_changed_behind_its_back() -> None:
    kernel = FakeIptables()
    b = IptablesBackend(RUN, kernel=kernel)
    b.sync(snapshot(), Changes())
    watch = FakeWatch()
    watch.suspect = lambda: True  # type: ignore[method-assign]  # the guard saw a foreign write
    b._watch = watch
    b.sync(snapshot(moved=3), Changes(full=False))
    # The same rule count (so only the guard's suspicion, not the stamp's rule-count check, can tell).
    kernel.restore(4, f"*nat\n-D {svc_chain(9)} 1\n-I {svc_chain(9)} 1 -j KUBE-MARK-MASQ\nCOMMIT\n")
    b.stopping()
    commits = restart(kernel, snapshot(moved=3))
    assert rewrote_all(commits, kernel)


def test_run_does_not_stamp_at_exit_after_any_suspicion_even_one_found_harmless() -> None:
    """The guard checks rule counts: a foreign write it let pass may still have edited one of our rules."""
    kernel = FakeIptables()
    b = IptablesBackend(RUN, kernel=kernel)
    b.sync(snapshot(), Changes())
    watch = FakeWatch()
    b._watch = watch
    kernel.restore(4, f"*nat\n-D {svc_chain(9)} 1\n-I {svc_chain(9)} 1 -j KUBE-MARK-MASQ\nCOMMIT\n")
    watch.suspect = lambda: True  # type: ignore[method-assign]
    assert b.tampered() is None  # the same rule counts: nothing to repair, as far as the guard can tell
    watch.suspect = lambda: False  # type: ignore[method-assign]
    b.sync(snapshot(moved=3), Changes(full=False))
    b.stopping()
    assert rewrote_all(restart(kernel, snapshot(moved=3)), kernel)


def test_cleanup_removes_the_stamp() -> None:
    kernel = written(snapshot())
    IptablesBackend(CONFIG, kernel=kernel).cleanup()
    for family in (4, 6):
        assert adopt.STAMP_CHAIN not in kernel.chains(family, adopt.STAMP_TABLE)


def test_stamp_round_trip_and_size() -> None:
    digests = {"nat": {f"KUBE-SVC-{i:016d}": f"{i:012x}" for i in range(500)}, "filter": {"KUBE-SERVICES": "0" * 12}}
    rules = adopt.stamp_rules("0123456789abcdef", "fp:00", digests)
    assert all(len(r[-1]) <= adopt.MAX_COMMENT for r in rules)
    kernel = FakeIptables()
    kernel.restore(4, "\n".join(table_text(adopt.stamp_change(rules))) + "\n")
    found = adopt.parse(kernel.save(4, adopt.STAMP_TABLE))
    assert found.chains == digests and found.config == "0123456789abcdef" and found.validator == "fp:00"



class _Meanwhile(FakeIptables):
    """Records, for each write, whether ``meanwhile`` came and whether the payload was in by then."""

    def __init__(self, flavour: str = "legacy") -> None:
        super().__init__(flavour)
        self.meanwhile_at: List[int] = []  # the number of commits when it was called

    def apply(self, family, changes, before_commit=None, meanwhile=None):  # type: ignore[no-untyped-def]
        def noted() -> None:
            self.meanwhile_at.append(len(self.commits))
            meanwhile()

        return super().apply(family, changes, before_commit, noted if meanwhile is not None else None)


@pytest.mark.parametrize("flavour", ["legacy", "nft"])
@pytest.mark.parametrize("config", [CONFIG, RUN], ids=["sync", "run"])
def test_the_stamp_made_while_the_write_commits_is_the_stamp_of_what_was_written(
        flavour: str, config: ProxyConfig) -> None:
    """The chain digests are packed while the writer commits a full write (``meanwhile``), the
    header after the fingerprint: the stamp is the one made from the written tables after the
    fact, and the next process adopts it.  A one-shot sync keeps no memo of the digests."""
    kernel = _Meanwhile(flavour)
    b = IptablesBackend(dataclasses.replace(config, iptables_flavour=flavour), kernel=kernel)
    b.sync(snapshot(), Changes())
    nat_filter = [c for c in kernel.commits if c.table != adopt.STAMP_TABLE]
    assert kernel.meanwhile_at and kernel.meanwhile_at[0] == 2, "after the write's nat and filter commits"
    assert not b._prepared, "each prepared stamp went into a stamp"
    assert bool(b._digests._memo) is (config is RUN)
    for family in (4, 6):
        stamp = _stamp_rules(kernel, family)
        head = adopt._HEADER.match(stamp[0][-1])
        assert head is not None
        digests = {t: {c: adopt.chain_digest(r) for c, r in kernel.chains(family, t).items() if names.is_owned(c)}
                   for t in ("nat", "filter")}
        assert stamp == list(adopt.stamp_rules(head.group("config"), head.group("validator"), digests))
    assert len(nat_filter) == 4
    assert restart(kernel, snapshot()) == []
    commits = restart(kernel, snapshot(moved=3))
    assert [(c.family, c.table, c.written) for c in commits] == [(4, "nat", {svc_chain(3)})]
    assert restart(kernel, snapshot(moved=3)) == [], "the adopting write's stamp, made while it committed"


def test_a_partial_write_does_not_leave_a_prepared_stamp_for_stopping() -> None:
    """``run``: a full write prepares its stamp; when that stamp cannot be written (no fingerprint
    after the write) and a partial write follows, stopping() must stamp the tables with their own
    digests, not the full write's: here the partial write is undone by the next input, which a stamp
    of the full write's chains would let the restart take for what the kernel holds."""
    kernel = _Meanwhile()
    b = IptablesBackend(RUN, kernel=kernel)
    kernel.stamps = False  # the fingerprint after the full write cannot be taken: not stamped
    b.sync(snapshot(), Changes())
    assert not _stamp_rules(kernel) if adopt.STAMP_CHAIN in kernel.chains(4, adopt.STAMP_TABLE) else True
    kernel.stamps = True
    b._watch = FakeWatch()
    b.sync(snapshot(moved=3), Changes(full=False))
    assert len(kernel.meanwhile_at) == 2, "only the full sync's writes (one per family) prepare a stamp"
    b._restamp()  # run's look between syncs: the fingerprint taken again
    b.stopping()
    assert _stamp_rules(kernel), "stamped at exit"
    commits = restart(kernel, snapshot())  # back to the first input: svc 3's chain must be written
    assert [(c.family, c.table, c.written) for c in commits] == [(4, "nat", {svc_chain(3)})]
    assert rules(kernel) == rules(fresh(snapshot()))


def _packed_as_first_written(digests: Dict[str, Dict[str, str]]) -> List[str]:
    """The stamp's comments as stamp format 2 was first written (a list of every entry, then packed):
    what the streamed :func:`adopt.stamp_body` must give, comment for comment."""
    entries = [(code, f"{c}={d}") for table, code in (("nat", "n"), ("filter", "f"))
               for c, d in sorted(digests.get(table, {}).items())]
    comments, line, code = [], "", ""
    for c, entry in entries:
        if line and (c != code or len(line) + 1 + len(entry) > adopt.MAX_COMMENT):
            comments.append(line)
            line = ""
        if not line:
            line, code = c, c
        line += " " + entry
    return comments + ([line] if line else [])


@pytest.mark.parametrize("seed", range(8))
def test_the_streamed_stamp_body_packs_as_before(seed: int) -> None:
    rng = random.Random(seed)
    digests = {t: {f"KUBE-{rng.choice(['SVC', 'SVCS', 'EXT', 'NPS'])}-{rng.getrandbits(60):X}"[:rng.randrange(12, 29)]:
                   f"{rng.getrandbits(48):012x}" for _ in range(rng.randrange(0, 400))} for t in ("nat", "filter")}
    rules = adopt.stamp_rules("0123456789abcdef", "fp:00", digests)
    assert [r[-1] for r in rules[1:]] == _packed_as_first_written(digests)
    assert adopt.parse("*mangle\n:KUBE-NP-STAMP - [0:0]\n" + "".join(
        f'-A KUBE-NP-STAMP -m comment --comment "{r[-1]}"\n' for r in rules) + "COMMIT\n").chains == digests
