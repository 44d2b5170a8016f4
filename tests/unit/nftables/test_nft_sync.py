"""Full and incremental syncs against the fake: the incremental result must equal a fresh full sync,
touch only the changed service's objects, and never read the table."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Dict, Tuple

import pytest

from netproxy.backends.base import SyncError
from netproxy.backends.nftables import names
from netproxy.backends.nftables.objects import Chain, Element, Set
from netproxy.core.model import Changes, Endpoint, ServicePort, ServicePortName, Snapshot
from tests.unit.nftables.nft_helpers import backend, dumps, eps, fresh_dumps, snap, svc

WEB = svc("web", "10.96.0.10", external=["192.0.2.10"])
API = svc("api", "10.96.0.11")
DNS = svc("dns", "10.96.0.53", 53, proto="UDP", port_name="dns")
STICKY = svc("sticky", "10.96.0.20", affinity=True, timeout=60)


def _base() -> Snapshot:
    return snap((WEB, eps("10.1.0.1", "10.1.0.2", "10.1.0.3")), (API, eps("10.1.1.1", "10.1.1.2", "10.1.1.3")),
                (DNS, eps("10.1.2.1", port=53)), (STICKY, eps("10.1.3.1", "10.1.3.2")))


def _incremental(b, snapshot: Snapshot, *changed) -> None:  # type: ignore[no-untyped-def]
    b.sync(snapshot, Changes(full=False, services=frozenset(s.name for s in changed)))


def _touched_text(fake) -> str:  # type: ignore[no-untyped-def]
    from netproxy.backends.nftables import serialise
    return serialise.ops_text(fake.transactions[-1])


def test_one_endpoint_change_names_only_that_service_and_equals_a_fresh_sync() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    reads = fake.reads
    after = _base()
    after.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    _incremental(b, after, API)
    text = _touched_text(fake)
    assert "10.1.1.9" in text and "10.96.0.11" in text
    for other in ("10.96.0.10", "10.96.0.53", "10.96.0.20", "192.0.2.10"):
        assert other not in text, f"incremental transaction touched another service:\n{text}"
    assert "table" not in text and "flush" not in text
    # delete + add of the endpoint (its index and the one it moves), and of its hairpin pair
    # (endpoints of unknown node may hairpin here); the service's dispatch element, whose service
    # stamp changed, and the table stamp are replaced too (stamp.py)
    assert len(fake.transactions[-1]) <= 4 + 2 + 2 + 2
    assert fake.reads == reads, "the incremental path must not read the kernel"
    assert dumps(fake) == fresh_dumps(after)


@pytest.mark.parametrize("change", ["grow", "shrink", "to-empty", "from-empty", "delete", "add", "affinity-on",
                                    "affinity-off", "timeout", "port", "external-ip", "local-policy"])
def test_every_kind_of_change_converges_to_what_a_full_sync_writes(change: str) -> None:
    b, fake = backend()
    before = _base()
    b.sync(before, Changes())
    services = dict(before.services)
    endpoints = dict(before.endpoints)
    target = API
    if change == "grow":
        endpoints[API.name] = eps("10.1.1.1", "10.1.1.2", "10.1.1.3", "10.1.1.4")
    elif change == "shrink":
        endpoints[API.name] = eps("10.1.1.1")
    elif change == "to-empty":
        endpoints[API.name] = ()
    elif change == "from-empty":
        endpoints[API.name] = ()
        b.sync(Snapshot(dict(services), dict(endpoints)), Changes())
        endpoints[API.name] = eps("10.1.1.7", "10.1.1.8")
    elif change == "delete":
        del services[API.name]
        del endpoints[API.name]
    elif change == "add":
        target = svc("new", "10.96.0.99")
        services[target.name] = target
        endpoints[target.name] = eps("10.1.9.1", "10.1.9.2")
    elif change == "affinity-on":
        services[API.name] = svc("api", "10.96.0.11", affinity=True)
    elif change == "affinity-off":
        target = STICKY
        services[STICKY.name] = svc("sticky", "10.96.0.20")
    elif change == "timeout":
        target = STICKY
        services[STICKY.name] = svc("sticky", "10.96.0.20", affinity=True, timeout=5)
    elif change == "port":
        services[API.name] = svc("api", "10.96.0.11", 8443)
    elif change == "external-ip":
        services[API.name] = svc("api", "10.96.0.11", external=["192.0.2.11"], lb=["198.51.100.11"])
    elif change == "local-policy":
        target = WEB
        services[WEB.name] = svc("web", "10.96.0.10", external=["192.0.2.10"], ext_policy="Local")
    after = Snapshot(services, endpoints)
    _incremental(b, after, target)
    assert dumps(fake) == fresh_dumps(after)


def test_shared_pick_chain_and_its_map_go_when_the_last_user_goes() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    assert "cluster-udp-pick-1" in fake.tables["ip"].chains  # dns has one endpoint
    services = dict(_base().services)
    endpoints = dict(_base().endpoints)
    endpoints[DNS.name] = eps("10.1.2.1", "10.1.2.2", port=53)
    _incremental(b, Snapshot(services, endpoints), DNS)
    assert "cluster-udp-pick-1" not in fake.tables["ip"].chains
    assert "cluster-udp-endpoints-1" not in fake.tables["ip"].sets
    # web and api still share the 3-endpoint chain and map
    assert len(fake.elements("ip", "cluster-tcp-endpoints-3")) == 6


def test_nothing_changed_writes_nothing() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    n = len(fake.transactions)
    _incremental(b, _base(), API, WEB)
    assert len(fake.transactions) == n


def test_refused_write_raises_with_the_line_keeps_state_and_next_sync_is_full() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    good = dumps(fake)
    after = _base()
    after.endpoints[API.name] = eps("10.1.1.5")  # type: ignore[index]
    fake.fail_next = "add element ip netproxy cluster-tcp-endpoints-1 { ... }"
    with pytest.raises(SyncError) as err:
        _incremental(b, after, API)
    assert err.value.line == "add element ip netproxy cluster-tcp-endpoints-1 { ... }"
    assert dumps(fake) == good
    reads = fake.reads
    _incremental(b, after, API)  # asked for incremental, but after a failure it must re-read and rewrite
    assert fake.reads > reads
    assert dumps(fake) == fresh_dumps(after)


def test_full_sync_repairs_a_table_changed_behind_our_back() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    t = fake.tables["ip"]
    del t.elements[names.SERVICE_IPS]["10.96.0.11 . tcp . 80"]
    t.elements[names.SERVICE_IPS]["10.96.9.9 . tcp . 80"] = Element(names.SERVICE_IPS, "10.96.9.9 . tcp . 80", "drop")
    t.chains["intruder"] = Chain("intruder")
    t.rules["intruder"] = []
    t.rules[names.SERVICES] = []
    fake.foreign_write()  # in the kernel, any change bumps the ruleset generation
    b.sync(_base(), Changes())
    assert dumps(fake) == fresh_dumps(_base())


AFF = names.affinity_map("tcp")


def test_full_sync_keeps_affinity_clients_with_their_time_left() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    fake.touch("ip", AFF, "172.16.0.5 . 10.96.0.20 . 80", expires=37, value="10.1.3.2 . 8080")
    fake.touch("ip", AFF, "172.16.0.6 . 10.96.0.20 . 80", expires=55, value="10.1.3.1 . 8080")
    fake.touch("ip", AFF, "172.16.0.7 . 10.96.0.20 . 80", expires=20, value="10.1.3.9 . 8080")  # not an endpoint
    fake.foreign_write()  # someone else's transaction: the full sync must rebuild the table
    b.sync(_base(), Changes())
    kept = fake.tables["ip"].elements[AFF]
    assert {k: (e.value, e.expires) for k, e in kept.items()} == {
        "172.16.0.5 . 10.96.0.20 . 80": ("10.1.3.2 . 8080", 37),
        "172.16.0.6 . 10.96.0.20 . 80": ("10.1.3.1 . 8080", 55)}


def test_incremental_change_of_another_service_leaves_affinity_clients_alone() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    fake.touch("ip", AFF, "172.16.0.5 . 10.96.0.20 . 80", expires=30, value="10.1.3.1 . 8080")
    reads = fake.reads
    after = _base()
    after.endpoints[API.name] = eps("10.1.1.4")  # type: ignore[index]
    _incremental(b, after, API)
    assert "172.16.0.5 . 10.96.0.20 . 80" in fake.tables["ip"].elements[AFF]
    assert fake.reads == reads, "no affinity service lost an endpoint: nothing to read"


def test_an_endpoint_that_leaves_releases_its_clients_in_the_same_transaction() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    fake.touch("ip", AFF, "172.16.0.5 . 10.96.0.20 . 80", expires=30, value="10.1.3.1 . 8080")
    fake.touch("ip", AFF, "172.16.0.6 . 10.96.0.20 . 80", expires=30, value="10.1.3.2 . 8080")
    fake.touch("ip", AFF, "172.16.0.7 . 10.96.0.10 . 80", expires=30, value="10.1.3.1 . 8080")  # other service
    after = _base()
    after.endpoints[STICKY.name] = eps("10.1.3.2", "10.1.3.3")  # type: ignore[index]
    _incremental(b, after, STICKY)
    assert set(fake.tables["ip"].elements[AFF]) == {"172.16.0.6 . 10.96.0.20 . 80", "172.16.0.7 . 10.96.0.10 . 80"}
    assert "delete element ip netproxy affinity-tcp { 172.16.0.5 . 10.96.0.20 . 80 }" in _touched_text(fake)
    gone = _base()
    del gone.services[STICKY.name]  # type: ignore[attr-defined]
    _incremental(b, gone, STICKY)
    assert set(fake.tables["ip"].elements[AFF]) == {"172.16.0.7 . 10.96.0.10 . 80"}


def test_first_ipv6_service_creates_the_ip6_table_and_cleanup_removes_both() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    assert set(fake.tables) == {"ip"}
    v6 = svc("v6", "fd00::10")
    services = dict(_base().services)
    endpoints = dict(_base().endpoints)
    services[v6.name] = v6
    endpoints[v6.name] = eps("fd01::1")
    after = Snapshot(services, endpoints)
    _incremental(b, after, v6)
    assert set(fake.tables) == {"ip", "ip6"}
    assert dumps(fake) == fresh_dumps(after)
    b.cleanup()
    assert fake.tables == {}


def test_fake_refuses_like_the_kernel() -> None:
    _, fake = backend()
    with pytest.raises(SyncError, match="No such file"):
        fake.apply([("add", "ip", Chain("x"))])
    b, fake = backend()
    b.sync(_base(), Changes())
    before = dumps(fake)
    with pytest.raises(SyncError, match="busy"):
        fake.apply([("delete", "ip", Chain("cluster-tcp-pick-3"))])  # still has its rule and map users
    with pytest.raises(SyncError, match="File exists"):
        fake.apply([("add", "ip", Element(names.SERVICE_IPS, "10.96.0.11 . tcp . 80", "drop"))])
    with pytest.raises(SyncError, match="No such file"):
        fake.apply([("add", "ip", Element(names.SERVICE_IPS, "10.9.9.9 . tcp . 80", "goto nowhere"))])
    with pytest.raises(SyncError, match="busy"):
        fake.apply([("delete", "ip", Set(names.CLUSTER_IPS, "ipv4_addr"))])
    assert dumps(fake) == before, "a refused transaction must change nothing"


def test_full_sync_with_no_foreign_write_since_ours_writes_only_what_changed() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    n = len(fake.transactions)
    b.sync(_base(), Changes())  # nothing changed, nobody else wrote: nothing to do
    assert len(fake.transactions) == n
    after = _base()
    after.endpoints[API.name] = eps("10.1.1.4", "10.1.1.5", "10.1.1.6")  # type: ignore[index]
    b.sync(after, Changes())  # the tracker lost track, but the generation proves the table is ours
    text = _touched_text(fake)
    assert "table" not in text and "10.96.0.10" not in text and "10.1.1.5" in text
    assert dumps(fake) == fresh_dumps(after)


def test_foreign_write_between_incremental_syncs_makes_the_next_full_sync_rebuild() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    fake.foreign_write()
    after = _base()
    after.endpoints[API.name] = eps("10.1.1.4")  # type: ignore[index]
    _incremental(b, after, API)
    b.sync(after, Changes())
    assert any(op[0] == "delete" and type(op[2]).__name__ == "Table" for op in fake.transactions[-1])
    assert dumps(fake) == fresh_dumps(after)


def test_foreign_write_elsewhere_does_not_rebuild_but_one_to_our_table_does() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    n = len(fake.transactions)
    fake.foreign_write(ours=False)  # e.g. firewalld writing its own table
    b.sync(_base(), Changes())
    assert len(fake.transactions) == n, "nothing of ours changed: nothing to write"
    after = _base()
    after.endpoints[API.name] = eps("10.1.1.4")  # type: ignore[index]
    _incremental(b, after, API)
    fake.foreign_write(ours=False)
    b.sync(after, Changes())
    assert len(fake.transactions) == n + 1, "the incremental write only"
    fake.foreign_write(ours=True)
    b.sync(after, Changes())
    assert any(op[0] == "delete" and type(op[2]).__name__ == "Table" for op in fake.transactions[-1])
    assert dumps(fake) == fresh_dumps(after)


def test_lost_notifications_mean_rebuild() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    fake.foreign_write(ours=False)
    fake.watching = False  # as after an overflow: the monitor cannot vouch for our tables
    b.sync(_base(), Changes())
    assert any(op[0] == "delete" and type(op[2]).__name__ == "Table" for op in fake.transactions[-1])


def test_a_skipped_full_sync_keeps_its_own_transactions_apart_from_foreign_ones() -> None:
    b, fake = backend()
    b.sync(_base(), Changes())
    after = _base()
    after.endpoints[API.name] = eps("10.1.1.4")  # type: ignore[index]
    _incremental(b, after, API)  # our transaction's notification waits in the queue
    b.sync(after, Changes())  # nobody else committed: nothing written, nothing drained
    fake.foreign_write(ours=False)
    assert b.tampered() is None, "our own incremental write is not someone else's change"
    n = len(fake.transactions)
    b.sync(after, Changes())
    assert len(fake.transactions) == n


def _random_service(rng: random.Random, i: int) -> ServicePort:
    """Service ports that share pick chains, cluster IPs (one per five ports) and hairpin pairs, each
    with dispatch keys of its own (a key two ports claim goes to the first, which a fresh build
    cannot know); port 0 is always IPv6, so that both builds have an ip6 table."""
    six = i == 0 or rng.random() < 0.2
    s = svc(f"r{i}", f"fd00::{i % 5 + 1:x}" if six else f"10.96.0.{i % 5 + 1}", 80 + i,
            proto=rng.choice(["TCP", "UDP"]), affinity=rng.random() < 0.3, timeout=rng.choice([60, 10800]),
            external=[f"192.0.2.{i % 3 + 1}"] if rng.random() < 0.3 and not six else [],
            lb=[f"198.51.100.{i % 3 + 1}"] if rng.random() < 0.3 and not six else [],
            ext_policy=rng.choice(["Cluster", "Local"]))
    return dataclasses.replace(s, node_port=rng.choice([0, 30000 + i]))


def _random_endpoints(rng: random.Random, s: ServicePort) -> Tuple[Endpoint, ...]:
    six = s.cluster_ips[0].version == 6
    picked = {rng.randrange(1, 6) for _ in range(rng.choice([0, 1, 2, 3]))}
    return eps(*(f"fd01::{n:x}" if six else f"10.1.0.{n}" for n in sorted(picked)),
               node=rng.choice([None, "node-a", "node-b"]))


@pytest.mark.parametrize("seed", range(6))
def test_incremental_syncs_end_with_the_reference_counts_of_a_fresh_full_build(seed: int) -> None:
    rng = random.Random(seed)
    services: Dict[ServicePortName, Tuple[ServicePort, Tuple[Endpoint, ...]]] = {}
    for i in range(8):
        s = _random_service(rng, i)
        services[s.name] = (s, _random_endpoints(rng, s))
    b, fake = backend()
    b.sync(snap(*services.values(), node="node-a"), Changes())
    most = 0
    for _ in range(40):
        changed = set()
        for i in rng.sample(range(10), rng.choice([1, 2, 3])):
            s = _random_service(rng, i)
            if s.name in services and i > 0 and rng.random() < 0.25:
                del services[s.name]
            elif s.name in services and rng.random() < 0.5:
                old = services[s.name][0]
                services[s.name] = (old, _random_endpoints(rng, old))
            else:
                services[s.name] = (s, _random_endpoints(rng, s))
            changed.add(s.name)
        now = snap(*services.values(), node="node-a")
        b.sync(now, Changes(full=False, services=frozenset(changed)))
        fresh, _ = backend()
        fresh.sync(now, Changes())
        assert b._state is not None and fresh._state is not None
        for fam in ("ip", "ip6"):
            got, want = b._state.family(fam), fresh._state.family(fam)
            assert (got.shared, got.refs, got.hairpin) == (want.shared, want.refs, want.hairpin)
            most = max([most, *got.shared.values(), *got.refs.values(), *got.hairpin.values()])
        assert dumps(fake) == fresh_dumps(now)
    assert most > 1, "nothing was shared: nothing was tested"


def test_a_deleted_table_is_repaired_even_when_our_last_write_could_not_be_vouched_for() -> None:
    """Someone committed while our full sync wrote (its generation is not ours + 1): the record is
    not trusted, so change notifications cannot clear a later commit — but a table deleted under it
    (``nft flush ruleset``) is still seen at once, not only at the next periodic sync."""
    b, fake = backend()
    real_apply = fake.apply

    def apply_with_a_commit_beside(ops: Any) -> int:
        fake.foreign_write(ours=False)  # another program's transaction lands between ours' two reads
        return int(real_apply(ops))

    fake.apply = apply_with_a_commit_beside  # type: ignore[method-assign]
    b.sync(_base(), Changes())
    fake.apply = real_apply  # type: ignore[method-assign]
    assert b._state is not None and b._state.generation is None, "the record should not be trusted"
    assert b.tampered() is None, "nothing of ours changed: no repair"
    fake.delete_tables()  # nft flush ruleset
    assert b.tampered() == "table-deleted"
