"""The proxy's configuration: one frozen object instead of a long constructor signature."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Tuple

from netproxy.model import IPNetwork

BACKENDS = ("auto", "iptables", "nftables", "fake")
IPTABLES_WRITERS = ("restore", "libiptc")
IPTABLES_FLAVOURS = ("legacy", "nft")
NFTABLES_WRITERS = ("netlink", "libnftables")


@dataclass(frozen=True)
class ProxyConfig:
    """Settings shared by the core and the backends; names follow kube-proxy's flags."""

    backend: str = "auto"
    iptables_writer: str = "restore"
    iptables_flavour: str = "legacy"
    """Which iptables the node uses ("legacy" or "nft"), decided by the version check."""
    nftables_writer: str = "netlink"
    """nftables backend: its own netlink batches (default) or libnftables (text)."""
    sync_period: float = 30.0
    min_sync_period: float = 1.0
    masquerade_all: bool = False
    masquerade_bit: int = 14
    cluster_cidrs: Tuple[IPNetwork, ...] = ()
    hostname: str = field(default_factory=socket.gethostname)
    nodeport_addresses: Tuple[IPNetwork, ...] = ()
    iptables_lock_timeout: float = 5.0
    """Seconds to wait for the xtables lock held by another program (legacy iptables)."""
    one_shot: bool = False
    """Set by ``netproxy sync``: this process writes once and ends, so nothing kept for the next
    sync (the iptables backend's table fingerprint) is worth its cost."""

    @property
    def masquerade_mark(self) -> int:
        return 1 << self.masquerade_bit


def parse_cidrs(text: str) -> Tuple[IPNetwork, ...]:
    """A comma-separated CIDR list from a flag; raises ValueError naming the bad entry."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "%" in part:  # an IPv6 zone would be carried into rule text verbatim
            raise ValueError(f"{part!r} is not a CIDR (no %zone allowed)")
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not a CIDR") from None
    return tuple(out)
