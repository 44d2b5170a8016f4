"""Kubernetes manifests for the lab's tests: Services, their ports and EndpointSlices, as the dicts a
source file holds, and writing them where ``netproxy sync``/``run`` reads them."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Sequence

from netproxy.lab.topology import Pod

Manifest = Dict[str, Any]


def service(name: str, cluster_ip: str, ports: Sequence[Manifest], *, namespace: str = "default",
            **spec: Any) -> Manifest:
    """A v1 Service; ``ports`` are Kubernetes port dicts; ``spec`` adds fields (camelCase).

    ``load_balancer_ips=[...]`` becomes ``status.loadBalancer.ingress``.
    """
    lb_ips = spec.pop("load_balancer_ips", None)
    body: Manifest = {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "ports": list(ports)}
    body.update(spec)
    out: Manifest = {"apiVersion": "v1", "kind": "Service",
                     "metadata": {"name": name, "namespace": namespace}, "spec": body}
    if lb_ips:
        out["spec"].setdefault("type", "LoadBalancer")
        out["status"] = {"loadBalancer": {"ingress": [{"ip": ip} for ip in lb_ips]}}
    return out


def port(number: int, target: Any = 8080, *, name: str = "", protocol: str = "TCP") -> Manifest:
    out: Manifest = {"port": number, "targetPort": target, "protocol": protocol}
    if name:
        out["name"] = name
    return out


def endpoint_slice(service_name: str, pods: Sequence[Pod], ports: Sequence[Manifest], *,
                   namespace: str = "default", suffix: str = "a", ready: bool = True,
                   address_type: str = "IPv4") -> Manifest:
    """A discovery.k8s.io/v1 EndpointSlice for ``service_name`` with ``pods`` as endpoints.

    ``address_type="IPv6"`` lists the pods' IPv6 addresses (one slice per family, as Kubernetes does).
    """
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{service_name}-{suffix}", "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": address_type,
        "ports": list(ports),
        "endpoints": [{"addresses": [p.ip6 if address_type == "IPv6" else p.ip], "nodeName": p.node_name,
                       "conditions": {"ready": ready, "serving": ready, "terminating": False},
                       "targetRef": {"kind": "Pod", "name": p.name, "namespace": namespace}} for p in pods],
    }


def write_manifests(path: str, objects: Sequence[Manifest]) -> None:
    """Multi-document YAML (each document JSON, which YAML reads as is), replaced atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join("---\n" + json.dumps(o, indent=1) + "\n" for o in objects))
    os.replace(tmp, path)  # a watcher sees a whole file or the old one, never half of one
