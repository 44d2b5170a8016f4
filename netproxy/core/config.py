"""The proxy's configuration: one frozen object instead of a long constructor signature."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Optional, Tuple

from netproxy.core.features import effective, enabled
from netproxy.core.model import FieldError, IPNetwork, check_cidr

_IPV4_LOOPBACK = ipaddress.ip_address("127.0.0.1")

BACKENDS = ("auto", "iptables", "nftables", "fake")
IPTABLES_WRITERS = ("restore", "libiptc")
NFTABLES_WRITERS = ("netlink", "libnftables")
LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
"""kube-proxy's ``--detect-local-mode``: what tells traffic from a pod of this node (its localdetector.go)."""
IFNAMSIZ = 16


@dataclass(frozen=True)
class ProxyConfig:
    """Settings shared by the core and the backends; names follow kube-proxy's flags.

    The one home of the proxy's defaults: the CLI's flags and the --config file leave a setting
    unset unless given, and this class's default applies (netproxy/cli/args.py reads them from here)."""

    backend: str = "auto"
    iptables_writer: str = "restore"
    iptables_flavour: str = "legacy"
    """Which iptables the node uses ("legacy" or "nft"): --iptables-flavour, or the version check's
    answer when that is auto."""
    nftables_writer: str = "netlink"
    """nftables backend: its own netlink batches (default) or libnftables (text)."""
    ipv6_affinity: str = "sets"
    """nftables backend: where IPv6 ClientIP affinity lives, a node fact chosen once at start from
    the node's ``nft --version`` (netproxy/node/detect.py): "maps", elements of the shared
    ``affinity-<proto>`` maps as IPv4's (nft >= 1.1 lists them in a form it loads again); "sets",
    one dynamic set per endpoint (nft 1.0.x aborts on the map layout, so an operator's ``nft list``
    and ``nft -f`` would fail on the node).  The default is the layout every nft reads back."""
    sync_period: float = 30.0
    min_sync_period: float = 1.0
    masquerade_all: bool = False
    masquerade_bit: int = 14
    cluster_cidrs: Tuple[IPNetwork, ...] = ()
    hostname: str = field(default_factory=socket.gethostname)
    nodeport_addresses: Tuple[IPNetwork, ...] = ()
    """CIDRs (``primary`` already turned into the node's primary IPs by the CLI); () is every local address."""
    localhost_nodeports: bool = True
    """``--iptables-localhost-nodeports``: the iptables backend answers NodePorts on 127.0.0.1
    (route_localnet), as kube-proxy's iptables mode does; the nftables backend never does."""
    detect_local_mode: str = "ClusterCIDR"
    node_pod_cidrs: Tuple[IPNetwork, ...] = ()
    """NodeCIDR mode: this node's ``spec.podCIDRs``, read from the Node at start (kube-proxy's too)."""
    pod_bridge_interface: str = ""
    pod_interface_name_prefix: str = ""
    service_cidrs: Tuple[IPNetwork, ...] = ()
    """--service-cluster-ip-range: service CIDRs known without the API's ServiceCIDR objects (the
    tracker joins both into ``Snapshot.service_cidrs``, which is what the backends read)."""
    feature_gates: Tuple[Tuple[str, bool], ...] = field(default_factory=lambda: effective({}))
    """kube-proxy's feature gates, every one netproxy knows with its value (netproxy/core/features.py)."""
    iptables_lock_timeout: float = 5.0
    """Seconds to wait for the xtables lock held by another program (legacy iptables)."""
    metrics_bind_address: str = "127.0.0.1:10249"
    """``run``: host:port serving /metrics ('' off)."""
    healthz_bind_address: str = "0.0.0.0:10256"
    """``run``: host:port serving /healthz and /livez ('' off)."""
    one_shot: bool = False
    """Set by ``netproxy sync``: this process writes once and ends, so nothing kept for the next
    sync (the iptables backend's table fingerprint) is worth its cost."""

    @property
    def masquerade_mark(self) -> int:
        return 1 << self.masquerade_bit

    @property
    def local_cidrs(self) -> Tuple[IPNetwork, ...]:
        """The CIDRs whose sources are this node's pods (ClusterCIDR, NodeCIDR modes); () otherwise."""
        if self.detect_local_mode == "NodeCIDR":
            return self.node_pod_cidrs
        if self.detect_local_mode == "ClusterCIDR":
            return self.cluster_cidrs
        return ()

    @property
    def local_interface(self) -> Optional[Tuple[str, bool]]:
        """(name, is a prefix) of the interface(s) pod traffic comes in on (BridgeInterface,
        InterfaceNamePrefix modes); None otherwise.  iptables writes ``-i br0`` / ``-i veth+``,
        nftables ``iifname "br0"`` / ``iifname "veth*"``."""
        if self.detect_local_mode == "BridgeInterface" and self.pod_bridge_interface:
            return self.pod_bridge_interface, False
        if self.detect_local_mode == "InterfaceNamePrefix" and self.pod_interface_name_prefix:
            return self.pod_interface_name_prefix, True
        return None

    @property
    def route_localnet_nodeports(self) -> bool:
        """Whether the iptables dataplane answers NodePorts on 127.0.0.1 (IPv4 only, by DNAT with the
        ``route_localnet`` sysctl), as kube-proxy's iptables mode decides: ``--iptables-localhost-nodeports``
        (default true) and ``--nodeport-addresses`` unset or holding 127.0.0.1 (its ``ContainsIPv4Loopback``).
        A config fact, not a backend's: the node's set-up reads it too (it sets the sysctl)."""
        if not self.localhost_nodeports:
            return False
        return not self.nodeport_addresses or any(_IPV4_LOOPBACK in c for c in self.nodeport_addresses
                                                  if c.version == 4)

    def gate(self, name: str) -> bool:
        """Whether feature gate ``name`` is on (``--feature-gates`` over kube-proxy's defaults)."""
        return enabled(self.feature_gates, name)


def check_interface_name(name: str, what: str, prefix: bool = False) -> str:
    """A Linux interface name (or name prefix) that is safe in rules; ValueError naming ``what``."""
    if not name:
        raise ValueError(f"{what}: must not be empty")
    # The kernel's name buffer keeps a byte for the NUL; iptables writes a prefix with its "+" in it.
    limit = IFNAMSIZ - (2 if prefix else 1)
    if len(name) > limit:
        raise ValueError(f"{what}: {name!r} is longer than {limit} characters")
    bad = any(not (c.isascii() and c.isprintable()) or c.isspace() or c in "/:+*\"'!" for c in name)
    if bad or name in (".", ".."):
        raise ValueError(f"{what}: {name!r} is not an interface name (printable ASCII, no whitespace, '/', ':', "
                         "'+', '*', quotes or '!')")
    return name


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
