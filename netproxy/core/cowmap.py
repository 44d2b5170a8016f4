"""A map the tracker changes a few entries of at a time and hands to each sync whole, without copying.

Every sync takes a snapshot of every service port and its endpoints.  Copying the tracker's two
dicts for it cost O(services) per change: at 100,000 services ~0.1–0.3 s for a one-endpoint change
whose kernel write is a few milliseconds (bench --scale 100000).  Here the entries live in a
``base`` dict that is never changed once a snapshot shares it, and the changes since in a small
``delta`` on top; a snapshot copies only the delta.  When the delta grows past a fraction of the
base, the two are merged into a new base (O(services), once per that many changes; the old base
stays with the snapshots that hold it).
"""

from __future__ import annotations

from typing import (
    Dict,
    Generic,
    ItemsView,
    Iterator,
    KeysView,
    Mapping,
    Optional,
    TypeVar,
    Union,
    ValuesView,
    cast,
    overload,
)

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


class _Gone:
    """A deleted entry in a delta (the key is still in the base below it)."""


GONE = _Gone()

MERGE_MIN = 1024
"""A delta is merged into a new base past ``max(MERGE_MIN, len(base) // MERGE_FRACTION)`` entries:
each snapshot copies at most that many entries, and a merge (one O(n) copy) comes once per that many
changes."""
MERGE_FRACTION = 64


class FrozenView(Mapping[K, V]):
    """An immutable mapping: ``base`` with ``delta`` over it.  Neither is changed after it is made.

    Lookups read the two; a walk over every entry (a full sync, the hooks after a sync) reads one
    merged dict, made once on the first walk: a generator over both cost ~0.5 µs an entry, the
    merge is one copy at C speed."""

    __slots__ = ("_base", "_delta", "_len", "_merged")

    def __init__(self, base: Dict[K, V], delta: Dict[K, Union[V, _Gone]], length: int) -> None:
        self._base = base
        self._delta = delta
        self._len = length
        self._merged: Optional[Dict[K, V]] = None

    # Values are never None (service ports, endpoint tuples): ``delta.get`` returning None means
    # "not changed since the base".
    def __getitem__(self, key: K) -> V:
        got = self._delta.get(key)
        if got is None:
            return self._base[key]
        if isinstance(got, _Gone):
            raise KeyError(key)
        return got

    @overload
    def get(self, key: K, /) -> Optional[V]: ...

    @overload
    def get(self, key: K, /, default: Union[V, T]) -> Union[V, T]: ...

    def get(self, key: K, /, default: Optional[Union[V, T]] = None) -> Optional[Union[V, T]]:
        # Mapping's get goes through __getitem__ and a KeyError: a full sync asks 100k times.
        got = self._delta.get(key)
        if got is None:
            return self._base.get(key, default)
        return default if isinstance(got, _Gone) else got

    def __contains__(self, key: object) -> bool:
        got = self._delta.get(cast(K, key))
        if got is None:
            return key in self._base
        return not isinstance(got, _Gone)

    def __len__(self) -> int:
        return self._len

    def _all(self) -> Dict[K, V]:
        merged = self._merged
        if merged is None:  # two threads may both merge: the same result, one kept
            merged = _applied(self._base, self._delta)
            self._merged = merged
        return merged

    def __iter__(self) -> Iterator[K]:
        return iter(self._all())

    def keys(self) -> KeysView[K]:
        return self._all().keys()

    def items(self) -> ItemsView[K, V]:
        return self._all().items()

    def values(self) -> ValuesView[V]:
        return self._all().values()

    def __repr__(self) -> str:
        return f"FrozenView({dict(self.items())!r})"


class CowMap(Generic[K, V]):
    """The tracker's side: a mutable map whose :meth:`frozen` views cost O(changes since the last merge)."""

    __slots__ = ("_base", "_delta", "_len")

    def __init__(self) -> None:
        self._base: Dict[K, V] = {}
        self._delta: Dict[K, Union[V, _Gone]] = {}
        self._len = 0

    def __contains__(self, key: K) -> bool:
        got = self._delta.get(key)
        if got is None:
            return key in self._base
        return not isinstance(got, _Gone)

    def __len__(self) -> int:
        return self._len

    def get(self, key: K) -> Optional[V]:
        got = self._delta.get(key)
        if got is None:
            return self._base.get(key)
        return None if isinstance(got, _Gone) else got

    def __setitem__(self, key: K, value: V) -> None:
        assert value is not None, "a CowMap holds no None (it means unchanged in the delta)"
        if key not in self:
            self._len += 1
        self._delta[key] = value

    def pop(self, key: K) -> None:
        """Remove ``key`` if present."""
        if key not in self:
            return
        self._len -= 1
        if key in self._base:
            self._delta[key] = GONE
        else:
            del self._delta[key]

    def frozen(self) -> Mapping[K, V]:
        """Every entry as it is now, unchanged by what this map does next."""
        if len(self._delta) > max(MERGE_MIN, len(self._base) // MERGE_FRACTION):
            self._merge()
        if not self._delta:
            return self._base  # shared: from now on the base is only read (writes go to the delta)
        return FrozenView(self._base, dict(self._delta), self._len)

    def _merge(self) -> None:
        self._base, self._delta = _applied(self._base, self._delta), {}


def _applied(base: Dict[K, V], delta: Dict[K, Union[V, _Gone]]) -> Dict[K, V]:
    """``delta`` applied to a copy of ``base`` (a new dict: the old one may be held by snapshots)."""
    out = dict(base)
    for key, value in delta.items():
        if isinstance(value, _Gone):
            del out[key]
        else:
            out[key] = value
    return out
