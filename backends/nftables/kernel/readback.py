"""netproxy's nftables tables as the kernel holds them, read over netlink into the fake kernel's
shape (:class:`~netproxy.backends.nftables.fake.FakeNft`), so that the same tracer that follows the
rendered rules follows the kernel's (``netproxy trace --kernel``).

Everything is read back, nothing is taken from the render: chains and their rules (the kernel's own
expressions, decoded by :func:`expr.decode_rule`), sets and maps with their elements (verdict maps
included; interval elements turned back into the CIDRs they cover).  One dump per object kind and
family; nothing is written.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple, Union

from netproxy.backends.base import BackendUnavailable
from netproxy.backends.nftables import encode, names, wire
from netproxy.backends.nftables import expr as ex
from netproxy.backends.nftables.fake import FakeNft, _FakeTable
from netproxy.backends.nftables.kernel.netlink import _data_value, _set_from_attrs, unpack
from netproxy.backends.nftables.kernel.nlsocket import NetlinkError, NlSocket
from netproxy.backends.nftables.objects import Chain, Element, Rule, Set, Table

_VERBS = {wire.NF_DROP: "drop", wire.NF_ACCEPT: "accept", wire.NFT_JUMP: "jump", wire.NFT_GOTO: "goto",
          wire.NFT_RETURN: "return"}


def read_kernel(sock: Optional[NlSocket] = None) -> FakeNft:
    """Every netproxy table the kernel holds now, in a :class:`FakeNft` (families without one are absent)."""
    try:
        sock = sock or NlSocket()
    except OSError as exc:
        raise BackendUnavailable("no nf_tables netlink socket", detail=str(exc)) from exc
    fake = FakeNft()
    for family, number in encode.FAMILIES.items():
        table = _read_table(sock, family, number)
        if table is not None:
            fake.tables[family] = table
    return fake


def _dump(sock: NlSocket, msg_type: int, number: int, body: bytes) -> List[Dict[int, bytes]]:
    try:
        return list(sock.dump(msg_type, number, body))
    except NetlinkError as exc:
        if exc.errno == 2:  # ENOENT: no such table in this family
            return []
        raise BackendUnavailable("cannot read netproxy's nftables tables", detail=str(exc)) from exc


def _read_table(sock: NlSocket, family: str, number: int) -> Optional[_FakeTable]:
    chains = _dump(sock, wire.GETCHAIN, number, wire.string(wire.CHAIN_TABLE, names.TABLE))
    if not chains:
        return None
    t = _FakeTable(Table(family, names.TABLE))
    for attrs in chains:
        name = wire.text(attrs[wire.CHAIN_NAME])
        t.chains[name] = Chain(name)
        t.rules[name] = []
    for attrs in _dump(sock, wire.GETRULE, number, wire.string(wire.RULE_TABLE, names.TABLE)):
        chain = wire.text(attrs[wire.RULE_CHAIN])
        try:
            exprs = ex.decode_rule(attrs.get(wire.RULE_EXPRESSIONS, b""))
        except (ValueError, KeyError) as exc:
            raise BackendUnavailable(f"a rule of {family} {names.TABLE} chain {chain} cannot be traced: {exc}") \
                from None
        t.rules.setdefault(chain, []).append(Rule(chain, "", None, exprs))
    for attrs in _dump(sock, wire.GETSET, number, wire.string(wire.SET_TABLE, names.TABLE)):
        spec = _set_from_attrs(attrs)
        if spec is None:
            continue
        t.sets[spec.name] = spec
        t.elements[spec.name] = {e.key: e for e in _elements(sock, number, spec)}
    return t


def _elements(sock: NlSocket, number: int, spec: Set) -> Iterator[Element]:
    key_fields = spec.key_type.split(" . ")
    value_fields = spec.value_type.split(" . ") if spec.value_type not in (None, "verdict") else None
    body = wire.string(wire.SET_ELEM_LIST_TABLE, names.TABLE) + wire.string(wire.SET_ELEM_LIST_SET, spec.name)
    points: List[Tuple[bytes, bool]] = []  # an rbtree interval set: (start or end, is the end)
    verdicts: Dict[bytes, str] = {}  # a verdict map's 10k-100k elements jump to a few dozen chains
    for attrs in _dump(sock, wire.GETSETELEM, number, body):
        for _, raw in wire.attribute_list(attrs.get(wire.SET_ELEM_LIST_ELEMENTS, b"")):
            e = wire.attributes(raw)
            key = _data_value(e.get(wire.ELEM_KEY, b""))
            if "interval" in spec.flags:
                if wire.ELEM_KEY_END in e:  # a concatenation (pipapo): the range is in the element
                    yield from _ranges(spec, key_fields, key, _data_value(e[wire.ELEM_KEY_END]),
                                       _comment(e.get(wire.ELEM_USERDATA)))
                else:
                    flags = wire.be32(e[wire.ELEM_FLAGS]) if wire.ELEM_FLAGS in e else 0
                    points.append((key, bool(flags & wire.ELEM_F_INTERVAL_END)))
                continue
            yield Element(spec.name, unpack(key_fields, key), _value(spec, value_fields, e, verdicts),
                          _comment(e.get(wire.ELEM_USERDATA)))
    yield from _from_points(spec, points)


def _value(spec: Set, value_fields: Optional[List[str]], e: Dict[int, bytes],
           verdicts: Optional[Dict[bytes, str]] = None) -> Optional[str]:
    """An element's data as nft prints it: a verdict (``goto <chain>``) or typed fields; None without.
    ``verdicts``: the text of verdicts decoded before, by their bytes (a dump's elements share a few)."""
    data = e.get(wire.ELEM_DATA)
    if data is None:
        return None
    if spec.value_type == "verdict":
        text = verdicts.get(data) if verdicts is not None else None
        if text is None:
            code, chain = ex.verdict_of(data)
            text = f"{_VERBS[code]} {chain}".strip()
            if verdicts is not None:
                verdicts[data] = text
        return text
    return unpack(value_fields, _data_value(e[wire.ELEM_DATA])) if value_fields else None


def _comment(udata: Optional[bytes]) -> Optional[str]:
    """An element's comment from its user data (libnftnl's items: type, length, value; the comment is
    item 0, NUL-terminated); None without one."""
    at = 0
    while udata is not None and at + 2 <= len(udata):
        kind, length = udata[at], udata[at + 1]
        if kind == 0:
            return udata[at + 2:at + 2 + length].rstrip(b"\0").decode(errors="replace")
        at += 2 + length
    return None


def read_named(sock: NlSocket, family: str, set_names: Sequence[str]) -> Dict[str, List[Element]]:
    """The elements (key, value, comment) of the named sets and maps of ``family netproxy`` that exist;
    a set that does not exist has no entry.  What restart by adoption reads (stamp.py): never the
    endpoint maps."""
    number = encode.FAMILIES[family]
    out: Dict[str, List[Element]] = {}
    wanted = set(set_names)
    for attrs in _dump(sock, wire.GETSET, number, wire.string(wire.SET_TABLE, names.TABLE)):
        spec = _set_from_attrs(attrs)
        if spec is not None and spec.name in wanted:
            plain = not spec.is_map and "interval" not in spec.flags and "timeout" not in spec.flags
            out[spec.name] = _plain_elements(sock, number, spec) if plain else list(_elements(sock, number, spec))
    return out


_HEADER = wire.ATTR_HEADER.unpack_from
_STAMP_HEAD = struct.Struct("=HHHHHH16sHH")
"""An element, its key (nested: a 16-byte value) and its user data's header, in one unpack."""


def _plain_elements(sock: NlSocket, number: int, spec: Set) -> List[Element]:
    """The elements (key, comment) of a set without values, ranges or timeouts (``service-stamps``:
    10k-100k of them at each start), parsed in one loop over the dump's bytes: the general reader's
    attribute dicts and lists per element were ~1 s of a 100k-service restart.  An element whose
    key is not one plain value falls back to the general parse of the whole set."""
    fields = spec.key_type.split(" . ")
    ipv6 = fields == ["ipv6_addr"]
    body = wire.string(wire.SET_ELEM_LIST_TABLE, names.TABLE) + wire.string(wire.SET_ELEM_LIST_SET, spec.name)
    out = []
    name = spec.name
    for attrs in _dump(sock, wire.GETSETELEM, number, body):
        data = attrs.get(wire.SET_ELEM_LIST_ELEMENTS, b"")
        at, end = 0, len(data)
        while at + 4 <= end:
            if ipv6 and at + _STAMP_HEAD.size <= end:
                # The service stamps' own shape (100k at a 100k-service start): a 16-byte key and a
                # comment, nothing else; its headers checked in one unpack (~1 µs an element less).
                length, _, klen, ktype, vlen, vtype, raw, ulen, utype = _STAMP_HEAD.unpack_from(data, at)
                if klen == 24 and vlen == 20 and ktype & 0x3FFF == wire.ELEM_KEY and vtype & 0x3FFF == wire.DATA_VALUE \
                        and utype & 0x3FFF == wire.ELEM_USERDATA and ulen >= 6 and at + length <= end \
                        and 28 + ulen <= length and data[at + 32] == 0 and data[at + 33] <= ulen - 6:
                    text = data[at + 34:at + 34 + data[at + 33]].rstrip(b"\0").decode(errors="replace")
                    out.append(Element(name, socket.inet_ntop(socket.AF_INET6, raw), None, text))
                    at += (length + 3) & ~3
                    continue
            length, _ = _HEADER(data, at)
            if length < 4:
                break
            inner, stop = at + 4, min(at + length, end)
            key: Optional[bytes] = None
            udata: Optional[bytes] = None
            while inner + 4 <= stop:
                size, kind = _HEADER(data, inner)
                if size < 4:
                    break
                kind &= 0x3FFF
                if kind == wire.ELEM_KEY:
                    vsize, vkind = _HEADER(data, inner + 4)
                    if vkind & 0x3FFF != wire.DATA_VALUE or vsize < 4:
                        return list(_elements(sock, number, spec))
                    key = data[inner + 8:inner + 4 + vsize]
                elif kind == wire.ELEM_USERDATA:
                    udata = data[inner + 4:inner + size]
                inner += (size + 3) & ~3
            at += (length + 3) & ~3
            if key is None:
                return list(_elements(sock, number, spec))
            text = socket.inet_ntop(socket.AF_INET6, key) if ipv6 and len(key) == 16 else unpack(fields, key)
            out.append(Element(name, text, None, _comment(udata)))
    return out


def get_elements(sock: NlSocket, family: str, set_name: str, keys: Sequence[str]) -> List[Element]:
    """The elements of ``keys`` that one set or map of ``family netproxy`` holds (key, value,
    comment), one netlink GET each: what restart by adoption reads of the endpoint maps, a few
    keys out of 100k-1M elements.  A key the set does not hold is left out."""
    number = encode.FAMILIES[family]
    head = wire.string(wire.SET_TABLE, names.TABLE) + wire.string(wire.SET_NAME, set_name)
    spec = _set_from_attrs(sock.get(wire.GETSET, number, head)) if keys else None
    if spec is None:
        return []
    encoder = encode.Encoder({(family, set_name): spec})
    key_fields = spec.key_type.split(" . ")
    value_fields = spec.value_type.split(" . ") if spec.value_type not in (None, "verdict") else None
    out = []
    for key in keys:
        # A delete's message names the element by its key alone: the same body asks for it.
        for (_, _, _, body), _op in encoder.messages([("delete", family, Element(set_name, key))]):
            try:
                reply = sock.get(wire.GETSETELEM, number, body)
            except NetlinkError as exc:
                if exc.errno == 2:  # ENOENT: not there
                    continue
                raise BackendUnavailable(f"cannot read {key} of {family} {names.TABLE} {set_name}",
                                         detail=str(exc)) from exc
            for _, raw in wire.attribute_list(reply.get(wire.SET_ELEM_LIST_ELEMENTS, b"")):
                e = wire.attributes(raw)
                out.append(Element(set_name, unpack(key_fields, _data_value(e.get(wire.ELEM_KEY, b""))),
                                   _value(spec, value_fields, e), _comment(e.get(wire.ELEM_USERDATA))))
    return out


def chain_names(sock: NlSocket, family: str) -> FrozenSet[str]:
    """The names of the chains of ``family netproxy`` (empty without the table)."""
    chains = _dump(sock, wire.GETCHAIN, encode.FAMILIES[family], wire.string(wire.CHAIN_TABLE, names.TABLE))
    return frozenset(wire.text(a[wire.CHAIN_NAME]) for a in chains)


def chain_uses(sock: NlSocket, family: str) -> Dict[str, int]:
    """The chains of ``family netproxy`` and the kernel's use count of each (``NFTA_CHAIN_USE``: its
    rules, plus every rule and verdict-map element that jumps or goes to it)."""
    chains = _dump(sock, wire.GETCHAIN, encode.FAMILIES[family], wire.string(wire.CHAIN_TABLE, names.TABLE))
    return {wire.text(a[wire.CHAIN_NAME]): wire.be32(a[wire.CHAIN_USE]) if wire.CHAIN_USE in a else -1
            for a in chains}


Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]


def _address(data: bytes) -> Address:
    return ipaddress.ip_address(data[:16] if len(data) >= 16 else data[:4])


def _cidrs(first: Address, last: Address) -> Iterator[str]:
    """The CIDRs that cover first..last exactly."""
    for net in ipaddress.summarize_address_range(first, last):
        yield str(net)


def _ranges(spec: Set, fields: List[str], start: bytes, end: bytes, comment: Optional[str]) -> Iterator[Element]:
    """A concatenation whose last field is a range: one element per CIDR of the range."""
    width = encode._TYPES[fields[-1]][1]
    head = unpack(fields[:-1], start) + " . " if len(fields) > 1 else ""
    first, last = _address(start[len(start) - width:]), _address(end[len(end) - width:])
    for net in _cidrs(first, last):
        yield Element(spec.name, f"{head}{net}", comment=comment)


def _from_points(spec: Set, points: List[Tuple[bytes, bool]]) -> Iterator[Element]:
    """An rbtree set's starts and (exclusive) ends, in address order, back into CIDRs."""
    opened: Optional[Address] = None
    for key, is_end in sorted(points, key=lambda p: (p[0], not p[1])):
        at = _address(key)
        if not is_end:
            opened = at
        elif opened is not None:
            for net in _cidrs(opened, at - 1):
                yield Element(spec.name, net)
            opened = None
    if opened is not None:  # open to the end of the address space
        top: Address = ipaddress.IPv4Address(2 ** 32 - 1) if opened.version == 4 else \
            ipaddress.IPv6Address(2 ** 128 - 1)
        for net in _cidrs(opened, top):
            yield Element(spec.name, net)
