"""NodePorts on localhost in nftables mode: kube-proxy's userspace relay (KEP-6032; 1.37 alpha, 1.38 beta).

The kernel drops a routed packet from or to 127.0.0.0/8 unless ``route_localnet`` is set, which is
how kube-proxy's iptables mode (and netproxy's iptables backend) serves ``127.0.0.1:<nodePort>``, at
the price of CVE-2020-8558. kube-proxy's nftables mode never sets it, and from 1.37 answers TCP
NodePorts on 127.0.0.1 and ::1 in userspace instead: it accepts the connection there and relays it
to an endpoint. ``netproxy run`` with the nftables backend does the same when ``--nodeport-addresses``
covers a family's loopback address (``localhost``, 127.0.0.0/8, ::1/128); the nftables rules never
match loopback destinations, so the relay is the only thing that answers there.

Which endpoint: the node's own connection to a NodePort is the exception of ``externalTrafficPolicy:
Local`` in kube-proxy (it reaches every endpoint), so every usable endpoint of the family, with
topology, whatever the policy; none → the connection is reset, as the rules reject it elsewhere.
The relay's connection to the endpoint leaves from the node's own address, as a masqueraded one does.

One asyncio loop in one thread serves every port; ``update`` (after each sync) opens and closes the
listeners and swaps the endpoint table the next connection reads.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import random
import threading
from typing import Dict, Iterable, Optional, Sequence, Set, Tuple

from netproxy.core.endpoints import node_endpoints
from netproxy.core.model import Endpoint, IPNetwork, NodeInfo, ServicePort, Snapshot
from netproxy.core.perport import Changed, PerPort

log = logging.getLogger(__name__)

LOOPBACKS = {4: "127.0.0.1", 6: "::1"}
CONNECT_TIMEOUT = 5.0
CHUNK = 65536
Key = Tuple[int, int]
"""(IP version, nodePort)."""
Target = Tuple[str, int]


def families_served(nodeport_addresses: Sequence[IPNetwork]) -> Tuple[int, ...]:
    """The IP versions whose loopback address ``--nodeport-addresses`` covers (none: the relay is off)."""
    return tuple(v for v, addr in LOOPBACKS.items()
                 if any(net.version == v and ipaddress.ip_address(addr) in net for net in nodeport_addresses))


def targets(snapshot: Snapshot, families: Sequence[int]) -> Dict[Key, Tuple[Target, ...]]:
    """Every TCP NodePort of ``snapshot`` in each served family, with the endpoints a connection from
    the node itself may reach (possibly none)."""
    return merged(port_targets(svc, snapshot.endpoints_of(name), snapshot.node, families)
                  for name, svc in snapshot.services.items())


PortTargets = Optional[Tuple[Tuple[Key, Tuple[Target, ...]], ...]]
"""One service port's relay targets per (family, NodePort); None: not a TCP NodePort."""


def port_targets(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo,
                 families: Sequence[int]) -> PortTargets:
    """One service port's part of :func:`targets` (None: not a TCP NodePort)."""
    if svc.protocol != "TCP" or not svc.node_port:
        return None
    eps = node_endpoints(svc, endpoints, node)
    return tuple(((family, svc.node_port), tuple((str(e.ip), e.port) for e in eps if e.ip.version == family))
                 for family in families)


def merged(parts: Iterable[PortTargets]) -> Dict[Key, Tuple[Target, ...]]:
    """Every service port's part, merged by (family, NodePort) (two services may share one)."""
    out: Dict[Key, Tuple[Target, ...]] = {}
    for part in parts:
        for key, found in part or ():
            out[key] = tuple(sorted(set(out.get(key, ()) + found)))
    return out


class LocalhostNodePorts:
    """The relay: :meth:`start`, then :meth:`update` after every sync, :meth:`close` at the end."""

    def __init__(self, families: Sequence[int]) -> None:
        self.families = tuple(families)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="localhost-nodeports", daemon=True)
        self._servers: Dict[Key, asyncio.AbstractServer] = {}
        self._targets: Dict[Key, Tuple[Target, ...]] = {}
        self._refused: Set[Key] = set()
        self.failed = 0
        served = self.families
        self._ports: PerPort[Tuple[Tuple[Key, Tuple[Target, ...]], ...]] = PerPort(
            lambda svc, eps, node: port_targets(svc, eps, node, served))
        """Each TCP NodePort's targets, kept from the changed ports only (core/perport.py)."""

    def start(self) -> None:
        self._thread.start()
        log.info("NodePorts on %s answered by netproxy's userspace relay (--nodeport-addresses covers them)",
                 " and ".join(LOOPBACKS[f] for f in self.families))

    def update(self, snapshot: Snapshot, changed: Changed = None) -> None:
        """Listen on exactly the snapshot's TCP NodePorts; the next connections use its endpoints.
        ``changed``: only these service ports changed since the last update (None: any may have)."""
        if not self._ports.update(snapshot, changed) and changed is not None and not self._refused:
            return  # no NodePort changed and none to try again
        wanted = merged(self._ports.values.values())
        asyncio.run_coroutine_threadsafe(self._apply(wanted), self._loop).result(timeout=30)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._apply({}), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _apply(self, wanted: Dict[Key, Tuple[Target, ...]]) -> None:
        self._targets = wanted
        for key in [k for k in self._servers if k not in wanted]:
            server = self._servers.pop(key)
            server.close()
            await server.wait_closed()
        for key in wanted:
            if key in self._servers:
                continue
            family, port = key
            try:
                self._servers[key] = await asyncio.start_server(
                    functools.partial(self._relay, key), host=LOOPBACKS[family], port=port, reuse_address=True)
                self._refused.discard(key)
            except OSError as err:
                if key not in self._refused:  # said once; tried again after every sync
                    log.warning("NodePort %s:%d on localhost: cannot listen (%s); another program holds it?",
                                LOOPBACKS[family], port, err)
                    self._refused.add(key)

    async def _relay(self, key: Key, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        choices = self._targets.get(key)
        if not choices:
            writer.transport.abort()  # a reset, as the rules reject a NodePort without endpoints
            return
        address, port = random.choice(choices)
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as err:
            self.failed += 1
            log.debug("localhost NodePort %d: endpoint %s:%d: %s", key[1], address, port, err)
            writer.transport.abort()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close: the other direction may still be talking."""
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()
