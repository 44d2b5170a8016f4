"""``netproxy top`` without a kernel: the conntrack reader on dump replies built as the kernel writes
them (netproxy/node/ctflows.py), the aggregation (netproxy/observe/traffic.py), its text and JSON
(toptable.py), the live view's keys and screen (netproxy/cli/toptui.py) and the command's flags."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any, List, Optional, Sequence, Set, Tuple

import pytest
from rich.console import Console

from netproxy.cli import main
from netproxy.cli.args import build_parser
from netproxy.cli.toptui import View, screen
from netproxy.core.model import Endpoint, NodeInfo, Snapshot
from netproxy.node import ctflows, ctnetlink
from netproxy.observe import toptable, traffic
from netproxy_lab.manifests import service_port
from tests.unit.ctsocket import DumpSocket

IP = ipaddress.ip_address
TCP, UDP, SCTP = 6, 17, 132
V4, V6 = socket.AF_INET, socket.AF_INET6
SVC, SVC6 = "10.96.0.10", "fd00:10:96::10"
PODS = ("10.244.1.1", "10.244.1.2", "10.244.1.3")
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "cluster.yaml")


# ---- the reader ---------------------------------------------------------------------------------


def reply(family: int, proto: int, orig: Tuple[str, str, int, int], rep: Tuple[str, str, int, int], *,
          entry_id: int = 7, state: Optional[int] = None, counters: Optional[Tuple[int, int]] = None,
          zone_in_tuple: bool = False, id_first: bool = False, protoinfo_first: bool = False, swap: str = "",
          extra: bytes = b"") -> bytes:
    """A dump reply laid out as ctnetlink_fill_info writes it: tuples, status, counters (acct on),
    timeout, protoinfo, id, use, then ``extra`` attributes.  Laid out otherwise, as another kernel
    (or a bug) might: ``id_first``, the id before the timeout; ``protoinfo_first``, the protoinfo
    before it; ``swap`` ("orig" or "reply"), that tuple's addresses destination first."""
    a = ctnetlink._attr

    def tup(kind: int, t: Tuple[str, str, int, int]) -> bytes:
        if swap != ("orig" if kind == ctnetlink.CTA_TUPLE_ORIG else "reply"):
            return ctnetlink.tuple_attr(kind, family, proto, *t)
        src = ctnetlink._IP_SRC[family]
        ip = ctnetlink._nest(ctnetlink.CTA_TUPLE_IP, a(src + 1, socket.inet_pton(family, t[1])),
                             a(src, socket.inet_pton(family, t[0])))
        ports = ctnetlink.tuple_attr(kind, family, proto, *t)[8 + len(ip) - 4:]  # PROTO { ... } as usual
        return ctnetlink._nest(kind, ip, ports)

    o = tup(ctnetlink.CTA_TUPLE_ORIG, orig)
    if zone_in_tuple:
        o = a(ctnetlink.CTA_TUPLE_ORIG | ctnetlink.NLA_F_NESTED, o[4:] + a(3, struct.pack("!H", 1)))
    r = tup(ctnetlink.CTA_TUPLE_REPLY, rep)
    rest = a(ctnetlink.CTA_STATUS, struct.pack("!I", 0x188))
    if counters is not None:
        for kind in (ctflows.CTA_COUNTERS_ORIG, ctflows.CTA_COUNTERS_REPLY):
            rest += ctnetlink._nest(kind, a(1, struct.pack("!Q", counters[0])), a(2, struct.pack("!Q", counters[1])))
    ident = a(ctnetlink.CTA_ID, struct.pack("!I", entry_id))
    info = b""
    if state is not None:
        inner = 1 if proto == TCP else 3  # CTA_PROTOINFO_TCP / _SCTP
        info = ctnetlink._nest(ctflows.CTA_PROTOINFO, ctnetlink._nest(inner, a(1, bytes([state])), a(2, b"\7")))
    timeout = a(ctnetlink.CTA_TIMEOUT, struct.pack("!I", 30))
    rest += (ident if id_first else b"") + (info + timeout if protoinfo_first else timeout + info)
    rest += (b"" if id_first else ident) + a(11, struct.pack("!I", 1)) + extra
    return ctnetlink._message(ctnetlink.IPCTNL_MSG_CT_NEW, 2, family, o + r + rest, seq=1)


def count(messages: Sequence[bytes], accounting: bool = True, clients: bool = True) -> ctflows.Counted:
    sock = DumpSocket(messages, per_buffer=3)
    got = ctflows.count(ctnetlink.Ctnetlink(sock), accounting, clients)
    for ids in got[0].values():
        ids.sort()  # read by a plan or walked: an order of no meaning
    (request,) = sock.sent
    assert request[16] == socket.AF_UNSPEC and len(request) == 20  # one dump: every family, no filter
    return got


def walked(messages: Sequence[bytes], accounting: bool = True, clients: bool = True) -> ctflows.Counted:
    """The same messages read attribute by attribute, one at a time: what every plan must agree with
    (a group's ids in any order: sorted, as :func:`count` gives them here)."""
    out: ctflows.Counted = ({}, {}, {})
    for msg in messages:
        flow = ctflows._flow_slowly(msg, msg[16])
        if flow is not None:
            ctflows._add(out, flow, accounting, clients)
    for ids in out[0].values():
        ids.sort()
    return out


def k(address: str, port: int) -> bytes:
    return IP(address).packed + struct.pack("!H", port)


@pytest.mark.parametrize("family,client,svc,pod", [(V4, "10.244.9.9", SVC, PODS[0]),
                                                   (V6, "fd00:10:244:9::9", SVC6, "fd00:10:244:1::1")])
@pytest.mark.parametrize("zone_in_tuple", [False, True])
def test_the_reader_counts_service_endpoint_state_ids_counters_and_clients(family: int, client: str, svc: str,
                                                                          pod: str, zone_in_tuple: bool) -> None:
    c = IP(client).packed
    msgs = [reply(family, TCP, (client, svc, 40000 + i, 80), (pod, client, 8080, 40000 + i), entry_id=41 + i,
                  state=3 + i % 2, counters=(5 + i, 700), zone_in_tuple=zone_in_tuple) for i in range(4)]
    msgs += [reply(family, UDP, (client, svc, 40009, 53), (pod, client, 5353, 40009), entry_id=49),
             reply(family, SCTP, (client, svc, 40010, 9), (pod, client, 9999, 40010), entry_id=50, state=4)]
    # The same length as the TCP entries, the id elsewhere: the kept plan's headers differ, it is walked.
    msgs.append(reply(family, TCP, (client, svc, 40011, 80), (pod, client, 8080, 40011), entry_id=51, state=7,
                      counters=(1, 2), zone_in_tuple=zone_in_tuple, id_first=True))
    assert len(msgs[-1]) == len(msgs[0])
    web, dns, sctp = (TCP, k(svc, 80), k(pod, 8080)), (UDP, k(svc, 53), k(pod, 5353)), (SCTP, k(svc, 9), k(pod, 9999))
    groups = {web + (3,): [41, 43], web + (4,): [42, 44], dns + (0,): [49], sctp + (4,): [50], web + (7,): [51]}
    # Both directions' counters: 2 x (5 + i) packets and 2 x 700 bytes an entry.
    sums = {web + (3,): [10 + 14, 2800], web + (4,): [12 + 16, 2800], dns + (0,): [0, 0], sctp + (4,): [0, 0],
            web + (7,): [2, 4]}
    assert count(msgs) == (groups, sums, {web: {c: 5}, dns: {c: 1}, sctp: {c: 1}}) == walked(msgs)
    assert count(msgs, accounting=False, clients=False) == (groups, {}, {})  # the common case's own loop
    assert count(msgs, accounting=True, clients=False) == (groups, sums, {})


def test_the_reader_skips_entries_without_ports_and_reads_both_families_of_one_dump() -> None:
    icmp = ctnetlink._message(ctnetlink.IPCTNL_MSG_CT_NEW, 2, V4, ctnetlink._nest(
        ctnetlink.CTA_TUPLE_ORIG, ctnetlink._nest(ctnetlink.CTA_TUPLE_IP, ctnetlink._attr(1, IP("10.0.0.1").packed),
                                                  ctnetlink._attr(2, IP("10.0.0.2").packed)),
        ctnetlink._nest(ctnetlink.CTA_TUPLE_PROTO, ctnetlink._attr(1, b"\1"))), seq=1)
    msgs = [icmp, reply(V6, UDP, ("fd00::9", SVC6, 1, 53), ("fd00::1", "fd00::9", 53, 1), entry_id=3),
            reply(V4, UDP, ("10.0.0.9", SVC, 1, 53), (PODS[0], "10.0.0.9", 53, 1), entry_id=4)]
    assert count(msgs, False, False)[0] == {(UDP, k(SVC6, 53), k("fd00::1", 53), 0): [3],
                                            (UDP, k(SVC, 53), k(PODS[0], 53), 0): [4]}


def test_entries_of_one_length_in_two_families_or_protocols_each_keep_their_own_plan() -> None:
    """An IPv6 UDP entry can be as long as an IPv4 TCP one (both 240 bytes as Linux 6.18 writes them):
    the plans are per length and family; two protocols of one length and family part at the protocol."""
    labels = ctnetlink._attr(22, bytes(20))  # CTA_LABELS: what lengthens the IPv4 entries to the IPv6 ones here
    v4 = [reply(V4, TCP, ("10.0.0.9", SVC, 1000 + i, 80), (PODS[i % 3], "10.0.0.9", 8080, 1000 + i), entry_id=i,
                state=3, extra=labels) for i in range(6)]
    v6 = [reply(V6, UDP, ("fd00::9", SVC6, 2000 + i, 53), ("fd00::1", "fd00::9", 53, 2000 + i), entry_id=100 + i)
          for i in range(6)]
    assert {len(m) for m in v4} == {len(m) for m in v6}
    # TCP and SCTP, each with its state: one length; the plan of the first is not the second's.
    tcp = [reply(V4, TCP, ("10.0.0.8", SVC, 3000 + i, 80), (PODS[0], "10.0.0.8", 8080, 3000 + i), entry_id=200 + i,
                 state=3) for i in range(2)]
    sctp = [reply(V4, SCTP, ("10.0.0.8", SVC, 3000 + i, 9), (PODS[1], "10.0.0.8", 9999, 3000 + i), entry_id=300 + i,
                  state=4) for i in range(2)]
    assert len(tcp[0]) == len(sctp[0])
    mixed = [m for pair in zip(v4, v6) for m in pair] + [tcp[0], sctp[0], tcp[1], sctp[1]]
    for accounting, clients in ((False, False), (True, True)):
        got = count(mixed, accounting, clients)
        assert got == walked(mixed, accounting, clients)
        assert sum(len(ids) for ids in got[0].values()) == len(mixed)


@pytest.mark.parametrize("family", [V4, V6])
@pytest.mark.parametrize("usual,odd", [
    ({"proto": UDP}, {"proto": TCP}),  # TCP without a protoinfo: as long as UDP, the protocol differs
    ({"proto": UDP}, {"proto": UDP, "id_first": True}),
    ({"proto": TCP, "state": 3}, {"proto": TCP, "state": 4, "protoinfo_first": True}),
    ({"proto": UDP}, {"proto": UDP, "swap": "orig"}),
    ({"proto": UDP}, {"proto": UDP, "swap": "reply"}),
])
def test_an_entry_of_a_plans_length_laid_out_otherwise_is_walked_not_misread(family: int, usual: Any,
                                                                              odd: Any) -> None:
    """Each header a plan relies on is checked: an entry as long as the plan's, one thing elsewhere."""
    client, svc, pod = ("10.0.0.9", SVC, PODS[0]) if family == V4 else ("fd00::9", SVC6, "fd00::1")

    def entry(i: int, kw: Any) -> bytes:
        kw = dict(kw)
        return reply(family, kw.pop("proto"), (client, svc, 1000 + i, 53), (pod, client, 5353, 1000 + i),
                     entry_id=i, **kw)

    msgs = [entry(0, usual), entry(1, odd), entry(2, usual), entry(3, odd)]
    assert len({len(m) for m in msgs}) == 1
    got = count(msgs, False, False)
    assert got == walked(msgs, False, False)
    assert sorted(i for ids in got[0].values() for i in ids) == [0, 1, 2, 3]


def test_a_refused_dump_raises() -> None:
    err = struct.pack("=IHHII", 36, ctnetlink.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -1) + b"\0" * 16
    sock = DumpSocket([])
    sock.buffers = [err]
    with pytest.raises(ctnetlink.CtnetlinkError, match="EPERM"):
        ctflows.count(ctnetlink.Ctnetlink(sock))


def test_accounting_is_read_from_the_sysctl_and_never_written(tmp_path: Any) -> None:
    path = tmp_path / "acct"
    path.write_text("0\n")
    assert not ctflows.accounting(str(path))
    path.write_text("1\n")
    assert ctflows.accounting(str(path))
    assert not ctflows.accounting(str(tmp_path / "missing"))
    assert path.read_text() == "1\n"


# ---- the aggregation ----------------------------------------------------------------------------


def ep(addr: str, **kw: Any) -> Endpoint:
    return Endpoint(IP(addr), 8080, **kw)


NODE = NodeInfo(name="node-a", zone="z1")


def web(eps: Sequence[Endpoint], node: NodeInfo = NODE, **kw: Any) -> traffic.ServiceMap:
    svc = service_port(**kw)
    return traffic.from_snapshot(Snapshot.build([svc], {svc.name: tuple(eps)}, node=node))


def flow(i: int, pod: str, *, client: str = "10.0.0.1", state: int = 3, dst: str = SVC, port: int = 80,
         proto: int = TCP) -> traffic.Flow:
    return (proto, IP(client).packed, k(dst, port), k(pod, 8080), state, i, 2, 100)


def run(smap: traffic.ServiceMap, flows: List[traffic.Flow], previous: Optional[Set[int]] = None,
        interval: Optional[float] = None, **kw: Any) -> Tuple[traffic.Report, Set[int]]:
    return traffic.aggregate(flows, smap, previous, interval, **kw)


def test_counts_establishment_shares_and_the_equal_split() -> None:
    smap = web([ep(p) for p in PODS])
    flows = [flow(i, PODS[i % 3]) for i in range(60)] + [flow(100 + i, PODS[0], state=7) for i in range(30)]
    report, ids = run(smap, flows)
    assert report.entries == 90 and ids == {f[5] for f in flows}
    (port,) = report.ports
    assert (port.name, port.protocol, port.connections, port.established) == ("default/web:http", "TCP", 90, 60)
    first, second, third = port.endpoints
    assert (first.address, first.state, first.connections, first.established) == ("10.244.1.1:8080", "ready", 50, 20)
    assert second.connections == third.connections == 20
    assert first.share == pytest.approx(50 / 90) and first.expected == pytest.approx(1 / 3)
    assert port.imbalance == pytest.approx(50 / 90 - 1 / 3)
    assert first.new is None and first.rate is None and port.rate is None  # one refresh: no rate


def test_each_port_expects_the_split_of_its_own_front_ends_only() -> None:
    """Two services on the map: each port's expected shares come from its own front ends' flows (the
    fold asks a port's fronts only, not the whole map's)."""
    web_svc = service_port()
    api_svc = service_port("api", cluster_ip="10.96.0.20")
    smap = traffic.from_snapshot(Snapshot.build([web_svc, api_svc], {
        web_svc.name: tuple(ep(p) for p in PODS), api_svc.name: (ep("10.244.2.1"), ep("10.244.2.2"))}, node=NODE))
    flows = [flow(i, PODS[0]) for i in range(30)]
    flows += [flow(100 + i, "10.244.2.1" if i % 4 else "10.244.2.2", dst="10.96.0.20") for i in range(40)]
    report, _ = run(smap, flows)
    by_port = {p.name: {e.address: (e.connections, e.share, e.expected) for e in p.endpoints} for p in report.ports}
    assert by_port["default/web:http"] == {f"{p}:8080": (n, pytest.approx(n / 30), pytest.approx(1 / 3))
                                           for p, n in zip(PODS, (30, 0, 0))}
    assert by_port["default/api:http"] == {"10.244.2.1:8080": (30, pytest.approx(0.75), pytest.approx(0.5)),
                                           "10.244.2.2:8080": (10, pytest.approx(0.25), pytest.approx(0.5))}


def test_new_connections_are_ids_the_previous_refresh_did_not_have_and_rates_divide_by_the_interval() -> None:
    smap = web([ep(p) for p in PODS])
    old = [flow(i, PODS[i % 3]) for i in range(30)]
    _, ids = run(smap, old)
    report, _ = run(smap, old[10:] + [flow(1000 + i, PODS[0]) for i in range(8)], ids, interval=2.0)
    (port,) = report.ports
    assert [e.new for e in port.endpoints] == [8, 0, 0]
    assert port.endpoints[0].rate == pytest.approx(4.0) and port.rate == pytest.approx(4.0)


def test_udp_entries_are_established_by_being_there() -> None:
    smap = web([ep(PODS[0])], protocol="UDP", port=53)
    report, _ = run(smap, [flow(1, PODS[0], state=0, port=53, proto=UDP)])
    assert report.ports[0].established == 1


def test_a_terminating_endpoint_with_flows_is_draining_and_one_gone_from_the_state_is_gone() -> None:
    smap = web([ep(PODS[0]), ep(PODS[1], ready=False, serving=True, terminating=True),
                ep(PODS[2], ready=False, serving=True, terminating=True)])
    report, _ = run(smap, [flow(1, PODS[0]), flow(2, PODS[1]), flow(3, "10.244.7.7")])
    states = {e.address: (e.state, e.expected) for e in report.ports[0].endpoints}
    assert states == {"10.244.1.1:8080": ("ready", 1.0), "10.244.1.2:8080": ("draining", 0.0),
                      "10.244.1.3:8080": ("terminating", 0.0), "10.244.7.7:8080": ("gone", 0.0)}


def test_the_expected_share_follows_the_topology_subset_of_this_node() -> None:
    eps = [ep(PODS[0], zone="z1"), ep(PODS[1], zone="z1"), ep(PODS[2], zone="z2")]
    smap = web(eps, traffic_distribution="PreferClose")
    report, _ = run(smap, [flow(i, PODS[i % 2]) for i in range(10)])
    assert [round(e.expected, 3) for e in report.ports[0].endpoints] == [0.5, 0.5, 0.0]
    assert report.ports[0].imbalance == pytest.approx(0.0)


def test_node_port_flows_use_the_external_policy_and_weigh_the_expectation() -> None:
    eps = [ep(PODS[0], node_name="node-a"), ep(PODS[1], node_name="node-b")]
    smap = web(eps, node_port=30080, external_traffic_policy="Local")
    # 4 through the cluster IP (equal split), 4 to the NodePort on any node address (local endpoint only).
    flows = [flow(i, PODS[i % 2]) for i in range(4)] + [flow(10 + i, PODS[0], dst="192.0.2.1", port=30080)
                                                      for i in range(4)]
    report, _ = run(smap, flows)
    first, second = report.ports[0].endpoints
    assert (first.connections, second.connections) == (6, 2)
    assert (first.expected, second.expected) == (pytest.approx(0.75), pytest.approx(0.25))


def test_flows_that_are_no_service_are_skipped_and_undnated_ones_counted_apart() -> None:
    smap = web([ep(PODS[0])])
    undnated = (TCP, IP("10.0.0.1").packed, k(SVC, 80), k(SVC, 80), 2, 5, 0, 0)
    report, _ = run(smap, [flow(1, PODS[0], dst="10.96.9.9"), undnated])
    (port,) = report.ports
    assert report.entries == 2 and port.connections == 0 and port.unanswered == 1


def test_clients_are_counted_per_endpoint_most_first() -> None:
    smap = web([ep(PODS[0])])
    flows = [flow(i, PODS[0], client="10.0.0.1") for i in range(3)] + [flow(9, PODS[0], client="10.0.0.2")]
    report, _ = run(smap, flows, clients=1)
    assert report.ports[0].endpoints[0].clients == [("10.0.0.1", 3)]


def test_bytes_and_packets_only_with_accounting() -> None:
    smap = web([ep(PODS[0])])
    off, _ = run(smap, [flow(1, PODS[0])])
    on, _ = run(smap, [flow(1, PODS[0])], accounting=True)
    assert off.ports[0].endpoints[0].bytes is None
    assert (on.ports[0].endpoints[0].packets, on.ports[0].endpoints[0].bytes) == (2, 100)


def test_ipv6_flows_meet_ipv6_front_ends() -> None:
    svc = service_port(cluster_ips=(IP(SVC6),))
    smap = traffic.from_snapshot(Snapshot.build([svc], {svc.name: (Endpoint(IP("fd00::1"), 8080),)}))
    report, _ = run(smap, [(TCP, IP("fd00::9").packed, k(SVC6, 80), k("fd00::1", 8080), 3, 1, 0, 0)])
    assert report.ports[0].endpoints[0].address == "[fd00::1]:8080"
    assert report.ports[0].endpoints[0].connections == 1


def test_the_kernel_listing_names_the_ports_and_routed_endpoints() -> None:
    rows = [("default/web:http", "10.96.0.10:80/tcp", ("10.244.1.1:8080", "10.244.1.2:8080")),
            ("default/web:http", "*:30080/tcp", ("10.244.1.1:8080",)),
            ("default/web6:http", "[fd00::10]:80/tcp", ("[fd00::1]:8080",)),
            ("default/none:dns", "10.96.0.53:53/udp", ("reject",))]
    smap = traffic.from_programmed(rows)
    assert [(p.name, p.protocol) for p in smap.ports] == [("default/web:http", "TCP"), ("default/web6:http", "TCP"),
                                                          ("default/none:dns", "UDP")]
    flows = [flow(1, PODS[0]), flow(2, PODS[1]), flow(3, PODS[0], dst="192.0.2.1", port=30080), flow(4, PODS[2])]
    report, _ = run(smap, flows)
    got = {e.address: (e.state, e.connections, round(e.expected, 3)) for e in report.ports[0].endpoints}
    # 3 flows through the cluster IP (1.5 expected on each routed endpoint), 1 to the NodePort (pod 0 only).
    assert got == {"10.244.1.1:8080": ("routed", 2, 0.625), "10.244.1.2:8080": ("routed", 1, 0.375),
                   "10.244.1.3:8080": ("gone", 1, 0.0)}
    report, _ = run(smap, [(TCP, IP("fd00::9").packed, k("fd00::10", 80), k("fd00::1", 8080), 3, 1, 0, 0)])
    assert report.ports[0].endpoints[0].connections == 1


def test_ports_are_sorted_and_filtered() -> None:
    ports = [traffic.PortFigures("b/x:p", "TCP", 5, imbalance=0.1),
             traffic.PortFigures("a/y:p", "TCP", 1, imbalance=0.5),
             traffic.PortFigures("c/web:p", "UDP", 9, imbalance=0.0)]
    assert [p.name for p in traffic.arrange(ports)] == ["a/y:p", "b/x:p", "c/web:p"]
    assert [p.name for p in traffic.arrange(ports, "connections")] == ["c/web:p", "b/x:p", "a/y:p"]
    assert [p.name for p in traffic.arrange(ports, "imbalance")] == ["a/y:p", "b/x:p", "c/web:p"]
    assert [p.name for p in traffic.arrange(ports, "name", "WEB")] == ["c/web:p"]


# ---- the outputs --------------------------------------------------------------------------------


def _report(accounting: bool = False) -> traffic.Report:
    smap = web([ep(PODS[0]), ep(PODS[1], ready=False, serving=True, terminating=True), ep(PODS[2])])
    _, ids = run(smap, [flow(1, PODS[0])])
    report, _ = run(smap, [flow(1, PODS[0]), flow(2, PODS[1]), flow(3, PODS[0], client="10.0.0.2")], ids,
                    interval=1.0, accounting=accounting, clients=2)
    return report


def test_the_table_fits_80_columns_and_says_how_to_count_bytes() -> None:
    report = _report()
    text = toptable.table(report, report.ports)
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["SERVICE", "PORT", "/"]
    assert any(line.startswith("  10.244.1.2:8080") and "draining" in line for line in lines)
    assert any("client 10.0.0.2" in line for line in lines)
    assert "sysctl -w net.netfilter.nf_conntrack_acct=1" in text
    assert all(len(line) <= 79 for line in lines), text
    row = next(line for line in lines if line.startswith("  10.244.1.1:8080"))
    for title, figure in (("CONNS", "2"), ("NEW/S", "1.0"), ("SHARE", "66.7%"), ("EXPECT", "50.0%")):
        end = lines[1].index(title) + len(title)  # right-aligned under its title
        assert row[:end].endswith(" " + figure), (title, row)
    assert "nf_conntrack_acct" not in toptable.table(_report(True), report.ports)


def test_the_json_carries_every_figure() -> None:
    report = _report(True)
    doc = json.loads(toptable.as_json(report, report.ports))
    (port,) = doc["ports"]
    assert port["name"] == "default/web:http" and port["connections"] == 3 and port["new"] == 2
    assert [e["state"] for e in port["endpoints"]] == ["ready", "draining", "ready"]
    assert port["endpoints"][0]["bytes"] == 200 and "accounting_off" not in doc


def test_human_figures() -> None:
    assert [toptable.human(v) for v in (None, 12, 1234, 5_600_000)] == ["-", "12", "1.2K", "5.6M"]


# ---- the live view ------------------------------------------------------------------------------


def test_keys_sort_filter_and_quit() -> None:
    view = View()
    view.key("s")
    assert view.sort == "imbalance"
    view.key("s")
    assert view.sort == "name"
    view.key("c")
    assert view.sort == "connections"
    for ch in "/webx\x7f\r":
        view.key(ch)
    assert (view.text, view.typing, view.done) == ("web", False, False)
    view.key("q")  # typed into no filter now: quits
    assert view.done
    view = View()
    for ch in "/q":
        view.key(ch)
    assert not view.done and view.text == "q"  # while typing, q is a letter
    view.key("\x1b")
    assert view.text == "" and not view.typing


def test_the_screen_shows_the_rows_in_80_columns() -> None:
    console = Console(width=80, record=True, force_terminal=False, color_system=None)
    console.print(screen(_report(), View(sort="name"), 1.0))
    text = console.export_text()
    assert "default/web:http" in text and "draining" in text and "sort: name" in text
    assert all(len(line.rstrip()) <= 80 for line in text.splitlines())
    # The live view's rows are the --once table's rows, column for column.
    report = _report()
    table = toptable.table(report, report.ports).splitlines()[1:9]
    assert [line.rstrip() for line in text.splitlines()[2:10]] == table
    six = traffic.from_snapshot(Snapshot.build([service_port(cluster_ips=(IP(SVC6),))],
                                               {service_port().name: (Endpoint(IP("fd00::1"), 8080),)}))
    report6, _ = run(six, [(TCP, IP("fd00::9").packed, k(SVC6, 80), k("fd00::1", 8080), 3, 1, 0, 0)])
    console = Console(width=80, record=True, color_system=None)
    console.print(screen(report6, View(), 1.0))
    assert "[fd00::1]:8080" in console.export_text()  # not read as markup
    console = Console(width=80, record=True, color_system=None)
    console.print(screen(_report(), View(text="nothing"), 1.0))
    assert "matching the filter" in console.export_text()


# ---- the command --------------------------------------------------------------------------------


def test_the_flags_parse() -> None:
    args = build_parser().parse_args(["top", "--once", "-o", "json", "--service", "default/web", "--clients",
                                      "--interval", "500ms", "--sort", "imbalance"])
    assert (args.once, args.output, args.service, args.clients, args.interval, args.sort) == \
        (True, "json", "default/web", 5, 0.5, "imbalance")


@pytest.mark.parametrize("argv", [["top", "--service", "web"], ["top", "--interval", "0s"],
                                  ["top", "--sort", "bytes"]])
def test_bad_flags_exit_1(argv: List[str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 1


def test_the_live_view_without_a_terminal_exits_1(capsys: Any) -> None:
    assert main(["top", "--source", EXAMPLE]) == 1
    assert "needs a terminal" in capsys.readouterr().err


class FakeSampler:
    """The sampler without ctnetlink: refreshes of an empty table."""

    def __init__(self, smap: traffic.ServiceMap, clients: int = 0, always: Tuple[str, ...] = ()) -> None:
        self.smap, self.always = smap, always

    def refresh(self) -> traffic.Report:
        report, _ = traffic.aggregate([], self.smap, set(), 0.1, always=self.always)
        return report

    def close(self) -> None:
        pass


def test_exit_codes_follow_the_cli_contract(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    """0 shown; 1 an unreadable source or an unknown --service; 2 objects rejected (named), the rest shown."""
    from netproxy.cli import top as top_mod

    monkeypatch.setattr(top_mod, "Sampler", FakeSampler)
    once = ["top", "--once", "--interval", "100ms", "--backend", "nftables"]
    assert main([*once, "--source", str(tmp_path / "missing.yaml")]) == 1
    assert main([*once, "--source", EXAMPLE, "--service", "nowhere/none"]) == 1
    assert "no such service port" in capsys.readouterr().err
    assert main([*once, "--source", EXAMPLE, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ports"] == []
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(EXAMPLE).read_text() + "\n---\napiVersion: v1\nkind: Service\nmetadata: "
                   "{name: Bad_Name, namespace: default}\nspec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}\n")
    assert main([*once, "--source", str(bad), "--service", "default/web"]) == 2
    captured = capsys.readouterr()
    assert "rejected Service default/Bad_Name" in captured.err and "default/web" in captured.out
