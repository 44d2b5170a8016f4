"""Which endpoints of a service port a backend routes to (kube-proxy's CategorizeEndpoints, in one place).

Both backends call these so that they cannot disagree on which endpoints are eligible:
- ready endpoints; when none is ready, the serving-and-terminating ones (graceful termination);
- ``internalTrafficPolicy``/``externalTrafficPolicy: Local``: only endpoints on this node;
- topology, as kube-proxy's ``pkg/proxy/topology.go`` (topologyModeFromHints) decides it, from the
  *ready* endpoints' hints only: when every ready endpoint has a node hint (``hints.forNodes``) and
  one is for this node, cluster traffic goes to the ready endpoints hinted for this node; otherwise,
  when every ready endpoint has a zone hint (``hints.forZones``) and one is for this node's zone, to
  those hinted for the zone; otherwise to every ready endpoint.  Partial hints (one ready endpoint
  without) switch that level off; a node level that is off falls back to the zone level.  Without
  ready endpoints there is no topology: the serving-and-terminating ones, wherever they are.
- Without the EndpointSlice controller (the file source), an endpoint that carries no hint at all
  gets what the controller would give it under ``trafficDistribution``: PreferClose/PreferSameZone
  its own zone, PreferSameNode its own node and zone (the controller's preferCloseHeuristic).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from netproxy.core.model import Endpoint, NodeInfo, ServicePort, Snapshot

SAME_NODE, SAME_ZONE = "PreferSameNode", "PreferSameZone"
"""Topology modes (kube-proxy's names, the trafficDistribution values); "" is none: every ready endpoint."""
PREFER_ZONE = ("PreferClose", SAME_ZONE)
PREFER_NODE = SAME_NODE


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
    return _by_topology(svc, endpoints, node)


def external_endpoints(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints for external traffic (NodePort, external IP, LB IP), honouring externalTrafficPolicy."""
    if svc.external_traffic_policy == "Local":
        return local_endpoints(endpoints, node)
    return _by_topology(svc, endpoints, node)


def node_endpoints(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints for a connection the node itself makes to a NodePort or an external address: every
    endpoint (with topology) whatever externalTrafficPolicy says — kube-proxy's exception for the
    node's own traffic, which has no client address to preserve."""
    return _by_topology(svc, endpoints, node)


def local_endpoints(endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints on this node (matched by nodeName), with the same ready/terminating fallback."""
    return usable(tuple(e for e in endpoints if node.name and e.node_name == node.name))


def hints(svc: ServicePort, ep: Endpoint) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(node hints, zone hints) of ``ep``: its own, or, when it carries none, what the EndpointSlice
    controller would give it under the service's trafficDistribution (file source)."""
    if ep.node_hints or ep.zone_hints:
        return ep.node_hints, ep.zone_hints
    distribution = svc.traffic_distribution
    if not distribution:
        return (), ()
    nodes = (ep.node_name,) if distribution == PREFER_NODE and ep.node_name else ()
    zones = (ep.zone,) if (distribution == PREFER_NODE or distribution in PREFER_ZONE) and ep.zone else ()
    return nodes, zones


def topology_mode(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> str:
    """kube-proxy's topologyModeFromHints: SAME_NODE, SAME_ZONE or "" (no topology)."""
    any_ready = False
    all_nodes = all_zones = True
    for_node = for_zone = False
    for ep in endpoints:
        if not ep.ready:
            continue  # only ready endpoints' hints count, as in kube-proxy
        any_ready = True
        nodes, zones = hints(svc, ep)
        if not nodes:
            all_nodes = False
        elif node.name in nodes:
            for_node = True
        if not zones:
            all_zones = False
        elif node.zone in zones:
            for_zone = True
        if not all_nodes and not all_zones:
            return ""
    if not any_ready:
        return ""
    if all_nodes and for_node and node.name:
        return SAME_NODE
    if all_zones and for_zone and node.zone:
        return SAME_ZONE
    return ""


def _by_topology(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    mode = topology_mode(svc, endpoints, node)
    if not mode:
        return usable(endpoints)
    if mode == SAME_NODE:
        return tuple(e for e in endpoints if e.ready and node.name in hints(svc, e)[0])
    # The mode was chosen because a ready endpoint is for this zone: never empty.
    return tuple(e for e in endpoints if e.ready and node.zone in hints(svc, e)[1])


def no_local_endpoints(snapshot: Snapshot) -> Dict[Tuple[int, str], int]:
    """(IP version, "internal"/"external") → service ports with a Local traffic policy of that kind and
    no eligible local endpoint while they have endpoints elsewhere (kube-proxy's
    sync_proxy_rules_no_local_endpoints_total{ip_family,traffic_policy}); a service port counts once
    for each family of its addresses, as kube-proxy's per-family proxiers count it.  ``run`` keeps
    these counts from the changed ports only (core/perport.py); this is the whole sum."""
    counts: Dict[Tuple[int, str], int] = {}
    for name, svc in snapshot.services.items():
        for key in no_local_kinds(svc, snapshot.endpoints_of(name), snapshot.node) or ():
            counts[key] = counts.get(key, 0) + 1
    return counts


def no_local_kinds(svc: ServicePort, eps: Sequence[Endpoint], node: NodeInfo) -> Optional[Tuple[Tuple[int, str], ...]]:
    """One service port's part of :func:`no_local_endpoints`: the (IP version, policy kind) it counts
    under, or None."""
    if not (svc.internal_traffic_policy == "Local" or svc.external_traffic_policy == "Local"):
        return None  # the common case first: no Local policy, nothing to look at
    if not eps or not usable(eps) or local_endpoints(eps, node):
        return None
    kinds = []
    if svc.internal_traffic_policy == "Local":
        kinds.append("internal")
    if svc.external_traffic_policy == "Local" and (svc.node_port or svc.external_ips or svc.load_balancer_ips):
        kinds.append("external")
    versions = sorted({a.version for a in svc.addresses()} or {4})
    return tuple((version, kind) for version in versions for kind in kinds) or None
