"""Typed nftables objects (knftables-style): what render produces and what a transaction carries.

A rule carries its nft statement text and its kernel expressions, both built by :mod:`stmt` from
validated model values; everything that is a name or a comment is kept apart.  :mod:`serialise`
turns these objects into libnftables input, :mod:`encode` into netlink messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional, Sequence, Tuple, Union


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
    packed: str
    """The values joined by newlines (no value text holds one): see :class:`ElementRun`."""


_SEP = "\n"


class ElementRun(_RunFields):
    """The elements ``<prefix> . 0 : values[0]``, ``<prefix> . 1 : values[1]``, ... of one map.

    How a service address's endpoint list travels: one object instead of one per endpoint (110k
    Element objects were a third of a 10k-service render); the serialiser expands it.  Its values
    are kept as one string, made into a tuple when asked for: a tuple of one string per endpoint
    was ~80 bytes an endpoint more (5 MB of the record at 10k services x 10, alive at the write).
    Made, compared and replaced by its values as a plain named tuple of (set, prefix, values) was.
    """

    __slots__ = ()

    def __new__(cls, set: str, prefix: str, values: Iterable[str]) -> ElementRun:
        return super().__new__(cls, set, prefix, _SEP.join(values))

    def __getnewargs__(self) -> Tuple[str, str, Tuple[str, ...]]:
        return (self.set, self.prefix, self.values)

    def _replace(self, *, set: Optional[str] = None, prefix: Optional[str] = None,
                 packed: Optional[str] = None, values: Optional[Iterable[str]] = None) -> ElementRun:
        """As a named tuple's, with ``values`` (``packed`` as the field itself)."""
        if values is not None:
            packed = _SEP.join(values)
        return _RunFields.__new__(ElementRun, self.set if set is None else set,
                                  self.prefix if prefix is None else prefix, self.packed if packed is None else packed)

    @property
    def values(self) -> Tuple[str, ...]:
        return tuple(self.packed.split(_SEP)) if self.packed else ()

    @property
    def indexed(self) -> bool:
        """False for one endpoint: its map draws nothing, so its only element is ``<prefix> : value``."""
        return _SEP in self.packed

    def elements(self) -> Tuple[Element, ...]:
        """One :class:`Element` per endpoint (the slow path: the serialisers expand runs themselves)."""
        if not self.indexed:
            return tuple(Element(self.set, self.prefix, v) for v in self.values)
        return tuple(Element(self.set, f"{self.prefix} . {i}", v) for i, v in enumerate(self.values))


class Elements(NamedTuple):
    """Elements and endpoint runs of one set as one operation: how a full sync's transaction carries
    a set's contents.  A 3-tuple operation per element was ~6 MB at the write of a 10k-service sync
    (~90k of them); the writers expand it as they expand a run.  ``items`` is a tuple, or a sequence
    that makes each element as it is read (``hairpin``'s: render.HairpinElements)."""

    set: str
    items: Sequence[Union[Element, ElementRun]]


Object = Union[Table, Chain, Rule, Set, Element, ElementRun, Elements]
ELEMENT_TYPES = (Element, ElementRun, Elements)
"""What an element operation carries (``isinstance(obj, ELEMENT_TYPES)``)."""


def element_items(obj: Union[Element, ElementRun, Elements]) -> Sequence[Union[Element, ElementRun]]:
    """The elements and runs of one element operation's object."""
    return obj.items if isinstance(obj, Elements) else (obj,)
