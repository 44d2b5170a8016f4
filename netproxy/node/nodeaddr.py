"""The node's local addresses, through netlink (pyroute2), for NodePorts with --nodeport-addresses.

Without --nodeport-addresses both backends match "any local address" in the kernel (addrtype LOCAL /
fib daddr type local) and need no list.  With it, the backends render the node's addresses inside
those CIDRs, and a watcher keeps the list current when addresses come and go.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from typing import Any, Callable, Optional, Sequence, Tuple

from netproxy.core.model import IPAddress, IPNetwork

log = logging.getLogger(__name__)


def local_addresses(cidrs: Sequence[IPNetwork], dump: Optional[Callable[[], Any]] = None) -> Tuple[IPAddress, ...]:
    """The addresses on this namespace's interfaces that fall inside ``cidrs``, sorted."""
    if dump is None:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            msgs = list(ipr.get_addr())
    else:
        msgs = list(dump())
    found = set()
    for msg in msgs:
        raw = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
        if not raw:
            continue
        addr = ipaddress.ip_address(raw)
        if any(addr.version == net.version and addr in net for net in cidrs):
            found.add(addr)
    return tuple(sorted(found, key=lambda a: (a.version, a)))


class NodeAddressWatcher:
    """Polls the node's addresses and tells the tracker when they change.

    A poll every few seconds is enough for NodePort addresses (kube-proxy also resyncs on a timer)
    and works the same on every pyroute2 version, unlike a netlink subscription.
    """

    def __init__(self, cidrs: Sequence[IPNetwork], interval: float = 2.0) -> None:
        self.cidrs = tuple(cidrs)
        self.interval = interval
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, tracker: Any) -> None:
        def loop() -> None:
            last: Optional[Tuple[IPAddress, ...]] = None
            while True:
                try:
                    now = local_addresses(self.cidrs)
                except Exception as err:  # noqa: BLE001 - one bad read must not end address following
                    log.warning("cannot read node addresses: %s", err)
                    now = last or ()
                if now != last:
                    log.info("node addresses for NodePorts: %s", ", ".join(map(str, now)) or "none")
                    tracker.set_node_addresses(now)
                    last = now
                if self._stop.wait(self.interval):
                    return

        self._thread = threading.Thread(target=loop, name="node-addresses", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
