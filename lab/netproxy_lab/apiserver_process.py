"""The API stand-in (:mod:`netproxy_lab.apiserver`) as a separate process (so that a measurement sees
only the client's work, and so that a kernel test or the bench can run it inside a network namespace),
and generated clusters to load into it."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from netproxy_lab.cleanup import stop_process

HERE = os.path.dirname(os.path.abspath(__file__))
POD_BASE = ipaddress.IPv4Address("172.16.0.0")
MANAGER = "endpointslice-controller.k8s.io"


def generated_cluster(services: int, endpoints_per_slice: int = 10) -> Dict[str, List[Dict[str, Any]]]:
    """``services`` one-port services, each with one EndpointSlice of ``endpoints_per_slice`` ready pods."""
    svcs, slices = [], []
    for i in range(services):
        ip = f"10.{96 + i // 65536}.{i // 256 % 256}.{i % 256}"
        name = f"svc-{i}"
        svcs.append({"metadata": {"name": name, "namespace": f"ns-{i % 50}", "labels": {"app": name}},
                     "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "selector": {"app": name},
                              "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
                              "sessionAffinity": "None", "ipFamilies": ["IPv4"]},
                     "status": {"loadBalancer": {}}})
        eps = [{"addresses": [str(POD_BASE + i * endpoints_per_slice + j)],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": f"node-{j % 20}", "zone": f"zone-{j % 3}",
                "targetRef": {"kind": "Pod", "name": f"{name}-pod-{j}", "namespace": f"ns-{i % 50}"}}
               for j in range(endpoints_per_slice)]
        slices.append({"metadata": {"name": f"{name}-abcde", "namespace": f"ns-{i % 50}",
                                    "labels": {"kubernetes.io/service-name": name,
                                               "endpointslice.kubernetes.io/managed-by": MANAGER}},
                       "addressType": "IPv4", "endpoints": eps,
                       "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
    return {"services": svcs, "endpointslices": slices}


class StandInProcess:
    """``with StandInProcess(objects) as url:`` — the stand-in in a child process, stopped on exit.

    ``prefix`` runs it under another command (e.g. ``["ip", "netns", "exec", "node"]``).
    """

    def __init__(self, objects: Optional[Dict[str, List[Dict[str, Any]]]] = None,
                 prefix: Sequence[str] = (), host: str = "127.0.0.1", extra: Sequence[str] = ()) -> None:
        self.objects = objects or {}
        self.prefix = list(prefix)
        self.extra = list(extra)
        """More arguments for apiserver.py (e.g. ``--storm``)."""
        self.host = host
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.tmp = tempfile.TemporaryDirectory(prefix="netproxy-apiserver-")
        self.url = ""

    def __enter__(self) -> str:
        load = os.path.join(self.tmp.name, "objects.json")
        port_file = os.path.join(self.tmp.name, "port")
        with open(load, "w") as f:
            json.dump(self.objects, f)
        self.proc = subprocess.Popen(self.prefix + [sys.executable, os.path.join(HERE, "apiserver.py"),
                                                    "--listen", f"{self.host}:0", "--port-file", port_file,
                                                    "--load", load, *self.extra])
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("the API stand-in did not start")
            time.sleep(0.02)
        with open(port_file) as f:
            self.url = f"http://{self.host}:{f.read().strip()}"
        return self.url

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
        self.tmp.cleanup()


def write_kubeconfig(path: str, url: str) -> str:
    """A kubeconfig at ``path`` for the stand-in at ``url`` (no credentials: it asks for none)."""
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "standin",
           "clusters": [{"name": "standin", "cluster": {"server": url}}],
           "users": [{"name": "proxy", "user": {}}],
           "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "proxy"}}]}
    with open(path, "w") as f:
        json.dump(doc, f)  # JSON is YAML: the client's loader reads it as is
    return path
