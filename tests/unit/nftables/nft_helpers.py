"""Builders shared by the nftables unit tests."""

from __future__ import annotations

import ipaddress
from typing import Dict, Iterable, Optional, Sequence, Tuple

import pytest

from netproxy.backends.nftables import FakeNft, NftablesBackend, encode
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


def mixed_snapshot() -> Snapshot:
    """The mixed cluster of the golden file (tests/unit/nftables/golden/mixed.nft) and of nft's own
    netlink bytes (nft_netlink_capture.py): external and LB IPs, UDP, affinity, no endpoints, IPv6."""
    return snap(
        (svc("web", "10.96.0.10", external=["192.0.2.10"], lb=["198.51.100.10"]),
         eps("10.1.0.2", "10.1.0.1", "10.1.0.3")),
        (svc("dns", "10.96.0.53", 53, proto="UDP", port_name="dns"), eps("10.1.0.7", port=53)),
        (svc("sticky", "10.96.0.20", affinity=True, timeout=60), eps("10.1.0.4", "10.1.0.5")),
        (svc("empty", "10.96.0.30"), ()),
        (svc("v6", "fd00::10"), eps("fd01::1", "fd01::2")),
    )


def assert_fast_pack_agrees(p: encode.Packer, good: Iterable[str], odd: Iterable[str]) -> None:
    """``p.pack`` (the fast paths) answers as ``p`` (the general path): the same bytes, of the key's
    length, for ``good``; for ``odd``, the same bytes, or the same refusal (EncodeError)."""
    for text in good:
        assert p.pack(text) == p(text) and len(p.pack(text)) == p.length
    for text in odd:
        try:
            want = p(text)
        except encode.EncodeError:
            with pytest.raises(encode.EncodeError):
                p.pack(text)
        else:
            assert p.pack(text) == want
