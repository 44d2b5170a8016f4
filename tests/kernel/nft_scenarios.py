"""A sequence of snapshots with every kind of nftables object netproxy writes, for the tests that
compare the two nftables writers (``test_nft_netlink.py``): both run the same steps, one full sync
then incremental ones, and must leave the same ruleset after each.

IPv4 and IPv6, TCP/UDP/SCTP, ClientIP affinity (shared maps in ip, per-service sets in ip6),
NodePorts, externalTrafficPolicy / internalTrafficPolicy Local, external and load-balancer IPs,
loadBalancerSourceRanges, services without endpoints, --cluster-cidr in both families.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import List, Optional, Sequence, Tuple

from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes, Endpoint, NodeInfo, ServicePort, Snapshot
from netproxy_lab.manifests import service_port

NODE = "node-a"
CONFIGS = {
    "default": ProxyConfig(hostname=NODE),
    "cidrs": ProxyConfig(hostname=NODE, cluster_cidrs=parse_cidrs("10.244.0.0/16,10.250.0.0/16,fd00:244::/56"),
                         masquerade_bit=5),
    "nodeport-addresses": ProxyConfig(hostname=NODE, nodeport_addresses=parse_cidrs("192.0.2.0/24"),
                                      masquerade_all=True),
}


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def svc(name: str, ip: str, port: int = 80, *, proto: str = "TCP", affinity: int = 0, node_port: int = 0,
        external: Sequence[str] = (), lb: Sequence[str] = (), ranges: str = "", etp: str = "Cluster",
        itp: str = "Cluster") -> ServicePort:
    return service_port(name, "ns", "p", protocol=proto, port=port, cluster_ip=ip,
                        external_ips=tuple(_ip(a) for a in external), load_balancer_ips=tuple(_ip(a) for a in lb),
                        source_ranges=parse_cidrs(ranges) if ranges else (),
                        affinity="ClientIP" if affinity else "None", affinity_timeout=affinity or 10800,
                        node_port=node_port, service_type="NodePort" if node_port else "ClusterIP",
                        external_traffic_policy=etp, internal_traffic_policy=itp)


def eps(*addrs: str, node: Optional[str] = None) -> Tuple[Endpoint, ...]:
    return tuple(Endpoint(_ip(a), 8080, node_name=node) for a in addrs)


WEB = svc("web", "10.96.0.10", external=["192.0.2.10"], lb=["198.51.100.10"], ranges="203.0.113.0/24,10.0.0.0/8",
          node_port=30080)
DNS = svc("dns", "10.96.0.53", 53, proto="UDP")
STICKY = svc("sticky", "10.96.0.20", affinity=60, node_port=30020)
LOCAL = svc("local", "10.96.0.31", external=["192.0.2.31"], etp="Local", node_port=30031, affinity=30)
ITP = svc("itp", "10.96.0.32", itp="Local")
SCTP = svc("sctp", "10.96.0.40", 9000, proto="SCTP")
EMPTY = svc("empty", "10.96.0.99")
V6 = svc("v6", "fd00::10", affinity=45)
V6B = svc("v6b", "fd00::11", node_port=30611, proto="UDP")


def _snap(items: Sequence[Tuple[ServicePort, Tuple[Endpoint, ...]]]) -> Snapshot:
    return Snapshot.build([s for s, _ in items], {s.name: e for s, e in items}, NodeInfo(NODE))


def steps() -> List[Tuple[Snapshot, Changes]]:
    """(snapshot, changes) to apply in order: a full sync, then incremental changes of every kind."""
    here = eps("10.1.0.1", "10.1.0.2", node=NODE)
    there = eps("10.1.9.1", "10.1.9.2", node="node-b")
    base = [(WEB, eps("10.1.0.1", "10.1.0.2", "10.1.0.3")), (DNS, eps("10.1.0.7")), (STICKY, here + there),
            (LOCAL, here + there), (ITP, here + there), (SCTP, eps("10.1.0.8")), (EMPTY, ()),
            (V6, eps("fd01::1", "fd01::2")), (V6B, eps("fd01::3"))]
    out = [(_snap(base), Changes())]

    def change(items: List[Tuple[ServicePort, Tuple[Endpoint, ...]]], *names: ServicePort) -> None:
        out.append((_snap(items), Changes(full=False, services=frozenset(s.name for s in names))))

    cur = list(base)
    cur[0] = (WEB, eps("10.1.0.1", "10.1.0.9", "10.1.0.3"))  # one endpoint replaced
    change(cur, WEB)
    cur[2] = (STICKY, eps("10.1.0.1", node=NODE) + there)  # an affinity endpoint leaves
    change(cur, STICKY)
    cur[3] = (LOCAL, there)  # no local endpoint any more
    change(cur, LOCAL)
    cur[7] = (V6, eps("fd01::2", "fd01::4"))  # IPv6 affinity endpoints change
    change(cur, V6)
    cur[6] = (dataclasses.replace(EMPTY, port=81), eps("10.1.0.5"))  # gets endpoints (and another port)
    change(cur, EMPTY)
    del cur[5]  # SCTP service removed
    change(cur, SCTP)
    return out
