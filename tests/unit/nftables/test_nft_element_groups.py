"""A full sync's elements travel as one :class:`~objects.Elements` operation per set (no 3-tuple per
element at the write's peak): the writers and the fake
must read a group exactly as the elements one by one (docs/performance.md, the seventh pass)."""

from __future__ import annotations

import copy
import pickle
from typing import List

import pytest

from netproxy.backends.nftables import encode, names, serialise
from netproxy.backends.nftables.objects import ElementRun, Elements
from netproxy.backends.nftables.serialise import Op
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes

from .nft_helpers import backend, eps, fresh_dumps, mixed_snapshot, snap, svc


def _one_by_one(ops: List[Op]) -> List[Op]:
    return [(v, f, item) for v, f, o in ops for item in (o.items if isinstance(o, Elements) else (o,))]


def _full_ops() -> List[Op]:
    b, _ = backend()
    b.sync(mixed_snapshot(), Changes())
    assert b.last_transaction is not None
    return b.last_transaction.ops


def test_a_full_sync_carries_one_element_operation_per_set() -> None:
    b, _ = backend()
    b.sync(mixed_snapshot(), Changes())
    tx = b.last_transaction
    assert tx is not None
    # The table stamps are added one by one after the transaction is built (put_stamp).
    assert {o.set for _, _, o in tx.phases["elements"] if not isinstance(o, Elements)} == {names.STAMP}
    groups = [op for op in tx.phases["elements"] if isinstance(op[2], Elements)]
    assert groups and all(o.items for _, _, o in groups)
    assert len({(f, o.set) for _, f, o in groups}) == len(groups), "one operation per family and set"
    assert all(item.set == o.set for _, _, o in groups for item in o.items)
    runs = [item for _, _, o in groups for item in o.items if isinstance(item, ElementRun)]
    assert len(runs) >= 4, "the endpoint runs of web, dns, sticky and v6"


def test_groups_encode_and_serialise_as_their_elements_one_by_one() -> None:
    ops = _full_ops()
    flat = _one_by_one(ops)
    assert len(flat) > len(ops)
    grouped = list(encode.Encoder().messages(ops))
    single = list(encode.Encoder().messages(flat))
    assert [m for m, _ in grouped] == [m for m, _ in single]
    # A refused message names an element, never the whole group (netlink.py prints it).
    assert [op for _, op in grouped] == [op for _, op in single]
    assert serialise.ops_text(ops) == serialise.ops_text(flat)


def test_the_fake_applies_a_group_as_its_elements() -> None:
    snapshot = mixed_snapshot()
    b, fake = backend()
    b.sync(snapshot, Changes())
    _, flat_fake = backend()
    flat_fake.apply(_one_by_one(_full_ops()))
    for fam in ("ip", "ip6"):
        assert fake.dump(fam) == flat_fake.dump(fam) == fresh_dumps(snapshot)[fam]


def test_a_run_keeps_its_values_as_the_kernels_bytes_and_behaves_as_the_tuple_did() -> None:
    values = ("10.1.0.1 . 8080", "10.1.0.2 . 8080", "10.1.0.3 . 8080")
    run = ElementRun("eps", "10.96.0.10 . 80", values)
    assert run.values == values and run.indexed and run.size == 3
    assert run.packed == b"".join(bytes([10, 1, 0, i]) + (8080).to_bytes(2, "big") + b"\0\0" for i in (1, 2, 3))
    assert run == ElementRun("eps", "10.96.0.10 . 80", list(values)) and hash(run) == hash(ElementRun(*run[:2], values))
    assert run != ElementRun("eps", "10.96.0.10 . 80", values[:2])
    one = ElementRun("eps", "10.96.0.10 . 80", values[:1])
    assert one.values == values[:1] and not one.indexed and ElementRun("eps", "p", ()).values == ()
    moved = run._replace(values=values[::-1])
    assert moved.values == values[::-1] and (moved.set, moved.prefix) == (run.set, run.prefix)
    assert run._replace(prefix="10.96.0.11 . 80").values == values
    assert copy.deepcopy(run) == run and pickle.loads(pickle.dumps(run)) == run
    assert [e.key for e in run.elements()] == [f"10.96.0.10 . 80 . {i}" for i in range(3)]


def test_ports_without_chains_of_their_own_share_one_read_only_empty_mapping() -> None:
    b, _ = backend(ProxyConfig(hostname="node-a", ipv6_affinity="sets"))
    b.sync(snap((svc("web", "10.96.0.10"), eps("10.1.0.1")), (svc("v6", "fd00::10"), eps("fd01::1")),
                (svc("s6", "fd00::20", affinity=True), eps("fd01::5", "fd01::6"))), Changes())
    assert b._state is not None
    objs = {str(n): e.objects for n, e in b._state.entries.items()}
    plain, v6, sticky = objs["ns/web:http"]["ip"], objs["ns/v6:http"]["ip6"], objs["ns/s6:http"]["ip6"]
    assert plain.chains is v6.chains and plain.sets is v6.sets and not plain.chains and not plain.sets
    with pytest.raises(TypeError):
        plain.chains["x"] = ()  # type: ignore[index]
    # IPv6 ClientIP affinity as per-service sets (nft < 1.1): its own chain and sets.
    assert sticky.chains and len(sticky.sets) == 2 and not v6.chains
