"""Builders shared by the nftables unit tests."""

from __future__ import annotations

import ipaddress
from typing import Dict, Iterable, Optional, Sequence, Tuple

from netproxy.backends.nftables import FakeNft, NftablesBackend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, NodeInfo, ServicePort, Snapshot
from netproxy_lab.manifests import service_port


def svc(name: str, cluster_ip: str, port: int = 80, *, proto: str = "TCP", port_name: str = "http",
        namespace: str = "ns", external: Sequence[str] = (), lb: Sequence[str] = (), affinity: bool = False,
        timeout: int = 10800, ext_policy: str = "Cluster") -> ServicePort:
    return service_port(name, namespace, port_name, protocol=proto, port=port, cluster_ip=cluster_ip,
                        external_ips=tuple(ipaddress.ip_address(a) for a in external),
                        load_balancer_ips=tuple(ipaddress.ip_address(a) for a in lb),
                        affinity="ClientIP" if affinity else "None", affinity_timeout=timeout,
                        external_traffic_policy=ext_policy)


def eps(*addrs: str, port: int = 8080, node: Optional[str] = None) -> Tuple[Endpoint, ...]:
    return tuple(Endpoint(ipaddress.ip_address(a), port, node_name=node) for a in addrs)


def snap(*items: Tuple[ServicePort, Iterable[Endpoint]], node: str = "") -> Snapshot:
    return Snapshot.build([s for s, _ in items], {s.name: tuple(e) for s, e in items}, NodeInfo(node))


def backend(config: Optional[ProxyConfig] = None) -> Tuple[NftablesBackend, FakeNft]:
    fake = FakeNft()
    return NftablesBackend(config or ProxyConfig(hostname="node-a"), kernel=fake), fake


def fresh_dumps(snapshot: Snapshot, config: Optional[ProxyConfig] = None) -> Dict[str, str]:
    """What a new backend writes for ``snapshot`` in one full sync: the reference for incremental ones."""
    b, fake = backend(config)
    b.sync(snapshot, Changes())
    return {fam: fake.dump(fam) for fam in ("ip", "ip6")}


def dumps(fake: FakeNft) -> Dict[str, str]:
    return {fam: fake.dump(fam) for fam in ("ip", "ip6")}
