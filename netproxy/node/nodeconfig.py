"""The configuration taken from this node: what counts as a local pod (``--detect-local-mode``),
which addresses take NodePorts (``--nodeport-addresses primary``) and the sysctl localhost NodePorts
need — kube-proxy's choices, made once at start from the flags and the Node object.

kube-proxy reads the Node before it builds its proxier (``newProxyServer``: ``NodeManager`` for the
pod CIDRs and the node IPs); so does netproxy, and the rules then stay as they were written for that
start (``netproxy run`` exits when the pod CIDRs change, as kube-proxy does).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import NodeInfo

log = logging.getLogger("netproxy")

PRIMARY, LOCALHOST, ALL = "primary", "localhost", "all"
"""``--nodeport-addresses`` keywords: the Node's primary IPs (kube-proxy's nftables default), the
loopback addresses, every local address."""
KEYWORDS = (PRIMARY, LOCALHOST, ALL)
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
NODE_WAIT = 60.0
"""Seconds ``run`` waits at start, in NodeCIDR mode, for the Node's pod CIDRs on the API."""


class ConfigError(ValueError):
    """The flags ask for something that cannot be set up (named), before anything is written."""


def hostname(args: Any) -> str:
    return getattr(args, "hostname_override", "") or socket.gethostname()


def local_detection(args: Any, node: Optional[NodeInfo]) -> Dict[str, Any]:
    """ProxyConfig's local-pod detection fields from the flags (and, for NodeCIDR, the Node);
    ConfigError naming the flag when the mode lacks what it needs, as kube-proxy refuses to start."""
    mode = getattr(args, "detect_local_mode", "ClusterCIDR") or "ClusterCIDR"
    out: Dict[str, Any] = {"detect_local_mode": mode}
    if mode == "BridgeInterface":
        if not getattr(args, "pod_bridge_interface", ""):
            raise ConfigError("--detect-local-mode BridgeInterface needs --pod-bridge-interface")
        out["pod_bridge_interface"] = args.pod_bridge_interface
    elif mode == "InterfaceNamePrefix":
        if not getattr(args, "pod_interface_name_prefix", ""):
            raise ConfigError("--detect-local-mode InterfaceNamePrefix needs --pod-interface-name-prefix")
        out["pod_interface_name_prefix"] = args.pod_interface_name_prefix
    elif mode == "NodeCIDR":
        if node is None or not node.pod_cidrs:
            raise ConfigError(f"--detect-local-mode NodeCIDR: the Node {hostname(args)!r} has no valid "
                              "spec.podCIDRs (give the Node in --source, or let the API source read it)")
        out["node_pod_cidrs"] = node.pod_cidrs
    return out


def parse_nodeport_addresses(entries: Sequence[str]) -> Tuple[Any, ...]:
    """Keywords and CIDRs, validated (ValueError naming the bad entry); ``()`` when empty."""
    out: List[Any] = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        if entry in KEYWORDS:
            out.append(entry)
            continue
        cidrs = parse_cidrs(entry)
        if not cidrs:
            raise ValueError(f"{entry!r} is not a CIDR or one of {', '.join(KEYWORDS)}")
        out.extend(cidrs)
    return tuple(dict.fromkeys(out))


def nodeport_cidrs(args: Any, node: Optional[NodeInfo]) -> Tuple[Any, ...]:
    """--nodeport-addresses as CIDRs, () meaning every local address, as kube-proxy resolves its
    keywords: ``all`` is every address; ``localhost`` 127.0.0.0/8 and ::1/128; ``primary`` the
    Node's primary IPs as /32 and /128 (none: nothing, and if nothing else is left, every local
    address — kube-proxy's loopback fallback)."""
    value = tuple(getattr(args, "nodeport_addresses", ()))
    if not value or ALL in value:
        return ()
    out: List[Any] = []
    for entry in value:
        if entry == LOCALHOST:
            out.extend(LOOPBACK)
        elif entry == PRIMARY:
            ips = [ip for ip in (node.ips if node is not None else ()) if not ip.is_loopback]
            if not ips:
                log.info("--nodeport-addresses primary: the Node %r has no InternalIP or ExternalIP",
                         hostname(args))
            out.extend(ipaddress.ip_network(ip) for ip in ips)
        else:
            out.append(entry)
    if not out:
        log.info("--nodeport-addresses: no address left; NodePorts are accepted on every local address "
                 "(as kube-proxy does)")
    return tuple(dict.fromkeys(out))


def needs_node(args: Any) -> bool:
    """Whether the configuration is read from the Node object (NodeCIDR, primary)."""
    return getattr(args, "detect_local_mode", "") == "NodeCIDR" or PRIMARY in getattr(args, "nodeport_addresses", ())


def start_node(args: Any, source: Any) -> Optional[NodeInfo]:
    """This node's Node at start: from the file source (whose cache the first load then reuses), or
    read from the API (once; in NodeCIDR mode until it has spec.podCIDRs, up to NODE_WAIT, as
    kube-proxy waits: the node controller fills them shortly after the node registers)."""
    from netproxy.source.files import FileSource

    if isinstance(source, FileSource):
        return source.node()
    from netproxy.source import kube

    name = hostname(args)
    client = getattr(source, "api_client", None)
    deadline = time.monotonic() + NODE_WAIT
    pause = 0.1  # doubling to 2 s: a node that registers a moment later is not waited for in 2 s steps
    while True:
        node = kube.read_node(client, name)
        if getattr(args, "detect_local_mode", "") != "NodeCIDR" or (node is not None and node.pod_cidrs):
            return node  # primary alone: no Node yet is kube-proxy's "assume loopback", all addresses
        if time.monotonic() >= deadline:
            return node
        if pause >= 1.0:
            log.info("waiting for the Node %r%s", name, " and its spec.podCIDRs" if node is not None else "")
        time.sleep(pause)
        pause = min(2.0, pause * 2)


def ensure_localhost_nodeports(backend: str, config: ProxyConfig) -> None:
    """kube-proxy's iptables mode serves NodePorts on 127.0.0.1 by setting route_localnet (the
    kernel otherwise drops a packet from or to 127/8 that is routed, as a DNAT-ed one is)."""
    if backend != "iptables" or not config.route_localnet_nodeports:
        return
    from netproxy.node import sysctl

    if sysctl.ensure(sysctl.ROUTE_LOCALNET, 1):
        log.info("set %s=1 to serve NodePorts on 127.0.0.1; --iptables-localhost-nodeports=false or "
                 "--nodeport-addresses without 127.0.0.0/8 turns this off", sysctl.ROUTE_LOCALNET)
