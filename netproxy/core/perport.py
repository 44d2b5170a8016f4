"""A value derived from each service port of the synced snapshot, kept up to date from the ports
that changed rather than computed again from all of them after every sync.

``netproxy run``'s steps after a sync (the metrics' no-local-endpoints counts and address
families, the UDP conntrack reconciler's view, the health-check servers, the localhost NodePort
relay) each used to walk every service port of the snapshot after every sync.  At 100,000 service
ports the walk for the no-local-endpoints gauge alone took 320 ms per sync, ~100 times the
sync it followed (by hand, ``no_local_endpoints`` over bench.objects' 100k × 10 snapshot,
2026-12-06): the next change waited for it.  The sync's :class:`~netproxy.core.model.Changes`
already names the service ports whose service or endpoints changed (deleted ones included), and
says ``full`` when anything else did (the node, the service CIDRs, a start or a repair).  So each
step keeps its per-port values here and asks again only for the named ports.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Dict, FrozenSet, Generic, List, Optional, Tuple, TypeVar

from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot

T = TypeVar("T")
Changed = Optional[FrozenSet[ServicePortName]]
"""The service ports a sync was told changed (deleted ones included); None after a full sync, when
anything may have changed (the node, the service CIDRs, a start, a repair)."""
AfterSync = Callable[[Optional[Snapshot], Snapshot, Changed], None]
"""A step of ``netproxy run`` after each successful sync: (previous snapshot, current, changed)."""
Derive = Callable[[ServicePort, Tuple[Endpoint, ...], NodeInfo], Optional[T]]
"""A port's value from its service, its endpoints and the node; None: the port contributes nothing."""
Diff = List[Tuple[ServicePortName, Optional[T], Optional[T]]]
"""(port, old value, new value) for every port whose value changed."""


class PerPort(Generic[T]):
    """Per service port: ``derive``'s value, for the ports where it is not None."""

    def __init__(self, derive: Derive[T]) -> None:
        self._derive = derive
        self.values: Dict[ServicePortName, T] = {}
        self._node: Optional[NodeInfo] = None
        self._primed = False

    def update(self, snapshot: Snapshot, changed: Optional[AbstractSet[ServicePortName]]) -> Diff[T]:
        """Bring the values to ``snapshot``: only the ports in ``changed`` are derived again, unless
        ``changed`` is None (a full sync: anything may have changed), nothing was derived yet, or the
        node is another (every port's value may depend on it).  Returns what changed."""
        node = snapshot.node
        if changed is None or not self._primed or (node is not self._node and node != self._node):
            return self._everything(snapshot)
        diff: Diff[T] = []
        services = snapshot.services
        for name in changed:
            svc = services.get(name)
            new = self._derive(svc, snapshot.endpoints_of(name), node) if svc is not None else None
            old = self.values.get(name)
            if new is None:
                self.values.pop(name, None)
            else:
                self.values[name] = new
            if old != new:
                diff.append((name, old, new))
        return diff

    def _everything(self, snapshot: Snapshot) -> Diff[T]:
        node = snapshot.node
        derive = self._derive
        values: Dict[ServicePortName, T] = {}
        for name, svc in snapshot.services.items():
            value = derive(svc, snapshot.endpoints_of(name), node)
            if value is not None:
                values[name] = value
        old = self.values
        diff: Diff[T] = [(n, v, values.get(n)) for n, v in old.items() if values.get(n) != v]
        diff += [(n, None, v) for n, v in values.items() if n not in old]
        self.values = values
        self._node = node
        self._primed = True
        return diff


class Tally(Generic[T]):
    """Counts of the keys that the ports' values name (a value is a tuple of keys), kept from the
    diffs of a :class:`PerPort`: the totals a gauge shows, without summing every port again."""

    def __init__(self, derive: Derive[Tuple[T, ...]]) -> None:
        self.ports: PerPort[Tuple[T, ...]] = PerPort(derive)
        self.counts: Dict[T, int] = {}

    def update(self, snapshot: Snapshot, changed: Optional[AbstractSet[ServicePortName]]) -> Dict[T, int]:
        for _name, old, new in self.ports.update(snapshot, changed):
            for key in old or ():
                left = self.counts[key] - 1
                if left:
                    self.counts[key] = left
                else:
                    del self.counts[key]
            for key in new or ():
                self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts
