"""Dispatch trees: a long list of keyed rules split into chains by key prefix.

A flat chain makes every packet check every rule before its own (docs/performance.md: ~24 ns per
rule on legacy, 252 µs at 10k services).  The tree jumps on a key prefix up to 16 ways per level, cut
on a fixed 4-bit grid, until a chain holds at most :data:`LEAF_SIZE` rules, so a packet checks a few
dozen rules whatever the size.  A chain depends only on the keys inside its block, so a one-service
change rewrites only the chains on that service's path (a leaf splitting aside).

One builder, :func:`split_tree`, over two key spaces (:class:`KeySpace`):

- destination addresses (:func:`address_space`, ``-d <prefix>``): nat ``KUBE-SERVICES`` (service
  dispatch) and filter ``KUBE-SERVICES`` (rejects and drops); hairpin masquerade needs no tree, it is
  one ipset lookup in ``KUBE-POSTROUTING`` (``ipset.py``);
- (protocol, destination port) (:func:`port_space`, ``-p tcp`` then ``--dport LO:HI``): nat
  ``KUBE-NODEPORTS`` and filter ``KUBE-EXTERNAL-SERVICES``, which every new connection to a node
  address walks (kubelet, ssh, hostNetwork pods), not only NodePort traffic.
"""

from __future__ import annotations

import ipaddress
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Tuple

Rule = Tuple[str, ...]
Chains = Dict[str, Tuple[Rule, ...]]

LEAF_SIZE = 32
"""At most this many rules in one chain before it is split further."""
FANOUT_BITS = 4
"""Each level splits on this many more key bits (16 ways)."""


@dataclass(frozen=True)
class DispatchEntry:
    """One rule keyed by what it matches (a destination address, or :func:`port_key`); ``rank``
    orders rules of one key (a per-port rule must come before a catch-all for the whole address)."""

    key: int
    rule: Rule
    rank: int = 0


@dataclass(frozen=True)
class KeySpace:
    """What a tree's integer keys mean to iptables."""

    bits: int
    """Key width."""
    split: Callable[[int], int]
    """Common prefix length of a chain's keys → the prefix length its children are cut at."""
    jump: Callable[[int, int], Tuple[Rule, str]]
    """(key >> (bits - prefix length), prefix length) → (the match of a jump to that block's chain,
    the chain's name)."""


def _grid(common: int) -> int:
    """The cut below a common prefix of ``common`` bits: the next multiple of FANOUT_BITS.  On a fixed
    grid, not ``common + FANOUT_BITS``: the blocks (and the chains named after them) then depend only
    on the keys inside them, so a service whose address lies far from the others (another range of
    the service CIDR) adds a level at the top and leaves every existing chain as it was.  Cut at
    ``common + 4``, it moved every cut below and renamed every leaf: one service added to a 10k
    table rewrote all 10,000 dispatch rules (iptables-nft: 4.6 s instead of a few chains)."""
    return (common // FANOUT_BITS + 1) * FANOUT_BITS


def address_space(family: int, chain_name: Callable[[str], str], label: str = "services") -> KeySpace:
    """Keys are destination addresses; ``chain_name(prefix)`` names the chain of ``-d <prefix>``."""
    bits = 32 if family == 4 else 128
    network = ipaddress.IPv4Network if family == 4 else ipaddress.IPv6Network

    def jump(block: int, split: int) -> Tuple[Rule, str]:
        net = str(network((block << (bits - split), split)))
        return ("-d", net, "-m", "comment", "--comment", f"{label} in {net}"), chain_name(net)

    return KeySpace(bits, lambda common: min(bits, _grid(common)), jump)


PROTOCOLS = ("tcp", "udp", "sctp")
"""Index = the protocol's value in the top bits of a :func:`port_key`."""
_PROTOCOL_BITS = 2
_PORT_BITS = 16


def port_key(protocol: str, port: int) -> int:
    """The tree key of a (protocol, destination port) rule: protocol above the 16 port bits."""
    return PROTOCOLS.index(protocol.lower()) << _PORT_BITS | port


def port_space(chain_name: Callable[[str], str], label: str = "nodeports") -> KeySpace:
    """Keys are :func:`port_key` values; the first cut is by protocol (a port range means nothing
    across protocols, and ``--dport`` needs ``-p``), then 16 port ranges per level.
    ``chain_name("tcp")`` / ``chain_name("tcp/30720:30975")`` names a chain."""
    bits = _PROTOCOL_BITS + _PORT_BITS

    def split(common: int) -> int:
        return _PROTOCOL_BITS if common < _PROTOCOL_BITS else min(bits, _PROTOCOL_BITS + _grid(common - _PROTOCOL_BITS))

    def jump(block: int, split: int) -> Tuple[Rule, str]:
        proto = PROTOCOLS[block >> (split - _PROTOCOL_BITS)]
        if split == _PROTOCOL_BITS:
            return ("-p", proto, "-m", "comment", "--comment", f"{label} in {proto}"), chain_name(proto)
        shift = bits - split
        lo = (block << shift) & ((1 << _PORT_BITS) - 1)
        hi = lo + (1 << shift) - 1
        ports = str(lo) if lo == hi else f"{lo}:{hi}"  # iptables-save prints N:N as N
        what = f"{proto}/{ports}"
        return (("-p", proto, "-m", "comment", "--comment", f"{label} in {what}", "-m", proto, "--dport", ports),
                chain_name(what))

    return KeySpace(bits, split, jump)


def split_tree(entries: Iterable[DispatchEntry], space: KeySpace) -> Tuple[Tuple[Rule, ...], Chains]:
    """(rules of the top chain, sub-chains by name), the rules ordered by (key, rank, rule).

    Works on index ranges of one sorted key list and finds each child's end by bisection, so a
    sync that rebuilds the tree (every sync: one service's change can move a leaf boundary) costs
    O(chains × log n) comparisons beyond the sort, not a Python loop over every entry per level.
    (:class:`SortedEntries` keeps the sorted list between syncs, so a change need not sort again.)
    """
    return split_sorted(sorted(entries, key=entry_order), space)


def entry_order(e: DispatchEntry) -> Tuple[int, int, Rule]:
    """The order of a tree's entries: by key, then rank, then the rule itself (deterministic)."""
    return (e.key, e.rank, e.rule)


def split_sorted(ordered: List[DispatchEntry], space: KeySpace) -> Tuple[Tuple[Rule, ...], Chains]:
    """:func:`split_tree` of entries already in :func:`entry_order`."""
    bits = space.bits
    keys = [e.key for e in ordered]
    rules_of = [e.rule for e in ordered]
    sub: Dict[str, Tuple[Rule, ...]] = {}

    def node(lo: int, hi: int) -> Tuple[Rule, ...]:
        if hi - lo <= LEAF_SIZE:
            return tuple(rules_of[lo:hi])
        common = bits - (keys[lo] ^ keys[hi - 1]).bit_length()
        if common == bits:  # one key with many rules (an address with many ports): nothing to split on
            return tuple(rules_of[lo:hi])
        split = space.split(common)
        shift = bits - split
        rules: List[Rule] = []
        start = lo
        while start < hi:
            block = keys[start] >> shift
            end = bisect_left(keys, (block + 1) << shift, start, hi)
            if end - start <= 2:  # a jump would cost as much as the rules themselves
                rules.extend(rules_of[start:end])
            else:
                match, chain = space.jump(block, split)
                sub[chain] = node(start, end)
                rules.append(match + ("-j", chain))
            start = end
        return tuple(rules)

    return node(0, len(ordered)), sub


def build_tree(entries: Iterable[DispatchEntry], family: int, chain_name: Callable[[str], str],
               label: str = "services") -> Tuple[Tuple[Rule, ...], Chains]:
    """A destination-prefix tree; ``chain_name(prefix)`` names a sub-chain."""
    return split_tree(entries, address_space(family, chain_name, label))


def build_sorted_tree(ordered: List[DispatchEntry], family: int, chain_name: Callable[[str], str],
                      label: str = "services") -> Tuple[Tuple[Rule, ...], Chains]:
    """:func:`build_tree` of entries already in :func:`entry_order` (:class:`SortedEntries`)."""
    return split_sorted(ordered, address_space(family, chain_name, label))


def build_port_tree(entries: Iterable[DispatchEntry], chain_name: Callable[[str], str],
                    label: str = "nodeports") -> Tuple[Tuple[Rule, ...], Chains]:
    """A (protocol, port) tree; up to :data:`LEAF_SIZE` rules it is the flat list in the given order
    (kube-proxy's ``KUBE-NODEPORTS``, byte for byte).  Rules of one key keep their given order (the
    first service claiming a port wins, as in the flat list)."""
    listed = list(entries)
    if len(listed) <= LEAF_SIZE:
        return tuple(e.rule for e in listed), {}
    return split_tree((DispatchEntry(e.key, e.rule, i) for i, e in enumerate(listed)), port_space(chain_name, label))


class SortedEntries:
    """A tree's entries in :func:`entry_order`, kept between syncs and updated by what changed.

    Sorting 10k entries again for a one-service change cost about as much as the rest of its
    Python work on iptables-legacy (whose write is the whole table anyway).  The entries come per
    service as tuples the renderer hands over unchanged (the same objects) while the service is
    unchanged, so the change is found by identity, and placed by bisection.  ``unique``: equal
    entries of several services are one rule (filter's catch-all REJECT of a multi-port cluster
    IP); otherwise each is its own rule (nat's dispatch).
    """

    REBUILD = 256
    """More changed entries than this: sort again (cheaper than as many insertions)."""

    def __init__(self, unique: bool = False) -> None:
        self.unique = unique
        self._inputs: List[Tuple[DispatchEntry, ...]] = []
        self._ordered: List[DispatchEntry] = []
        self._keys: List[Tuple[int, int, Rule]] = []
        self._count: Dict[DispatchEntry, int] = {}

    def update(self, inputs: List[Tuple[DispatchEntry, ...]]) -> List[DispatchEntry]:
        """The sorted entries of ``inputs`` (one tuple per service)."""
        old = {id(t): t for t in self._inputs}
        new_ids = {id(t) for t in inputs}
        added = [e for t in inputs if id(t) not in old for e in t]
        removed = [e for i, t in old.items() if i not in new_ids for e in t]
        if not self._inputs or len(added) + len(removed) > self.REBUILD or \
                not all(self._remove(e) for e in removed):
            self._rebuild(inputs)  # (an entry not where it should be: never seen, but never trusted)
        else:
            for e in added:
                self._add(e)
        self._inputs = list(inputs)
        return self._ordered

    def _rebuild(self, inputs: List[Tuple[DispatchEntry, ...]]) -> None:
        self._count = {}
        listed: List[DispatchEntry] = []
        for t in inputs:
            for e in t:
                n = self._count.get(e, 0)
                self._count[e] = n + 1
                if not (self.unique and n):
                    listed.append(e)
        self._ordered = sorted(listed, key=entry_order)
        self._keys = [entry_order(e) for e in self._ordered]

    def _add(self, e: DispatchEntry) -> None:
        n = self._count.get(e, 0)
        self._count[e] = n + 1
        if self.unique and n:
            return
        k = entry_order(e)
        at = bisect_right(self._keys, k)
        self._keys.insert(at, k)
        self._ordered.insert(at, e)

    def _remove(self, e: DispatchEntry) -> bool:
        """Take one ``e`` out; False if it was not there (the caller rebuilds)."""
        n = self._count.get(e, 0) - 1
        if n < 0:
            return False
        if n > 0:
            self._count[e] = n
            if self.unique:
                return True
        else:
            del self._count[e]
        k = entry_order(e)
        at = bisect_left(self._keys, k)
        if at == len(self._keys) or self._keys[at] != k:
            return False
        del self._keys[at]
        del self._ordered[at]
        return True
