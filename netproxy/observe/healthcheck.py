"""HTTP health checks, as kube-proxy serves them.

- Per service with ``externalTrafficPolicy: Local`` and a ``healthCheckNodePort``: a server on that
  port answering 200 while the service has local endpoints *and* the proxy is healthy (no change
  waiting past the healthz timeout), 503 otherwise, with the local endpoint count in
  ``X-Load-Balancing-Endpoint-Weight`` and kube-proxy's JSON body — so that a load balancer only
  sends traffic to nodes that can serve it locally and whose rules are being kept up to date.
- ``/healthz`` and ``/livez`` for the proxy itself (``--healthz-bind-address``): 503 once a queued
  change has waited longer than the healthz timeout (and /healthz while the node is being deleted).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional, Tuple

from netproxy.core.endpoints import local_endpoints
from netproxy.core.model import Endpoint, NodeInfo, ServicePort, Snapshot
from netproxy.core.perport import Changed, PerPort

log = logging.getLogger(__name__)
Key = Tuple[str, str]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


Body = Callable[[str], Tuple[int, Dict[str, object], Dict[str, str]]]
"""Answers a GET of a path: (HTTP code, JSON payload, extra headers)."""


def _handler(body: Body) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            code, payload, headers = body(self.path)
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Content-Type-Options", "nosniff")
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug("health check: " + fmt, *args)

    return Handler


def _serve(host: str, port: int, body: Body) -> Optional[_Server]:
    try:
        server = _Server((host, port), _handler(body))
    except OSError as err:
        log.error("cannot listen on %s:%d for health checks: %s", host or "*", port, err)
        return None
    threading.Thread(target=server.serve_forever, name=f"health-{port}", daemon=True).start()
    return server


def _health_check(svc: ServicePort, endpoints: Tuple[Endpoint, ...], node: NodeInfo) -> Optional[Tuple[int, Key, int]]:
    if svc.external_traffic_policy != "Local" or not svc.health_check_node_port:
        return None
    return svc.health_check_node_port, svc.name.service, len(local_endpoints(endpoints, node))


class ServiceHealthServers:
    """One listener per health-check node port, updated from each synced snapshot."""

    def __init__(self, host: str = "", health: Optional[ProxyHealth] = None) -> None:
        self.host = host
        self.health = health
        """The proxy's own health (kube-proxy: ``healthzServer.IsHealthy()``, which leaves the node's
        deletion to /healthz): a stuck proxy must not keep attracting load-balanced traffic."""
        self._counts: Dict[Key, int] = {}
        self._servers: Dict[int, Tuple[Key, Optional[_Server]]] = {}
        self._lock = threading.Lock()
        self._ports: PerPort[Tuple[int, Key, int]] = PerPort(_health_check)
        """(health-check node port, service, local endpoints) of each Local port that has one, kept
        from the changed ports only (core/perport.py)."""

    def update(self, snap: Snapshot, changed: Changed = None) -> None:
        """Serve the snapshot's health-check node ports; ``changed``: only these ports changed
        since the last update (None: any may have)."""
        if not self._ports.update(snap, changed) and changed is not None:
            return  # no port with a health check changed: listeners and counts stay
        wanted: Dict[int, Key] = {}
        counts: Dict[Key, int] = {}
        for port, key, local in self._ports.values.values():
            wanted[port] = key
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

    def _answer(self, key: Key) -> Body:
        def body(path: str) -> Tuple[int, Dict[str, object], Dict[str, str]]:
            with self._lock:
                count = self._counts.get(key, 0)
            healthy = self.health is None or self.health.healthy()
            payload: Dict[str, object] = {"service": {"namespace": key[0], "name": key[1]},
                                          "localEndpoints": count, "serviceProxyHealthy": healthy}
            code = 200 if count > 0 and healthy else 503
            return code, payload, {"X-Load-Balancing-Endpoint-Weight": str(count)}
        return body

    def close(self) -> None:
        for _, server in self._servers.values():
            if server is not None:
                server.shutdown()
                server.server_close()
        self._servers.clear()


class ProxyHealth:
    """/healthz and /livez with kube-proxy's semantics (its ``proxierHealthServer``).

    Healthy (200) while no change is waiting, or the oldest waiting change was queued less than
    ``timeout`` ago (kube-proxy: 2 × ``--sync-period``); 503 once a change has waited longer.  A
    proxy with nothing to do stays healthy however long ago it last synced, and so does one still
    starting: the age of the last sync is not a fault, a change that does not get written is.
    /healthz is also 503 while this node is being deleted (``nodeEligible`` false) so that load
    balancers drain it; /livez ignores the node.  Each answer is counted per HTTP code in
    ``kubeproxy_proxy_healthz_total`` / ``kubeproxy_proxy_livez_total``.
    """

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self.clock = clock
        self.wall = wall
        self.last_ok: Optional[float] = None
        """Wall-clock time of the last successful sync."""
        self.oldest_queued: Optional[float] = None
        """When the oldest change not yet written was queued (monotonic)."""
        self.node_eligible = True
        """kube-proxy starts eligible and only a node event says otherwise."""
        self.server: Optional[_Server] = None
        self._lock = threading.Lock()

    def queued(self) -> None:
        with self._lock:
            if self.oldest_queued is None:
                self.oldest_queued = self.clock()

    def synced(self) -> None:
        with self._lock:
            self.last_ok = self.wall()
            self.oldest_queued = None

    def sync_node(self, node: NodeInfo) -> None:
        """This node's state from the source: not eligible while it is being deleted."""
        with self._lock:
            self.node_eligible = node.eligible

    def healthy(self) -> bool:
        """The proxier's own health, without the node (what /livez answers)."""
        with self._lock:
            queued = self.oldest_queued
        return queued is None or self.clock() - queued < self.timeout

    def status(self, path: str = "/healthz") -> Tuple[int, Dict[str, object]]:
        """(code, kube-proxy's JSON body) for /healthz or /livez."""
        livez = path.split("?")[0] == "/livez"
        with self._lock:
            last, eligible = self.last_ok, self.node_eligible
        now = self.wall()
        healthy = self.healthy() and (livez or eligible)
        if healthy:
            last = now  # as kube-proxy: a healthy answer says "recent", whatever the last sync's age
        payload: Dict[str, object] = {"lastUpdated": _iso(last), "currentTime": _iso(now)}
        if not livez:
            payload["nodeEligible"] = eligible
        return (200 if healthy else 503), payload

    def serve(self, address: str) -> None:
        if not address:
            return
        host, _, port = address.rpartition(":")
        self.server = _serve(host.strip("[]"), int(port), self._answer)

    def _answer(self, path: str) -> Tuple[int, Dict[str, object], Dict[str, str]]:
        """/livez and /healthz (any other path: /healthz, as kube-proxy's mux)."""
        from netproxy import metrics

        code, payload = self.status(path)
        (metrics.LIVEZ if path.split("?")[0] == "/livez" else metrics.HEALTHZ).labels(str(code)).inc()
        return code, payload, {}


def _iso(t: Optional[float]) -> str:
    if t is None:
        return ""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
