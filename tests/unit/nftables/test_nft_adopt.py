"""Restart by adoption against the fake kernel: a new backend (a new process) over tables a previous
one wrote writes only what differs, and rewrites everything at any doubt (adopt.py, stamp.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Tuple

import pytest

from netproxy.backends.nftables import FakeNft, NftablesBackend, adopt, names, serialise, stamp
from netproxy.backends.nftables.objects import Chain, Element
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes, NodeInfo, Snapshot
from tests.unit.nftables.nft_helpers import dumps, eps, fresh_dumps, snap, svc

CONFIG = ProxyConfig(hostname="node-a", cluster_cidrs=parse_cidrs("10.244.0.0/16"))
WEB = svc("web", "10.96.0.10", external=["192.0.2.10"])
API = svc("api", "10.96.0.11")
DNS = svc("dns", "10.96.0.53", 53, proto="UDP", port_name="dns")
STICKY = svc("sticky", "10.96.0.20", affinity=True, timeout=60)
LOCAL = svc("local", "10.96.0.30", external=["192.0.2.30"], ext_policy="Local")
V6 = svc("v6", "fd00::10")


def _base() -> Snapshot:
    return snap((WEB, eps("10.1.0.1", "10.1.0.2", "10.1.0.3")), (API, eps("10.1.1.1", "10.1.1.2", "10.1.1.3")),
                (DNS, eps("10.1.2.1", port=53)), (STICKY, eps("10.1.3.1", "10.1.3.2")),
                (LOCAL, eps("10.1.4.1", "10.1.4.2", node="node-a")), (V6, eps("fd01::1", "fd01::2")),
                node="node-a")


def _written(snapshot: Snapshot, config: ProxyConfig = CONFIG) -> FakeNft:
    """A kernel holding what a first process wrote for ``snapshot``."""
    fake = FakeNft()
    NftablesBackend(config, kernel=fake).sync(snapshot, Changes())
    return fake


def _restart(fake: FakeNft, snapshot: Snapshot, config: ProxyConfig = CONFIG) -> Tuple[NftablesBackend, int]:
    """A second process's first (full) sync; the transactions it wrote."""
    b = NftablesBackend(config, kernel=fake)
    before = len(fake.transactions)
    result = b.sync(snapshot, Changes())
    assert result.full
    return b, len(fake.transactions) - before


def _text(fake: FakeNft) -> str:
    return serialise.ops_text(fake.transactions[-1])


def test_the_same_input_is_adopted_without_a_write(caplog: pytest.LogCaptureFixture) -> None:
    fake = _written(_base())
    want = dumps(fake)
    caplog.set_level(logging.INFO, logger="netproxy.backends.nftables")
    b, written = _restart(fake, _base())
    assert written == 0, f"a restart with nothing changed wrote:\n{_text(fake)}"
    assert dumps(fake) == want
    assert "adopted the tables in the kernel" in caplog.text
    # The adopted record is the one a full sync would keep: incremental syncs go on from it.
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    b.sync(later, Changes(full=False, services=frozenset({API.name})))
    assert "delete table" not in _text(fake)
    assert dumps(fake) == fresh_dumps(later, CONFIG)


def test_one_endpoint_changed_writes_only_that_service() -> None:
    fake = _written(_base())
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    b, written = _restart(fake, later)
    assert written == 1
    text = _text(fake)
    assert "delete table" not in text and "10.1.1.9" in text
    # Its old endpoints asked for by key: only the indexes that changed are rewritten.
    assert "10.1.1.1 . 8080" not in text, text
    for other in ("10.96.0.10", "10.96.0.53", "10.96.0.20", "10.96.0.30", "fd00::10"):
        assert other not in text, f"the adoption touched another service:\n{text}"
    assert dumps(fake) == fresh_dumps(later, CONFIG)
    assert b.sync(later, Changes()).services_written == 0, "the adopted record matches the kernel"


@pytest.mark.parametrize("by_key", [True, False], ids=["asked-by-key", "read-whole"])
@pytest.mark.parametrize("change", ["grow", "shrink", "to-empty", "from-empty", "delete", "add", "affinity-on",
                                    "affinity-off", "port", "external-ip", "local-policy", "local-endpoints",
                                    "v6", "nodeport"])
def test_every_kind_of_change_across_a_restart_converges_to_a_fresh_sync(change: str, by_key: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of learning a changed service's old endpoints: asked for by key (a few changed
    services) and not at all, its runs rewritten whole and the shared sets read (many)."""
    if not by_key:
        monkeypatch.setattr(adopt, "GET_LIMIT", 0)
    fake = _written(_base())
    services, endpoints = dict(_base().services), dict(_base().endpoints)
    if change == "grow":
        endpoints[API.name] = eps("10.1.1.1", "10.1.1.2", "10.1.1.3", "10.1.1.4")
    elif change == "shrink":
        endpoints[API.name] = eps("10.1.1.1")
    elif change == "to-empty":
        endpoints[API.name] = ()
    elif change == "from-empty":
        fake = _written(snap(*[(s, () if s is API else _base().endpoints[s.name]) for s in _base().services.values()],
                             node="node-a"))
    elif change == "delete":
        del services[DNS.name]
    elif change == "add":
        new = svc("new", "10.96.0.60", 443)
        services[new.name], endpoints[new.name] = new, eps("10.1.6.1", "10.1.6.2")
    elif change == "affinity-on":
        services[API.name] = dataclasses.replace(API, affinity="ClientIP", affinity_timeout=30)
    elif change == "affinity-off":
        services[STICKY.name] = dataclasses.replace(STICKY, affinity="None")
    elif change == "port":
        services[API.name] = dataclasses.replace(API, port=8443)
    elif change == "external-ip":
        services[WEB.name] = dataclasses.replace(WEB, external_ips=())
    elif change == "local-policy":
        services[LOCAL.name] = dataclasses.replace(LOCAL, external_traffic_policy="Cluster")
    elif change == "local-endpoints":
        endpoints[LOCAL.name] = eps("10.1.4.1", node="node-a") + eps("10.1.4.2", node="node-b")
    elif change == "v6":
        endpoints[V6.name] = eps("fd01::1")
    elif change == "nodeport":
        services[WEB.name] = dataclasses.replace(WEB, node_port=30080)
    later = Snapshot.build(list(services.values()), endpoints, NodeInfo("node-a"))
    b, written = _restart(fake, later)
    assert written == 1 and "delete table" not in _text(fake), _text(fake)
    assert dumps(fake) == fresh_dumps(later, CONFIG)
    # and the record goes on: every service changed once more, incrementally
    again = Snapshot.build(list(later.services.values()), {n: eps("10.1.9.1") for n in later.services},
                           NodeInfo("node-a"))
    b.sync(again, Changes(full=False, services=frozenset(set(later.services) | set(_base().services))))
    assert dumps(fake) == fresh_dumps(again, CONFIG)


def test_source_ranges_are_adopted_and_a_changed_one_is_rewritten(caplog: pytest.LogCaptureFixture) -> None:
    ranged = dataclasses.replace(svc("lb", "10.96.0.40", lb=["198.51.100.40"]),
                                 source_ranges=tuple(parse_cidrs("203.0.113.0/24")))
    first = snap(*[(s, _base().endpoints[s.name]) for s in _base().services.values()],
                 (ranged, eps("10.1.7.1")), node="node-a")
    fake = _written(first)
    assert fake.comments("ip", names.FIREWALL_ALLOW), "the firewall elements carry the service stamp"
    assert _restart(fake, first)[1] == 0
    # Its ranges are not read back: a change to it is a rewrite (adopt.py's _ghost).
    later = snap(*[(s, _base().endpoints[s.name]) for s in _base().services.values()],
                 (ranged, eps("10.1.7.2")), node="node-a")
    _rewrites(fake, later, caplog, "loadBalancerSourceRanges")


def test_remembered_clients_of_a_gone_endpoint_are_forgotten_at_adoption() -> None:
    fake = _written(_base())
    fake.touch("ip", "affinity-tcp", "10.244.1.7 . 10.96.0.20 . 80", 50, "10.1.3.1 . 8080")
    fake.touch("ip", "affinity-tcp", "10.244.1.8 . 10.96.0.20 . 80", 50, "10.1.3.2 . 8080")
    later = _base()
    later.endpoints[STICKY.name] = eps("10.1.3.2", "10.1.3.3")  # type: ignore[index]
    _restart(fake, later)
    assert set(fake.elements("ip", "affinity-tcp")) == {"10.244.1.8 . 10.96.0.20 . 80"}


def _rewrites(fake: FakeNft, snapshot: Snapshot, caplog: pytest.LogCaptureFixture, reason: str,
              config: ProxyConfig = CONFIG) -> None:
    caplog.clear()
    caplog.set_level(logging.INFO, logger="netproxy.backends.nftables")
    _, written = _restart(fake, snapshot, config)
    assert written == 1
    ops = fake.transactions[-1]
    assert ("delete", "ip") in [(v, f) for v, f, o in ops if type(o).__name__ == "Table"], _text(fake)
    assert dumps(fake) == fresh_dumps(snapshot, config)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("not adopting" in m and reason in m for m in infos), infos


def test_a_write_by_anyone_since_the_stamp_means_a_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    fake = _written(_base())
    fake.foreign_write(ours=False)  # another table: the generation moved all the same
    _rewrites(fake, _base(), caplog, "someone committed since")


def test_a_deleted_endpoint_element_is_repaired_because_the_generation_moved(caplog: pytest.LogCaptureFixture) -> None:
    fake = _written(_base())
    want = dumps(fake)
    del fake.tables["ip"].elements["cluster-tcp-endpoints-3"]["10.96.0.11 . 80 . 1"]
    fake.foreign_write()  # `nft delete element` is a commit: the kernel moves the generation
    assert dumps(fake) != want
    _rewrites(fake, _base(), caplog, "someone committed since")
    assert dumps(fake) == want


def test_a_stamp_of_another_configuration_or_node_means_a_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    fake = _written(_base())
    _rewrites(fake, _base(), caplog, "another netproxy version, layout, configuration",
              dataclasses.replace(CONFIG, masquerade_bit=13))
    fake = _written(_base())
    other_node = snap(*[(s, _base().endpoints[s.name]) for s in _base().services.values()], node="node-b")
    _rewrites(fake, other_node, caplog, "another netproxy version, layout, configuration")
    # the writer is not part of it: the other writer's tables are adopted
    fake = _written(_base())
    _, written = _restart(fake, _base(), dataclasses.replace(CONFIG, nftables_writer="libnftables"))
    assert written == 0


def _stamp(fake: FakeNft, fam: str = "ip") -> Element:
    return fake.tables[fam].elements[names.STAMP][stamp.STAMP_KEY]


def test_torn_or_missing_stamps_mean_a_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    # Edits below change the fake's tables without moving its generation: what a kernel never
    # shows, so that each check stands on its own.
    fake = _written(_base())
    del fake.tables["ip"].elements[names.STAMP][stamp.STAMP_KEY]
    _rewrites(fake, _base(), caplog, "holds 0 stamps")

    fake = _written(_base())
    del fake.tables["ip6"].sets[names.STAMP], fake.tables["ip6"].elements[names.STAMP]
    _rewrites(fake, _base(), caplog, "has no stamp set")

    fake = _written(_base())
    s = _stamp(fake)
    fake.tables["ip"].elements[names.STAMP][stamp.STAMP_KEY] = s._replace(comment=(s.comment or "")[:-3])
    fake.tables["ip"].elements[names.STAMP]["2"] = s._replace(key="2")
    _rewrites(fake, _base(), caplog, "holds 2 stamps")

    fake = _written(_base())
    s = _stamp(fake)
    fake.tables["ip"].elements[names.STAMP][stamp.STAMP_KEY] = s._replace(comment="netproxy 1 config:zz gen:1")
    _rewrites(fake, _base(), caplog, "does not parse")

    # A service port's own elements are read when its stamp differs (an unchanged one's are vouched
    # for by the generation): the torn comment is then seen.
    fake = _written(_base())
    dispatch = fake.tables["ip"].elements[names.SERVICE_IPS]
    dispatch["10.96.0.11 . tcp . 80"] = dispatch["10.96.0.11 . tcp . 80"]._replace(comment=None)
    _rewrites(fake, _api_changed(), caplog, "carries no service comment")

    fake = _written(_base())
    where, key = stamp.stamp_place(WEB.name)
    stamps = fake.tables["ip"].elements[where]
    stamps[key] = stamps[key]._replace(comment=None)
    _rewrites(fake, _base(), caplog, "carries no service comment")


def _api_changed() -> Snapshot:
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    return later


def test_a_service_whose_stamp_is_torn_or_missing_is_rewritten_alone() -> None:
    """The digest lives in the service's element of ``service-stamps-<x>``: without it, or with another,
    what the kernel holds for that service is not vouched for, and it alone is written again."""
    for tear in ("no digest", "another digest", "missing"):
        fake = _written(_base())
        where, key = stamp.stamp_place(API.name)
        stamps = fake.tables["ip"].elements[where]
        assert (stamps[key].comment or "").startswith("ns/api:http d:")  # the layout the test relies on
        if tear == "missing":
            del stamps[key]
        else:
            stamps[key] = stamps[key]._replace(
                comment="ns/api:http" if tear == "no digest" else "ns/api:http d:0123456789abcdef")
        _, written = _restart(fake, _base())
        assert written == 1, tear
        text = _text(fake)
        # Its objects checked against the kernel by key (they are as they were): the stamp is what differs.
        assert "delete table" not in text and f"add element ip netproxy {where} {{ {key} comment" in text
        others = [stamp.stamp_key(s.name) for s in (WEB, DNS, STICKY, LOCAL)]
        assert not [k for k in others if k in text] and "10.96.0.10" not in text, (tear, text)
        assert dumps(fake) == fresh_dumps(_base(), CONFIG), tear


def test_an_endpoint_change_does_not_replace_the_dispatch_element() -> None:
    """A running process's endpoint change replaces the endpoint element and the service's stamp,
    never its verdict-map element: adding one with a goto makes the kernel validate the whole table
    at commit (stamp.py), the cost that grows with the number of services."""
    fake = FakeNft()
    b = NftablesBackend(CONFIG, kernel=fake)
    b.sync(_base(), Changes())
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    b.sync(later, Changes(full=False, services=frozenset({API.name})))
    touched = {(verb, getattr(obj, "set", None)) for verb, _, obj in fake.transactions[-1]}
    where = stamp.stamp_place(API.name)[0]
    assert touched == {("delete", "cluster-tcp-endpoints-3"), ("add", "cluster-tcp-endpoints-3"),
                       ("delete", names.HAIRPIN), ("add", names.HAIRPIN),  # 10.1.1.2's pair out, 10.1.1.9's in
                       ("delete", where), ("add", where),
                       ("delete", names.STAMP), ("add", names.STAMP)}, _text(fake)
    assert dumps(fake) == fresh_dumps(later, CONFIG)


def test_an_object_a_stamp_promises_that_is_missing_means_a_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    fake = _written(_base())
    del fake.tables["ip"].chains[names.FILTER_INPUT], fake.tables["ip"].rules[names.FILTER_INPUT]
    _rewrites(fake, _base(), caplog, "lacks chain filter-input")

    fake = _written(_base())
    del fake.tables["ip"].sets[names.EXEMPT_IPS], fake.tables["ip"].elements[names.EXEMPT_IPS]
    # Read when a service port went away (its elements are not known by key): the set is then seen.
    gone = snap(*[(s, _base().endpoints[s.name]) for s in _base().services.values() if s is not DNS], node="node-a")
    _rewrites(fake, gone, caplog, "has no exempt-ips")

    # Any one of the sixteen stamp sets, even one that holds no stamp.
    for where in (stamp.stamp_place(WEB.name)[0], names.SERVICE_STAMP_SETS[-1]):
        fake = _written(_base())
        del fake.tables["ip"].sets[where], fake.tables["ip"].elements[where]
        _rewrites(fake, _base(), caplog, f"has no {where}")

    fake = _written(_base())
    del fake.tables["ip6"]
    _rewrites(fake, _base(), caplog, "table ip6 netproxy is missing")

    fake = _written(_base())
    del fake.tables["ip"].elements["cluster-tcp-endpoints-3"]["10.96.0.11 . 80 . 2"]
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    _rewrites(fake, later, caplog, "lacks endpoint elements its dispatch verdict promises")

    fake = _written(_base())
    fake.tables["ip"].chains["intruder"] = Chain("intruder")
    fake.tables["ip"].rules["intruder"] = []
    _rewrites(fake, _base(), caplog, "chain intruder")


def test_no_table_or_a_table_without_stamps_is_rewritten(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="netproxy.backends.nftables")
    fake = FakeNft()
    _, written = _restart(fake, _base())
    assert written == 1 and "no netproxy table" in caplog.text


def test_a_refused_adoption_falls_back_to_a_rewrite_in_the_same_sync(caplog: pytest.LogCaptureFixture) -> None:
    fake = _written(_base())
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    fake.fail_next = "refused"
    caplog.set_level(logging.INFO, logger="netproxy.backends.nftables")
    b = NftablesBackend(CONFIG, kernel=fake)
    result = b.sync(later, Changes())
    assert result.full and "the kernel refused the changes" in caplog.text
    assert "delete table ip netproxy" in _text(fake)
    assert dumps(fake) == fresh_dumps(later, CONFIG)


def test_every_commit_stamps_the_generation_it_gets() -> None:
    fake = FakeNft()
    b = NftablesBackend(CONFIG, kernel=fake)
    later = _base()
    stamps: List[str] = []
    b.sync(later, Changes())
    stamps.append(_stamp(fake).comment or "")
    later.endpoints[API.name] = eps("10.1.1.9")  # type: ignore[index]
    b.sync(later, Changes(full=False, services=frozenset({API.name})))
    stamps.append(_stamp(fake).comment or "")
    for fam in ("ip", "ip6"):
        parsed = stamp.parse_table_stamp(_stamp(fake, fam).comment)
        assert parsed is not None and parsed.generation == fake.gen, (fam, _stamp(fake, fam))
    assert stamps[0] != stamps[1]


def test_run_stopping_restamps_after_others_commits_elsewhere_so_the_next_process_adopts() -> None:
    fake = FakeNft()
    first = NftablesBackend(CONFIG, kernel=fake)
    first.sync(_base(), Changes())
    fake.foreign_write(ours=False)  # another program's table: the generation moved
    first.stopping()
    assert stamp.parse_table_stamp(_stamp(fake).comment).generation == fake.gen  # type: ignore[union-attr]
    _, written = _restart(fake, _base())
    assert written == 0, _text(fake)


def test_run_stopping_does_not_restamp_tables_someone_else_touched(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNft()
    first = NftablesBackend(CONFIG, kernel=fake)
    first.sync(_base(), Changes())
    fake.foreign_write(ours=True)  # a commit that touched netproxy's tables
    before = len(fake.transactions)
    first.stopping()
    assert len(fake.transactions) == before, "re-stamped tables someone else changed"
    _rewrites(fake, _base(), caplog, "someone committed since")


def test_run_stopping_writes_nothing_when_the_stamp_is_current() -> None:
    fake = FakeNft()
    first = NftablesBackend(CONFIG, kernel=fake)
    first.sync(_base(), Changes())
    before = len(fake.transactions)
    first.stopping()
    assert len(fake.transactions) == before


def test_stamp_keys_are_ipaddress_text_of_the_name_hash() -> None:
    """The stamp key is formatted in C (inet_ntop) except where inet_ntop writes dotted quads: it must
    be exactly ``str(IPv6Address(hash))``, the text the kernel's set reads back and adoption matches."""
    import hashlib
    import ipaddress
    import os
    from unittest import mock

    from netproxy.core.model import ServicePortName

    for i in range(20000):
        name = ServicePortName("ns", f"svc-{i}", "p")
        digest = hashlib.blake2b(str(name).encode(), digest_size=16).digest()
        assert stamp.stamp_key(name) == str(ipaddress.IPv6Address(digest))
    # Digests of every shape (zero runs anywhere, the ::/96 and ::ffff:0:0/96 forms), through the hash.
    shapes = [bytes(12) + os.urandom(4), bytes(10) + b"\xff\xff" + os.urandom(4), bytes(16), bytes(15) + b"\x01"]
    for start in range(8):
        for length in range(1, 9 - start):
            raw = bytearray(os.urandom(16))
            raw[2 * start:2 * (start + length)] = bytes(2 * length)
            shapes.append(bytes(raw))
    for digest in shapes:
        fake = mock.Mock()
        fake.digest.return_value = digest
        with mock.patch.object(stamp.hashlib, "blake2b", return_value=fake):
            assert stamp.stamp_key(ServicePortName("ns", "x")) == str(ipaddress.IPv6Address(digest)), digest.hex()


def test_stamped_objects_keep_every_field_but_their_own_elements() -> None:
    from netproxy.backends.nftables import render

    objs = render.render_service(svc("web", "10.96.0.10", ext_policy="Local", external=["203.0.113.5"]),
                                 eps("10.0.0.1", "10.0.0.2", node="node-a"), NodeInfo("node-a"), "ip", ProxyConfig())
    out = stamp.stamped(objs, svc("web", "10.96.0.10").name, "0123456789abcdef")
    for f in dataclasses.fields(render.ServiceObjects):
        if f.name != "elements":
            assert getattr(out, f.name) is getattr(objs, f.name), f.name
    assert set(out.elements) > set(objs.elements)


def test_service_stamps_spread_over_sixteen_sets_by_their_keys_first_hex_digit() -> None:
    """A full sync puts each service stamp in ``service-stamps-<x>``, x its key's first hex digit, and
    no stamp anywhere else: one set of 100k stamps cost ~0.8 s to dump (the kernel restarts its walk
    at every answer, stamp.py), and the next process reads the sixteen sets."""
    import ipaddress

    services = [(svc(f"s{i}", f"10.96.1.{i}"), eps(f"10.1.2.{i}")) for i in range(1, 120)]
    fake = _written(snap(*services, node="node-a"))
    held = {where: dict(fake.tables["ip"].elements[where]) for where in names.SERVICE_STAMP_SETS}
    assert sum(map(len, held.values())) == len(services)
    assert all(held.values()), {w: len(e) for w, e in held.items()}  # 119 stamps: every set holds some
    for where, elements in held.items():
        for key in elements:
            assert where == f"service-stamps-{ipaddress.IPv6Address(key).packed[0] >> 4:x}", (where, key)
    assert names.SERVICE_STAMPS not in fake.tables["ip"].sets


def test_a_table_of_layout_3_one_stamp_set_is_rewritten_never_adopted(caplog: pytest.LogCaptureFixture) -> None:
    """Layout 3 held every service stamp in one ``service-stamps`` set.  Such a table, even stamped
    with this process's configuration and the kernel's generation, is rewritten whole (its one set
    gone), never adopted: this process would find none of its stamps in the sixteen sets."""
    import re

    fake = _written(_base())
    for fam, table in fake.tables.items():
        one = {}
        for where in names.SERVICE_STAMP_SETS:
            spec = table.sets.pop(where)
            one.update({k: e._replace(set=names.SERVICE_STAMPS) for k, e in table.elements.pop(where).items()})
        table.sets[names.SERVICE_STAMPS] = dataclasses.replace(spec, name=names.SERVICE_STAMPS)
        table.elements[names.SERVICE_STAMPS] = one
        s = _stamp(fake, fam)
        table.elements[names.STAMP][stamp.STAMP_KEY] = s._replace(comment=re.sub(r"^netproxy \d+ ", "netproxy 3 ",
                                                                                 s.comment or ""))
    _rewrites(fake, _base(), caplog, "stamp layout 3")
    assert names.SERVICE_STAMPS not in fake.tables["ip"].sets
