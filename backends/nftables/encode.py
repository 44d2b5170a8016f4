"""netproxy's nftables objects as nf_tables netlink messages, attribute for attribute as ``nft``
1.0.6 sends them (so ``nft list ruleset`` reads them back as if nft had written them).

Pure: (verb, family, object) operations in, ``(message type, flags, family, attributes)`` out.
Set user data (key types, typeof expressions, comments) follows libnftnl's layout: nft prints
raw types without it.  Element keys and values arrive as the same nft value text the libnftables
writer sends; they are packed here per the set's declared types (each concatenated field padded to
4 bytes, as the kernel's registers are).  Endpoint runs' values and ``hairpin``'s keys arrive packed
already (objects.ElementRun, objects.PackedKeys): laid out as they are, many elements at once.
tests/unit/nftables/test_nft_netlink_nft_bytes.py compares the messages with the ones nft 1.0.6
sends for the same transactions (recorded from nft itself).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from netproxy.backends.nftables import names, wire
from netproxy.backends.nftables.objects import (
    ELEMENT_TYPES,
    Chain,
    Element,
    ElementRun,
    Elements,
    Object,
    PackedKeys,
    Rule,
    Set,
    Table,
)
from netproxy.backends.nftables.serialise import Op

Message = Tuple[int, int, int, bytes]
"""(nf_tables message type, netlink flags, address family, attributes)."""

FAMILIES = {"ip": socket.AF_INET, "ip6": socket.AF_INET6}
_HOOKS = {"prerouting": 0, "input": 1, "forward": 2, "output": 3, "postrouting": 4}
_PROTOS = {"tcp": 6, "udp": 17, "sctp": 132}
_ELEMENTS_PER_MESSAGE_BYTES = 60000
"""An attribute's length is 16 bits: a message's element list stays under 64 KB."""
_BLOCK_ELEMENTS = 4096
"""Endpoint elements laid out in one go (Encoder._run_encoder): ~160 KB, a few messages' worth.
Enough that the per-block work (a slice assignment per byte of a field) is nothing per element;
few enough that the block and its copy stay small beside the batch (a map's every run at once
was ~4 MB twice at 10k services, ~40 MB twice at 100k)."""

# --- types ---------------------------------------------------------------------------------------
# (nft datatype id, length in bytes, byte order for user data: 2 big endian, 1 host)
_TYPES = {"ipv4_addr": (7, 4, 2), "ipv6_addr": (8, 16, 2), "inet_proto": (12, 1, 1), "inet_service": (13, 2, 2),
          "integer": (4, 4, 1), "verdict": (1, 0, 0)}
# typeof selectors: (datatype, length, typeof user data: expression type, fields)
_PAYLOAD, _NUMGEN, _CONCAT = 7, 23, 13
_TYPEOF = {"ip daddr": ("ipv4_addr", (_PAYLOAD, (12, 12))), "ip6 daddr": ("ipv6_addr", (_PAYLOAD, (13, 9))),
           "th dport": ("inet_service", (_PAYLOAD, (11, 2))), "numgen random mod 1": ("integer", (_NUMGEN, (1, 1, 0)))}
UD_KEYBYTEORDER, UD_DATABYTEORDER, UD_KEY_TYPEOF, UD_DATA_TYPEOF, UD_DATA_INTERVAL, UD_SET_COMMENT = 0, 1, 3, 4, 6, 7


class EncodeError(ValueError):
    """An object the netlink writer cannot express (never one netproxy renders)."""


def _u32le(value: int) -> bytes:
    return struct.pack("=I", value)


def _fields(spec: str, typeof: bool) -> List[str]:
    """The datatype names of a key or value spec (``ipv4_addr . inet_service``, or typeof selectors)."""
    parts = [p.strip() for p in spec.split(" . ")]
    if not typeof:
        return parts
    try:
        return [_TYPEOF[p][0] for p in parts]
    except KeyError as exc:
        raise EncodeError(f"typeof {spec!r}: unsupported selector {exc}") from None


def _type_id(fields: Sequence[str]) -> int:
    tid = 0
    for f in fields:
        tid = (tid << 6) | _TYPES[f][0]
    return tid


def _length(fields: Sequence[str]) -> int:
    if len(fields) == 1:
        return _TYPES[fields[0]][1]
    return sum((_TYPES[f][1] + 3) & ~3 for f in fields)


def _typeof_udata(spec: str) -> bytes:
    """nft's typeof user data: one expression's (type, attributes), or a concatenation of them."""
    items: List[Tuple[int, bytes]] = []
    for i, part in enumerate(p.strip() for p in spec.split(" . ")):
        kind, args = _TYPEOF[part][1]
        inner: bytes = wire.udata(*[(j, _u32le(a)) for j, a in enumerate(args)])
        items.append((i, wire.udata((0, _u32le(kind)), (1, inner))))
    if len(items) == 1:
        return items[0][1]
    out: bytes = wire.udata((0, _u32le(_CONCAT)), (1, wire.udata(*items)))
    return out


def set_udata(s: Set) -> bytes:
    key = _fields(s.key_type, s.typeof)
    concat = len(key) > 1
    items = [(UD_KEYBYTEORDER, _u32le(0 if concat else _TYPES[key[0]][2]))]
    if s.is_map:
        items.append((UD_DATABYTEORDER, _u32le(0)))
    concat_mark = wire.udata((0, _u32le(_CONCAT)), (1, b""))
    if s.typeof:
        items.append((UD_KEY_TYPEOF, _typeof_udata(s.key_type)))
    elif concat:
        items.append((UD_KEY_TYPEOF, concat_mark))
    if s.is_map and s.typeof and s.value_type is not None:
        items.append((UD_DATA_TYPEOF, _typeof_udata(s.value_type)))
    elif s.is_map and s.value_type is not None and len(_fields(s.value_type, False)) > 1:
        items.append((UD_DATA_TYPEOF, concat_mark))  # a concatenated value is marked as a key is (nft 1.0.6)
    if s.is_map:
        items.append((UD_DATA_INTERVAL, _u32le(0)))
    if s.comment is not None:
        items.append((UD_SET_COMMENT, wire.udata_strz(names.comment(s.comment))))
    out: bytes = wire.udata(*items)
    return out


_FLAGS = {"interval": wire.SET_F_INTERVAL, "dynamic": wire.SET_F_EVAL, "timeout": wire.SET_F_TIMEOUT}


def _set_body(s: Set, set_id: int) -> bytes:
    key = _fields(s.key_type, s.typeof)
    flags = (wire.SET_F_MAP if s.is_map else 0) | sum(_FLAGS[f] for f in s.flags)
    interval_concat = "interval" in s.flags and len(key) > 1
    if interval_concat:
        flags |= wire.SET_F_CONCAT
    body = (wire.string(wire.SET_TABLE, names.TABLE) + wire.string(wire.SET_NAME, names.identifier(s.name))
            + wire.u32(wire.SET_FLAGS, flags) + wire.u32(wire.SET_KEY_TYPE, _type_id(key))
            + wire.u32(wire.SET_KEY_LEN, _length(key)))
    if s.value_type is not None:
        if s.value_type == "verdict":  # a length of 0, as nft sends (the kernel sizes a verdict itself)
            body += wire.u32(wire.SET_DATA_TYPE, wire.DATA_TYPE_VERDICT) + wire.u32(wire.SET_DATA_LEN, 0)
        else:
            value = _fields(s.value_type, s.typeof)
            body += wire.u32(wire.SET_DATA_TYPE, _type_id(value)) + wire.u32(wire.SET_DATA_LEN, _length(value))
    if s.timeout is not None:
        body += wire.u64(wire.SET_TIMEOUT, s.timeout * 1000)
    desc = b""
    if s.size is not None:
        desc += wire.u32(wire.SET_DESC_SIZE, s.size)
    if interval_concat:
        desc += wire.nest(wire.SET_DESC_CONCAT, *[wire.nest(wire.LIST_ELEM, wire.u32(wire.SET_FIELD_LEN, _TYPES[f][1]))
                                                  for f in key])
    if desc:
        body += wire.nest(wire.SET_DESC, desc)
    out: bytes = body + wire.u32(wire.SET_ID, set_id) + wire.attr(wire.SET_USERDATA, set_udata(s))
    return out


# --- element values -------------------------------------------------------------------------------

def _pack_field(kind: str, text: str) -> bytes:
    if kind == "ipv4_addr":
        return socket.inet_aton(text)
    if kind == "ipv6_addr":
        return socket.inet_pton(socket.AF_INET6, text)
    if kind == "inet_service":
        return int(text).to_bytes(2, "big") + b"\0\0"
    if kind == "inet_proto":
        return bytes((_PROTOS[text] if text in _PROTOS else int(text),)) + b"\0\0\0"
    if kind == "integer":
        return struct.pack("=I", int(text))
    raise EncodeError(f"cannot pack a {kind} value")


class _Packed(Dict[str, bytes]):
    """Text → packed bytes for one field kind, computed on first use (ports and protocols recur)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def __missing__(self, text: str) -> bytes:
        got = _pack_field(self.kind, text)
        self[text] = got
        return got


def _converter(kind: str) -> Callable[[str], bytes]:
    if kind == "ipv4_addr":
        return socket.inet_aton  # C, faster than any cache
    if kind == "ipv6_addr":
        # C too; and a cache would keep every service stamp's key (10k-100k, each seen once).
        return functools.partial(socket.inet_pton, socket.AF_INET6)
    cached: Callable[[str], bytes] = _Packed(kind).__getitem__
    return cached


def _two_fields(first: Callable[[str], bytes], second: Callable[[str], bytes],
                general: Callable[[str], bytes]) -> Callable[[str], bytes]:
    """A packer of ``a . b`` texts without the general path's split, zip and list; anything it
    cannot take (another shape, a value a converter refuses) goes to ``general``, which answers or
    raises the error that names the value."""

    def pack(text: str) -> bytes:
        a, sep, b = text.partition(" . ")
        if sep and " . " not in b:
            try:
                return first(a) + second(b)
            except (OSError, ValueError, KeyError, OverflowError):
                pass
        return general(text)

    return pack


class Packer:
    """Packs value text of one set's key or value type: one converter per field, in C where it can."""

    def __init__(self, fields: Sequence[str]) -> None:
        self.fields = tuple(fields)
        self.converters = [_converter(k) for k in self.fields]
        self.single = len(fields) == 1
        self.truncate = _TYPES[self.fields[0]][1] if self.single and self.fields[0] in ("inet_proto",
                                                                                      "inet_service") else 0
        fast = {1: self._single, 2: self._pair, 3: self._triple}.get(len(self.converters))
        self.pack: Callable[[str], bytes] = fast() if fast is not None else self.__call__
        """What the hot loops call: for keys of one to three fields (``cluster-ips``' address,
        ``service-stamps``' hash, ``address . port``, ``address . protocol . port``: every element of
        a 10k-service sync but the endpoint runs) a path without the general one's split, zip and
        list; anything it cannot take goes the general way (:meth:`__call__`)."""

    def _single(self) -> Callable[[str], bytes]:
        convert, truncate = self.converters[0], self.truncate
        general = self.__call__

        def pack(text: str) -> bytes:
            if " . " not in text:
                try:
                    got = convert(text)
                    return got[:truncate] if truncate else got
                except (OSError, ValueError, KeyError, OverflowError):
                    pass
            return general(text)  # the general path's answer, or its error naming the value

        return pack

    def _triple(self) -> Callable[[str], bytes]:
        first, second, third = self.converters
        general = self.__call__

        def pack(text: str) -> bytes:
            a, sep, rest = text.partition(" . ")
            b, sep2, c = rest.partition(" . ")
            if sep and sep2 and " . " not in c:
                try:
                    return first(a) + second(b) + third(c)
                except (OSError, ValueError, KeyError, OverflowError):
                    pass
            return general(text)

        return pack

    def _pair(self) -> Callable[[str], bytes]:
        first, second = self.converters
        return _two_fields(first, second, self.__call__)

    def __call__(self, text: str) -> bytes:
        parts = text.split(" . ")
        if len(parts) != len(self.converters):
            raise EncodeError(f"value {text!r} does not fit {' . '.join(self.fields)}")
        try:
            got = b"".join([c(p) for c, p in zip(self.converters, parts)])
        except (OSError, ValueError, KeyError, OverflowError) as exc:
            raise EncodeError(f"value {text!r} is not a {' . '.join(self.fields)}: {exc}") from None
        return got[:self.truncate] if self.truncate else got

    def prefix(self, text: str) -> bytes:
        """The packed leading fields of a key whose last field is left out (a run's prefix)."""
        parts = text.split(" . ")
        if len(parts) != len(self.converters) - 1:
            raise EncodeError(f"prefix {text!r} does not fit {' . '.join(self.fields)}")
        try:
            return b"".join([c(p) for c, p in zip(self.converters, parts)])
        except (OSError, ValueError, KeyError, OverflowError) as exc:
            raise EncodeError(f"prefix {text!r} is not a {' . '.join(self.fields[:-1])}: {exc}") from None

    def prefix_packer(self) -> Callable[[str], bytes]:
        """:meth:`prefix`, with a path for one or two leading fields (a run's ``address . port`` or
        ``nodePort``) that skips the general one's split, zip and list."""
        general = self.prefix
        if len(self.converters) == 2:
            single = self.converters[0]

            def one(text: str) -> bytes:
                if " . " not in text:  # (inet_aton takes "10.0.0.1 . 5": what follows a space is ignored)
                    try:
                        return single(text)
                    except (OSError, ValueError, KeyError, OverflowError):
                        pass
                return general(text)  # its answer, or its error naming the prefix

            return one
        if len(self.converters) != 3:
            return general
        first, second = self.converters[:2]
        return _two_fields(first, second, general)

    @property
    def length(self) -> int:
        return _length(self.fields)


def _verdict(text: str) -> bytes:
    word, _, chain = text.partition(" ")
    codes = {"goto": wire.NFT_GOTO, "jump": wire.NFT_JUMP, "drop": wire.NF_DROP, "accept": wire.NF_ACCEPT}
    if word not in codes:
        raise EncodeError(f"unknown verdict {text!r}")
    out: bytes = wire.data_verdict(wire.ELEM_DATA, codes[word], names.identifier(chain) if chain else "")
    return out


# --- the encoder -----------------------------------------------------------------------------------

def _same_run(op: Op, verb: str, family: str, set_name: str) -> bool:
    obj = op[2]
    return op[0] == verb and op[1] == family and isinstance(obj, ELEMENT_TYPES) and obj.set == set_name


def _first_item(op: Op) -> Op:
    """``op``, or for a group (:class:`~objects.Elements`) the operation of its first item: what a
    message names when the kernel refuses it."""
    obj = op[2]
    return (op[0], op[1], obj.items[0]) if isinstance(obj, Elements) and obj.items else op


class _Group:
    """Elements encoded together (a block of runs, packed keys): which operation element ``j`` of
    them came from, made only when a message starts there (to name it if the kernel refuses it)."""

    __slots__ = ("verb", "family", "items", "per")

    def __init__(self, verb: str, family: str, items: Sequence[Union[Element, ElementRun]], per: int) -> None:
        self.verb, self.family, self.items, self.per = verb, family, items, per

    def op(self, j: int) -> Op:
        return self.verb, self.family, self.items[j // self.per]


_Owner = Union[Op, _Group]


class Encoder:
    """Turns one transaction's operations into messages, knowing the sets it has seen (their types
    are needed to pack their elements); ``sets`` may be primed with what the kernel holds."""

    def __init__(self, sets: Optional[Dict[Tuple[str, str], Set]] = None) -> None:
        self.sets: Dict[Tuple[str, str], Set] = dict(sets or {})
        self._packers: Dict[Tuple[str, str, bool], Packer] = {}
        self._ids = 0

    def messages(self, ops: Sequence[Op]) -> Iterator[Tuple[Message, Op]]:
        """Each message with the operation it came from (to name it when the kernel refuses it)."""
        i, n = 0, len(ops)
        while i < n:
            verb, family, obj = ops[i]
            if isinstance(obj, ELEMENT_TYPES):
                j = i + 1
                while j < n and _same_run(ops[j], verb, family, obj.set):
                    j += 1
                yield from self._elements(verb, family, obj.set, ops[i:j])
                i = j
                continue
            yield self._one(verb, family, obj), ops[i]
            i += 1

    def _one(self, verb: str, family: str, obj: Object) -> Message:
        fam = FAMILIES[family]
        create = wire.NLM_F_CREATE
        if isinstance(obj, Table):
            if verb == "delete":
                return wire.DELTABLE, 0, fam, wire.string(wire.TABLE_NAME, obj.name)
            body = wire.string(wire.TABLE_NAME, obj.name) + wire.u32(wire.TABLE_FLAGS, 0)
            if obj.comment:
                body += wire.attr(wire.TABLE_USERDATA, wire.udata((0, wire.udata_strz(names.comment(obj.comment)))))
            return wire.NEWTABLE, create, fam, body
        if isinstance(obj, Chain):
            where = (wire.string(wire.CHAIN_TABLE, names.TABLE)
                     + wire.string(wire.CHAIN_NAME, names.identifier(obj.name)))
            if verb == "delete":
                return wire.DELCHAIN, 0, fam, where
            if verb == "flush":
                return wire.DELRULE, 0, fam, wire.string(wire.RULE_TABLE, names.TABLE) + \
                    wire.string(wire.RULE_CHAIN, names.identifier(obj.name))
            return wire.NEWCHAIN, create, fam, where + _chain_spec(obj)
        if isinstance(obj, Set):
            key = (family, obj.name)
            where = wire.string(wire.SET_TABLE, names.TABLE) + wire.string(wire.SET_NAME, names.identifier(obj.name))
            if verb == "delete":
                self.sets.pop(key, None)
                return wire.DELSET, 0, fam, where
            if verb == "flush":
                return wire.DELSETELEM, 0, fam, wire.string(wire.SET_ELEM_LIST_TABLE, names.TABLE) + \
                    wire.string(wire.SET_ELEM_LIST_SET, names.identifier(obj.name))
            self.sets[key] = obj
            self._ids += 1
            return wire.NEWSET, create, fam, _set_body(obj, self._ids)
        if isinstance(obj, Rule):
            return wire.NEWRULE, create | wire.NLM_F_APPEND, fam, rule_body(obj)
        raise EncodeError(f"not an nftables object: {obj!r}")

    def _packer(self, family: str, set_name: str, value: bool) -> Packer:
        key = (family, set_name, value)
        p = self._packers.get(key)
        if p is None:
            s = self.sets.get((family, set_name))
            if s is None:
                raise EncodeError(f"elements for unknown set {family} {set_name}")
            spec = s.value_type if value else s.key_type
            p = self._packers[key] = Packer(_fields(str(spec), s.typeof))
        return p

    def _elements(self, verb: str, family: str, set_name: str, ops: Sequence[Op]) -> Iterator[Tuple[Message, Op]]:
        s = self.sets.get((family, set_name))
        if s is None:
            raise EncodeError(f"elements for unknown set {family} {set_name}")
        head = (wire.string(wire.SET_ELEM_LIST_TABLE, names.TABLE)
                + wire.string(wire.SET_ELEM_LIST_SET, names.identifier(set_name)))
        msg_type = wire.NEWSETELEM if verb == "add" else wire.DELSETELEM
        flags = wire.NLM_F_CREATE if verb == "add" else 0
        fam = FAMILIES[family]
        limit = _ELEMENTS_PER_MESSAGE_BYTES
        chunk: List[bytes] = []
        size = 0
        first: Op = _first_item(ops[0])
        if verb == "add" and "interval" in s.flags and len(_fields(s.key_type, s.typeof)) == 1:
            chunk.append(interval_anchor(family))
        for blob, unit, owner in self._segments(s, verb, family, ops):
            n = len(blob)
            if size + n <= limit:
                chunk.append(blob)  # all of it fits: what the loop below would do, element by element
                size += n
                continue
            # Split at element boundaries (``unit`` bytes each), as one element at a time would be.
            at = 0
            while at < n:
                take = limit - size
                take -= take % unit
                if take <= 0:
                    if chunk:
                        yield (msg_type, flags, fam, head + wire.nest(wire.SET_ELEM_LIST_ELEMENTS, *chunk)), first
                        chunk, size = [], 0
                        first = owner.op(at // unit) if isinstance(owner, _Group) else owner
                        continue
                    take = unit  # one element larger than a message: alone
                piece = blob[at:at + take]
                chunk.append(piece)
                size += len(piece)
                at += take
        if chunk:
            yield (msg_type, flags, fam, head + wire.nest(wire.SET_ELEM_LIST_ELEMENTS, *chunk)), first

    def _segments(self, s: Set, verb: str, family: str, ops: Sequence[Op]) -> Iterator[Tuple[bytes, int, _Owner]]:
        """Encoded elements, as (bytes, the size of one element in them, who they came from): many
        fixed-size elements at once where the layout allows (endpoint runs, packed keys), else one."""
        add = verb == "add"
        encode_one = self._element_encoder(s, family, add)
        runs = self._run_encoder(s, family, add)
        keys = self._keys_encoder(s, family, add)
        for op in ops:
            obj = op[2]
            items: Sequence[Union[Element, ElementRun]]
            if isinstance(obj, Elements):
                items = obj.items
                if keys is not None and isinstance(items, PackedKeys):
                    if len(items):
                        blob = keys(items)
                        yield blob, len(blob) // len(items), _Group(verb, family, items, 1)
                    continue
            else:
                items = (obj,)  # type: ignore[assignment]
            i, n = 0, len(items)
            while i < n:
                item = items[i]
                if isinstance(item, ElementRun):
                    if runs is None:
                        for e in item.elements():
                            for blob in encode_one(e):
                                yield blob, len(blob), (verb, family, item)
                        i += 1
                        continue
                    # The runs that follow with as many endpoints (a map's runs all have as many): one
                    # go, up to ~_BLOCK_ELEMENTS elements (the block's bytes are held twice while made).
                    count, j = item.size, i + 1
                    end = min(n, i + max(1, _BLOCK_ELEMENTS // max(count, 1)))
                    while j < end:
                        nxt = items[j]
                        if not isinstance(nxt, ElementRun) or nxt.size != count:
                            break
                        j += 1
                    block = items[i:j] if j > i + 1 else (item,)
                    if count:
                        blob = runs(block, count)  # type: ignore[arg-type]
                        yield blob, len(blob) // (count * (j - i)), _Group(verb, family, block, count)
                    i = j
                    continue
                if not isinstance(item, Element):  # messages() groups elements only (_same_run)
                    raise EncodeError(f"not an element of {family} {s.name}: {item!r}")
                item_op = op if item is obj else (verb, family, item)
                for blob in encode_one(item):
                    yield blob, len(blob), item_op
                i += 1

    def _run_encoder(self, s: Set, family: str, with_value: bool
                     ) -> Optional[Callable[[Sequence[ElementRun], int], bytes]]:
        """Endpoint runs (``prefix . i : value``, or ``prefix : value`` in a one-endpoint map) as
        one bytes per block of runs with as many endpoints: every element is the same headers
        around the run's prefix, its index and its value, so the elements are one template
        repeated and the prefixes, indexes and values written into it column by column (in C:
        a slice assignment with a step per byte of a field, whatever the number of elements).  The
        values are the run's bytes as render made them; nothing is parsed per endpoint."""
        key_pack = self._packer(family, s.name, False)
        fields = key_pack.fields
        if "interval" in s.flags or s.value_type in (None, "verdict"):
            return None
        value_pack = self._packer(family, s.name, True)
        indexed = len(fields) >= 2 and fields[-1] == "integer"
        if indexed:
            prefix_pack = key_pack.prefix_packer()
            prefix_len = key_pack.length - 4
        else:
            prefix_pack = key_pack.pack
            prefix_len = key_pack.length
        value_len = value_pack.length if with_value else 0
        body = wire.data_value(wire.ELEM_KEY, bytes(key_pack.length))
        if with_value:
            value_at = len(body) + 12
            body += wire.data_value(wire.ELEM_DATA, bytes(value_len))
        template = wire.nest(wire.LIST_ELEM, body)
        unit = len(template)
        key_at = 12  # the element's header, the key's nest and its value's header: 4 bytes each
        index_blocks: Dict[int, bytes] = {}

        def encode(runs: Sequence[ElementRun], count: int) -> bytes:
            if not indexed and count != 1:
                raise EncodeError(f"endpoints {runs[0].prefix}: {count} values in {s.name}, keyed without an index")
            total = count * len(runs)
            out = bytearray(template * total)
            if with_value:
                if any(r.width != value_len for r in runs):
                    bad = next(r for r in runs if r.width != value_len)
                    raise EncodeError(f"endpoints {bad.prefix}: values of {bad.width} bytes do not fit "
                                      f"{' . '.join(value_pack.fields)} in {s.name}")
                values = b"".join([r.packed for r in runs])
                for k in range(value_len):
                    out[value_at + k::unit] = values[k::value_len]
            prefixes = b"".join([prefix_pack(r.prefix) * count for r in runs])  # each field's fixed size
            for k in range(prefix_len):
                out[key_at + k::unit] = prefixes[k::prefix_len]
            if indexed:
                block = index_blocks.get(count)
                if block is None:
                    block = index_blocks[count] = struct.pack(f"={count}I", *range(count))
                indexes = block * len(runs)
                for k in range(4):
                    out[key_at + prefix_len + k::unit] = indexes[k::4]
            return bytes(out)

        return encode

    def _keys_encoder(self, s: Set, family: str, with_value: bool) -> Optional[Callable[[PackedKeys], bytes]]:
        """Elements of a plain set given as packed keys (:class:`~objects.PackedKeys`): one template
        repeated, the keys written into it column by column, as for runs."""
        if "interval" in s.flags or s.value_type is not None:
            return None
        key_len = self._packer(family, s.name, False).length
        template = wire.nest(wire.LIST_ELEM, wire.data_value(wire.ELEM_KEY, bytes(key_len)))
        unit = len(template)

        def encode(items: PackedKeys) -> bytes:
            keys = items.packed_keys()
            if len(keys) != key_len * len(items):
                raise EncodeError(f"keys of {len(keys)} bytes for {len(items)} elements of {s.name} "
                                  f"({key_len} bytes each)")
            out = bytearray(template * len(items))
            for k in range(key_len):
                out[12 + k::unit] = keys[k::key_len]
            return bytes(out)

        return encode

    def _element_encoder(self, s: Set, family: str, with_value: bool) -> Callable[[Element], List[bytes]]:
        key_pack = self._packer(family, s.name, False)
        interval = "interval" in s.flags
        concat = len(key_pack.fields) > 1
        value_pack = None
        if with_value and s.value_type is not None and s.value_type != "verdict":
            value_pack = self._packer(family, s.name, True)
        verdicts = s.value_type == "verdict"
        timeout = s.timeout
        plain = None
        if not interval and key_pack.length % 4 == 0 and (value_pack is not None or s.value_type is None
                                                             or not with_value):
            # Fixed sizes: constant headers around the packed key (and value), as for runs.
            key_hdr = _value_header(wire.ELEM_KEY, key_pack.length)
            value_hdr = _value_header(wire.ELEM_DATA, value_pack.length) if value_pack is not None else b""
            size = 4 + len(key_hdr) + key_pack.length + len(value_hdr) + (value_pack.length if value_pack else 0)
            plain = wire.ATTR_HEADER.pack(size, wire.LIST_ELEM | wire.NLA_F_NESTED) + key_hdr
        # Verdict maps' elements (a service's dispatch: address . protocol . port → goto its chain,
        # with the service's comment): the key's constant headers, and each verdict encoded once —
        # a 10k-service sync has 10k elements and a few dozen distinct verdicts.
        verdict_key = _value_header(wire.ELEM_KEY, key_pack.length) \
            if verdicts and with_value and not interval and key_pack.length % 4 == 0 else None
        encoded_verdicts: Dict[str, bytes] = {}

        def encode(e: Element) -> List[bytes]:
            if plain is not None and e.expires is None and e.timeout is None:
                if e.comment is None or not with_value:  # (a deletion names the key alone)
                    if value_pack is None:
                        return [plain + key_pack.pack(e.key)]
                    if e.value is not None:
                        return [b"".join((plain, key_pack.pack(e.key), value_hdr, value_pack.pack(e.value)))]
                elif value_pack is None or e.value is not None:
                    # With a comment (``service-stamps``: 10k in a 10k-service sync): its length in the header.
                    parts = [key_hdr, key_pack.pack(e.key)]
                    if value_pack is not None and e.value is not None:
                        parts += (value_hdr, value_pack.pack(e.value))
                    parts.append(_comment(e.comment))
                    inner = b"".join(parts)
                    return [wire.ATTR_HEADER.pack(4 + len(inner), wire.LIST_ELEM | wire.NLA_F_NESTED) + inner]
            if verdict_key is not None and e.value is not None and e.expires is None and e.timeout is None:
                verdict = encoded_verdicts.get(e.value)
                if verdict is None:
                    verdict = encoded_verdicts[e.value] = _verdict(e.value)
                body = verdict_key + key_pack.pack(e.key) + verdict
                if e.comment is not None:
                    body += _comment(e.comment)
                return [wire.ATTR_HEADER.pack(4 + len(body), wire.LIST_ELEM | wire.NLA_F_NESTED) + body]
            if interval:
                note = _comment(e.comment) if e.comment is not None and with_value else b""
                return _interval_elements(e, key_pack, concat, note)
            body = wire.data_value(wire.ELEM_KEY, key_pack(e.key))
            if with_value and e.value is not None:
                body += _verdict(e.value) if verdicts or value_pack is None else \
                    wire.data_value(wire.ELEM_DATA, value_pack(e.value))
            if e.timeout is not None:
                body += wire.u64(wire.ELEM_TIMEOUT, e.timeout * 1000)
            if e.expires is not None:
                if e.timeout is None and timeout is None:
                    body += wire.u64(wire.ELEM_TIMEOUT, e.expires * 1000)
                body += wire.u64(wire.ELEM_EXPIRATION, e.expires * 1000)
            if e.comment is not None and with_value:
                body += _comment(e.comment)
            return [wire.nest(wire.LIST_ELEM, body)]

        return encode


def _comment(text: str) -> bytes:
    """An element's comment as nft stores it: user data item 0, NUL-terminated, made safe.  As
    ``wire.attr(ELEM_USERDATA, wire.udata((0, wire.udata_strz(names.comment(text)))))``, in one
    go: 20k of them in a 10k-service sync (the dispatch elements and the service stamps)."""
    raw = names.comment(text).encode()
    size = len(raw) + 7  # attribute header 4, user data type and length 2, the text, its NUL
    return b"".join((wire.ATTR_HEADER.pack(size, wire.ELEM_USERDATA), b"\0", bytes((len(raw) + 1,)), raw,
                     _PADS[size % 4]))


_PADS = (b"\0", b"\0\0\0\0", b"\0\0\0", b"\0\0")
"""The text's NUL and the attribute's padding, by the attribute's length modulo 4."""


def _value_header(kind: int, length: int) -> bytes:
    """The headers of ``nest(kind, attr(DATA_VALUE, <length bytes>))`` (lengths a multiple of 4)."""
    if length % 4:
        raise EncodeError(f"unaligned fixed-size value ({length} bytes)")
    inner = wire.ATTR_HEADER.pack(4 + length, wire.DATA_VALUE)
    out: bytes = wire.ATTR_HEADER.pack(4 + len(inner) + length, kind | wire.NLA_F_NESTED) + inner
    return out


def _interval_elements(e: Element, pack: Packer, concat: bool, note: bytes = b"") -> List[bytes]:
    """An interval set's element: a concatenation's last field a CIDR (``key`` .. ``key end``), or
    (one field) a CIDR as a start and an interval end, as the kernel's rbtree wants them."""
    parts = e.key.split(" . ")
    net = ipaddress.ip_network(parts[-1], strict=False)
    if concat:
        head = pack(" . ".join(parts[:-1] + [str(net.network_address)]))
        tail = pack(" . ".join(parts[:-1] + [str(net.broadcast_address)]))
        both = wire.data_value(wire.ELEM_KEY, head) + wire.data_value(wire.ELEM_KEY_END, tail)
        return [wire.nest(wire.LIST_ELEM, both + note)]
    out = [wire.nest(wire.LIST_ELEM, wire.data_value(wire.ELEM_KEY, net.network_address.packed) + note)]
    end = int(net.broadcast_address) + 1
    if end < 2 ** net.max_prefixlen:
        key = end.to_bytes(len(net.network_address.packed), "big")
        out.append(wire.nest(wire.LIST_ELEM, wire.data_value(wire.ELEM_KEY, key)
                             + wire.u32(wire.ELEM_FLAGS, wire.ELEM_F_INTERVAL_END)))
    return out


def interval_anchor(family: str) -> bytes:
    """The element ``nft`` adds first to a one-field interval set: address 0 as an interval end, so
    that the ranges before the first start match nothing."""
    size = 16 if family == "ip6" else 4
    out: bytes = wire.nest(wire.LIST_ELEM, wire.data_value(wire.ELEM_KEY, b"\0" * size)
                           + wire.u32(wire.ELEM_FLAGS, wire.ELEM_F_INTERVAL_END))
    return out


def _chain_spec(chain: Chain) -> bytes:
    body = b""
    if chain.hook is not None:
        h = chain.hook
        body += wire.nest(wire.CHAIN_HOOK, wire.u32(wire.HOOK_HOOKNUM, _HOOKS[h.hook]),
                          wire.u32(wire.HOOK_PRIORITY, h.priority))
        body += wire.u32(wire.CHAIN_POLICY, wire.NF_ACCEPT if h.policy == "accept" else wire.NF_DROP)
        body += wire.string(wire.CHAIN_TYPE, h.type)
    if chain.comment is not None:
        body += wire.attr(wire.CHAIN_USERDATA, wire.udata((0, wire.udata_strz(names.comment(chain.comment)))))
    out: bytes = body
    return out


def rule_body(rule: Rule) -> bytes:
    if not rule.exprs:
        raise EncodeError(f"rule in {rule.chain} has no kernel expressions: {rule.body!r}")
    body = (wire.string(wire.RULE_TABLE, names.TABLE) + wire.string(wire.RULE_CHAIN, names.identifier(rule.chain))
            + wire.nest(wire.RULE_EXPRESSIONS, *[e.encode() for e in rule.exprs]))
    if rule.comment is not None:
        body += wire.attr(wire.RULE_USERDATA, wire.udata((0, wire.udata_strz(names.comment(rule.comment)))))
    out: bytes = body
    return out
