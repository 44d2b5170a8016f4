"""The benchmark's clusters, as Kubernetes objects (the dicts `kubectl get -o json` would print).

Two variants, both deterministic (a seeded RNG) so that every backend sees the same cluster:

- ``uniform``: N services ``bench/svc-00000`` … each with one TCP port (80 → 8080) and one
  EndpointSlice of 10 ready endpoints — the workload of ``docs/performance.md``;
- ``mixed``: 1–50 endpoints per service, one service in five UDP, one in ten with ClientIP affinity,
  one in four a NodePort (a fifth of those externalTrafficPolicy: Local), one in twenty
  internalTrafficPolicy: Local; every other endpoint on another node.

Service ``i`` has ClusterIP ``10.96.0.0 + 1 + i`` (room for 65k services); endpoint ``j`` of service
``i`` is ``10.64.0.0 + 1 + 64 i + j`` (room for 64 endpoints each).  Names sort in index order, so the
*last* service is the one a linear dispatch list checks last.  ``pods`` replaces the last service's
endpoints with real pod addresses (the data-plane measure connects to it).
"""

from __future__ import annotations

import ipaddress
import json
import random
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

NAMESPACE = "bench"
SERVICE_NET = ipaddress.IPv4Address("10.96.0.0")
ENDPOINT_NET = ipaddress.IPv4Address("10.64.0.0")
EXTRA_NET = ipaddress.IPv4Address("10.97.0.0")  # services added during a run (latency, "one added")
REPLACED_NET = ipaddress.IPv4Address("10.100.0.0")  # endpoints moved during a run
PORT, TARGET_PORT = 80, 8080
VARIANTS = ("uniform", "mixed")
MAX_ENDPOINTS = 50

Obj = Dict[str, Any]
PodAddr = Tuple[str, int]  # (ip, port)


@dataclass(frozen=True)
class Shape:
    """What one service looks like: endpoint count, protocol, affinity."""

    endpoints: int
    protocol: str = "TCP"
    affinity: bool = False
    node_port: int = 0
    etp_local: bool = False
    itp_local: bool = False


NODE_PORT_MIN, NODE_PORT_MAX = 30000, 32767
LOCAL_NODE = "np-node"  # the --hostname-override the benchmark runs netproxy with (bench/worker.py)


def service_name(i: int) -> str:
    return f"svc-{i:05d}"


def cluster_ip(i: int) -> str:
    return str(SERVICE_NET + 1 + i)


def endpoint_ip(i: int, j: int) -> str:
    return str(ENDPOINT_NET + 1 + 64 * i + j)


def shapes(n: int, variant: str = "uniform", seed: int = 6) -> List[Shape]:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
    if variant == "uniform":
        return [Shape(10)] * n
    rng = random.Random(seed)
    out = []
    next_node_port = NODE_PORT_MIN
    for _ in range(n):
        count = rng.randint(1, MAX_ENDPOINTS)
        proto = "UDP" if rng.random() < 0.2 else "TCP"
        affinity = rng.random() < 0.1
        # The kube-proxy parity features in the mixed cluster: one service in four gets a NodePort (while the
        # range lasts), one NodePort service in five has externalTrafficPolicy: Local, one service
        # in twenty internalTrafficPolicy: Local.
        node_port = 0
        if rng.random() < 0.25 and next_node_port <= NODE_PORT_MAX:
            node_port, next_node_port = next_node_port, next_node_port + 1
        etp_local = bool(node_port) and rng.random() < 0.2
        out.append(Shape(count, proto, affinity, node_port, etp_local, rng.random() < 0.05))
    return out


def service(name: str, ip: str, shape: Shape, port: int = PORT, target_port: int = TARGET_PORT) -> Obj:
    spec: Obj = {
        "type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
        "ports": [{"name": "p", "protocol": shape.protocol, "port": port, "targetPort": target_port}],
    }
    if shape.node_port:
        spec["type"] = "NodePort"
        spec["ports"][0]["nodePort"] = shape.node_port
        if shape.etp_local:
            spec["externalTrafficPolicy"] = "Local"
    if shape.itp_local:
        spec["internalTrafficPolicy"] = "Local"
    if shape.affinity:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 600}}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": NAMESPACE, "name": name},
            "spec": spec}


def endpoint_slice(service_name_: str, addrs: Sequence[PodAddr], protocol: str = "TCP", suffix: str = "a") -> Obj:
    """One slice for ``service_name_``; every address must share one port (as a real slice does)."""
    ports = {p for _, p in addrs} or {TARGET_PORT}
    if len(ports) != 1:
        raise ValueError(f"{service_name_}: endpoints on different ports {sorted(ports)} need different slices")
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": NAMESPACE, "name": f"{service_name_}-{suffix}",
                     "labels": {"kubernetes.io/service-name": service_name_}},
        "addressType": "IPv4",
        "ports": [{"name": "p", "protocol": protocol, "port": ports.pop()}],
        # Every other endpoint on another node, so that the Local policies have something to filter.
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                       "nodeName": LOCAL_NODE if j % 2 == 0 else "np-other-node"} for j, (ip, _) in enumerate(addrs)],
    }


def cluster(n: int, variant: str = "uniform", pods: Optional[Sequence[PodAddr]] = None) -> List[Obj]:
    """Services and slices for ``n`` services (Service, slice, Service, slice …)."""
    out: List[Obj] = []
    for i, shape in enumerate(shapes(n, variant)):
        name = service_name(i)
        if pods and i == n - 1:
            shape = Shape(len(pods), "TCP", False)
            addrs: Sequence[PodAddr] = pods
            target = pods[0][1]
        else:
            addrs = [(endpoint_ip(i, j), TARGET_PORT) for j in range(shape.endpoints)]
            target = TARGET_PORT
        out.append(service(name, cluster_ip(i), shape, target_port=target))
        out.append(endpoint_slice(name, addrs, shape.protocol))
    return out


def replaced_endpoint(objects: Sequence[Obj], index: int, generation: int) -> Obj:
    """A copy of service ``index``'s slice with its first endpoint moved to a new address."""
    old = objects[2 * index + 1]
    new: Obj = json.loads(json.dumps(old))
    new["endpoints"][0]["addresses"] = [str(REPLACED_NET + 1 + 4096 * generation + index % 4096)]
    return new


def extra_service(k: int, addrs: Sequence[PodAddr], shape: Optional[Shape] = None) -> Tuple[Obj, Obj]:
    """Service ``bench/extra-<k>`` (ClusterIP 10.97.x.y) and its slice: the service a run adds."""
    name = f"extra-{k:05d}"
    ip = str(EXTRA_NET + 1 + k)
    shape = shape or Shape(len(addrs))
    return service(name, ip, shape, target_port=addrs[0][1]), endpoint_slice(name, addrs, shape.protocol)


def extra_ip(k: int) -> str:
    return str(EXTRA_NET + 1 + k)


def as_list(objects: Sequence[Obj]) -> Obj:
    """A ``kind: List`` document, as ``kubectl get svc,endpointslices -A -o json`` prints."""
    return {"apiVersion": "v1", "kind": "List", "items": list(objects)}


def write_json(path: str, objects: Sequence[Obj]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(as_list(objects), fh, separators=(",", ":"))


def endpoint_count(objects: Sequence[Obj]) -> int:
    return sum(len(o["endpoints"]) for o in objects if o["kind"] == "EndpointSlice")


def iter_objects(objects: Sequence[Obj]) -> Iterator[Obj]:
    return iter(objects)
