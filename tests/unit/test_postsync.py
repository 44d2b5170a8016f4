"""Post-sync steps: health-check answers, node addresses (no kernel needed)."""

from __future__ import annotations

import ipaddress
import json
import socket
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any, Optional

from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot
from netproxy.node.nodeaddr import local_addresses
from netproxy.observe.healthcheck import ProxyHealth, ServiceHealthServers
from netproxy_lab.manifests import service_port

IP = ipaddress.ip_address


def udp_service(name: str = "dns", node_port: int = 0, **kw: Any) -> ServicePort:
    return service_port(name, "kube-system", "dns", protocol="UDP", port=53, target_port=5353,
                        cluster_ip="10.96.0.53", node_port=node_port, **kw)


def ep(addr: str, port: int = 5353, **kw: Any) -> Endpoint:
    return Endpoint(IP(addr), port, **kw)


def snap(svc: ServicePort, *eps: Endpoint, node: Optional[NodeInfo] = None) -> Snapshot:
    return Snapshot.build([svc], {svc.name: eps}, node or NodeInfo())


def _get(port: int, path: str = "/") -> Any:
    return _get_with_headers(port, path)[:2]


def _get_with_headers(port: int, path: str = "/") -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_health_check_node_port_answers_local_endpoint_count() -> None:
    port = _free_port()
    svc = ServicePort(ServicePortName("shop", "lb", "http"), "TCP", 80, 8080, cluster_ips=(IP("10.96.0.9"),),
                      external_traffic_policy="Local", health_check_node_port=port, service_type="LoadBalancer")
    node = NodeInfo(name="node-a")
    servers = ServiceHealthServers(host="127.0.0.1")
    try:
        servers.update(snap(svc, ep("10.244.1.1", node_name="node-a"), ep("10.244.1.2", node_name="node-a"),
                            ep("10.244.2.1", node_name="node-b"), node=node))
        code, body = _get(port)
        assert code == 200
        assert body["localEndpoints"] == 2
        assert body["service"] == {"namespace": "shop", "name": "lb"}
        # As `netproxy run` calls it after a partial sync: told which ports changed.
        moved = snap(svc, ep("10.244.2.1", node_name="node-b"), node=node)
        servers.update(moved, frozenset({svc.name}))
        code, body = _get(port)
        assert (code, body["localEndpoints"]) == (503, 0)
        servers.update(moved, frozenset())  # another port changed: same answer, same listener
        assert _get(port)[0] == 503
        servers.update(Snapshot(), frozenset({svc.name}))  # service gone: the port is closed
        try:
            _get(port)
            raise AssertionError("health check port still open after the service went away")
        except urllib.error.URLError:
            pass
    finally:
        servers.close()


def test_health_check_node_port_tells_the_truth_about_a_stuck_proxy() -> None:
    """kube-proxy's service health server: 200 only with local endpoints *and* a healthy proxy (no
    change waiting past the healthz timeout); the count in X-Load-Balancing-Endpoint-Weight; the body
    says ``serviceProxyHealthy``."""
    port = _free_port()
    svc = ServicePort(ServicePortName("shop", "lb", "http"), "TCP", 80, 8080, cluster_ips=(IP("10.96.0.9"),),
                      external_traffic_policy="Local", health_check_node_port=port, service_type="LoadBalancer")
    now = [100.0]
    health = ProxyHealth(timeout=60.0, clock=lambda: now[0])
    servers = ServiceHealthServers(host="127.0.0.1", health=health)
    try:
        servers.update(snap(svc, ep("10.244.1.1", node_name="node-a"), ep("10.244.1.2", node_name="node-a"),
                            node=NodeInfo(name="node-a")))
        code, body, headers = _get_with_headers(port)
        assert (code, body["serviceProxyHealthy"], headers["X-Load-Balancing-Endpoint-Weight"]) == (200, True, "2")
        assert body == {"service": {"namespace": "shop", "name": "lb"}, "localEndpoints": 2,
                        "serviceProxyHealthy": True}
        health.queued()  # a change that cannot be written (the kernel refuses every write)...
        now[0] += 59.0
        assert _get(port)[0] == 200  # ...not yet past the timeout
        now[0] += 2.0
        code, body, headers = _get_with_headers(port)
        assert (code, body["localEndpoints"], body["serviceProxyHealthy"]) == (503, 2, False)
        assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"
        health.synced()  # written at last
        assert _get(port)[0] == 200
    finally:
        servers.close()


def test_local_addresses_filters_by_cidr_and_family() -> None:
    def msg(addr: str) -> Any:
        return SimpleNamespace(get_attr=lambda name: addr if name == "IFA_ADDRESS" else None)

    dump = lambda: [msg("192.0.2.1"), msg("10.0.0.5"), msg("2001:db8::1"), msg("127.0.0.1")]  # noqa: E731
    got = local_addresses([ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("2001:db8::/64")], dump)
    assert got == (IP("192.0.2.1"), IP("2001:db8::1"))
