"""From parsed flags to what the commands use: the backend's name, the one ProxyConfig, the backend
(built by netproxy/wiring.py), the conntrack sysctls."""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Optional, Tuple

from netproxy.backends.base import Backend
from netproxy.core import features
from netproxy.core.config import ProxyConfig
from netproxy.core.model import NodeInfo
from netproxy.node import ctsysctl
from netproxy.node import detect as detect_mod
from netproxy.node.nodeconfig import PRIMARY, ConfigError, hostname, local_detection, needs_node, nodeport_cidrs
from netproxy.wiring import is_kernel, new_backend

log = logging.getLogger("netproxy")


def conntrack_settings(args: argparse.Namespace) -> ctsysctl.ConntrackSettings:
    return ctsysctl.ConntrackSettings(
        max_per_core=getattr(args, "conntrack_max_per_core", None), min=getattr(args, "conntrack_min", None),
        tcp_established_timeout=getattr(args, "conntrack_tcp_timeout_established", None),
        tcp_close_wait_timeout=getattr(args, "conntrack_tcp_timeout_close_wait", None),
        tcp_be_liberal=bool(getattr(args, "conntrack_tcp_be_liberal", False)),
        udp_timeout=getattr(args, "conntrack_udp_timeout", None),
        udp_stream_timeout=getattr(args, "conntrack_udp_timeout_stream", None))


def set_conntrack_sysctls(args: argparse.Namespace, backend: Backend) -> None:
    """kube-proxy's platformSetup: a setting that cannot be applied stops the start (SysctlError)."""
    if is_kernel(backend):
        ctsysctl.apply(conntrack_settings(args))


def proxy_config(args: argparse.Namespace, backend: str, flavour: str,
                 node: Optional[NodeInfo] = None, ipv6_affinity: str = ProxyConfig.ipv6_affinity) -> ProxyConfig:
    """The flags (with --config's values already on them) as the one ProxyConfig.  A command without
    a flag leaves ProxyConfig's default; ``node`` gives NodeCIDR's pod CIDRs and ``primary``'s IPs;
    ``ipv6_affinity`` is the node's nft's answer (:func:`make_backend` asks it)."""
    D = ProxyConfig
    sync_period = getattr(args, "sync_period", D.sync_period)
    min_sync_period = getattr(args, "min_sync_period", D.min_sync_period)
    if min_sync_period > sync_period:
        # kube-proxy's validation: syncPeriod must be at least minSyncPeriod.
        raise ConfigError(f"--min-sync-period ({min_sync_period:g}s) must not exceed --sync-period "
                          f"({sync_period:g}s)")
    return ProxyConfig(
        backend=backend, iptables_writer=args.iptables_writer, iptables_flavour=flavour,
        nftables_writer=args.nftables_writer, ipv6_affinity=ipv6_affinity,
        sync_period=sync_period,
        min_sync_period=min_sync_period,
        masquerade_all=getattr(args, "masquerade_all", D.masquerade_all),
        masquerade_bit=getattr(args, "masquerade_bit", D.masquerade_bit),
        cluster_cidrs=tuple(getattr(args, "cluster_cidr", D.cluster_cidrs)),
        hostname=hostname(args),
        nodeport_addresses=nodeport_cidrs(args, node),
        localhost_nodeports=getattr(args, "iptables_localhost_nodeports", D.localhost_nodeports) is not False,
        service_cidrs=tuple(getattr(args, "service_cluster_ip_range", D.service_cidrs)),
        one_shot=getattr(args, "one_shot", D.one_shot),
        metrics_bind_address=getattr(args, "metrics_bind_address", D.metrics_bind_address),
        healthz_bind_address=getattr(args, "healthz_bind_address", D.healthz_bind_address),
        **local_detection(args, node),
        iptables_lock_timeout=getattr(args, "iptables_lock_timeout", D.iptables_lock_timeout),
        feature_gates=features.effective(getattr(args, "feature_gates", {})),
    )


def choose_backend(args: argparse.Namespace) -> Tuple[str, str]:
    """(backend, iptables flavour) from the flags, running the version check where they say auto."""
    flavour = args.iptables_flavour
    if args.backend == "auto":
        decision = detect_mod.detect()
        log.info("backend %s: %s", decision.backend, decision.reason)
        backend = decision.backend
        if flavour == "auto":
            flavour = decision.flavour or "legacy"
    else:
        backend = args.backend
    if flavour == "auto":
        # Only the iptables backend cares which iptables the node has; don't probe for the others.
        flavour = detect_mod.iptables_flavour() if backend == "iptables" else "legacy"
    return backend, flavour


def make_backend(args: argparse.Namespace, node: Optional[NodeInfo] = None,
                 read_node: Optional[Callable[[], Optional[NodeInfo]]] = None,
                 lock_waits: Optional[Callable[[float], None]] = None) -> Tuple[Backend, ProxyConfig]:
    """The backend and its configuration; ``node`` (or ``read_node()``, asked only when the
    configuration needs the Node) gives NodeCIDR's pod CIDRs and ``primary``'s addresses."""
    backend, flavour = choose_backend(args)
    chosen = set(getattr(args, "given", ())) | set(getattr(args, "from_config", ()))
    if backend == "nftables" and hasattr(args, "nodeport_addresses") and "nodeport_addresses" not in chosen:
        args.nodeport_addresses = (PRIMARY,)  # kube-proxy's nftables mode default (its platformApplyDefaults)
    if node is None and read_node is not None and needs_node(args):
        node = read_node()
    affinity = ProxyConfig.ipv6_affinity
    if backend == "nftables":
        # A node fact, asked once here: every command then renders the layout the node's nft lists back.
        found = detect_mod.ipv6_affinity_layout()
        log.info("nftables IPv6 ClientIP affinity: %s (%s)", found.layout, found.reason)
        affinity = found.layout
    config = proxy_config(args, backend, flavour, node, affinity)
    return new_backend(backend, config, lock_waits), config


def kube_client(args: argparse.Namespace) -> Any:
    """The API client of --kubeconfig, or of the pod's service account; SourceError when neither."""
    # Imported lazily: the kubernetes client is slow to import and file-source users never need it.
    from netproxy.source import kube
    from netproxy.source.files import SourceError

    try:
        return kube.api_client_from(args.kubeconfig)
    except ValueError as err:
        raise SourceError(f"{err}; pass --source PATH or --kubeconfig PATH") from None
