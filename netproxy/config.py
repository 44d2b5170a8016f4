"""The proxy's configuration: one frozen object instead of a long constructor signature."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Tuple

from netproxy.model import FieldError, IPNetwork, check_cidr

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
    service_cidrs: Tuple[IPNetwork, ...] = ()
    """--service-cluster-ip-range: service CIDRs known without the API's ServiceCIDR objects (the
    tracker joins both into ``Snapshot.service_cidrs``, which is what the backends read)."""
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
        try:
            out.append(check_cidr(part, ""))  # the one CIDR check (model.py), also for objects
        except FieldError as err:
            raise ValueError(err.message) from None
    return tuple(out)
