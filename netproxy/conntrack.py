"""UDP conntrack cleanup after a sync, through pyroute2's conntrack netlink (no `conntrack` fork per entry).

UDP has no connection end, so the kernel keeps DNAT-ing a flow to the endpoint it first chose for as
long as packets keep coming.  As kube-proxy does, after each sync:
- flows DNAT-ed to a UDP endpoint that went away are deleted (the next packet is load-balanced anew);
- when a UDP service gets its first endpoint, flows to its addresses are deleted (they were being
  rejected, and a cached entry would keep them rejected).
Only entries whose original destination is one of netproxy's service addresses are touched.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Iterable, Optional, Set, Tuple

from netproxy.endpoints import cluster_endpoints
from netproxy.model import Snapshot

log = logging.getLogger(__name__)

IPPROTO = {"UDP": socket.IPPROTO_UDP, "SCTP": 132}
IPS_DST_NAT = 1 << 5
Dest = Tuple[str, int]  # (address, port) as text, the way pyroute2 reports them


@dataclass(frozen=True)
class Stale:
    """What the last sync made stale: endpoints gone, and service destinations that gained endpoints."""

    gone_endpoints: FrozenSet[Tuple[Dest, FrozenSet[Dest]]]  # endpoint → the service destinations it served
    revived: FrozenSet[Dest]

    def __bool__(self) -> bool:
        return bool(self.gone_endpoints or self.revived)


def _udp_view(snap: Snapshot) -> dict:  # type: ignore[type-arg]
    view = {}
    for name, svc in snap.services.items():
        if svc.protocol != "UDP":
            continue
        dests = frozenset((str(a), svc.port) for a in svc.addresses())
        if svc.node_port:
            dests |= {("*", svc.node_port)}  # a NodePort flow's original destination is any node address
        eps = frozenset((str(e.ip), e.port) for e in cluster_endpoints(svc, snap.endpoints_of(name), snap.node))
        view[name] = (dests, eps)
    return view


def stale_udp(previous: Optional[Snapshot], current: Snapshot) -> Stale:
    """Compare two snapshots' UDP services (kube-proxy's deleteUDPEndpointConnections inputs)."""
    if previous is None:
        return Stale(frozenset(), frozenset())
    before, after = _udp_view(previous), _udp_view(current)
    gone: Set[Tuple[Dest, FrozenSet[Dest]]] = set()
    revived: Set[Dest] = set()
    for name, (dests, eps) in before.items():
        now_eps = after.get(name, (dests, frozenset()))[1]
        for ep in eps - now_eps:
            gone.add((ep, dests))
    for name, (dests, eps) in after.items():
        if eps and not before.get(name, (dests, frozenset()))[1]:
            revived |= dests
    return Stale(frozenset(gone), frozenset(revived))


class ConntrackCleaner:
    """Deletes the conntrack entries that :func:`stale_udp` names, in the caller's network namespace."""

    def __init__(self, factory: Optional[Callable[[int], Any]] = None) -> None:
        self._factory = factory

    def _open(self, family: int) -> Any:
        if self._factory is not None:
            return self._factory(family)
        from pyroute2 import Conntrack  # imported lazily: unit tests and `plan` never need netlink

        return Conntrack(nfgen_family=family)

    def clean(self, stale: Stale, families: Iterable[int] = (socket.AF_INET, socket.AF_INET6)) -> int:
        if not stale:
            return 0
        gone = {ep: dests for ep, dests in stale.gone_endpoints}
        deleted = 0
        for family in families:
            ct = self._open(family)
            try:
                for entry in list(ct.dump_entries()):
                    if self._matches(entry, gone, stale.revived):
                        try:
                            ct.entry("del", tuple_orig=entry.tuple_orig)
                            deleted += 1
                        except Exception as err:  # noqa: BLE001 - the entry may have expired meanwhile
                            log.debug("conntrack entry already gone: %s", err)
            finally:
                ct.close()
        if deleted:
            log.info("deleted %d stale UDP conntrack entries", deleted)
        return deleted

    @staticmethod
    def _matches(entry: Any, gone: dict, revived: FrozenSet[Dest]) -> bool:  # type: ignore[type-arg]
        orig, reply = entry.tuple_orig, entry.tuple_reply
        if orig is None or reply is None:
            return False
        if orig.proto != socket.IPPROTO_UDP:
            return False
        dest = (str(orig.daddr), orig.dport)
        node_dest = ("*", orig.dport)
        if dest in revived or node_dest in revived:
            return True
        served = gone.get((str(reply.saddr), reply.sport))
        return served is not None and (dest in served or node_dest in served)

