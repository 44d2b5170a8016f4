"""The kernel's ipsets over netlink: the sets the iptables backend keeps beside its rules.

Two kinds of ``hash:ip,port,ip`` set per family (README.md, "Sets"):

- ``NETPROXY-HAIRPIN-<4|6>``: ``endpoint ip, proto:port, endpoint ip`` for every endpoint that can
  hairpin through this node; one rule in ``KUBE-POSTROUTING`` matches ``src,dst,dst`` against it.
- ``NETPROXY-AFFINITY-<4|6>-<slot>``: ``client, proto:service port, service address`` remembered by
  ClientIP affinity for the endpoint that sits in ``slot`` of that service (``affinity.py``), with
  each element's own timeout.  Filled by the kernel (``-j SET --add-set``); netproxy only deletes
  from them (an endpoint that leaves releases its clients) and creates and destroys them.

Hand-written on :mod:`netproxy.backends.nftables.wire` because pyroute2's ``IPSet`` sends one
element per message with an ACK each: 345 µs per element measured (10k hairpin elements 3.4 s;
129k at the benchmark's mixed 10k cluster would be 44 s), where one message carries ~1,000 elements
here.  Attribute numbers are from the kernel's ``include/uapi/linux/netfilter/ipset/ip_set.h``.
"""

from __future__ import annotations

import ipaddress
import operator
import socket
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Set, Tuple

from netproxy.backends.base import BackendError
from netproxy.backends.nftables import wire
from netproxy.backends.nftables.kernel.nlsocket import NetlinkError, NlSocket

__all__ = ["Element", "Ipsets", "KernelIpsets", "PREFIX", "affinity_set", "hairpin_set", "IpsetError"]

PREFIX = "NETPROXY-"
"""Every set netproxy creates starts with it; ``cleanup`` destroys those and nothing else."""
TYPE = "hash:ip,port,ip"
REVISION = 1  # timeouts since revision 0, SCTP since 1; every kernel we support has 1-5
MAXELEM = 1 << 20
"""A set holds at most this many elements (ipset's default is 65,536; kube-proxy's recent lists
hold 100 clients per endpoint by default).  Memory is taken per element, not reserved."""
DEFAULT_TIMEOUT = 10800
"""The timeout an affinity set is created with; each element carries its service's own."""

NFNL_SUBSYS_IPSET = 6
PROTOCOL = 6  # IPSET_PROTOCOL_MIN: what every kernel since 3.x takes
CMD_CREATE, CMD_DESTROY, CMD_LIST, CMD_ADD, CMD_DEL = 2, 3, 7, 9, 10
ATTR_PROTOCOL, ATTR_SETNAME, ATTR_TYPENAME, ATTR_REVISION, ATTR_FAMILY, ATTR_FLAGS = 1, 2, 3, 4, 5, 6
ATTR_DATA, ATTR_ADT, ATTR_LINENO = 7, 8, 9
ATTR_IP, ATTR_PORT, ATTR_TIMEOUT, ATTR_PROTO, ATTR_IP2 = 1, 4, 6, 7, 20
ATTR_MAXELEM = 19
ATTR_IPADDR_IPV4, ATTR_IPADDR_IPV6 = 1, 2
NLA_F_NET_BYTEORDER = 0x4000
FLAG_LIST_HEADER = 1 << 2
NFPROTO = {4: 2, 6: 10}
PER_MESSAGE = 1000
"""Elements per message: the ADT nest's length is 16 bits (≤ 64 KB); an IPv6 element is ~68 bytes."""

ERRORS = {4097: "protocol error", 4098: "set type not supported by the kernel", 4099: "too many sets",
          4100: "set is busy", 4101: "set name exists", 4102: "set type mismatch",
          4103: "element exists", 4107: "timeout not supported by the set", 4108: "set is in use by a rule",
          4109: "invalid IPv4 address", 4110: "invalid IPv6 address", 4353: "set is full"}

PROTOS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP, "sctp": 132}

Element = Tuple[int, int, int, int]
"""(first address as an integer, IP protocol number, port, second address as an integer)."""


class IpsetError(BackendError):
    """The kernel refused an ipset request."""


def affinity_set(family: int, slot: int) -> str:
    return f"{PREFIX}AFFINITY-{family}-{slot}"


def hairpin_set(family: int) -> str:
    return f"{PREFIX}HAIRPIN-{family}"


def cluster_ip_set(family: int) -> str:
    """``hash:ip`` of every service's cluster IPs: filter refuses their ports no service has."""
    return f"{PREFIX}CLUSTER-IPS-{family}"


def family_of(name: str) -> int:
    """4 or 6: the first number in one of netproxy's set names."""
    return int(next(part for part in name.split("-") if part.isdigit()))


def set_type(name: str) -> str:
    return "hash:ip" if name.startswith(f"{PREFIX}CLUSTER-IPS-") else TYPE


def address(ip: int) -> Element:
    """An element of a ``hash:ip`` set, in the same 4-tuple as the others."""
    return (ip, 0, 0, 0)


@dataclass(frozen=True)
class SetInfo:
    name: str
    family: int


class Ipsets(Protocol):
    """What the backend needs from the kernel's sets (a fake keeps them in memory for unit tests)."""

    def sets(self) -> Dict[str, SetInfo]: ...

    def create(self, name: str, family: int, timeout: bool) -> None: ...

    def destroy(self, name: str) -> None: ...

    def add(self, name: str, family: int, elements: Iterable[Element]) -> None: ...

    def delete(self, name: str, family: int, elements: Iterable[Element]) -> None: ...

    def elements(self, name: str) -> List[Element]: ...

    def each(self, name: str) -> Iterator[Element]:
        """:meth:`elements` one at a time, as the kernel hands them over: a full sync compares the
        500k hairpin elements of 100k services with those it wants without holding them all."""


def _addr(kind: int, family: int, value: int) -> bytes:
    if family == 4:
        inner = wire.attr(ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, struct.pack(">I", value))
    else:
        inner = wire.attr(ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, value.to_bytes(16, "big"))
    out: bytes = wire.nest(kind, inner)
    return out


def _element_struct(family: int) -> Tuple[struct.Struct, Tuple[int, ...]]:
    """One element as one ``struct``: every header is a constant, only the values vary."""
    n = 4 if family == 4 else 16
    addr_type = (ATTR_IPADDR_IPV4 if family == 4 else ATTR_IPADDR_IPV6) | NLA_F_NET_BYTEORDER
    ip_nest = 4 + 4 + n
    size = 4 + ip_nest + 8 + 8 + ip_nest
    heads = (size, ATTR_DATA | wire.NLA_F_NESTED, ip_nest, ATTR_IP | wire.NLA_F_NESTED, 4 + n, addr_type,
             6, ATTR_PORT | NLA_F_NET_BYTEORDER, 5, ATTR_PROTO, ip_nest, ATTR_IP2 | wire.NLA_F_NESTED, 4 + n, addr_type)
    return struct.Struct(f"=HHHHHH{n}sHH2s2xHHB3xHHHH{n}s"), heads


_STRUCTS = {f: _element_struct(f) for f in (4, 6)}


def _address_element(family: int, e: Element) -> bytes:
    out: bytes = wire.nest(ATTR_DATA, _addr(ATTR_IP, family, e[0]))
    return out


def _element(family: int, e: Element) -> bytes:
    """What :mod:`wire` would build from nested attributes (``tests/unit`` compares them), fast:
    a cold sync of the benchmark's mixed cluster sends 129k hairpin elements."""
    form, h = _STRUCTS[family]
    n = 4 if family == 4 else 16
    return form.pack(h[0], h[1], h[2], h[3], h[4], h[5], e[0].to_bytes(n, "big"), h[6], h[7],
                     e[2].to_bytes(2, "big"), h[8], h[9], e[1], h[10], h[11], h[12], h[13], e[3].to_bytes(n, "big"))


def _element_slow(family: int, e: Element) -> bytes:
    out: bytes = wire.nest(ATTR_DATA, _addr(ATTR_IP, family, e[0]),
                     wire.attr(ATTR_PORT | NLA_F_NET_BYTEORDER, struct.pack(">H", e[2])),
                     wire.u8(ATTR_PROTO, e[1]),
                     _addr(ATTR_IP2, family, e[3]))
    return out


def _parse_addr(payload: bytes) -> int:
    for _kind, value in wire.attribute_list(payload):
        return int.from_bytes(value, "big")
    return 0


def _parse_element(payload: bytes) -> Element:
    attrs = wire.attributes(payload)
    return (_parse_addr(attrs.get(ATTR_IP, b"")), attrs.get(ATTR_PROTO, b"\0")[0],
            struct.unpack(">H", attrs.get(ATTR_PORT, b"\0\0")[:2])[0], _parse_addr(attrs.get(ATTR_IP2, b"")))


def _parse_elements(adt: bytes) -> List[Element]:
    """A dump's list of elements.  They are all alike (one set: one type, one family, the same
    extensions), so the first one gives a ``struct`` layout and the rest are unpacked with it, their
    headers checked against the first's; anything else goes through the attribute parser.  (Listing
    the hairpin set is part of every full sync: 50k–129k elements at 10k services.)"""
    def slow() -> List[Element]:
        return [_parse_element(v) for _k, v in wire.attribute_list(adt)]

    first_len = struct.unpack_from("=H", adt, 0)[0] if len(adt) >= 4 else 0
    size = (first_len + 3) & ~3
    layout = _layout(adt[4:first_len]) if size and not len(adt) % size else None
    if layout is None:
        return slow()
    form, heads_at, expected, values_at = layout
    heads, values = operator.itemgetter(*heads_at), operator.itemgetter(*values_at)
    out: List[Element] = []
    for fields in struct.Struct(f"=HH{form}{size - first_len}x").iter_unpack(adt):
        if fields[0] != first_len or heads(fields) != expected:
            return slow()
        ip, proto, port, ip2 = values(fields)
        out.append((int.from_bytes(ip, "big"), proto[0], int.from_bytes(port, "big"), int.from_bytes(ip2, "big")))
    return out


def _layout(payload: bytes) -> Optional[Tuple[str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """One element's attributes as a ``struct`` form (after the element's own 4-byte header):
    (form, indexes of its header words, their values, indexes of ip/proto/port/ip2).  None when the
    element holds anything else (a timeout, counters, a comment): the slow parser decides then."""
    form = ""
    heads_at: List[int] = []
    expected: List[int] = []
    values: Dict[int, int] = {}
    index = 2  # after the element's own length and type
    at = 0
    while at + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, at)
        words = [length, kind]
        kind &= 0x3FFF
        if kind in (ATTR_IP, ATTR_IP2):
            inner = struct.unpack_from("=HH", payload, at + 4)
            if length != 4 + inner[0] or inner[0] - 4 not in (4, 16):
                return None
            words += list(inner)
            value = f"{inner[0] - 4}s"
        elif kind == ATTR_PORT and length == 6:
            value = "2s2x"
        elif kind == ATTR_PROTO and length == 5:
            value = "1s3x"
        else:
            return None
        form += "H" * len(words) + value
        heads_at += range(index, index + len(words))
        expected += words
        values[kind] = index + len(words)
        index += len(words) + 1
        at += (length + 3) & ~3
    if set(values) != {ATTR_IP, ATTR_IP2, ATTR_PORT, ATTR_PROTO} or at != len(payload):
        return None
    return form, tuple(heads_at), tuple(expected), (values[ATTR_IP], values[ATTR_PROTO], values[ATTR_PORT],
                                                    values[ATTR_IP2])


def chunks(elements: Sequence[Element], size: int = PER_MESSAGE) -> Iterator[Sequence[Element]]:
    for i in range(0, len(elements), size):
        yield elements[i:i + size]


class KernelIpsets:
    """The sets of the calling process's network namespace."""

    def __init__(self) -> None:
        self._sock: Optional[NlSocket] = None

    def _socket(self) -> NlSocket:
        if self._sock is None:
            try:
                self._sock = NlSocket()
            except OSError as exc:
                raise IpsetError("cannot open a netfilter netlink socket for ipset", detail=str(exc)) from exc
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, what: str, bodies: Sequence[Tuple[int, int, int, bytes]]) -> None:
        if not bodies:
            return
        try:
            self._socket().send_each(bodies, NFNL_SUBSYS_IPSET)
        except NetlinkError as exc:
            reason = ERRORS.get(exc.errno, exc.strerror or str(exc.errno))
            raise IpsetError(f"ipset {what}: {reason}", detail=f"errno {exc.errno}") from exc
        except OSError as exc:
            raise IpsetError(f"ipset {what}: {exc}") from exc

    def sets(self) -> Dict[str, SetInfo]:
        out: Dict[str, SetInfo] = {}
        body = wire.u8(ATTR_PROTOCOL, PROTOCOL) + wire.u32(ATTR_FLAGS, FLAG_LIST_HEADER)
        try:
            for attrs in self._socket().dump(CMD_LIST, socket.AF_INET, body, subsys=NFNL_SUBSYS_IPSET):
                name = wire.text(attrs.get(ATTR_SETNAME, b""))
                fam = attrs.get(ATTR_FAMILY, b"\2")[0]
                out[name] = SetInfo(name, 6 if fam == NFPROTO[6] else 4)
        except OSError as exc:
            raise IpsetError(f"ipset list: {exc}") from exc
        return out

    def create(self, name: str, family: int, timeout: bool) -> None:
        data = [wire.attr(ATTR_MAXELEM | NLA_F_NET_BYTEORDER, struct.pack(">I", MAXELEM))]
        if timeout:
            data.append(wire.attr(ATTR_TIMEOUT | NLA_F_NET_BYTEORDER, struct.pack(">I", DEFAULT_TIMEOUT)))
        kind = set_type(name)
        body = (wire.u8(ATTR_PROTOCOL, PROTOCOL) + wire.string(ATTR_SETNAME, name) + wire.string(ATTR_TYPENAME, kind)
                + wire.u8(ATTR_REVISION, REVISION if kind == TYPE else 1) + wire.u8(ATTR_FAMILY, NFPROTO[family])
                + wire.nest(ATTR_DATA, *data))
        # Without NLM_F_EXCL the kernel takes an existing set of the same definition as success.
        self._send(f"create {name}", [(CMD_CREATE, 0, socket.AF_INET, body)])

    def destroy(self, name: str) -> None:
        body = wire.u8(ATTR_PROTOCOL, PROTOCOL) + wire.string(ATTR_SETNAME, name)
        self._send(f"destroy {name}", [(CMD_DESTROY, 0, socket.AF_INET, body)])

    def _adt(self, cmd: int, name: str, family: int, elements: Iterable[Element]) -> None:
        items = list(elements)
        encode = _address_element if set_type(name) != TYPE else _element
        # A list of elements (ADT) needs a line number beside it: the kernel reports the failing one there.
        head = wire.u8(ATTR_PROTOCOL, PROTOCOL) + wire.string(ATTR_SETNAME, name) + wire.u32(ATTR_LINENO, 0)
        bodies = [(cmd, 0, socket.AF_INET,
                   head + wire.nest(ATTR_ADT, *(encode(family, e) for e in part))) for part in chunks(items)]
        self._send(f"{'add to' if cmd == CMD_ADD else 'delete from'} {name}", bodies)

    def add(self, name: str, family: int, elements: Iterable[Element]) -> None:
        self._adt(CMD_ADD, name, family, elements)

    def delete(self, name: str, family: int, elements: Iterable[Element]) -> None:
        self._adt(CMD_DEL, name, family, elements)

    def elements(self, name: str) -> List[Element]:
        return list(self.each(name))

    def each(self, name: str) -> Iterator[Element]:
        body = wire.u8(ATTR_PROTOCOL, PROTOCOL) + wire.string(ATTR_SETNAME, name)
        try:
            for attrs in self._socket().dump(CMD_LIST, socket.AF_INET, body, subsys=NFNL_SUBSYS_IPSET):
                adt = attrs.get(ATTR_ADT)
                if adt:
                    yield from _parse_elements(adt)  # one dump message's elements at a time
        except OSError as exc:
            raise IpsetError(f"ipset list {name}: {exc}") from exc


class FakeIpsets:
    """Sets in memory with the kernel's rules that matter here: a set must exist to be filled or
    referenced, one in use by a rule cannot be destroyed (the caller says which are in use)."""

    def __init__(self) -> None:
        self.content: Dict[str, Set[Element]] = {}
        self.info: Dict[str, SetInfo] = {}
        self.in_use: Set[str] = set()
        self.calls: List[Tuple[str, str]] = []

    def sets(self) -> Dict[str, SetInfo]:
        return dict(self.info)

    def create(self, name: str, family: int, timeout: bool) -> None:
        self.calls.append(("create", name))
        self.info.setdefault(name, SetInfo(name, family))
        self.content.setdefault(name, set())

    def destroy(self, name: str) -> None:
        self.calls.append(("destroy", name))
        if name in self.in_use:
            raise IpsetError(f"ipset destroy {name}: set is in use by a rule")
        self.info.pop(name, None)
        self.content.pop(name, None)

    def _need(self, name: str) -> Set[Element]:
        if name not in self.content:
            raise IpsetError(f"ipset {name}: no such set")
        return self.content[name]

    def add(self, name: str, family: int, elements: Iterable[Element]) -> None:
        self.calls.append(("add", name))
        self._need(name).update(elements)

    def delete(self, name: str, family: int, elements: Iterable[Element]) -> None:
        self.calls.append(("delete", name))
        self._need(name).difference_update(elements)

    def elements(self, name: str) -> List[Element]:
        return sorted(self._need(name))

    def each(self, name: str) -> Iterator[Element]:
        yield from sorted(self._need(name))


def element(first: str, proto: str, port: int, second: str) -> Element:
    """An element from text (tests, the tracer)."""
    return (int(ipaddress.ip_address(first)), PROTOS[proto.lower()], port, int(ipaddress.ip_address(second)))


def main(argv: Sequence[str]) -> int:
    """``python -m netproxy.backends.iptables.ipset create NAME...`` (the sets a raw restore of
    netproxy's payload needs, for the benchmark) or ``destroy-all`` (netproxy's sets, once no rule
    names them: the test and benchmark namespaces' reset)."""
    sets = KernelIpsets()
    if argv[:1] == ["create"]:
        for name in argv[1:]:
            sets.create(name, family_of(name), timeout="AFFINITY" in name)
        return 0
    if argv == ["destroy-all"]:
        for name in sorted(sets.sets()):
            if name.startswith(PREFIX):
                sets.destroy(name)
        return 0
    print(main.__doc__)
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
