"""``hairpin``'s pairs are counted by endpoint address (render.ServiceObjects.hairpin): two service
ports that share an endpoint address hold one pair, which stays while either needs it — in full and
incremental syncs and across a restart by adoption — and the pairs are written as the texts they
were when each was an Element."""

from __future__ import annotations

import ipaddress
from typing import List, Tuple

import pytest

from netproxy.backends.nftables import FakeNft, NftablesBackend, adopt, names, render, serialise
from netproxy.backends.nftables.objects import Element, Elements
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, ServicePort, Snapshot
from tests.unit.nftables.nft_helpers import dumps, eps, fresh_dumps, snap, svc

CONFIG = ProxyConfig(hostname="node-a")
A, Z = svc("a", "10.96.0.10"), svc("z", "10.96.0.11", 443)
A6, Z6 = svc("a6", "fd00::10"), svc("z6", "fd00::11", 443)
SHARED, SHARED6 = "10.1.0.1", "fd01::1"


def _both(a_has: bool, z_has: bool) -> Snapshot:
    """A and Z (and their IPv6 twins), each with an endpoint of its own and, if asked, the shared one."""
    def of(own: str, own6: str, has: bool) -> Tuple[Tuple[Endpoint, ...], Tuple[Endpoint, ...]]:
        return (eps(own, *([SHARED] if has else []), node="node-a"),
                eps(own6, *([SHARED6] if has else []), node="node-a"))
    a4, a6 = of("10.1.0.2", "fd01::2", a_has)
    z4, z6 = of("10.1.0.3", "fd01::3", z_has)
    return snap((A, a4), (Z, z4), (A6, a6), (Z6, z6), node="node-a")


def _pairs(fake: FakeNft) -> List[str]:
    return sorted(fake.elements("ip", names.HAIRPIN)) + sorted(fake.elements("ip6", names.HAIRPIN))


def _counts(b: NftablesBackend) -> Tuple[int, int]:
    assert b._state is not None
    return (b._state.family("ip").hairpin.get(int(ipaddress.ip_address(SHARED)), 0),
            b._state.family("ip6").hairpin.get(int(ipaddress.ip_address(SHARED6)), 0))


def _step(b: NftablesBackend, fake: FakeNft, snapshot: Snapshot, *changed: ServicePort) -> None:
    b.sync(snapshot, Changes(full=False, services=frozenset(s.name for s in changed)))
    assert dumps(fake) == fresh_dumps(snapshot, CONFIG)


def test_a_shared_address_is_one_pair_counted_by_each_user_in_full_and_incremental_syncs() -> None:
    fake = FakeNft()
    b = NftablesBackend(CONFIG, kernel=fake)
    b.sync(_both(True, True), Changes())
    both = ["10.1.0.1 . 10.1.0.1", "10.1.0.2 . 10.1.0.2", "10.1.0.3 . 10.1.0.3",
            "fd01::1 . fd01::1", "fd01::2 . fd01::2", "fd01::3 . fd01::3"]
    assert _pairs(fake) == both and _counts(b) == (2, 2)
    # A drops the shared address: Z still needs its pair.
    _step(b, fake, _both(False, True), A, A6)
    assert _pairs(fake) == both and _counts(b) == (1, 1)
    # Z drops it too: the pair goes, and so does its count.
    _step(b, fake, _both(False, False), Z, Z6)
    assert _pairs(fake) == [p for p in both if "::1 " not in p and "0.1 " not in p] and _counts(b) == (0, 0)
    assert b._state is not None and int(ipaddress.ip_address(SHARED)) not in b._state.family("ip").hairpin
    # Both take it back in one sync: one pair, two users.
    _step(b, fake, _both(True, True), A, Z, A6, Z6)
    assert _pairs(fake) == both and _counts(b) == (2, 2)
    # One leaves and the other comes back in the same sync.
    _step(b, fake, _both(False, True), A, A6)
    _step(b, fake, _both(True, False), A, Z, A6, Z6)
    assert _pairs(fake) == both and _counts(b) == (1, 1)


@pytest.mark.parametrize("by_key", [True, False], ids=["asked-by-key", "read-whole"])
def test_a_shared_pair_stays_across_a_restart_while_an_unchanged_port_needs_it(
        by_key: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not by_key:
        monkeypatch.setattr(adopt, "GET_LIMIT", 0)
    fake = FakeNft()
    NftablesBackend(CONFIG, kernel=fake).sync(_both(True, True), Changes())
    for later in (_both(False, True), _both(False, False), _both(True, True)):
        b = NftablesBackend(CONFIG, kernel=fake)
        before = len(fake.transactions)
        b.sync(later, Changes())
        assert len(fake.transactions) == before + 1 and "delete table" not in serialise.ops_text(fake.transactions[-1])
        assert dumps(fake) == fresh_dumps(later, CONFIG)
    # The adopted record counts the users as a full sync's does.
    assert _counts(b) == (2, 2)


def test_a_full_sync_writes_the_pairs_as_texts_in_numeric_order() -> None:
    """One operation for the set, its elements made as the writer reads them, in the addresses'
    numeric order (10.1.0.9 before 10.1.0.10: no text made to sort on), equal to the Elements they were."""
    fake = FakeNft()
    b = NftablesBackend(CONFIG, kernel=fake)
    addresses = [f"10.1.0.{i}" for i in (9, 10, 1)]
    b.sync(snap((A, eps(*addresses, node="node-a")), (Z, eps("10.1.0.10")), node="node-a"), Changes())
    ops = [obj for _, fam, obj in fake.transactions[-1]
           if fam == "ip" and isinstance(obj, Elements) and obj.set == names.HAIRPIN]
    assert len(ops) == 1
    want = tuple(Element(names.HAIRPIN, f"{a} . {a}") for a in sorted(addresses, key=ipaddress.ip_address))
    assert ops[0].items == want and tuple(ops[0].items) == want and list(ops[0].items[1:]) == list(want[1:])
    assert ops[0].items[0] == want[0] and len(ops[0].items) == 3
    assert "add element ip netproxy hairpin { 10.1.0.1 . 10.1.0.1, 10.1.0.9 . 10.1.0.9, 10.1.0.10 . 10.1.0.10 }" \
        in serialise.ops_text(fake.transactions[-1])


def test_the_addresses_are_the_models_integers() -> None:
    for text in ("10.1.0.1", "255.255.255.254", "fd01::1", "::ffff:10.0.0.1"):
        ep = eps(text)[0]
        assert render._ip_int(ep) == int(ipaddress.ip_address(text))
        family = "ip" if ep.ip.version == 4 else "ip6"
        assert render.hairpin_key(int(ep.ip), family) == f"{ep.ip} . {ep.ip}"
