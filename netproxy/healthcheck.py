"""HTTP health checks, as kube-proxy serves them.

- Per service with ``externalTrafficPolicy: Local`` and a ``healthCheckNodePort``: a server on that
  port answering 200 with the number of local endpoints when there are some, 503 when not, so that
  a load balancer only sends traffic to nodes that can serve it locally.
- ``/healthz`` for the proxy itself (``--healthz-bind-address``): 200 once the rules were synced
  recently, 503 before the first sync or when syncs have stopped succeeding.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional, Tuple

from netproxy.endpoints import local_endpoints
from netproxy.model import Snapshot

log = logging.getLogger(__name__)
Key = Tuple[str, str]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _handler(body: Callable[[], Tuple[int, Dict[str, object]]]) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            code, payload = body()
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug("health check: " + fmt, *args)

    return Handler


def _serve(host: str, port: int, body: Callable[[], Tuple[int, Dict[str, object]]]) -> Optional[_Server]:
    try:
        server = _Server((host, port), _handler(body))
    except OSError as err:
        log.error("cannot listen on %s:%d for health checks: %s", host or "*", port, err)
        return None
    threading.Thread(target=server.serve_forever, name=f"health-{port}", daemon=True).start()
    return server


class ServiceHealthServers:
    """One listener per health-check node port, updated from each synced snapshot."""

    def __init__(self, host: str = "") -> None:
        self.host = host
        self._counts: Dict[Key, int] = {}
        self._servers: Dict[int, Tuple[Key, Optional[_Server]]] = {}
        self._lock = threading.Lock()

    def update(self, snap: Snapshot) -> None:
        wanted: Dict[int, Key] = {}
        counts: Dict[Key, int] = {}
        for name, svc in snap.services.items():
            if svc.external_traffic_policy != "Local" or not svc.health_check_node_port:
                continue
            key = svc.name.service
            wanted[svc.health_check_node_port] = key
            local = len(local_endpoints(snap.endpoints_of(name), snap.node))
            counts[key] = max(counts.get(key, 0), local)
        with self._lock:
            self._counts = counts
        for port in set(self._servers) - set(wanted):
            _, server = self._servers.pop(port)
            if server is not None:
                server.shutdown()
                server.server_close()
        for port, key in wanted.items():
            if port not in self._servers or self._servers[port][0] != key:
                old = self._servers.pop(port, None)
                if old is not None and old[1] is not None:
                    old[1].shutdown()
                    old[1].server_close()
                self._servers[port] = (key, _serve(self.host, port, self._answer(key)))

    def _answer(self, key: Key) -> Callable[[], Tuple[int, Dict[str, object]]]:
        def body() -> Tuple[int, Dict[str, object]]:
            with self._lock:
                count = self._counts.get(key, 0)
            payload: Dict[str, object] = {"service": {"namespace": key[0], "name": key[1]},
                                          "localEndpoints": count, "serviceProxyHealthy": True}
            return (200 if count > 0 else 503), payload
        return body

    def close(self) -> None:
        for _, server in self._servers.values():
            if server is not None:
                server.shutdown()
                server.server_close()
        self._servers.clear()


class ProxyHealth:
    """/healthz: healthy when the last successful sync is younger than ``2 × sync_period``."""

    def __init__(self, sync_period: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.sync_period = sync_period
        self.clock = clock
        self.last_ok: Optional[float] = None
        self.server: Optional[_Server] = None

    def synced(self) -> None:
        self.last_ok = self.clock()

    def status(self) -> Tuple[int, Dict[str, object]]:
        healthy = self.last_ok is not None and self.clock() - self.last_ok <= 2 * self.sync_period
        return (200 if healthy else 503), {"lastUpdated": self.last_ok, "healthy": healthy}

    def serve(self, address: str) -> None:
        if not address:
            return
        host, _, port = address.rpartition(":")
        self.server = _serve(host.strip("[]"), int(port), self.status)
