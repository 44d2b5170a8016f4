"""Who may reach a load-balancer IP that has ``loadBalancerSourceRanges`` (one place for both backends).

The ranges themselves, of one family; and, when one of them covers this node's primary IP, the
load-balancer IPs as sources too (kube-proxy's "allowFromNode").  A node that holds the LB IP on an
interface — MetalLB in L2 mode, keepalived, a cloud VIP routed to the node — reaches that IP through
its local route, and the kernel picks the LB IP itself as the source; a cloud load balancer that
rewrites the source to its own address looks the same.  Allowing the node's ranges but dropping its
own traffic to the LB would break health checks and node-local clients that the ranges meant to let
in.  A source outside every range is still dropped.
"""

from __future__ import annotations

import ipaddress
from typing import Tuple

from netproxy.core.model import IPNetwork, NodeInfo, ServicePort


def firewall_sources(svc: ServicePort, node: NodeInfo, version: int) -> Tuple[IPNetwork, ...]:
    """The source CIDRs allowed to the service's LB IPs in family ``version`` (the caller decides
    whether the service is restricted at all: any ``loadBalancerSourceRanges``)."""
    ranges = tuple(r for r in svc.source_ranges if r.version == version)
    node_in_range = any(ip in r for ip in node.ips if ip.version == version for r in ranges)
    if not node_in_range:
        return ranges
    own = tuple(ipaddress.ip_network(ip) for ip in svc.load_balancer_ips if ip.version == version)
    return ranges + tuple(n for n in own if n not in ranges)
