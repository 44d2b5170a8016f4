"""Post-sync steps: UDP conntrack staleness, health-check answers, node addresses (no kernel needed)."""

from __future__ import annotations

import ipaddress
import json
import socket
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any, List, Optional

from netproxy.conntrack import ConntrackCleaner, Stale, stale_udp
from netproxy.healthcheck import ServiceHealthServers
from netproxy.model import Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot
from netproxy.nodeaddr import local_addresses

IP = ipaddress.ip_address


def udp_service(name: str = "dns", node_port: int = 0, **kw: Any) -> ServicePort:
    return ServicePort(ServicePortName("kube-system", name, "dns"), "UDP", 53, 5353,
                       cluster_ips=(IP("10.96.0.53"),), node_port=node_port, **kw)


def ep(addr: str, port: int = 5353, **kw: Any) -> Endpoint:
    return Endpoint(IP(addr), port, **kw)


def snap(svc: ServicePort, *eps: Endpoint, node: Optional[NodeInfo] = None) -> Snapshot:
    return Snapshot.build([svc], {svc.name: eps}, node or NodeInfo())


def test_no_previous_snapshot_means_nothing_stale() -> None:
    assert not stale_udp(None, snap(udp_service(), ep("10.244.1.1")))


def test_removed_udp_endpoint_is_stale_for_the_service_addresses() -> None:
    svc = udp_service()
    stale = stale_udp(snap(svc, ep("10.244.1.1"), ep("10.244.1.2")), snap(svc, ep("10.244.1.1")))
    assert stale.gone_endpoints == frozenset({(("10.244.1.2", 5353), frozenset({("10.96.0.53", 53)}))})
    assert stale.revived == frozenset()


def test_not_ready_endpoint_counts_as_gone() -> None:
    svc = udp_service()
    stale = stale_udp(snap(svc, ep("10.244.1.1"), ep("10.244.1.2")),
                      snap(svc, ep("10.244.1.1"), ep("10.244.1.2", ready=False, serving=False)))
    assert {e for e, _ in stale.gone_endpoints} == {("10.244.1.2", 5353)}


def test_first_endpoint_revives_service_addresses_including_node_port() -> None:
    svc = udp_service(node_port=30053)
    stale = stale_udp(snap(svc), snap(svc, ep("10.244.1.1")))
    assert stale.revived == frozenset({("10.96.0.53", 53), ("*", 30053)})
    assert not stale.gone_endpoints


def test_tcp_services_are_ignored() -> None:
    tcp = ServicePort(ServicePortName("default", "web", ""), "TCP", 80, 8080, cluster_ips=(IP("10.96.0.10"),))
    assert not stale_udp(snap(tcp, ep("10.244.1.1", 8080)), snap(tcp))


class FakeConntrack:
    """Entries as pyroute2 reports them; records deletions."""

    def __init__(self, entries: List[Any]) -> None:
        self.entries = entries
        self.deleted: List[Any] = []

    def dump_entries(self) -> List[Any]:
        return list(self.entries)

    def entry(self, cmd: str, tuple_orig: Any) -> None:
        assert cmd == "del"
        self.deleted.append(tuple_orig)

    def close(self) -> None:
        pass


def flow(daddr: str, dport: int, reply_saddr: str, reply_sport: int, proto: int = socket.IPPROTO_UDP) -> Any:
    return SimpleNamespace(tuple_orig=SimpleNamespace(daddr=daddr, dport=dport, proto=proto),
                           tuple_reply=SimpleNamespace(saddr=reply_saddr, sport=reply_sport))


def test_cleaner_deletes_only_flows_dnated_to_gone_endpoints_of_netproxy_services() -> None:
    to_gone = flow("10.96.0.53", 53, "10.244.1.2", 5353)
    to_kept = flow("10.96.0.53", 53, "10.244.1.1", 5353)
    direct = flow("10.244.1.2", 5353, "10.244.1.2", 5353)  # straight to the pod, no service: not ours
    tcp = flow("10.96.0.53", 53, "10.244.1.2", 5353, proto=socket.IPPROTO_TCP)
    ct = FakeConntrack([to_gone, to_kept, direct, tcp])
    stale = Stale(frozenset({(("10.244.1.2", 5353), frozenset({("10.96.0.53", 53)}))}), frozenset())
    assert ConntrackCleaner(lambda family: ct).clean(stale, families=(socket.AF_INET,)) == 1
    assert ct.deleted == [to_gone.tuple_orig]


def test_cleaner_deletes_flows_to_a_revived_service_and_its_node_port() -> None:
    to_vip = flow("10.96.0.53", 53, "10.96.0.53", 53)
    to_nodeport = flow("192.0.2.1", 30053, "192.0.2.1", 30053)
    other = flow("10.96.9.9", 53, "10.96.9.9", 53)
    ct = FakeConntrack([to_vip, to_nodeport, other])
    stale = Stale(frozenset(), frozenset({("10.96.0.53", 53), ("*", 30053)}))
    ConntrackCleaner(lambda family: ct).clean(stale, families=(socket.AF_INET,))
    assert ct.deleted == [to_vip.tuple_orig, to_nodeport.tuple_orig]


def _get(port: int, path: str = "/") -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


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
        servers.update(snap(svc, ep("10.244.2.1", node_name="node-b"), node=node))
        code, body = _get(port)
        assert (code, body["localEndpoints"]) == (503, 0)
        servers.update(Snapshot())  # service gone: the port is closed
        try:
            _get(port)
            raise AssertionError("health check port still open after the service went away")
        except urllib.error.URLError:
            pass
    finally:
        servers.close()


def test_local_addresses_filters_by_cidr_and_family() -> None:
    def msg(addr: str) -> Any:
        return SimpleNamespace(get_attr=lambda name: addr if name == "IFA_ADDRESS" else None)

    dump = lambda: [msg("192.0.2.1"), msg("10.0.0.5"), msg("2001:db8::1"), msg("127.0.0.1")]  # noqa: E731
    got = local_addresses([ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("2001:db8::/64")], dump)
    assert got == (IP("192.0.2.1"), IP("2001:db8::1"))
