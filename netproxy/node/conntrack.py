"""The conntrack reconciler: delete the UDP and SCTP flows the current state says are stale.

UDP and SCTP flows keep the endpoint conntrack chose for their first packet for as long as packets
keep coming, so a flow DNAT-ed to an endpoint that went away (or one recorded without DNAT while
its service had no endpoint) would never move.  As kube-proxy 1.32+ does (pkg/proxy/conntrack,
CleanStaleEntries), each pass compares the kernel's table with the *current* services and endpoints,
not with the previous sync's: a one-shot ``netproxy sync`` and the first sync after a restart clean
what an earlier process left, and a pass that failed is made good by the next one.

For every UDP/SCTP service port with its serving endpoints E (ready or serving-terminating, every
endpoint of the port: traffic policies and topology are ignored, as kube-proxy ignores them, so a
policy change does not cut flows), an entry is stale when
- its original destination is a service address (cluster IP, external IP, load-balancer IP) and
  port, and its reply source (the DNAT target) is not in E; or
- its original destination port is the port's NodePort (any address), likewise;
- its original destination is an address inside the service CIDRs (``--service-cluster-ip-range``,
  ServiceCIDR objects) that no service port owns: its service was deleted (kube-proxy 1.38 clears
  those flows in ``run``; netproxy also in a one-shot ``sync`` after the deletion, which learns what
  was there from the flow itself rather than from a previous process's memory).
A port with no serving endpoint has E empty: every flow to it is deleted, so that its packets meet
the reject rule instead of the endpoint that went away (kubernetes #139628, fixed upstream by #139629).
A port deleted since the last pass is reconciled once more with E empty (#141371).

TCP is left alone, as kube-proxy leaves it: a TCP connection to a removed endpoint fails on its own
(reset or timeout) and a new connection is load-balanced anew.  SCTP is included as kube-proxy
<= 1.31 did (its IsClearConntrackNeeded); 1.32+'s reconciler reads UDP only (docs/parity.md).
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

from netproxy.core.model import Endpoint, IPAddress, ServicePort, ServicePortName, Snapshot
from netproxy.core.perport import Changed

log = logging.getLogger(__name__)

PROTOCOLS = {"UDP": socket.IPPROTO_UDP, "SCTP": 132}
FAMILIES: Dict[int, int] = {4: socket.AF_INET, 6: socket.AF_INET6}
FAMILY_LABEL: Dict[int, str] = {socket.AF_INET: "IPv4", socket.AF_INET6: "IPv6"}
Key = bytes
"""Packed address + big-endian port (or the port alone for a NodePort), as ctnetlink carries them."""


def key(address: IPAddress, port: int) -> Key:
    return address.packed + struct.pack("!H", port)


def port_key(port: int) -> Key:
    return struct.pack("!H", port)


@dataclass(frozen=True)
class Desired:
    """What one (family, protocol) table should hold: which DNAT targets each service front end may have."""

    by_address: Mapping[Key, FrozenSet[Key]] = field(default_factory=dict)
    by_node_port: Mapping[Key, FrozenSet[Key]] = field(default_factory=dict)
    unowned: Tuple[Tuple[int, int], ...] = ()
    """The service CIDRs of this family as (network, mask) integers: a flow to an address inside
    them that no service port owns belonged to a service that was deleted (no one else DNATs into
    the service range, and the rules drop such traffic now) — stale, whatever its endpoint."""

    def stale(self, service: Key, dport: Key, endpoint: Key) -> bool:
        """kube-proxy's two tests, in its order: the address:port front end, then the NodePort; then
        an unowned service address (a deleted service, which a new process cannot remember)."""
        by_address = self.by_address.get(service)
        if by_address is not None and endpoint not in by_address:
            return True
        by_node_port = self.by_node_port.get(dport)
        if by_node_port is not None:
            return endpoint not in by_node_port
        if by_address is None and self.unowned:
            address = int.from_bytes(service[:-2], "big")
            return any(address & mask == network for network, mask in self.unowned)
        return False

    def __bool__(self) -> bool:
        return bool(self.by_address or self.by_node_port or self.unowned)


State = Dict[Tuple[int, int], Desired]
"""(address family, IP protocol number) → what that table should hold."""


PortView = List[Tuple[Tuple[int, int], List[Key], Optional[Key], FrozenSet[Key]]]
"""One port's share of the state: per table, its front-end keys, NodePort key, allowed endpoints."""
ViewCache = Dict[ServicePortName, Tuple[ServicePort, Sequence[Endpoint], PortView]]


def port_view(svc: ServicePort, endpoints: Sequence[Endpoint]) -> PortView:
    out: PortView = []
    proto = PROTOCOLS.get(svc.protocol)
    if proto is None:
        return out
    for version, family in FAMILIES.items():
        fronts = [key(a, svc.port) for a in svc.addresses() if a.version == version]
        if not fronts:
            continue  # the port does not exist in this family (kube-proxy's per-family proxier)
        allowed = frozenset(key(e.ip, e.port) for e in endpoints if e.ip.version == version and (e.serving or e.ready))
        out.append(((family, proto), fronts, port_key(svc.node_port) if svc.node_port else None, allowed))
    return out


def desired_state(snapshot: Snapshot, retired: Iterable[ServicePortName] = (),
                  previous: Optional[Snapshot] = None, cache: Optional[ViewCache] = None) -> State:
    """The reconciler's view of ``snapshot``: every UDP/SCTP service port's front ends, per family,
    with the serving endpoints of that family.  ``retired`` names ports gone since ``previous``:
    their front ends (read from ``previous``) get no endpoint at all.  ``cache`` keeps each port's
    view while its ServicePort and endpoints are the same objects (the tracker reuses them), so
    that a sync at 10k services does not rebuild 10k views."""
    maps: Dict[Tuple[int, int], Tuple[Dict[Key, FrozenSet[Key]], Dict[Key, FrozenSet[Key]]]] = {}
    views: List[PortView] = []
    for name, svc in snapshot.services.items():
        if svc.protocol not in PROTOCOLS:
            continue
        endpoints = snapshot.endpoints_of(name)
        hit = cache.get(name) if cache is not None else None
        if hit is not None and hit[0] is svc and hit[1] is endpoints:
            views.append(hit[2])
            continue
        view = port_view(svc, endpoints)
        if cache is not None:
            cache[name] = (svc, endpoints, view)
        views.append(view)
    if previous is not None:
        views += [port_view(previous.services[n], ()) for n in retired if n in previous.services]
    if cache is not None and len(cache) > len(snapshot.services):
        for gone in [n for n in cache if n not in snapshot.services]:
            del cache[gone]
    for view in views:
        for table, fronts, node_port, allowed in view:
            by_address, by_node_port = maps.setdefault(table, ({}, {}))
            for front in fronts:
                by_address[front] = allowed
            if node_port is not None:
                by_node_port[node_port] = allowed
    ranges: Dict[int, Tuple[Tuple[int, int], ...]] = {
        version: tuple((int(c.network_address), int(c.netmask)) for c in snapshot.service_cidrs if c.version == version)
        for version in FAMILIES}
    for version, family in FAMILIES.items():
        if ranges[version]:  # flows of a deleted UDP service: checked even when no UDP service is left
            maps.setdefault((family, socket.IPPROTO_UDP), ({}, {}))
    version_of = {family: version for version, family in FAMILIES.items()}
    return {table: Desired(a, n, ranges[version_of[table[0]]]) for table, (a, n) in maps.items()}


def _reconciled(snapshot: Optional[Snapshot], name: ServicePortName) -> bool:
    """Whether ``name`` is a port of ``snapshot`` whose flows the reconciler looks after."""
    svc = snapshot.services.get(name) if snapshot is not None else None
    return svc is not None and svc.protocol in PROTOCOLS


@dataclass
class Pass:
    """What one reconcile pass did (logged, counted in the metrics, returned to callers)."""

    seen: Dict[str, int] = field(default_factory=dict)
    deleted: Dict[str, int] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    errors: List[str] = field(default_factory=list)

    @property
    def total_deleted(self) -> int:
        return sum(self.deleted.values())


class Table(Protocol):
    """What a pass needs of ctnetlink (netproxy.node.ctnetlink.Ctnetlink; a fake in unit tests)."""

    def select(self, family: int, proto: int, pick: Callable[[bytes, bytes, bytes], bool]) -> Tuple[int, List[bytes]]:
        ...

    def delete(self, messages: Sequence[bytes], family: int) -> Tuple[int, int]: ...

    def close(self) -> None: ...


class Reconciler:
    """Runs passes against the kernel of the caller's network namespace.

    ``run`` calls :meth:`after_sync` after every successful sync: a pass happens when the desired
    state differs from the last pass's, and at least every ``period`` seconds (the sync period:
    a flow can become stale without any change of ours, e.g. a client that started before the rules
    were written)."""

    def __init__(self, period: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 opener: Optional[Callable[[], Table]] = None, metrics: bool = True) -> None:
        self.period = period
        self.metrics = metrics
        """Record each pass in the Prometheus metrics (``run``); a one-shot ``sync`` serves none, and
        importing prometheus_client (and http.server with it) cost 34 ms of its start."""
        self.clock = clock
        self._opener = opener
        self._last: Optional[State] = None
        self._last_at = 0.0
        self._unusable: Optional[str] = None
        self._views: ViewCache = {}
        self.last: Optional[Pass] = None
        """The last pass run by :meth:`after_sync`."""

    def after_sync(self, previous: Optional[Snapshot], current: Snapshot, changed: Changed = None) -> None:
        now = self.clock()
        if changed is not None and self._last is not None and now - self._last_at < self.period and \
                not any(_reconciled(previous, n) or _reconciled(current, n) for n in changed):
            return  # only TCP ports changed: the view is the last pass's (without a walk of every port)
        retired: Iterable[ServicePortName] = ()
        if previous is not None:
            gone = previous.services if changed is None else changed
            retired = [n for n in gone if n in previous.services and n not in current.services]
        state = desired_state(current, retired, previous, self._views)
        if self._last is not None and state == self._last and now - self._last_at < self.period:
            return
        self.last = self.reconcile(state)
        if self.last.errors:
            self._last = None  # the next sync tries again
            return
        # Deleted ports were handled; keep only the live ones so that the next pass does not
        # re-run merely because they are gone from the view.
        self._last = desired_state(current, cache=self._views) if retired else state
        self._last_at = now

    def reconcile(self, state: State) -> Pass:
        """One pass: per (family, protocol) with service ports, one dump, then batched deletes."""
        from netproxy.node.ctnetlink import Ctnetlink

        done = Pass()
        if not state:
            return done
        if self._unusable is not None:
            done.errors.append(self._unusable)
            return done
        try:
            ct: Table = self._opener() if self._opener is not None else Ctnetlink()
        except OSError as err:
            # No ctnetlink (module missing, no CAP_NET_ADMIN): say so once, keep proxying.
            self._unusable = f"conntrack reconciler off: cannot open ctnetlink: {err}"
            log.error("%s", self._unusable)
            done.errors.append(self._unusable)
            return done
        try:
            for (family, proto), desired in sorted(state.items()):
                label = FAMILY_LABEL[family]
                start = time.perf_counter()
                seen = 0
                try:
                    seen, stale = ct.select(family, proto, desired.stale)
                    deleted, _gone = ct.delete(stale, family) if stale else (0, 0)
                except OSError as err:
                    deleted = 0
                    done.errors.append(f"{label} {proto}: {err}")
                    log.error("conntrack reconcile of %s protocol %d failed: %s", label, proto, err)
                elapsed = time.perf_counter() - start
                done.seen[label] = done.seen.get(label, 0) + seen
                done.deleted[label] = done.deleted.get(label, 0) + deleted
                done.seconds[label] = done.seconds.get(label, 0.0) + elapsed
            if self.metrics:
                from netproxy import metrics

                for label, seconds in done.seconds.items():
                    metrics.CONNTRACK_RECONCILE_DURATION.labels(label).observe(seconds)
                    metrics.CONNTRACK_RECONCILE_DELETED.labels(label).inc(done.deleted[label])
        finally:
            ct.close()
        if done.total_deleted:
            log.info("conntrack reconciler: deleted %d stale entries (%s) of %d read in %.3f s",
                     done.total_deleted, ", ".join(f"{k} {v}" for k, v in sorted(done.deleted.items()) if v),
                     sum(done.seen.values()), sum(done.seconds.values()))
        else:
            log.debug("conntrack reconciler: nothing stale among %d entries", sum(done.seen.values()))
        return done
