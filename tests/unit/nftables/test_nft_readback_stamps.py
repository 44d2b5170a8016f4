"""readback._plain_elements' quick path for the service stamps' shape (a 16-byte key and a comment,
nothing else: 100k of them at a 100k-service start), against the general reader on the same bytes:
elements of that shape and elements beside it that are not (the general loop reads those)."""

from __future__ import annotations

import os
from typing import Dict, Iterator, List

from netproxy.backends.nftables import wire
from netproxy.backends.nftables.kernel import readback
from netproxy.backends.nftables.kernel.nlsocket import NlSocket
from netproxy.backends.nftables.objects import Set


def _element(key: bytes, udata: bytes, nested: bool, extra: bytes = b"", after: bytes = b"") -> bytes:
    parts = wire.data_value(wire.ELEM_KEY, key) + extra + wire.attr(wire.ELEM_USERDATA, udata) + after
    # The kernel's answers carry no NLA_F_NESTED on the element: both forms.
    return wire.nest(wire.LIST_ELEM, parts) if nested else wire.attr(wire.LIST_ELEM, parts)


class _Dump(NlSocket):
    """A socket whose dump answers ``messages`` (each a list of encoded elements); no netlink socket."""

    def __init__(self, messages: List[List[bytes]]) -> None:
        self.messages = messages

    def dump(self, msg_type: int, family: int, body: bytes = b"",
             subsys: int = wire.NFNL_SUBSYS_NFTABLES) -> Iterator[Dict[int, bytes]]:
        for elements in self.messages:
            yield {wire.SET_ELEM_LIST_ELEMENTS: b"".join(elements)}


def test_the_quick_path_reads_what_the_general_reader_does() -> None:
    comment = wire.udata((0, wire.udata_strz("ns/web:http d:0123456789abcdef n:3")))
    odd = [
        _element(os.urandom(16), wire.udata((1, b"x"), (0, wire.udata_strz("ns/a:p d:00"))), True),  # comment not first
        _element(os.urandom(16), comment, False, extra=wire.attr(wire.ELEM_FLAGS, b"\0\0\0\0")),  # one more attribute
        _element(os.urandom(16), comment, True, after=wire.attr(wire.ELEM_FLAGS, b"\0\0\0\0")),  # ... after the comment
        _element(os.urandom(16), wire.udata((0, wire.udata_strz("x" * 200))), True),  # a long comment
        _element(bytes(10) + b"\xff\xff" + os.urandom(4), comment, False),  # ::ffff:a.b.c.d, written dotted
        _element(os.urandom(16), b"\0", True),  # user data too short to hold a comment
        _element(os.urandom(16), bytes((0, 50)) + b"short\0", False),  # a comment longer than its user data
    ]
    plain = [_element(os.urandom(16), wire.udata((0, wire.udata_strz(f"ns/s{i}:p d:{i:016x} n:{i}"))), i % 2 == 0)
             for i in range(40)]
    sock = _Dump([plain[:20] + odd[:3], odd[3:] + plain[20:]])
    spec = Set("service-stamps-3", "ipv6_addr")
    quick = readback._plain_elements(sock, 10, spec)
    general = list(readback._elements(sock, 10, spec))
    assert quick == general and len(quick) == 47
    assert [e.comment for e in quick[:3]] == ["ns/s0:p d:0000000000000000 n:0", "ns/s1:p d:0000000000000001 n:1",
                                              "ns/s2:p d:0000000000000002 n:2"]
