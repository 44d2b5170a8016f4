"""Every conntrack entry of the namespace as the few fields ``netproxy top`` counts, in one dump.

The reconciler's reader (ctnetlink.py) keeps four tuple fields of one protocol; ``top`` also needs
who the client is (the original source address), the protocol, whether the connection is still
open (the TCP or SCTP state), which entry it is from one refresh to the next (``CTA_ID``), and the
packet and byte counters the kernel keeps when ``nf_conntrack_acct`` is on.

- One dump of every family and protocol: the kernel walks its whole table for each dump request,
  whatever the filter (an empty IPv6 dump beside 100,000 IPv4 entries cost 25 ms), so one walk
  instead of six.
- The tuples are read at the fixed offsets ctnetlink.py relies on (the kernel always writes them
  ``IP{src,dst} PROTO{num,sport,dport}``).  The attributes after them come in an order that differs
  between kernel versions, but entries of one protocol and length are laid out alike: the first such
  entry is walked and the offsets it had are kept (a :class:`_Plan`, at most ``_PLANS`` of them); the
  next entries are read with one unpack that also reads every attribute header it relies on, and an
  entry whose headers differ is walked.  Walking every entry cost 0.5 s per 100,000.
- An entry laid out otherwise (a per-direction zone inside a tuple) is read attribute by attribute;
  one of a protocol without ports (ICMP) is skipped.
Nothing is kept between entries: one tuple per entry, handed on at once.
"""

from __future__ import annotations

import errno
import socket
import struct
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from netproxy.node.ctnetlink import (
    _ADDR_LEN,
    _IP_SRC,
    _NEW_REPLY,
    CTA_PROTO_DST_PORT,
    CTA_PROTO_NUM,
    CTA_PROTO_SRC_PORT,
    CTA_TUPLE_IP,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_PROTO,
    CTA_TUPLE_REPLY,
    IPCTNL_MSG_CT_GET,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    Ctnetlink,
    CtnetlinkError,
    Layout,
    _message,
    _walk,
)

CTA_PROTOINFO, CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY, CTA_ID = 4, 9, 10, 12
CTA_PROTOINFO_STATE = 1  # CTA_PROTOINFO_TCP_STATE and CTA_PROTOINFO_SCTP_STATE alike: the first attribute
CTA_COUNTERS_PACKETS, CTA_COUNTERS_BYTES = 1, 2
_PLANS = 64

Flow = Tuple[int, bytes, bytes, bytes, int, int, int, int]
"""(IP protocol, client address, service address + port, endpoint address + port, protocol state
(TCP's or SCTP's, 0 for UDP), entry id, packets, bytes (both directions; 0 without accounting)).
Addresses and ports are packed as the kernel sends them (ports big-endian), as
netproxy.node.conntrack's keys are."""

Tail = Tuple[int, int, int, int]
"""(state, id, packets, bytes) from the attributes after the tuples."""
Reader = Callable[[bytes, int, int, bytes, bytes, bytes], Optional[Flow]]
"""A plan's reader: (message, where its attributes after the tuples start, and the tuples' protocol,
client, service and endpoint) → the whole flow, in one tuple; None when laid out otherwise."""

_HDR = struct.Struct("=IHHII")
_ATTR = struct.Struct("=HH")
_ERR = struct.Struct("=i")
_BE32 = struct.Struct("!I")
_BE64 = struct.Struct("!Q")
_RECV_SIZE = 1 << 16


class _Shape:
    """One unpack per entry for the netlink header, the family and the tuple fields ``top`` reads."""

    def __init__(self, family: int) -> None:
        a = _ADDR_LEN[family]
        layout = Layout.of(family)
        self.expected = layout.expected
        self.tail = 20 + 2 * layout.tuple_len  # where the attributes after both tuples start
        # Layout.whole, with the original source address and the protocol number read too.
        whole = struct.Struct(f"=IHHI8x12s{a}s4x{a}s8xB11x4s2s2x12s{a}s{16 + a}x4s2s")
        self.unpack, self.size = whole.unpack_from, whole.size


_SHAPES: Dict[int, _Shape] = {family: _Shape(family) for family in _ADDR_LEN}


def _unseen(data: bytes, p: int, proto: int, client: bytes, dst: bytes, ep: bytes) -> Optional[Flow]:
    """The plans' marker for a layout not seen yet (None there: one not to plan, walked)."""
    return None


_UNSEEN = _unseen


class _Plan:
    """Where the attributes after the tuples were in an entry of one protocol and length: one unpack
    reads each attribute's header (to check) and value; ``read`` gives None when a header differs."""

    def __init__(self, data: bytes, p: int, end: int) -> None:
        pieces: List[Tuple[int, int, str, str]] = []  # (header offset from p, header length, value format, slot)
        for kind, start, stop in _walk(data, p, end):
            hdr = start - 4 - p
            if kind == CTA_ID and stop - start == 4:
                pieces.append((hdr, 4, "I", "id"))
            elif kind == CTA_PROTOINFO and stop - start >= 9 and \
                    _ATTR.unpack_from(data, start + 4)[1] == CTA_PROTOINFO_STATE:
                pieces.append((hdr, 12, "B", "state"))  # PROTOINFO { TCP|SCTP { STATE u8 ...
            elif kind in (CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY) and stop - start == 24 and \
                    [k for k, _, _ in _walk(data, start, stop)] == [CTA_COUNTERS_PACKETS, CTA_COUNTERS_BYTES]:
                pieces += [(hdr, 8, "Q", "packets"), (hdr + 16, 4, "Q", "bytes")]
        fmt, at = "!", 0
        headers: List[bytes] = []
        self.slots: Dict[str, List[int]] = {}
        for i, (hdr, size, value, slot) in enumerate(pieces):
            fmt += f"{hdr - at}x{size}s{value}"
            headers.append(data[p + hdr:p + hdr + size])
            self.slots.setdefault(slot, []).append(2 * i + 1)
            at = hdr + size + struct.calcsize("!" + value)
        self.struct = struct.Struct(fmt)
        self.headers = tuple(headers)

    def reader(self) -> Reader:
        """The reading function of this plan (one per layout: no branch or loop in the common cases)."""
        unpack, headers = self.struct.unpack_from, self.headers
        state_at = self.slots.get("state", [-1])[0]
        id_at = self.slots.get("id", [-1])[0]
        packets_at, bytes_at = self.slots.get("packets", []), self.slots.get("bytes", [])
        if state_at >= 0 and id_at >= 0 and not packets_at:  # TCP, SCTP: no accounting

            def stateful(data: bytes, p: int, proto: int, client: bytes, dst: bytes, ep: bytes) -> Optional[Flow]:
                v = unpack(data, p)
                return (proto, client, dst, ep, v[state_at], v[id_at], 0, 0) if v[0::2] == headers else None

            return stateful
        if id_at >= 0 and not packets_at:  # UDP: no accounting

            def stateless(data: bytes, p: int, proto: int, client: bytes, dst: bytes, ep: bytes) -> Optional[Flow]:
                v = unpack(data, p)
                return (proto, client, dst, ep, 0, v[id_at], 0, 0) if v[0::2] == headers else None

            return stateless

        def counted(data: bytes, p: int, proto: int, client: bytes, dst: bytes, ep: bytes) -> Optional[Flow]:
            v = unpack(data, p)
            if v[0::2] != headers:
                return None  # laid out otherwise: walk this one
            return (proto, client, dst, ep, v[state_at] if state_at >= 0 else 0, v[id_at] if id_at >= 0 else 0,
                    sum(v[i] for i in packets_at), sum(v[i] for i in bytes_at))

        return counted


def flows(ct: Ctnetlink) -> Iterator[Flow]:
    """Every entry of the caller's namespace, one dump, in the kernel's order."""
    sock = ct._sock
    ct._seq += 1
    seq = ct._seq
    sock.send(_message(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, socket.AF_UNSPEC, b"", seq))
    plans: Dict[int, Optional[Reader]] = {}
    shapes: Dict[int, _Shape] = {int(family): shape for family, shape in _SHAPES.items()}
    unpack_header = _HDR.unpack_from
    while True:
        data = sock.recv(_RECV_SIZE)
        off, n = 0, len(data)
        while off + 16 <= n:
            length, kind, _flags, mseq, _pid = unpack_header(data, off)
            if length < 16:
                raise CtnetlinkError(errno.EPROTO, "conntrack dump: malformed netlink message")
            if mseq != seq:
                pass
            elif kind == _NEW_REPLY:
                # The loop a refresh spends its time in, kept inline (a call per entry cost 10 %).
                end = off + length
                shape = shapes.get(data[off + 16])
                if shape is not None and off + shape.size <= end:
                    _l, _k, _f, _s, oh, client, dst, proto, dh, dport, rh, src, sh, sport = shape.unpack(data, off)
                    if (oh, dh, rh, sh) == shape.expected:
                        p = off + shape.tail
                        key = proto << 16 | (end - p)
                        read = plans.get(key, _UNSEEN)
                        if read is _UNSEEN:
                            read = plans[key] = _Plan(data, p, end).reader() if len(plans) < _PLANS else None
                        flow = read(data, p, proto, client, dst + dport, src + sport) if read is not None else None
                        yield flow if flow is not None else \
                            (proto, client, dst + dport, src + sport) + _after_tuples(data, p, end)
                        off += (length + 3) & ~3
                        continue
                found = _flow_slowly(data[off:end], socket.AF_INET if data[off + 16] == socket.AF_INET
                                     else socket.AF_INET6)
                if found is not None:
                    yield found
            elif kind == NLMSG_DONE:
                return
            elif kind == NLMSG_ERROR:
                code = -_ERR.unpack_from(data, off + 16)[0]
                if code:
                    raise CtnetlinkError(code, f"conntrack dump refused: {errno.errorcode.get(code, code)}")
            off += (length + 3) & ~3


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


__all__: List[str] = ["Flow", "accounting", "flows"]
