"""Kubernetes manifests for the tests: Services, their ports and EndpointSlices, as the dicts a source
file (or the API) holds, and writing them where ``netproxy sync``/``run`` reads them.

The one place the tests build these objects (unit, kernel, fault suite): a test names only what it
is about (a cluster IP, a protocol, an endpoint's readiness) and gets the rest as Kubernetes fills it in.
:func:`service_port` builds the same as the model holds it, for tests below the source.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any, Dict, Optional, Sequence, Union

from netproxy.core.model import ServicePort, ServicePortName
from netproxy_lab.topology import Pod

Manifest = Dict[str, Any]


def service(name: str, cluster_ip: str, ports: Optional[Sequence[Manifest]] = None, *, namespace: str = "default",
             **spec: Any) -> Manifest:
    """A v1 Service; ``ports`` are Kubernetes port dicts (default one: TCP 80 → 8080, unnamed);
    ``spec`` adds fields (camelCase).

    ``load_balancer_ips=[...]`` becomes ``status.loadBalancer.ingress``.
    """
    lb_ips = spec.pop("load_balancer_ips", None)
    body: Manifest = {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                      "ports": list(ports) if ports is not None else [port(80)]}
    body.update(spec)
    out: Manifest = {"apiVersion": "v1", "kind": "Service",
                     "metadata": {"name": name, "namespace": namespace}, "spec": body}
    if lb_ips:
        out["spec"].setdefault("type", "LoadBalancer")
        out["status"] = {"loadBalancer": {"ingress": [{"ip": ip} for ip in lb_ips]}}
    return out


def port(number: int, target: Any = 8080, *, name: str = "", protocol: str = "TCP", node_port: int = 0) -> Manifest:
    """A Service port (with ``nodePort`` when ``node_port`` is given)."""
    out: Manifest = {"port": number, "targetPort": target, "protocol": protocol}
    if name:
        out["name"] = name
    if node_port:
        out["nodePort"] = node_port
    return out


def slice_port(number: int = 8080, *, name: str = "", protocol: str = "TCP") -> Manifest:
    """An EndpointSlice port: no ``targetPort`` (a strict client refuses one)."""
    out: Manifest = {"port": number, "protocol": protocol}
    if name:
        out["name"] = name
    return out


def endpoint_slice(service_name: str, endpoints: Sequence[Union[Pod, str, Manifest]],
                   ports: Optional[Sequence[Manifest]] = None, *, namespace: str = "default", suffix: str = "a",
                   name: str = "", ready: bool = True, address_type: str = "IPv4") -> Manifest:
    """A discovery.k8s.io/v1 EndpointSlice for ``service_name`` (named ``<service>-<suffix>`` unless
    ``name``), with ``endpoints`` as its endpoints: sandbox pods (with their node and a targetRef),
    bare addresses, or endpoint dicts taken as they are.  ``ports`` default to one unnamed TCP 8080.

    ``address_type="IPv6"`` lists the pods' IPv6 addresses (one slice per family, as Kubernetes does).
    """
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name or f"{service_name}-{suffix}", "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": address_type,
        "ports": list(ports) if ports is not None else [slice_port()],
        "endpoints": [_endpoint(e, ready, address_type, namespace) for e in endpoints],
    }


def _endpoint(endpoint: Union[Pod, str, Manifest], ready: bool, address_type: str, namespace: str) -> Manifest:
    if isinstance(endpoint, dict):
        return endpoint
    conditions = {"ready": ready, "serving": ready, "terminating": False}
    if isinstance(endpoint, str):
        return {"addresses": [endpoint], "conditions": conditions}
    return {"addresses": [endpoint.ip6 if address_type == "IPv6" else endpoint.ip], "nodeName": endpoint.node_name,
            "conditions": conditions, "targetRef": {"kind": "Pod", "name": endpoint.name, "namespace": namespace}}


def api_object(manifest: Manifest) -> Manifest:
    """``manifest`` as the API server holds it in a typed list: without ``apiVersion`` and ``kind``."""
    return {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}


def write_manifests(path: str, objects: Sequence[Manifest]) -> None:
    """Multi-document YAML (each document JSON, which YAML reads as is), replaced atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join("---\n" + json.dumps(o, indent=1) + "\n" for o in objects))
    os.replace(tmp, path)  # a watcher sees a whole file or the old one, never half of one


def service_port(name: str = "web", namespace: str = "default", port_name: str = "http", *, protocol: str = "TCP",
                 port: int = 80, target_port: Union[int, str] = 8080, cluster_ip: str = "10.96.0.10",
                 **fields: Any) -> ServicePort:
    """A model :class:`~netproxy.core.model.ServicePort` (what conversion makes of one Service port):
    ``namespace/name:port_name``, ``protocol`` ``port`` → ``target_port`` on ``cluster_ip``;
    ``fields`` set any other field (``cluster_ips`` replaces ``cluster_ip``)."""
    fields.setdefault("cluster_ips", (ipaddress.ip_address(cluster_ip),))
    return ServicePort(ServicePortName(namespace, name, port_name), protocol, port, target_port, **fields)
