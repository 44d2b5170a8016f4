"""Which endpoints of a service port a backend routes to (kube-proxy's CategorizeEndpoints, in one place).

Both backends call these so that they cannot disagree on which endpoints are eligible.
"""

from __future__ import annotations

from typing import Sequence, Tuple

from netproxy.model import Endpoint, NodeInfo, ServicePort


def _usable(endpoints: Sequence[Endpoint]) -> Tuple[Endpoint, ...]:
    """Ready endpoints; when there are none, the serving-and-terminating ones (graceful shutdown)."""
    ready = tuple(e for e in endpoints if e.ready)
    if ready:
        return ready
    return tuple(e for e in endpoints if e.serving and e.terminating)


def cluster_endpoints(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints for traffic from inside the cluster (ClusterIP), honouring internalTrafficPolicy."""
    if svc.internal_traffic_policy == "Local":
        return local_endpoints(endpoints, node)
    return _usable(endpoints)


def external_endpoints(svc: ServicePort, endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    """Endpoints for external traffic (NodePort, external IP, LB IP), honouring externalTrafficPolicy."""
    if svc.external_traffic_policy == "Local":
        return local_endpoints(endpoints, node)
    return _usable(endpoints)


def local_endpoints(endpoints: Sequence[Endpoint], node: NodeInfo) -> Tuple[Endpoint, ...]:
    return _usable(tuple(e for e in endpoints if node.name and e.node_name == node.name))
