"""A lean ctnetlink client: one filtered dump of the conntrack table, deletes in batches.

The reconciler reads every UDP (or SCTP) entry of a family once per pass.  pyroute2's Conntrack
builds a Python object tree per entry, which at 100,000 entries takes seconds (bench/conntrack.py
measures both); this module keeps each dump reply as bytes and reads the four fields the reconciler
compares (original destination address and port, reply source address and port) at fixed offsets:
the kernel always writes a tuple as ``IP{src,dst} PROTO{num,sport,dport}`` (ctnetlink_dump_tuples).
An entry laid out otherwise (a per-direction zone in the tuple) is read attribute by attribute.

- The dump asks the kernel to filter by protocol (``CTA_FILTER``, Linux 5.8+), so a node's TCP
  entries never cross into user space.  ctnetlink (and pyroute2) can also filter on the conntrack
  mark, zone and status, but netproxy's rules set no conntrack mark or zone on service flows and a
  stale flow may or may not be DNAT-ed (one recorded while its service had no endpoint is not), so
  the protocol is the only filter that narrows the dump without missing a stale entry.
- Deletes name an entry by its original tuple, copied from the dump as it was, plus ``CTA_ID``: an
  entry that expired and was re-created with the same tuple meanwhile is a different id, and stays.
- One receive loop for every dump (:meth:`Ctnetlink.dump`, each reply read where it lies in the
  received bytes): the reconciler's filtered ones (:meth:`Ctnetlink.select`) and ``netproxy top``'s
  unfiltered one (netproxy/node/ctflows.py).
- Many requests go in one ``send`` (the kernel walks every message of a netlink packet), each acked
  with only the header echoed back (``NETLINK_CAP_ACK``).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from typing import Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE, NLM_F_DUMP = 0x1, 0x4, 0x200, 0x400, 0x300
NLA_F_NESTED = 0x8000
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_TIMEOUT, CTA_ID, CTA_ZONE, CTA_FILTER = 1, 2, 3, 7, 12, 18, 25
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_FILTER_ORIG_FLAGS = 1
CTA_FILTER_FLAG_CTA_PROTO_NUM = 1 << 3
SOL_NETLINK, NETLINK_CAP_ACK = 270, 10
SO_RCVBUFFORCE = 33

_HDR = struct.Struct("=IHHII")
_HDR_READ = struct.Struct("=IH2xI")
"""The length, type and sequence number of a message: what a dump reads of each header."""
_NFGEN = struct.Struct("=BBH")
_ATTR = struct.Struct("=HH")
_ERR = struct.Struct("=i")
_NEW_REPLY = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW
_ADDR_LEN: Dict[int, int] = {socket.AF_INET: 4, socket.AF_INET6: 16}
_IP_SRC: Dict[int, int] = {socket.AF_INET: 1, socket.AF_INET6: 3}
_SEND_CHUNK = 60_000  # bytes of requests per send: well under the default socket send buffer
_RECV_SIZE = 1 << 16


class CtnetlinkError(OSError):
    """The kernel refused a request (the message names which one)."""


Keys = Tuple[bytes, bytes, bytes]
"""What the reconciler compares, as bytes of the kernel's message: (original destination address +
port, original destination port, reply source address + port).  Ports are big-endian."""


def _attr(kind: int, payload: bytes) -> bytes:
    head = _ATTR.pack(4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _nest(kind: int, *parts: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(parts))


def _message(kind: int, flags: int, family: int, payload: bytes, seq: int = 0) -> bytes:
    body = _NFGEN.pack(family, 0, 0) + payload
    return _HDR.pack(_HDR.size + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | kind, flags, seq, 0) + body


def tuple_attr(kind: int, family: int, proto: int, src: str, dst: str, sport: int, dport: int) -> bytes:
    """A CTA_TUPLE_ORIG/REPLY attribute from text addresses (creating entries: bench and tests)."""
    src_type = _IP_SRC[family]
    ip = _nest(CTA_TUPLE_IP, _attr(src_type, socket.inet_pton(family, src)),
               _attr(src_type + 1, socket.inet_pton(family, dst)))
    ports = _nest(CTA_TUPLE_PROTO, _attr(CTA_PROTO_NUM, bytes([proto])),
                  _attr(CTA_PROTO_SRC_PORT, struct.pack("!H", sport)),
                  _attr(CTA_PROTO_DST_PORT, struct.pack("!H", dport)))
    return _nest(kind, ip, ports)


def _walk(data: bytes, start: int, end: int) -> Iterator[Tuple[int, int, int]]:
    """(type without flags, payload start, payload end) of the attributes in data[start:end]."""
    while start + 4 <= end:
        length, kind = _ATTR.unpack_from(data, start)
        if length < 4:
            return
        yield kind & 0x3FFF, start + 4, start + length
        start += (length + 3) & ~3


class Layout:
    """Offsets of the compared fields in a dump reply of one family, and the bytes that must be
    there for those offsets to hold."""

    def __init__(self, family: int) -> None:
        a = _ADDR_LEN[family]
        self.family = family
        self.tuple_len = 44 + 2 * a  # nest header, IP{src,dst}, PROTO{num,sport,dport}
        src = _IP_SRC[family]
        self.orig_head = _ATTR.pack(self.tuple_len, CTA_TUPLE_ORIG | NLA_F_NESTED) + \
            _ATTR.pack(12 + 2 * a, CTA_TUPLE_IP | NLA_F_NESTED) + _ATTR.pack(4 + a, src)
        self.reply_head = _ATTR.pack(self.tuple_len, CTA_TUPLE_REPLY | NLA_F_NESTED) + \
            _ATTR.pack(12 + 2 * a, CTA_TUPLE_IP | NLA_F_NESTED) + _ATTR.pack(4 + a, src)
        # One unpack reads the four headers that pin the layout and the four compared fields.
        self.fixed = struct.Struct(f"=12s{4 + a}x{a}s20x4s2s2x12s{a}s{16 + a}x4s2s")
        self.expected = (self.orig_head, _ATTR.pack(6, CTA_PROTO_DST_PORT), self.reply_head,
                         _ATTR.pack(6, CTA_PROTO_SRC_PORT))

    @staticmethod
    def of(family: int) -> Layout:
        return _LAYOUTS[family]

    def keys(self, msg: bytes, off: int = 0) -> Optional[Keys]:
        """The compared fields of the dump reply at ``msg[off:]`` (header included); None if it has
        none (not a port-carrying protocol)."""
        oh, dst, dh, dport, rh, src, sh, sport = self.fixed.unpack_from(msg, off + 20)
        if (oh, dh, rh, sh) == self.expected:
            return dst + dport, dport, src + sport
        length = _HDR.unpack_from(msg, off)[0]
        return self.keys_slowly(msg[off:off + length])

    def keys_slowly(self, msg: bytes) -> Optional[Keys]:
        """The compared fields of dump reply ``msg``, walked attribute by attribute (any layout)."""
        found = {}
        for kind, start, end in _walk(msg, 20, len(msg)):
            if kind in (CTA_TUPLE_ORIG, CTA_TUPLE_REPLY):
                fields = {}
                for sub, s0, s1 in _walk(msg, start, end):
                    for leaf, l0, l1 in _walk(msg, s0, s1):
                        fields[(sub, leaf)] = msg[l0:l1]
                found[kind] = fields
        src = _IP_SRC[self.family]
        try:
            orig, reply = found[CTA_TUPLE_ORIG], found[CTA_TUPLE_REPLY]
            dport = orig[(CTA_TUPLE_PROTO, CTA_PROTO_DST_PORT)][:2]
            return (orig[(CTA_TUPLE_IP, src + 1)] + dport, dport,
                    reply[(CTA_TUPLE_IP, src)] + reply[(CTA_TUPLE_PROTO, CTA_PROTO_SRC_PORT)][:2])
        except KeyError:
            return None  # not a port-carrying protocol: nothing the reconciler compares


def delete_request(msg: bytes, family: int) -> bytes:
    """The delete for the entry of dump reply ``msg``: its original tuple as dumped, its id and zone."""
    layout = _LAYOUTS[family]
    tuples = 20 + 2 * layout.tuple_len
    if msg[20:32] == layout.orig_head and msg[20 + layout.tuple_len:32 + layout.tuple_len] == layout.reply_head:
        parts, start = [msg[20:20 + layout.tuple_len]], tuples  # the usual layout: skip both tuples
    else:
        parts, start = [], 20
    for kind, begin, end in _walk(msg, start, len(msg)):
        if kind in (CTA_TUPLE_ORIG, CTA_ID, CTA_ZONE):
            parts.append(msg[begin - 4:(end + 3) & ~3])
    return _message(IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK, family, b"".join(parts))


_LAYOUTS: Dict[int, Layout] = {family: Layout(family) for family in _ADDR_LEN}


class NetlinkSocket(Protocol):
    """What :class:`Ctnetlink` uses of its socket (a ``socket.socket``; a fake in unit tests)."""

    def send(self, data: bytes, /) -> int: ...

    def recv(self, size: int, /) -> bytes: ...

    def close(self) -> None: ...


class Ctnetlink:
    """A ctnetlink socket in the caller's network namespace (``sock``: one already open, for tests)."""

    def __init__(self, sock: Optional[NetlinkSocket] = None) -> None:
        self._sock = sock if sock is not None else self._open()
        self._seq = 0

    @staticmethod
    def _open() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        sock.bind((0, 0))
        try:  # room for a batch's acks; FORCE needs CAP_NET_ADMIN, which a proxy has
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        with contextlib.suppress(OSError):  # an old kernel echoes whole requests in acks: only slower
            sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        return sock

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Ctnetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def dump(self, family: int = socket.AF_UNSPEC, proto: Optional[int] = None) -> Iterator[Tuple[bytes, int, int]]:
        """Every entry of ``family`` (AF_UNSPEC: both) and ``proto`` (None: every protocol, no filter),
        as (received bytes, offset, length) of its dump reply: slicing out every message would copy
        the whole table once more.  The one receive loop of every dump (:meth:`select`,
        netproxy/node/ctflows.py): the callers read each reply where it lies.  Against a loop of
        select's own, a generator step and a header read an entry: 0.01 s of CPU per 100,000 entries
        (replayed dump, by hand, 2026-12-06 09:01, load 12)."""
        self._seq += 1
        seq = self._seq
        if proto is None:
            request = _message(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, family, b"", seq)
        else:
            request = self._dump_request(family, proto, seq)
        self._sock.send(request)
        unpack_header = _HDR_READ.unpack_from
        while True:
            data = self._sock.recv(_RECV_SIZE)
            off, n = 0, len(data)
            while off + 16 <= n:
                length, kind, mseq = unpack_header(data, off)
                if length < 16:
                    raise CtnetlinkError(errno.EPROTO, "conntrack dump: malformed netlink message")
                if mseq == seq:
                    if kind == _NEW_REPLY:
                        yield data, off, length
                    elif kind == NLMSG_DONE:
                        return
                    elif kind == NLMSG_ERROR:
                        code = -_ERR.unpack_from(data, off + 16)[0]
                        if code:
                            raise CtnetlinkError(code, f"conntrack dump refused: {errno.errorcode.get(code, code)}")
                off += (length + 3) & ~3

    def select(self, family: int, proto: int, pick: Callable[[bytes, bytes, bytes], bool]) -> Tuple[int, List[bytes]]:
        """One dump of ``family``/``proto``: (entries seen, the dump replies of those ``pick`` chose).
        ``pick`` gets :data:`Keys`.  The loop a pass spends its time in: one unpack per entry reads
        the compared fields, no object per entry."""
        layout = _LAYOUTS[family]
        fixed, expected = layout.fixed, layout.expected
        floor = 20 + fixed.size
        seen, picked = 0, []
        for data, off, length in self.dump(family, proto):
            seen += 1
            if length >= floor:
                oh, dst, dh, dport, rh, src, sh, sport = fixed.unpack_from(data, off + 20)
                if (oh, dh, rh, sh) == expected:
                    if pick(dst + dport, dport, src + sport):
                        picked.append(data[off:off + length])
                    continue
            keys = layout.keys_slowly(data[off:off + length])
            if keys is not None and pick(*keys):
                picked.append(data[off:off + length])
        return seen, picked

    @staticmethod
    def _dump_request(family: int, proto: int, seq: int) -> bytes:
        wanted = _nest(CTA_TUPLE_ORIG, _nest(CTA_TUPLE_PROTO, _attr(CTA_PROTO_NUM, bytes([proto]))))
        flt = _nest(CTA_FILTER, _attr(CTA_FILTER_ORIG_FLAGS, struct.pack("=I", CTA_FILTER_FLAG_CTA_PROTO_NUM)))
        return _message(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, family, wanted + flt, seq)

    def batch(self, requests: Sequence[bytes]) -> Tuple[int, int]:
        """Send acked requests in as few sends as fit; (done, already gone).  Another refusal raises,
        after the whole batch was tried."""
        done = gone = 0
        other: Optional[Tuple[int, int]] = None
        i = 0
        while i < len(requests):
            chunk: List[bytes] = []
            size = 0
            first = self._seq + 1
            while i < len(requests) and (not chunk or size + len(requests[i]) <= _SEND_CHUNK):
                self._seq += 1
                req = requests[i]
                chunk.append(req[:8] + struct.pack("=I", self._seq) + req[12:])
                size += len(req)
                i += 1
            self._sock.send(b"".join(chunk))
            pending = set(range(first, self._seq + 1))
            while pending:
                data = self._sock.recv(_RECV_SIZE)
                off = 0
                while off + 16 <= len(data):
                    length, kind, _flags, mseq, _pid = _HDR.unpack_from(data, off)
                    if kind == NLMSG_ERROR and mseq in pending:
                        pending.discard(mseq)
                        code = -_ERR.unpack_from(data, off + 16)[0]
                        if code == 0:
                            done += 1
                        elif code == errno.ENOENT:
                            gone += 1
                        elif other is None:
                            other = (code, mseq - first)
                    off += (length + 3) & ~3 if length >= 16 else len(data)
        if other is not None:
            raise CtnetlinkError(other[0], f"conntrack request refused: {errno.errorcode.get(other[0], other[0])}")
        return done, gone

    def delete(self, messages: Sequence[bytes], family: int) -> Tuple[int, int]:
        """Delete the entries of these dump replies, batched; (deleted, already gone)."""
        return self.batch([delete_request(m, family) for m in messages])


def create_request(family: int, proto: int, client: Tuple[str, int], service: Tuple[str, int],
                   endpoint: Tuple[str, int], timeout: int = 300) -> bytes:
    """A new entry as a DNAT-ed flow leaves it: ``client`` → ``service``, answered by ``endpoint``."""
    payload = (tuple_attr(CTA_TUPLE_ORIG, family, proto, client[0], service[0], client[1], service[1])
               + tuple_attr(CTA_TUPLE_REPLY, family, proto, endpoint[0], client[0], endpoint[1], client[1])
               + _attr(CTA_TIMEOUT, struct.pack("!I", timeout)))
    return _message(IPCTNL_MSG_CT_NEW, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, family, payload)
