"""Every conntrack entry of the namespace, counted as ``netproxy top`` folds them, in one dump.

The reconciler's reader (ctnetlink.py) keeps four tuple fields of one protocol; ``top`` also needs
the protocol, whether the connection is still open (the TCP or SCTP state), which entry it is from
one refresh to the next (``CTA_ID``), and, when asked, who the client is (the original source
address) and the packet and byte counters the kernel keeps when ``nf_conntrack_acct`` is on.

- One dump of every family and protocol (``Ctnetlink.dump`` unfiltered): the kernel walks its whole
  table for each dump request, whatever the filter (an empty IPv6 dump beside 100,000 IPv4 entries
  cost 25 ms), so one walk instead of six.
- Counted as read: each entry goes straight into its group, (protocol, service address + port,
  endpoint address + port, state) → the ids of its entries (and, when asked, [packets, bytes] and
  the clients' counts), the groups netproxy/observe/traffic.py folds.  No object per entry but its
  id; reading every entry into a tuple first and grouping them after cost about twice as much.
- Entries of one length and family are laid out alike: the first such entry is walked and the
  offsets of what ``top`` reads are kept (a :class:`_Plan`, at most ``_PLANS`` of them); the next are
  read with one unpack that also reads every header those offsets rely on (the tuples', the
  protocol number's and each read attribute's); an entry whose headers differ is walked.  The
  tuples come at the fixed offsets ctnetlink.py relies on (the kernel always writes them
  ``IP{src,dst} PROTO{num,sport,dport}``); the attributes after them in an order that differs
  between kernel versions.
- An entry laid out otherwise (a per-direction zone inside a tuple) is read attribute by attribute;
  one of a protocol without ports (ICMP) is skipped.
"""

from __future__ import annotations

import struct
from operator import itemgetter
from typing import Any, Callable, Dict, List, Optional, Tuple

from netproxy.node.ctnetlink import (
    _ADDR_LEN,
    _IP_SRC,
    CTA_PROTO_DST_PORT,
    CTA_PROTO_NUM,
    CTA_PROTO_SRC_PORT,
    CTA_TUPLE_IP,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_PROTO,
    CTA_TUPLE_REPLY,
    Ctnetlink,
    Layout,
    _walk,
)

CTA_PROTOINFO, CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY, CTA_ID = 4, 9, 10, 12
CTA_PROTOINFO_STATE = 1  # CTA_PROTOINFO_TCP_STATE and CTA_PROTOINFO_SCTP_STATE alike: the first attribute
CTA_COUNTERS_PACKETS, CTA_COUNTERS_BYTES = 1, 2
_PLANS = 64

Flow = Tuple[int, bytes, bytes, bytes, int, int, int, int]
"""One entry read attribute by attribute: (IP protocol, client address, service address + port,
endpoint address + port, protocol state (TCP's or SCTP's, 0 for UDP), entry id, packets, bytes (both
directions; 0 without accounting)).  Addresses and ports are packed as the kernel sends them (ports
big-endian), as netproxy.node.conntrack's keys are."""

Key = Tuple[int, bytes, bytes, int]
"""A group of entries: (IP protocol, service address + port, endpoint address + port, state)."""
Groups = Dict[Key, List[int]]
"""Each group's entry ids."""
Sums = Dict[Key, List[int]]
"""Each group's [packets, bytes] (with accounting)."""
Clients = Dict[Tuple[int, bytes, bytes], Dict[bytes, int]]
"""(IP protocol, service, endpoint) → client address → entries (with ``clients``)."""
Counted = Tuple[Groups, Sums, Clients]

Tail = Tuple[int, int, int, int]
"""(state, id, packets, bytes) from the attributes after the tuples."""

_ATTR = struct.Struct("=HH")
_BE32 = struct.Struct("!I")
_BE64 = struct.Struct("!Q")

_Values = Tuple[Any, ...]
"""One entry's unpack, as struct gives it (bytes, and ints for the id, state and counters)."""
_Fast = Tuple[Callable[[bytes, int], _Values], Callable[[_Values], _Values], _Values,
              Callable[[_Values], _Values], int, Dict[_Values, List[int]]]
"""What the counting loop takes from a plan, unpacked at once: (unpack, the read headers' getter,
those headers as the plan's first entry had them, the group key's getter, the id's slot, the groups)."""


class _Plan:
    """Where ``top``'s fields were in the first entry of one length and family (``data[off:]``).

    One unpack reads them and the headers they rely on; ``fast`` is what the counting loop uses."""

    def __init__(self, data: bytes, off: int, length: int, family: int, accounting: bool, clients: bool) -> None:
        a = _ADDR_LEN[family]
        reply = 20 + Layout.of(family).tuple_len

        def address(at: int, role: str) -> List[Tuple[int, int, str, str]]:
            # As integers (one, or two for IPv6): a group's key hashes them without hashing bytes.
            return [(at + i, 8 if a == 16 else 4, "Q" if a == 16 else "I", role) for i in range(0, a, 8)]

        # (offset in the reply, size, struct code, role): "check" bytes must be as in this entry.  They
        # pin every offset read: the tuples' lengths, the protocol (whose ports come in one order) and
        # the header of each attribute read after the tuples.
        pieces: List[Tuple[int, int, str, str]] = [
            (16, 16, "16s", "check"),  # nfgenmsg, then ORIG { IP { SRC's header
            *address(36 + a, "dst"),
            (36 + 2 * a, 16, "16s", "check"),  # PROTO { NUM (the protocol) and SRC_PORT's header
            (60 + 2 * a, 2, "H", "dport"),
            (reply, 12, "12s", "check"), *address(reply + 12, "ep"),  # REPLY { IP { SRC
            (reply + 32 + 2 * a, 2, "H", "eport")]
        if clients:
            pieces.append((32, a, f"{a}s", "client"))
        self.proto = data[off + 44 + 2 * a]
        for kind, start, stop in _walk(data, off + 20 + 2 * (reply - 20), off + length):
            hdr = start - 4 - off
            if kind == CTA_ID and stop - start == 4:
                pieces += [(hdr, 4, "4s", "check"), (hdr + 4, 4, "I", "id")]
            elif kind == CTA_PROTOINFO and stop - start >= 9 and \
                    _ATTR.unpack_from(data, start + 4)[1] == CTA_PROTOINFO_STATE:
                pieces += [(hdr, 12, "12s", "check"), (hdr + 12, 1, "B", "state")]  # PROTOINFO { TCP|SCTP { STATE
            elif accounting and kind in (CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY):
                for leaf, l0, l1 in _walk(data, start, stop):
                    if l1 - l0 == 8 and leaf in (CTA_COUNTERS_PACKETS, CTA_COUNTERS_BYTES):
                        role = "packets" if leaf == CTA_COUNTERS_PACKETS else "bytes"
                        pieces += [(l0 - 4 - off, 4, "4s", "check"), (l0 - off, 8, "Q", role)]
        pieces.sort()
        fmt, at = "!", 0
        slots: Dict[str, List[int]] = {}
        for i, (where, size, code, role) in enumerate(pieces):
            fmt += f"{where - at}x{code}"
            slots.setdefault(role, []).append(i)
            at = where + size
        self.ok = "id" in slots
        """An entry without an id is not planned (every kernel writes one): walked."""
        self.stateful = "state" in slots
        keyed = [i for role in ("dst", "dport", "ep", "eport", "state") for i in slots.get(role, [])]
        self.packed = struct.Struct("!QQH" if a == 16 else "!IH").pack
        """An address and port of the key (integers) as the kernel sent them."""
        self.width = a // 8 + 1 if a == 16 else 2
        unpack = struct.Struct(fmt).unpack_from
        checks = itemgetter(*slots["check"])
        self.key = itemgetter(*keyed)
        self.id_at = slots.get("id", [0])[0]
        self.client_at = slots.get("client", [0])[0]
        self.packets_at, self.bytes_at = tuple(slots.get("packets", ())), tuple(slots.get("bytes", ()))
        self.groups: Dict[_Values, List[int]] = {}
        self.sums: Dict[_Values, List[int]] = {}
        self.who: Dict[_Values, Dict[bytes, int]] = {}
        self.fast: _Fast = (unpack, checks, checks(unpack(data, off)), self.key, self.id_at, self.groups)

    def merge(self, out: Counted) -> None:
        """This plan's groups into ``out``, keyed as :data:`Key`."""
        groups, sums, who = out
        proto, stateful, packed, w = self.proto, self.stateful, self.packed, self.width
        for found, into in ((self.groups, groups), (self.sums, sums)):
            for k, got in found.items():
                key = (proto, packed(*k[:w]), packed(*k[w:2 * w]), k[2 * w] if stateful else 0)
                have = into.get(key)
                if have is None:
                    into[key] = got
                elif into is groups:
                    have += got
                else:
                    have[0] += got[0]
                    have[1] += got[1]
        for k, tally in self.who.items():
            merged = who.setdefault((proto, packed(*k[:w]), packed(*k[w:2 * w])), {})
            for client, n in tally.items():
                merged[client] = merged.get(client, 0) + n


def _usual(data: bytes, off: int, family: int) -> bool:
    """Whether the entry's tuples are laid out as a plan expects (no zone inside them)."""
    layout = Layout.of(family)
    reply = off + 20 + layout.tuple_len
    return data[off + 20:off + 32] == layout.orig_head and data[reply:reply + 12] == layout.reply_head


def count(ct: Ctnetlink, accounting: bool = False, clients: bool = False) -> Counted:
    """Every entry of the caller's namespace, one dump, counted into groups (see the module's
    docstring); ``accounting``: sum packets and bytes; ``clients``: count each group's clients."""
    plans: Dict[int, Optional[_Plan]] = {}
    walked: List[Flow] = []
    if not accounting and not clients:  # the common case, in the tightest loop
        fast: Dict[int, _Fast] = {}
        for data, off, length in ct.dump():
            key = length << 8 | data[off + 16]
            found = fast.get(key)
            if found is not None:
                unpack, checks, headers, group_of, id_at, groups = found
                v = unpack(data, off)
                if checks(v) == headers:
                    k = group_of(v)
                    ids = groups.get(k)
                    if ids is None:
                        ids = groups[k] = []
                    ids.append(v[id_at])
                    continue
            elif key not in plans:
                plan = _new_plan(data, off, length, plans, key, False, False)
                if plan is not None:
                    fast[key] = plan.fast
                    continue
            _walk_entry(data, off, length, walked)
    else:
        for data, off, length in ct.dump():
            key = length << 8 | data[off + 16]
            plan = plans.get(key)
            if plan is None and key not in plans:
                plan = _new_plan(data, off, length, plans, key, accounting, clients)
                if plan is not None:
                    continue
            if plan is not None and _count_one(plan, data, off, accounting, clients):
                continue
            _walk_entry(data, off, length, walked)
    out: Counted = ({}, {}, {})
    for plan in plans.values():
        if plan is not None:
            plan.merge(out)
    for flow in walked:
        _add(out, flow, accounting, clients)
    return out


def _new_plan(data: bytes, off: int, length: int, plans: Dict[int, Optional[_Plan]], key: int,
              accounting: bool, clients: bool) -> Optional[_Plan]:
    """The plan of this entry's length and family, counting this entry; None (the entry not
    counted) when it has none: more than ``_PLANS`` layouts, or tuples laid out otherwise."""
    family = data[off + 16]
    if family not in _ADDR_LEN or len(plans) >= _PLANS or not _usual(data, off, family):
        return None
    plan = _Plan(data, off, length, family, accounting, clients)
    plans[key] = plan if plan.ok else None
    if not plan.ok:
        return None
    _count_one(plan, data, off, accounting, clients)
    return plan


def _count_one(plan: _Plan, data: bytes, off: int, accounting: bool, clients: bool) -> bool:
    """One entry into its plan's groups; False when its headers differ from the plan's."""
    unpack, checks, headers, group_of, id_at, groups = plan.fast
    v = unpack(data, off)
    if checks(v) != headers:
        return False
    k = group_of(v)
    ids = groups.get(k)
    if ids is None:
        ids = groups[k] = []
    ids.append(v[id_at])
    if accounting:
        total = plan.sums.get(k)
        if total is None:
            total = plan.sums[k] = [0, 0]
        for i in plan.packets_at:
            total[0] += v[i]
        for i in plan.bytes_at:
            total[1] += v[i]
    if clients:
        tally = plan.who.setdefault(k, {})
        client: bytes = v[plan.client_at]
        tally[client] = tally.get(client, 0) + 1
    return True


def _walk_entry(data: bytes, off: int, length: int, walked: List[Flow]) -> None:
    family = data[off + 16]
    if family in _ADDR_LEN:
        found = _flow_slowly(data[off:off + length], family)
        if found is not None:
            walked.append(found)


def _add(out: Counted, flow: Flow, accounting: bool, clients: bool) -> None:
    """One walked entry into the groups."""
    groups, sums, who = out
    proto, client, dst, ep, state, fid, packets, nbytes = flow
    key = (proto, dst, ep, state)
    groups.setdefault(key, []).append(fid)
    if accounting:
        total = sums.setdefault(key, [0, 0])
        total[0] += packets
        total[1] += nbytes
    if clients:
        tally = who.setdefault((proto, dst, ep), {})
        tally[client] = tally.get(client, 0) + 1


def _after_tuples(data: bytes, p: int, end: int) -> Tail:
    """(state, id, packets, bytes) from the attributes at ``data[p:end]``, walked."""
    state = fid = packets = nbytes = 0
    while p + 4 <= end:
        alen, kind = _ATTR.unpack_from(data, p)
        if alen < 4:
            break
        kind &= 0x3FFF
        if kind == CTA_ID and alen >= 8:
            fid = _BE32.unpack_from(data, p + 4)[0]
        elif kind == CTA_PROTOINFO and alen >= 13 and _ATTR.unpack_from(data, p + 8)[1] == CTA_PROTOINFO_STATE:
            state = data[p + 12]  # PROTOINFO { TCP|SCTP { STATE u8, ... } }
        elif kind in (CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY):
            for leaf, start, stop in _walk(data, p + 4, p + alen):
                if stop - start == 8 and leaf == CTA_COUNTERS_PACKETS:
                    packets += _BE64.unpack_from(data, start)[0]
                elif stop - start == 8 and leaf == CTA_COUNTERS_BYTES:
                    nbytes += _BE64.unpack_from(data, start)[0]
        p += (alen + 3) & ~3
    return state, fid, packets, nbytes


def _flow_slowly(msg: bytes, family: int) -> Optional[Flow]:
    """The same fields from an entry whose tuples carry more than the usual attributes."""
    tuples: Dict[int, Dict[Tuple[int, int], bytes]] = {}
    for kind, start, end in _walk(msg, 20, len(msg)):
        if kind in (CTA_TUPLE_ORIG, CTA_TUPLE_REPLY):
            fields: Dict[Tuple[int, int], bytes] = {}
            for sub, s0, s1 in _walk(msg, start, end):
                for leaf, l0, l1 in _walk(msg, s0, s1):
                    fields[(sub, leaf)] = msg[l0:l1]
            tuples[kind] = fields
    src = _IP_SRC[family]
    try:
        orig, reply = tuples[CTA_TUPLE_ORIG], tuples[CTA_TUPLE_REPLY]
        client = orig[(CTA_TUPLE_IP, src)]
        proto = orig[(CTA_TUPLE_PROTO, CTA_PROTO_NUM)][0]
        dst = orig[(CTA_TUPLE_IP, src + 1)] + orig[(CTA_TUPLE_PROTO, CTA_PROTO_DST_PORT)][:2]
        ep = reply[(CTA_TUPLE_IP, src)] + reply[(CTA_TUPLE_PROTO, CTA_PROTO_SRC_PORT)][:2]
    except (KeyError, IndexError):
        return None  # not a port-carrying protocol
    state, fid, packets, nbytes = _after_tuples(msg, 20, len(msg))
    return proto, client, dst, ep, state, fid, packets, nbytes


ACCT = "/proc/sys/net/netfilter/nf_conntrack_acct"


def accounting(path: str = ACCT) -> bool:
    """Whether the kernel counts packets and bytes per entry in this namespace (only read: turning
    it on is the operator's choice, it costs every packet a little)."""
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


__all__: List[str] = ["Clients", "Counted", "Groups", "Key", "Sums", "accounting", "count"]
