"""``netproxy status`` against a proxy's real /metrics and /healthz servers (in this process)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Tuple

import pytest
from prometheus_client import REGISTRY, generate_latest

from netproxy import cli, metrics
from netproxy.core.model import NodeInfo
from netproxy.observe.healthcheck import ProxyHealth


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        data = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args: object) -> None:
        pass


@pytest.fixture()
def proxy_endpoints() -> Iterator[Tuple[str, str, ProxyHealth]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    health = ProxyHealth(timeout=60)
    health.serve("127.0.0.1:0")
    assert health.server is not None
    try:
        yield f"127.0.0.1:{server.server_address[1]}", f"127.0.0.1:{health.server.server_address[1]}", health
    finally:
        for s in (server, health.server):
            s.shutdown()
            s.server_close()


def test_status_reads_a_running_proxy(proxy_endpoints: Tuple[str, str, ProxyHealth],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    metrics_at, healthz_at, health = proxy_endpoints
    metrics.BACKEND.labels("nftables", "netlink").set(1)
    metrics.SERVICES.set(7)
    metrics.LAST_SYNC.labels("IPv4").set_to_current_time()
    metrics.LAST_DURATION.set(0.25)
    health.synced()
    argv = ["status", "--metrics-address", metrics_at, "--healthz-address", healthz_at]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "backend:          nftables" in out and "writer:           netlink" in out
    assert "service ports:    7" in out and "last sync took:   0.250s" in out and "healthz:          ok (200)" in out
    assert cli.main([*argv, "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["backend"], doc["service_ports"], doc["health_code"]) == ("nftables", 7, 200)
    assert doc["health"]["nodeEligible"] is True
    health.sync_node(NodeInfo("n1", eligible=False))  # the node is being deleted: healthz 503
    assert cli.main(argv) == 1
    assert "failing (503), node being deleted" in capsys.readouterr().out


def test_status_without_a_running_proxy_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["status", "--metrics-address", f"127.0.0.1:{port}"]) == 1
    assert "no netproxy run answers" in capsys.readouterr().err
