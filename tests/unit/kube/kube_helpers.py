"""Helpers for the Kubernetes source tests: a tracker that records what the source called (and still
does the real work), a real client pointed at the stand-in, object builders."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from kubernetes import client

from netproxy.core.model import EndpointSet, NodeInfo, ServicePort, ValidationError
from netproxy.core.tracker import ChangeTracker
from netproxy.source.kube_reflector import ReflectorSettings
from netproxy_lab import manifests
from netproxy_lab.manifests import api_object

# Short timeouts and backoff so that recovery paths run in well under a second.
FAST = ReflectorSettings(page_size=2, watch_timeout=30, read_slack=5, connect_timeout=2, list_timeout=10,
                         backoff_initial=0.05, backoff_cap=0.2, backoff_jitter=0.0)


class RecordingTracker(ChangeTracker):
    """The real tracker, plus a log of every call a source made, in order."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: List[Tuple[Any, ...]] = []
        self.errors: List[ValidationError] = []
        self._calls_lock = threading.Lock()

    def _rec(self, *call: Any) -> None:
        with self._calls_lock:
            self.calls.append(call)

    def update_service(self, namespace: str, name: str, ports: Optional[Tuple[ServicePort, ...]]) -> None:
        self._rec("update_service", namespace, name, ports)
        super().update_service(namespace, name, ports)

    def update_endpoints(self, namespace: str, slice_name: str, eps: Optional[EndpointSet]) -> None:
        self._rec("update_endpoints", namespace, slice_name, eps)
        super().update_endpoints(namespace, slice_name, eps)

    def replace_services(self, services: Mapping[Tuple[str, str], Tuple[ServicePort, ...]]) -> None:
        self._rec("replace_services", dict(services))
        super().replace_services(services)

    def replace_endpoints(self, sets: Mapping[Tuple[str, str], EndpointSet]) -> None:
        self._rec("replace_endpoints", dict(sets))
        super().replace_endpoints(sets)

    def set_node(self, node: NodeInfo) -> None:
        self._rec("set_node", node)
        super().set_node(node)

    def services_synced(self) -> None:
        self._rec("services_synced")
        super().services_synced()

    def endpoints_synced(self) -> None:
        self._rec("endpoints_synced")
        super().endpoints_synced()

    def reject(self, error: ValidationError) -> None:
        self._rec("reject", str(error))
        self.errors.append(error)
        super().reject(error)

    def named(self, *names: str) -> List[Tuple[Any, ...]]:
        with self._calls_lock:
            return [c for c in self.calls if c[0] in names]


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def make_client(url: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = url
    return client.ApiClient(cfg)


# -- object builders (what the API server would hold) ------------------------------------------

def service(name: str, ip: str, port: int = 80, ns: str = "default", **spec: Any) -> Dict[str, Any]:
    return api_object(manifests.service(name, ip, [manifests.port(port, name="http")], namespace=ns,
                                        type="ClusterIP", **spec))


def endpoint_slice(name: str, svc: str, ips: List[str], ns: str = "default", port: int = 8080,
                   address_type: str = "IPv4", **conds: Any) -> Dict[str, Any]:
    out = api_object(manifests.endpoint_slice(svc, ips, [manifests.slice_port(port, name="http")], namespace=ns,
                                              name=name, address_type=address_type))
    for ep in out["endpoints"]:
        ep["conditions"].update(conds)
    return out


def node(name: str, zone: Optional[str] = None, **labels: str) -> Dict[str, Any]:
    all_labels = dict(labels)
    if zone is not None:
        all_labels["topology.kubernetes.io/zone"] = zone
    return {"metadata": {"name": name, "labels": all_labels}, "spec": {}}
