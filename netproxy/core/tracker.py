"""The change tracker: turns source events into snapshots and says which service ports changed.

Sources call the ``update_*``/``replace_*`` methods from their own threads; the sync loop calls
:meth:`ChangeTracker.take` to get a :class:`Snapshot` and the set of changed service port names.
Endpoints are resolved per service port here (merging every slice of a service, deduplicating an
endpoint listed by two slices), so backends only ever see resolved ``Endpoint`` tuples.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from dataclasses import replace
from itertools import islice
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

from netproxy.core.cowmap import CowMap
from netproxy.core.model import (
    Changes,
    Endpoint,
    EndpointSet,
    IPAddress,
    IPNetwork,
    NodeInfo,
    ServicePort,
    ServicePortName,
    Snapshot,
    ValidationError,
)

log = logging.getLogger(__name__)

Key = Tuple[str, str]  # (namespace, name)


class ChangeTracker:
    """Holds the latest state from the sources and what changed since the last :meth:`take`."""

    def __init__(self, node: Optional[NodeInfo] = None, on_change: Optional[Callable[[], None]] = None,
                 service_cidrs: Tuple[IPNetwork, ...] = (), external_ips: bool = True) -> None:
        self._lock = threading.Lock()
        self._external_ips = external_ips
        """kube-proxy's AllowServiceExternalIPs gate: false drops every service's spec.externalIPs as it
        enters, so that no backend sees them (the rest of the service is served as ever)."""
        self._flag_cidrs = tuple(service_cidrs)
        """--service-cluster-ip-range: always part of the snapshot's service CIDRs."""
        self._cidr_objects: Dict[str, Tuple[IPNetwork, ...]] = {}
        """ServiceCIDR objects by name (cluster-scoped), from the sources."""
        self._service_cidrs = _joined(self._flag_cidrs, self._cidr_objects)
        self._services: Dict[Key, Tuple[ServicePort, ...]] = {}
        self._slices: Dict[Key, EndpointSet] = {}  # keyed by (namespace, slice name)
        self._slices_by_service: Dict[Key, Set[Key]] = {}
        self._dirty: Set[Key] = set()  # services (namespace, name) whose ports or endpoints changed
        # Copy-on-write: a snapshot shares them and copies only what changed since (cowmap.py).
        self._resolved: CowMap[ServicePortName, Tuple[Endpoint, ...]] = CowMap()
        self._ports: CowMap[ServicePortName, ServicePort] = CowMap()
        self._names_by_service: Dict[Key, Set[ServicePortName]] = {}
        self._node = node or NodeInfo()
        self._node_changed = False
        self._node_addresses: Tuple[IPAddress, ...] = ()
        self._services_synced = False
        self._endpoints_synced = False
        self._addresses_expected = False
        self.rejected = 0  # a count: a long-running proxy must not keep every error it ever saw
        self.on_change = on_change
        self.service_changes = 0
        """Changes of services seen (kube-proxy's sync_proxy_rules_service_changes_total)."""
        self.endpoint_changes = 0
        self._pending_services = 0
        self._pending_endpoints = 0
        self._started = time.time()
        self._trigger_times: List[float] = []
        self.last_trigger_times: Tuple[float, ...] = ()
        """The last-change-trigger-times of the endpoint changes in the last :meth:`take`, for
        kube-proxy's network programming latency (observed once those changes are written)."""

    # -- events from sources ------------------------------------------------------------------

    def update_service(self, namespace: str, name: str, ports: Optional[Tuple[ServicePort, ...]]) -> None:
        """A service was added or changed (``ports``) or deleted (``None``)."""
        with self._lock:
            self._set_service((namespace, name), ports)
        self._notify()

    def update_endpoints(self, namespace: str, slice_name: str, eps: Optional[EndpointSet]) -> None:
        """An EndpointSlice (or legacy Endpoints) was added or changed, or deleted (``None``)."""
        with self._lock:
            self._set_slice((namespace, slice_name), eps)
        self._notify()

    def replace_services(self, services: Mapping[Key, Tuple[ServicePort, ...]]) -> None:
        """The full set of services after a (re)list: ones not in ``services`` are removed."""
        with self._lock:
            for key in set(self._services) - set(services):
                self._set_service(key, None)
            for key, ports in services.items():
                self._set_service(key, ports)
        self._notify()

    def replace_endpoints(self, sets: Mapping[Key, EndpointSet]) -> None:
        """The full set of endpoint slices after a (re)list: ones not in ``sets`` are removed."""
        with self._lock:
            for key in set(self._slices) - set(sets):
                self._set_slice(key, None)
            for key, eps in sets.items():
                self._set_slice(key, eps)
        self._notify()

    def set_node(self, node: NodeInfo) -> None:
        with self._lock:
            if node != self._node:
                self._node = node
                self._node_changed = True
        self._notify()

    def set_node_addresses(self, addresses: Tuple[IPAddress, ...]) -> None:
        """The node's local addresses changed (kept apart from set_node: two sources feed them)."""
        with self._lock:
            self._addresses_expected = False
            if addresses != self._node_addresses:
                self._node_addresses = addresses
                self._node_changed = True
        self._notify()

    def update_service_cidr(self, name: str, cidrs: Optional[Tuple[IPNetwork, ...]]) -> None:
        """A ServiceCIDR object was added or changed (``cidrs``) or deleted (``None``)."""
        with self._lock:
            if cidrs is None:
                self._cidr_objects.pop(name, None)
            else:
                self._cidr_objects[name] = cidrs
            changed = self._cidrs_now()
        if changed:
            self._notify()

    def replace_service_cidrs(self, objects: Mapping[str, Tuple[IPNetwork, ...]]) -> None:
        """Every ServiceCIDR object after a (re)list or a file load: ones not in ``objects`` are gone."""
        with self._lock:
            self._cidr_objects = dict(objects)
            changed = self._cidrs_now()
        if changed:
            self._notify()

    def _cidrs_now(self) -> bool:
        """Join the flag's and the objects' CIDRs again; whether that changed anything."""
        joined = _joined(self._flag_cidrs, self._cidr_objects)
        if joined == self._service_cidrs:
            return False  # e.g. every file reload: no sync to ask for
        self._service_cidrs = joined
        # Rare, and node-wide (a drop rule or set, not a service's rules): a full sync.
        self._node_changed = True
        return True

    def services_synced(self) -> None:
        with self._lock:
            self._services_synced = True
        self._notify()

    def endpoints_synced(self) -> None:
        with self._lock:
            self._endpoints_synced = True
        self._notify()

    def reject(self, error: ValidationError) -> None:
        """A source could not use an object; it is logged here once, with the object and field."""
        log.error("rejected %s", error)
        with self._lock:
            self.rejected += 1

    # -- the sync loop's side -------------------------------------------------------------------

    def expect_node_addresses(self) -> None:
        """The node's addresses for NodePorts will come (``--nodeport-addresses``): the first sync
        waits for them, so that it is not followed at once by a second full one when they arrive."""
        with self._lock:
            self._addresses_expected = True

    @property
    def ready(self) -> bool:
        """Never write before services and endpoints were each seen once (kube-proxy's rule), nor
        before the node's addresses are known when they are expected."""
        with self._lock:
            return self._services_synced and self._endpoints_synced and not self._addresses_expected

    def pending(self) -> bool:
        with self._lock:
            return bool(self._dirty) or self._node_changed

    def pending_changes(self) -> Tuple[int, int]:
        """(service changes, endpoint changes) not yet taken by a sync."""
        with self._lock:
            return self._pending_services, self._pending_endpoints

    def take(self) -> Tuple[Snapshot, Changes]:
        """The current snapshot and the service ports changed since the last call (then cleared)."""
        with self._lock:
            changed: Set[ServicePortName] = set()
            for key in self._dirty:
                changed.update(self._resolve(key))
            self._dirty.clear()
            self._pending_services = self._pending_endpoints = 0
            self.last_trigger_times, self._trigger_times = tuple(self._trigger_times), []
            full = self._node_changed  # node zone/name (and service CIDR) changes can affect every service
            self._node_changed = False
            node = replace(self._node, addresses=self._node_addresses) if self._node_addresses else self._node
            snap = Snapshot(self._ports.frozen(), self._resolved.frozen(), node, self._service_cidrs)
        return snap, Changes(full=full, services=frozenset(changed))

    # -- internals (lock held) ------------------------------------------------------------------

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _set_service(self, key: Key, ports: Optional[Tuple[ServicePort, ...]]) -> None:
        old = self._services.get(key)
        if old is ports and ports:
            return  # the same object again (a cached file part): nothing to compare
        if ports and not self._external_ips:
            ports = tuple(replace(p, external_ips=()) if p.external_ips else p for p in ports)
        if ports is None or not ports:
            if old is not None:
                del self._services[key]
                self._dirty.add(key)
                self._count_service()
                log.debug("service %s/%s deleted", *key)
            return
        if old != ports:
            log.debug("service %s/%s %s", *key, "added" if old is None else "changed")
            self._services[key] = ports
            self._dirty.add(key)
            self._count_service()

    def _count_service(self) -> None:
        self.service_changes += 1
        self._pending_services += 1

    def _set_slice(self, key: Key, eps: Optional[EndpointSet]) -> None:
        old = self._slices.get(key)
        if old is eps or old == eps:
            return
        log.debug("endpoint slice %s/%s %s", *key, "added" if old is None else "deleted" if eps is None else "changed")
        self.endpoint_changes += 1
        self._pending_endpoints += 1
        stamp = eps.trigger_time if eps is not None else None
        if stamp is not None and stamp >= self._started:
            # As kube-proxy: a change from before this proxy started (the initial list after a
            # restart) would measure the restart, not the network programming.
            self._trigger_times.append(stamp)
        if old is not None:
            service = (old.namespace, old.service)
            keys = self._slices_by_service.get(service)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._slices_by_service[service]
            self._dirty.add(service)
            del self._slices[key]
        if eps is not None:
            service = (eps.namespace, eps.service)
            self._slices[key] = eps
            self._slices_by_service.setdefault(service, set()).add(key)
            self._dirty.add(service)

    def _resolve(self, key: Key) -> Set[ServicePortName]:
        """Recompute one service's ports and endpoints; return every port name touched."""
        touched = self._names_by_service.pop(key, set())
        for name in touched:
            self._ports.pop(name)
            self._resolved.pop(name)
        ports = self._services.get(key, ())
        slices = [self._slices[k] for k in sorted(self._slices_by_service.get(key, ()))]
        names: Set[ServicePortName] = set()
        for sp in ports:
            if len(slices) == 1:
                # One slice (nearly every service): its endpoints for this port are often already
                # what the merge below makes of them (ordered, each address once), and then they
                # are kept as they are, shared with the slice rather than copied.
                own = slices[0].for_port(sp.name.port, sp.protocol)
                if in_order(own):
                    self._ports[sp.name] = sp
                    self._resolved[sp.name] = own
                    names.add(sp.name)
                    continue
            # Keyed by plain ints: ipaddress' __hash__/__lt__ are Python-level and showed up as a
            # third of a 10k-service resolve.
            seen: Dict[Tuple[int, int, int], Endpoint] = {}
            for s in slices:
                for ep in s.for_port(sp.name.port, sp.protocol):
                    # The same address in two slices (during a slice rebalance) counts once; a ready
                    # copy wins over a not-ready one.
                    k = (ep.ip.version, int(ep.ip), ep.port)
                    prev = seen.get(k)
                    if prev is None or (ep.ready and not prev.ready):
                        seen[k] = ep
            self._ports[sp.name] = sp
            self._resolved[sp.name] = tuple(seen[k] for k in sorted(seen))
            names.add(sp.name)
        if names:
            self._names_by_service[key] = names
        return touched | names


_ORDER = operator.attrgetter("ip._max_prefixlen", "ip._ip", "port")
"""An endpoint's place in a resolved tuple, read in C: (32 or 128, the address as an int, the port)
orders as (IP version, address, port) does, the key :meth:`ChangeTracker._resolve` sorts on."""


def in_order(eps: Tuple[Endpoint, ...]) -> bool:
    """Whether ``eps`` is already what :meth:`ChangeTracker._resolve` would make of it alone:
    strictly ordered by (IP version, address, port), so no endpoint is listed twice."""
    if len(eps) < 2:
        return True
    keys = list(map(_ORDER, eps))
    return all(map(operator.lt, keys, islice(keys, 1, None)))


def _joined(flag: Tuple[IPNetwork, ...], objects: Mapping[str, Tuple[IPNetwork, ...]]) -> Tuple[IPNetwork, ...]:
    """The flag's CIDRs and every object's, once each, in a stable order (v4 first)."""
    seen = set(flag)
    for cidrs in objects.values():
        seen.update(cidrs)
    return tuple(sorted(seen, key=lambda n: (n.version, int(n.network_address), n.prefixlen)))
