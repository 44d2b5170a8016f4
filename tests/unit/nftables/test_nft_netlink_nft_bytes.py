"""The netlink encoder against the bytes ``nft`` itself sends for the same transactions.

The expectation comes from nft 1.0.6, not from netproxy: data/nft-netlink.json holds the messages
that ``nft --debug=mnl -f`` sent for two of the nftables backend's transactions written as nft text
(tests/unit/nftables/nft_netlink_capture.py made it, in a throwaway network namespace). This file
reads both sides with its own netlink attribute parser (no ``wire`` helper, which the encoder uses)
and compares what the kernel would make of them:

- every message but element additions and deletions, in order, attribute for attribute (the
  kernel reads a message's attributes into a table by type, so their order inside a message is
  not compared; the entries of a list -- a rule's expressions, a set's concatenated fields -- are
  compared in order, without their entry type, which the kernel ignores and libnftnl numbers);
- the elements: both sides' element messages applied in order to a model of each set (an add puts
  the element under its key and flags, a delete removes it, a flush empties the set), and every
  set's elements compared after each transaction. nft 1.0.6 also sends an interval set's new
  elements a second time right after creating the set (with its anchor element); the model keeps
  that from counting as a difference, while any element either side adds, leaves out, changes or
  removes is one.

Left out, as netproxy leaves them out: the set id with which nft also names a set created in the
same batch (in a lookup, a dynset, an element list); the kernel finds the set by name first, and
netproxy names every set it refers to.

If a change to the renderer changes these transactions the test says so: rerun the capture script
as root and review its diff.
"""

from __future__ import annotations

import json
import struct
from typing import Dict, List, Optional, Sequence, Tuple, Union

import pytest

from netproxy.backends.nftables import encode, serialise
from netproxy.backends.nftables.objects import Set
from tests.unit.nftables.nft_netlink_capture import DATA, transactions

# The kernel's uapi (linux/netfilter/nf_tables.h, linux/netlink.h), written out here on purpose.
SUBSYS_NFTABLES = 10
NEWTABLE, NEWCHAIN, NEWRULE, DELRULE, NEWSET, DELSET, NEWSETELEM, DELSETELEM = 0, 3, 6, 8, 9, 11, 12, 14
RULE_EXPRESSIONS = 4
SET_DESC, SET_DESC_CONCAT = 9, 2
ELEM_LIST_TABLE, ELEM_LIST_SET, ELEM_LIST_ELEMENTS, ELEM_LIST_SET_ID = 1, 2, 3, 4
ELEM_KEY, ELEM_FLAGS = 1, 3
EXPR_NAME, EXPR_DATA = 1, 2
LOOKUP_SET_ID, DYNSET_SET_ID = 4, 2
META_KEY, META_L4PROTO = 2, 16
NESTED, TYPE_MASK = 0x8000, 0x3FFF

Tree = Union[bytes, Tuple[object, ...]]
"""A normalised attribute: a leaf's payload, a nest's sorted (type, tree) pairs, or ("list", trees)."""


def _attributes(payload: bytes) -> List[Tuple[int, bytes]]:
    out, at = [], 0
    while at + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, at)
        if length < 4 or at + length > len(payload):
            raise AssertionError(f"attribute of type {kind & TYPE_MASK} at {at}: bad length {length}")
        out.append((kind, payload[at + 4:at + length]))
        at += (length + 3) & ~3
    assert at == len(payload), f"{len(payload) - at} trailing bytes"
    return out


def _tree(payload: bytes, lists: Sequence[Tuple[int, ...]], path: Tuple[int, ...] = ()) -> Tuple[object, ...]:
    pairs: List[Tuple[int, object]] = []
    for kind, value in _attributes(payload):
        t = kind & TYPE_MASK
        if not kind & NESTED:
            pairs.append((kind, value))
        elif path + (t,) in lists:  # a list: entries in order, their (ignored) entry types dropped
            entries = tuple(_entry(v, lists, path + (t,)) for _, v in _attributes(value))
            pairs.append((kind, ("list", entries)))
        else:
            pairs.append((kind, _tree(value, lists, path + (t,))))
    return tuple(sorted(pairs, key=lambda p: (p[0], repr(p[1]))))


def _fields(tree: object) -> Dict[object, object]:
    """A normalised nest's attributes by type."""
    assert isinstance(tree, tuple), tree
    return {pair[0]: pair[1] for pair in tree if isinstance(pair, tuple)}


def _entry(payload: bytes, lists: Sequence[Tuple[int, ...]], path: Tuple[int, ...]) -> Tuple[object, ...]:
    """A list's entry; an expression less the set id nft adds beside a set's name."""
    tree = _tree(payload, lists, path)
    name = _fields(tree).get(EXPR_NAME)
    drop = {b"lookup\0": LOOKUP_SET_ID, b"dynset\0": DYNSET_SET_ID}.get(name) if isinstance(name, bytes) else None
    if drop is None:
        return tree
    out: List[object] = []
    for pair in tree:
        assert isinstance(pair, tuple)
        kind, value = pair
        if kind == EXPR_DATA | NESTED and isinstance(value, tuple):
            value = tuple(p for p in value if isinstance(p, tuple) and p[0] & TYPE_MASK != drop)
        out.append((kind, value))
    return tuple(out)


_LISTS: Dict[int, Sequence[Tuple[int, ...]]] = {NEWRULE: [(RULE_EXPRESSIONS,)], NEWSET: [(SET_DESC, SET_DESC_CONCAT)]}

Sets = Dict[Tuple[int, bytes, bytes], Dict[Tuple[object, object], Tuple[object, ...]]]


def _apply_elements(sets: Sets, kind: int, family: int, body: bytes) -> None:
    """One element message applied to the model of the sets' contents."""
    fields = dict((k & TYPE_MASK, v) for k, v in _attributes(body))
    where = (family, fields[ELEM_LIST_TABLE], fields[ELEM_LIST_SET])
    if ELEM_LIST_ELEMENTS not in fields:  # no list: a flush
        assert kind == DELSETELEM, "an element addition without elements"
        sets[where] = {}
        return
    members = sets.setdefault(where, {})
    for _, raw in _attributes(fields[ELEM_LIST_ELEMENTS]):
        element = _tree(raw, [])
        parts = _fields(element)
        identity = (parts.get(ELEM_KEY | NESTED), parts.get(ELEM_FLAGS, struct.pack(">I", 0)))
        if kind == NEWSETELEM:
            members[identity] = element
        else:
            assert identity in members, f"set {where[2]!r}: deletes {identity} it does not hold"
            del members[identity]


Message = Tuple[int, int, bytes]
"""(nf_tables message type, address family, attributes)."""


def _is_l4proto_byteorder(expr: object, before: object) -> bool:
    if _fields(expr).get(EXPR_NAME) != b"byteorder\0" or before is None:
        return False
    prev = _fields(before)
    return prev.get(EXPR_NAME) == b"meta\0" and \
        _fields(prev.get(EXPR_DATA | NESTED, ())).get(META_KEY) == struct.pack(">I", META_L4PROTO)


def _without_l4proto_byteorder(rule: Tuple[object, ...]) -> Tuple[object, ...]:
    """nft 1.0.6's rule less the byteorder expression it puts after a ``meta l4proto`` load (the one
    allowed difference in a rule: a one-byte no-op that nft 1.1 no longer emits and Debian 13's kernel
    refuses; netproxy writes as nft 1.1)."""
    out: List[object] = []
    for pair in rule:
        assert isinstance(pair, tuple)
        kind, value = pair
        if kind == RULE_EXPRESSIONS | NESTED and isinstance(value, tuple):
            kept: List[object] = []
            for expr in value[1]:
                if not _is_l4proto_byteorder(expr, kept[-1] if kept else None):
                    kept.append(expr)
            value = ("list", tuple(kept))
        out.append((kind, value))
    return tuple(out)


def _replay(messages: Sequence[Message], sets: Sets, nft: bool = False) -> List[Tuple[int, int, Tuple[object, ...]]]:
    """The messages other than element ones, normalised, in order; the element ones applied to ``sets``."""
    others = []
    for kind, family, body in messages:
        if kind in (NEWSETELEM, DELSETELEM):
            _apply_elements(sets, kind, family, body)
            continue
        if kind == DELSET:
            name = dict((k & TYPE_MASK, v) for k, v in _attributes(body))
            sets.pop((family, name[1], name[2]), None)
        tree = _tree(body, _LISTS.get(kind, []))
        others.append((kind, family, _without_l4proto_byteorder(tree) if nft and kind == NEWRULE else tree))
    return others


def _nft_messages(recorded: Sequence[Sequence[object]]) -> List[Message]:
    out = []
    for kind, payload_hex in recorded:
        payload = bytes.fromhex(str(payload_hex))
        assert int(str(kind)) >> 8 == SUBSYS_NFTABLES, f"not an nf_tables message: {kind}"
        # nfgenmsg: family, version 0, resource id 0
        assert payload[1:4] == b"\0\0\0", payload[:4].hex()
        out.append((int(str(kind)) & 0xFF, payload[0], payload[4:]))
    return out


def _diff(nft: Sequence[object], ours: Sequence[object]) -> Optional[str]:
    for i, (a, b) in enumerate(zip(nft, ours)):
        if a != b:
            return f"message {i} differs:\n  nft:  {a}\n  ours: {b}"
    if len(nft) != len(ours):
        return f"nft sent {len(nft)} such messages, the encoder {len(ours)}"
    return None


@pytest.fixture(scope="module")
def recorded() -> Dict[str, object]:
    with open(DATA) as f:
        data: Dict[str, object] = json.load(f)
    return data


def test_the_recorded_transactions_are_the_backends() -> None:
    with open(DATA) as f:
        data = json.load(f)
    texts = [serialise.ops_text(t) for t in transactions()]
    assert texts == [t["input"] for t in data["transactions"]], (
        "the backend's transactions changed: rerun `python -m tests.unit.nftables.nft_netlink_capture` as root "
        "and review data/nft-netlink.json's diff")


def test_the_encoder_sends_what_nft_sends_for_the_same_transactions(recorded: Dict[str, object]) -> None:
    nft_sets: Sets = {}
    our_sets: Sets = {}
    known: Dict[Tuple[str, str], Set] = {}
    recorded_transactions = recorded["transactions"]
    assert isinstance(recorded_transactions, list)
    for n, (ops, seen) in enumerate(zip(transactions(), recorded_transactions)):
        encoder = encode.Encoder(known)  # one per transaction, as the writer's; it knows the sets made before
        ours = [(kind, int(family), body) for (kind, _flags, family, body), _op in encoder.messages(ops)]
        nft = _nft_messages(seen["messages"])
        nft_others, our_others = _replay(nft, nft_sets, nft=True), _replay(ours, our_sets)
        assert nft_others and nft_sets, "nothing recorded"
        problem = _diff(nft_others, our_others)
        assert problem is None, f"transaction {n}: {problem}"
        known = encoder.sets
        for where in sorted(set(nft_sets) | set(our_sets)):
            assert our_sets.get(where) == nft_sets.get(where), f"transaction {n}: set {where[2]!r} holds other elements"
