"""Which endpoints of a service port a backend routes to (kube-proxy's CategorizeEndpoints, in one place).

Both backends call these so that they cannot disagree on which endpoints are eligible:
- ready endpoints; when none is ready, the serving-and-terminating ones (graceful termination);
- ``internalTrafficPolicy``/``externalTrafficPolicy: Local``: only endpoints on this node;
- topology: zone hints (``hints.forZones``, or the endpoint's own zone under
  ``trafficDistribution: PreferClose``) restrict cluster traffic to endpoints for this node's zone,
  only when every endpoint is hinted and at least one is for this zone (kube-proxy's canUseTopology).
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

from netproxy.model import Endpoint, NodeInfo, ServicePort, Snapshot

PREFER_ZONE = ("PreferClose", "PreferSameZone")


def usable(endpoints: Sequence[Endpoint]) -> Tuple[Endpoint, ...]:
    """Ready endpoints; when there are none, the serving-and-terminating ones (graceful shutdown)."""
    ready = tuple(e for e in endpoints if e.ready)
    if ready:
        return ready
    return tuple(e for e in endpoints if e.serving and e.terminating)


def cluster_endpoints(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints for traffic from inside the cluster (ClusterIP), honouring internalTrafficPolicy."""
    if svc.internal_traffic_policy == "Local":
        return local_endpoints(endpoints, node)
    return _by_topology(svc, usable(endpoints), node)


def external_endpoints(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints for external traffic (NodePort, external IP, LB IP), honouring externalTrafficPolicy."""
    if svc.external_traffic_policy == "Local":
        return local_endpoints(endpoints, node)
    return _by_topology(svc, usable(endpoints), node)


def local_endpoints(endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints on this node (matched by nodeName), with the same ready/terminating fallback."""
    return usable(tuple(e for e in endpoints if node.name and e.node_name == node.name))


def _zones_of(svc: ServicePort, ep: Endpoint) -> Tuple[str, ...]:
    if ep.zone_hints:
        return ep.zone_hints
    if svc.traffic_distribution in PREFER_ZONE and ep.zone:
        # Without the EndpointSlice controller (file source), PreferClose means what the controller
        # would hint: each endpoint serves its own zone.
        return (ep.zone,)
    return ()


def _by_topology(svc: ServicePort, endpoints: Tuple[Endpoint, ...], node: NodeInfo) -> Tuple[Endpoint, ...]:
    if not node.zone or not endpoints:
        return endpoints
    zones = [_zones_of(svc, e) for e in endpoints]
    if any(not z for z in zones):
        return endpoints  # kube-proxy ignores hints unless every endpoint has them
    same = tuple(e for e, z in zip(endpoints, zones) if node.zone in z)
    return same or endpoints


def no_local_endpoints(snapshot: Snapshot) -> Dict[Tuple[int, str], int]:
    """(IP version, "internal"/"external") → service ports with a Local traffic policy of that kind and
    no eligible local endpoint while they have endpoints elsewhere (kube-proxy's
    sync_proxy_rules_no_local_endpoints_total{ip_family,traffic_policy}); a service port counts once
    for each family of its addresses, as kube-proxy's per-family proxiers count it."""
    counts: Dict[Tuple[int, str], int] = {}
    for name, svc in snapshot.services.items():
        eps = snapshot.endpoints_of(name)
        if not eps or not usable(eps):
            continue
        local = local_endpoints(eps, snapshot.node)
        if local:
            continue
        kinds = []
        if svc.internal_traffic_policy == "Local":
            kinds.append("internal")
        if svc.external_traffic_policy == "Local" and (svc.node_port or svc.external_ips or svc.load_balancer_ips):
            kinds.append("external")
        for version in {a.version for a in svc.addresses()} or {4}:
            for kind in kinds:
                counts[(version, kind)] = counts.get((version, kind), 0) + 1
    return counts
