"""Typed nftables objects (knftables-style): what render produces and what a transaction carries.

A rule carries its nft statement text and its kernel expressions, both built by :mod:`stmt` from
validated model values; everything that is a name or a comment is kept apart.  :mod:`serialise`
turns these objects into libnftables input, :mod:`encode` into netlink messages.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union


@dataclass(frozen=True)
class Table:
    family: str
    name: str
    comment: Optional[str] = None


@dataclass(frozen=True)
class Hook:
    """What makes a chain a base chain."""

    type: str  # "nat" or "filter"
    hook: str  # "prerouting", "output", ...
    priority: int
    policy: str = "accept"


@dataclass(frozen=True)
class Chain:
    name: str
    hook: Optional[Hook] = None
    comment: Optional[str] = None


class Rule(NamedTuple):
    """A rule in both forms: ``body`` is its nft text, ``exprs`` the kernel expressions the netlink
    writer sends; both come from the same statements (:mod:`stmt`)."""

    chain: str
    body: str
    comment: Optional[str] = None
    exprs: Tuple[Any, ...] = ()


@dataclass(frozen=True)
class Set:
    """A named set, or a map when ``value_type`` is given.

    ``key_type`` is an nft type expression: ``ipv4_addr . inet_proto . inet_service`` or, when
    ``typeof`` is set, an expression such as ``ip daddr . th dport``.
    """

    name: str
    key_type: str
    value_type: Optional[str] = None
    typeof: bool = False
    flags: Tuple[str, ...] = ()
    timeout: Optional[int] = None
    comment: Optional[str] = None
    size: Optional[int] = None

    @property
    def is_map(self) -> bool:
        return self.value_type is not None


class Element(NamedTuple):
    """One element of a set or map; ``key`` and ``value`` are nft value text (e.g. ``10.0.0.1 . tcp . 80``)."""

    set: str
    key: str
    value: Optional[str] = None
    comment: Optional[str] = None
    expires: Optional[int] = None
    """Seconds left, for an element of a timeout set carried over a table rebuild (affinity)."""
    timeout: Optional[int] = None
    """Its own timeout in seconds (elements the kernel added to a map with no default timeout)."""


class _RunFields(NamedTuple):
    set: str
    prefix: str
    packed: bytes
    """The endpoints as the kernel holds the map's values: ``address . port``, each field padded to
    4 bytes (8 bytes an IPv4 endpoint, 20 an IPv6 one), one after the other in index order."""
    width: int
    """The bytes of one value: 8 (IPv4) or 20 (IPv6)."""


V4_WIDTH, V6_WIDTH = 8, 20
_PORT = struct.Struct(">H2x")


def pack_endpoint(text: str) -> bytes:
    """``address . port`` text as an endpoints map's value bytes (what :class:`ElementRun` holds)."""
    address, sep, port = text.partition(" . ")
    try:
        if not sep or " . " in port:
            raise ValueError("not address . port")
        raw = socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
        return raw + _PORT.pack(int(port))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"endpoint value {text!r} is not an address . port: {exc}") from None


def endpoint_text(value: bytes) -> str:
    """One endpoints map value's bytes as nft writes it: ``address . port``."""
    if len(value) == V4_WIDTH:
        address = socket.inet_ntoa(value[:4])
    elif value[:10] == bytes(10):
        address = str(ipaddress.IPv6Address(value[:16]))  # ::/96 and ::ffff:0:0/96: inet_ntop writes them dotted
    else:
        address = socket.inet_ntop(socket.AF_INET6, value[:16])
    return f"{address} . {int.from_bytes(value[-4:-2], 'big')}"


class ElementRun(_RunFields):
    """The elements ``<prefix> . 0 : value 0``, ``<prefix> . 1 : value 1``, ... of one endpoints map.

    How a service address's endpoint list travels: one object instead of one per endpoint (110k
    Element objects were a third of a 10k-service render).  Its values are the kernel's bytes
    (:attr:`packed`), made by render from the model's integers: the netlink encoder slices them
    where it used to parse each endpoint's text back (100k at 10k services), and text is made
    only where text is read (:attr:`values`: the nft text writer, logs, adoption's comparisons).
    Made from text too (``ElementRun(set, prefix, values)``), compared and replaced by its values
    as the plain named tuple of (set, prefix, values) it once was.
    """

    __slots__ = ()

    def __new__(cls, set: str, prefix: str, values: Iterable[str]) -> ElementRun:
        packed = [pack_endpoint(v) for v in values]
        return _RunFields.__new__(cls, set, prefix, b"".join(packed), len(packed[0]) if packed else V4_WIDTH)

    @classmethod
    def of_packed(cls, set: str, prefix: str, packed: bytes, width: int) -> ElementRun:
        """A run from its values' bytes (``width`` each): render's way, no text."""
        return _RunFields.__new__(cls, set, prefix, packed, width)

    @classmethod
    def unknown(cls, set: str, prefix: str, count: int, family: str) -> ElementRun:
        """``count`` elements whose values are not known (adoption's old objects before it reads
        them): address 0, port 0, which no endpoint has (the model refuses port 0), so every one
        of them differs from any endpoint rendered."""
        width = V6_WIDTH if family == "ip6" else V4_WIDTH
        return _RunFields.__new__(cls, set, prefix, bytes(width * count), width)

    def __reduce__(self) -> Tuple[object, Tuple[str, str, bytes, int]]:
        return (ElementRun.of_packed, (self.set, self.prefix, self.packed, self.width))

    def _replace(self, *, set: Optional[str] = None, prefix: Optional[str] = None, packed: Optional[bytes] = None,
                 width: Optional[int] = None, values: Optional[Iterable[str]] = None) -> ElementRun:
        """As a named tuple's, and with ``values`` as text."""
        packed = self.packed if packed is None else packed
        width = self.width if width is None else width
        if values is not None:
            made = ElementRun("", "", values)
            packed, width = made.packed, made.width if made.packed else width
        return _RunFields.__new__(ElementRun, self.set if set is None else set,
                                  self.prefix if prefix is None else prefix, packed, width)

    @property
    def size(self) -> int:
        """The number of endpoints (of elements)."""
        return len(self.packed) // self.width

    def value(self, i: int) -> bytes:
        """The bytes of value ``i``."""
        w = self.width
        return self.packed[i * w:(i + 1) * w]

    @property
    def values(self) -> Tuple[str, ...]:
        """The values as nft text (``address . port``), made on each call."""
        w, packed = self.width, self.packed
        return tuple(endpoint_text(packed[o:o + w]) for o in range(0, len(packed), w))

    @property
    def indexed(self) -> bool:
        """False for one endpoint: its map draws nothing, so its only element is ``<prefix> : value``."""
        return len(self.packed) > self.width

    def keys(self) -> List[str]:
        """Its elements' keys as text: ``<prefix> . i``, or ``<prefix>`` alone for one endpoint."""
        if not self.indexed:
            return [self.prefix] if self.packed else []
        return [f"{self.prefix} . {i}" for i in range(self.size)]

    def elements(self) -> Tuple[Element, ...]:
        """One :class:`Element` per endpoint (the slow path: the writers expand runs themselves)."""
        return tuple(Element(self.set, k, v) for k, v in zip(self.keys(), self.values))


class PackedKeys(Sequence[Element]):
    """Elements of a plain set (key only, no value or comment) that can also give their keys as the
    kernel holds them, all at once: the netlink encoder lays those out without an Element or a text
    per element (``hairpin``'s pairs: render.HairpinElements)."""

    __slots__ = ()

    def packed_keys(self) -> bytes:
        """Every element's key, ``len(self)`` of them of one width each, in order."""
        raise NotImplementedError


class Elements(NamedTuple):
    """Elements and endpoint runs of one set as one operation: how a full sync's transaction carries
    a set's contents.  A 3-tuple operation per element was ~6 MB at the write of a 10k-service sync
    (~90k of them); the writers expand it as they expand a run.  ``items`` is a tuple, or a sequence
    that makes each element as it is read (:class:`PackedKeys`: ``hairpin``'s, render.HairpinElements)."""

    set: str
    items: Sequence[Union[Element, ElementRun]]


Object = Union[Table, Chain, Rule, Set, Element, ElementRun, Elements]
ELEMENT_TYPES = (Element, ElementRun, Elements)
"""What an element operation carries (``isinstance(obj, ELEMENT_TYPES)``)."""


def element_items(obj: Union[Element, ElementRun, Elements]) -> Sequence[Union[Element, ElementRun]]:
    """The elements and runs of one element operation's object."""
    return obj.items if isinstance(obj, Elements) else (obj,)
