"""The conntrack reconciler's comparison (netproxy/node/conntrack.py) and the ctnetlink codec it reads
with (netproxy/node/ctnetlink.py), without a kernel: dump replies are built as the kernel writes them."""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
from prometheus_client import REGISTRY

from netproxy.core.model import Endpoint, ServicePort, Snapshot
from netproxy.node import ctnetlink
from netproxy.node.conntrack import Desired, Reconciler, desired_state, key, port_key
from netproxy_lab.manifests import service_port
from tests.unit.ctsocket import DumpSocket

IP = ipaddress.ip_address
UDP, TCP, SCTP = socket.IPPROTO_UDP, socket.IPPROTO_TCP, 132
V4, V6 = socket.AF_INET, socket.AF_INET6
DNS_IP, DNS_IP6, LB_IP = "10.96.0.53", "fd00:10:96::53", "198.51.100.53"


def service(name: str = "dns", protocol: str = "UDP", node_port: int = 0, **kw: Any) -> ServicePort:
    return service_port(name, "kube-system", "dns", protocol=protocol, port=53, target_port=5353,
                        cluster_ip=DNS_IP, node_port=node_port, **kw)


def ep(addr: str, port: int = 5353, **kw: Any) -> Endpoint:
    return Endpoint(IP(addr), port, **kw)


def snap(*pairs: Tuple[ServicePort, Sequence[Endpoint]]) -> Snapshot:
    return Snapshot.build([s for s, _ in pairs], {s.name: e for s, e in pairs})


def k(address: str, port: int) -> bytes:
    return key(IP(address), port)


def stale(desired: Desired, dst: str, dport: int, reply_src: str, reply_sport: int) -> bool:
    return desired.stale(k(dst, dport), port_key(dport), k(reply_src, reply_sport))


# ---- the comparison (kube-proxy's CleanStaleEntries) --------------------------------------------


def test_a_flow_to_a_removed_endpoint_is_stale_and_one_to_a_serving_endpoint_is_not() -> None:
    d = desired_state(snap((service(), [ep("10.244.1.1")])))[(V4, UDP)]
    assert stale(d, DNS_IP, 53, "10.244.1.2", 5353)
    assert not stale(d, DNS_IP, 53, "10.244.1.1", 5353)


def test_the_endpoint_port_counts_not_only_its_address() -> None:
    d = desired_state(snap((service(), [ep("10.244.1.1", 5353)])))[(V4, UDP)]
    assert stale(d, DNS_IP, 53, "10.244.1.1", 9999)  # same pod, a port the service no longer targets


def test_flows_to_addresses_and_ports_that_are_no_service_are_left_alone() -> None:
    d = desired_state(snap((service(), [ep("10.244.1.1")])))[(V4, UDP)]
    assert not stale(d, "10.96.0.99", 53, "10.244.1.2", 5353)  # another address
    assert not stale(d, DNS_IP, 54, "10.244.1.2", 5353)  # the service address, another port
    assert not stale(d, "10.244.1.2", 5353, "10.244.1.2", 5353)  # straight to a pod


def test_a_flow_to_an_unowned_address_of_the_service_cidrs_is_stale_even_in_a_new_process() -> None:
    """kube-proxy 1.38 clears the UDP flows of a deleted service; a one-shot sync that follows the
    deletion has no earlier state, but the flow itself says its service address, and an address of
    the service CIDRs that no service owns is a deleted service's. Outside the CIDRs: left alone."""
    cidrs = (ipaddress.ip_network("10.96.0.0/16"),)
    current = Snapshot.build([service()], {service().name: (ep("10.244.1.1"),)}, service_cidrs=cidrs)
    d = desired_state(current)[(V4, UDP)]
    assert stale(d, "10.96.7.7", 53, "10.244.1.9", 5353)  # a deleted service's flow
    assert not stale(d, DNS_IP, 53, "10.244.1.1", 5353)  # an owned address: its own rule
    assert not stale(d, "192.0.2.7", 53, "10.244.1.9", 5353)  # outside the service CIDRs
    # The last UDP service deleted: the table is still reconciled.
    empty = desired_state(Snapshot.build([], {}, service_cidrs=cidrs))
    assert stale(empty[(V4, UDP)], DNS_IP, 53, "10.244.1.1", 5353)


def test_a_flow_recorded_without_dnat_is_stale_once_the_service_has_an_endpoint() -> None:
    # While the service had no endpoint its flows were rejected or went nowhere: the entry's reply
    # source is the service address itself, and would keep the flow from ever reaching the endpoint.
    d = desired_state(snap((service(node_port=30053), [ep("10.244.1.1")])))[(V4, UDP)]
    assert stale(d, DNS_IP, 53, DNS_IP, 53)
    assert stale(d, "192.0.2.1", 30053, "192.0.2.1", 30053)


def test_scale_to_zero_makes_every_flow_to_the_service_stale() -> None:
    """kubernetes #139628: skipping services without endpoints left flows DNAT-ed to the endpoint
    that went away for as long as the client kept sending."""
    d = desired_state(snap((service(node_port=30053), [])))[(V4, UDP)]
    assert stale(d, DNS_IP, 53, "10.244.1.1", 5353)
    assert stale(d, "192.0.2.1", 30053, "10.244.1.1", 5353)


def test_node_port_flows_match_on_the_port_alone_at_any_address() -> None:
    d = desired_state(snap((service(node_port=30053), [ep("10.244.1.1")])))[(V4, UDP)]
    for node_address in ("192.0.2.1", "10.244.1.1", "203.0.113.7"):
        assert stale(d, node_address, 30053, "10.244.1.2", 5353)
        assert not stale(d, node_address, 30053, "10.244.1.1", 5353)


def test_external_and_load_balancer_addresses_are_front_ends_too() -> None:
    svc = service(external_ips=(IP("203.0.113.53"),), load_balancer_ips=(IP(LB_IP),))
    d = desired_state(snap((svc, [ep("10.244.1.1")])))[(V4, UDP)]
    for front in (DNS_IP, "203.0.113.53", LB_IP):
        assert stale(d, front, 53, "10.244.1.2", 5353)
        assert not stale(d, front, 53, "10.244.1.1", 5353)


def test_serving_terminating_endpoints_keep_their_flows_and_unserving_ones_lose_them() -> None:
    d = desired_state(snap((service(), [ep("10.244.1.1", ready=False, serving=True, terminating=True),
                                        ep("10.244.1.2", ready=False, serving=False)])))[(V4, UDP)]
    assert not stale(d, DNS_IP, 53, "10.244.1.1", 5353)
    assert stale(d, DNS_IP, 53, "10.244.1.2", 5353)


def test_traffic_policy_and_topology_do_not_cut_flows() -> None:
    # kube-proxy: "changes to the service should not affect existing flows": a remote endpoint
    # that Local policy no longer routes to keeps the flows it already has.
    svc = service(internal_traffic_policy="Local", external_traffic_policy="Local")
    d = desired_state(snap((svc, [ep("10.244.1.1", node_name="elsewhere", zone_hints=("z9",))])))[(V4, UDP)]
    assert not stale(d, DNS_IP, 53, "10.244.1.1", 5353)


def test_udp_and_sctp_are_reconciled_tcp_is_not() -> None:
    state = desired_state(snap((service("dns"), [ep("10.244.1.1")]),
                               (service("sig", "SCTP"), [ep("10.244.1.2")]),
                               (service("web", "TCP"), [ep("10.244.1.3")])))
    assert set(state) == {(V4, UDP), (V4, SCTP)}


def test_each_family_gets_its_own_front_ends_and_endpoints() -> None:
    svc = service(cluster_ips=(IP(DNS_IP), IP(DNS_IP6)), node_port=30053)
    state = desired_state(snap((svc, [ep("10.244.1.1"), ep("fd00:10:244:1::1")])))
    v4, v6 = state[(V4, UDP)], state[(V6, UDP)]
    assert not stale(v4, DNS_IP, 53, "10.244.1.1", 5353)
    assert not stale(v6, DNS_IP6, 53, "fd00:10:244:1::1", 5353)
    assert stale(v6, "fd00::1", 30053, "fd00:10:244:1::2", 5353)
    assert k(DNS_IP6, 53) not in v4.by_address


def test_a_single_stack_service_leaves_the_other_family_alone() -> None:
    state = desired_state(snap((service(node_port=30053), [ep("10.244.1.1")])))
    assert (V6, UDP) not in state


def test_a_deleted_port_is_reconciled_with_no_endpoint() -> None:
    """kubernetes #141371: a deleted UDP service's flows would otherwise live on."""
    old = snap((service(), [ep("10.244.1.1")]))
    state = desired_state(Snapshot.build([]), [service().name], old)
    assert stale(state[(V4, UDP)], DNS_IP, 53, "10.244.1.1", 5353)


# ---- the codec ----------------------------------------------------------------------------------


def reply(family: int, proto: int, orig: Tuple[str, str, int, int], rep: Tuple[str, str, int, int],
          *, entry_id: int = 7, zone_in_tuple: bool = False) -> bytes:
    """A dump reply as ctnetlink_fill_info writes it (tuples, status, timeout, id, use)."""
    o = ctnetlink.tuple_attr(ctnetlink.CTA_TUPLE_ORIG, family, proto, *orig)
    if zone_in_tuple:  # a per-direction zone: the tuple grows by CTA_TUPLE_ZONE, the layout shifts
        inner = o[4:] + ctnetlink._attr(3, struct.pack("!H", 1))
        o = ctnetlink._attr(ctnetlink.CTA_TUPLE_ORIG | ctnetlink.NLA_F_NESTED, inner)
    r = ctnetlink.tuple_attr(ctnetlink.CTA_TUPLE_REPLY, family, proto, *rep)
    rest = (ctnetlink._attr(ctnetlink.CTA_STATUS, struct.pack("!I", 0x188))
            + ctnetlink._attr(ctnetlink.CTA_TIMEOUT, struct.pack("!I", 30))
            + ctnetlink._attr(ctnetlink.CTA_ID, struct.pack("!I", entry_id))
            + ctnetlink._attr(11, struct.pack("!I", 1)))
    return ctnetlink._message(ctnetlink.IPCTNL_MSG_CT_NEW, 2, family, o + r + rest)


@pytest.mark.parametrize("family,client,svc,pod", [
    (V4, "10.244.1.2", DNS_IP, "10.244.1.1"),
    (V6, "fd00:10:244:1::2", DNS_IP6, "fd00:10:244:1::1"),
])
@pytest.mark.parametrize("zone_in_tuple", [False, True])
def test_layout_reads_the_compared_fields(family: int, client: str, svc: str, pod: str, zone_in_tuple: bool) -> None:
    msg = b"\0" * 8 + reply(family, UDP, (client, svc, 40053, 53), (pod, client, 5353, 40053),
                             zone_in_tuple=zone_in_tuple)
    keys = ctnetlink.Layout.of(family).keys(msg, 8)
    assert keys == (k(svc, 53), port_key(53), k(pod, 5353))


def test_delete_request_carries_the_original_tuple_and_id_only() -> None:
    msg = reply(V4, UDP, ("10.244.1.2", DNS_IP, 40053, 53), ("10.244.1.1", "10.244.1.2", 5353, 40053), entry_id=99)
    req = ctnetlink.delete_request(msg, V4)
    length, kind, flags, _, _ = ctnetlink._HDR.unpack_from(req)
    assert length == len(req) and kind == (1 << 8) | ctnetlink.IPCTNL_MSG_CT_DELETE
    assert flags == ctnetlink.NLM_F_REQUEST | ctnetlink.NLM_F_ACK
    attrs = [(t, req[a:b]) for t, a, b in ctnetlink._walk(req, 20, len(req))]
    assert [t for t, _ in attrs] == [ctnetlink.CTA_TUPLE_ORIG, ctnetlink.CTA_ID]
    assert attrs[0][1] == ctnetlink.tuple_attr(ctnetlink.CTA_TUPLE_ORIG, V4, UDP, "10.244.1.2", DNS_IP, 40053, 53)[4:]
    assert attrs[1][1] == struct.pack("!I", 99)


@pytest.mark.parametrize("family,client,svc,pod", [
    (V4, "10.244.1.2", DNS_IP, "10.244.1.1"),
    (V6, "fd00:10:244:1::2", DNS_IP6, "fd00:10:244:1::1"),
])
def test_select_reads_one_filtered_dump_through_the_one_receive_loop(family: int, client: str, svc: str,
                                                                      pod: str) -> None:
    """Ctnetlink.select over Ctnetlink.dump (the loop netproxy top's reader uses too): every reply of
    its own request read, the usual layout and one with a zone in its tuple, the others skipped."""
    msgs = [reply(family, UDP, (client, svc, 40000 + i, 53), (pod, client, 5353, 40000 + i), entry_id=i,
                  zone_in_tuple=i % 2 == 1) for i in range(5)]
    sock = DumpSocket(msgs)
    picked: List[Tuple[bytes, bytes, bytes]] = []

    def pick(dst: bytes, dport: bytes, src: bytes) -> bool:
        picked.append((dst, dport, src))
        return len(picked) in (2, 3)

    seen, chosen = ctnetlink.Ctnetlink(sock).select(family, UDP, pick)
    assert seen == 5 and picked == [(k(svc, 53), port_key(53), k(pod, 5353))] * 5
    assert [ctnetlink._HDR.unpack_from(m)[3] for m in chosen] == [1, 1]
    assert [m[:8] + m[12:] for m in chosen] == [m[:8] + m[12:] for m in msgs[1:3]]
    (request,) = sock.sent
    assert request[16] == family and ctnetlink._HDR.unpack_from(request)[3] == 1  # filtered by protocol:
    assert ctnetlink._attr(ctnetlink.CTA_PROTO_NUM, bytes([UDP])) in request


def test_a_dump_the_kernel_refuses_raises_with_its_error() -> None:
    refused = struct.pack("=IHHII", 36, ctnetlink.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -1) + b"\0" * 16
    with pytest.raises(ctnetlink.CtnetlinkError, match="EPERM"):
        ctnetlink.Ctnetlink(DumpSocket([], end=refused)).select(V4, UDP, lambda *_: True)


# ---- passes -------------------------------------------------------------------------------------


class FakeTable:
    """Dump replies per (family, protocol); records what was deleted."""

    def __init__(self, entries: Dict[Tuple[int, int], List[bytes]]) -> None:
        self.entries = entries
        self.dumps: List[Tuple[int, int]] = []
        self.deleted: List[bytes] = []
        self.closed = False

    def select(self, family: int, proto: int, pick: Callable[[bytes, bytes, bytes], bool]) -> Tuple[int, List[bytes]]:
        self.dumps.append((family, proto))
        entries = self.entries.get((family, proto), [])
        layout = ctnetlink.Layout.of(family)
        return len(entries), [m for m in entries if pick(*(layout.keys(m) or (b"", b"", b"")))]

    def delete(self, messages: Sequence[bytes], family: int) -> Tuple[int, int]:
        self.deleted.extend(messages)
        return len(messages), 0

    def close(self) -> None:
        self.closed = True


def flow(client_port: int, to: str, dport: int, answered_by: str, sport: int = 5353, proto: int = UDP) -> bytes:
    return reply(V4, proto, ("10.244.1.9", to, client_port, dport), (answered_by, "10.244.1.9", sport, client_port))


def metric(name: str, family: str = "IPv4") -> float:
    return REGISTRY.get_sample_value(name, {"ip_family": family}) or 0.0


def test_a_pass_dumps_once_per_table_and_deletes_only_stale_flows() -> None:
    gone, kept = flow(1, DNS_IP, 53, "10.244.1.2"), flow(2, DNS_IP, 53, "10.244.1.1")
    revived = flow(3, DNS_IP, 53, DNS_IP, 53)
    unrelated = flow(4, "10.96.7.7", 53, "10.244.1.2")
    table = FakeTable({(V4, UDP): [gone, kept, revived, unrelated]})
    before = metric("kubeproxy_conntrack_reconciler_deleted_entries_total")
    count = metric("kubeproxy_conntrack_reconciler_sync_duration_seconds_count")
    done = Reconciler(opener=lambda: table).reconcile(desired_state(snap((service(), [ep("10.244.1.1")]))))
    assert table.dumps == [(V4, UDP)]
    assert table.deleted == [gone, revived]
    assert table.closed
    assert done.seen == {"IPv4": 4} and done.deleted == {"IPv4": 2}
    assert metric("kubeproxy_conntrack_reconciler_deleted_entries_total") == before + 2
    assert metric("kubeproxy_conntrack_reconciler_sync_duration_seconds_count") == count + 1


def test_a_one_shot_pass_deletes_the_same_and_records_no_metric() -> None:
    """``netproxy sync`` serves no metrics: its reconciler (metrics=False) deletes what run's would
    and leaves the metrics, and the module that holds them, alone."""
    gone, kept = flow(1, DNS_IP, 53, "10.244.1.2"), flow(2, DNS_IP, 53, "10.244.1.1")
    table = FakeTable({(V4, UDP): [gone, kept]})
    before = metric("kubeproxy_conntrack_reconciler_deleted_entries_total")
    count = metric("kubeproxy_conntrack_reconciler_sync_duration_seconds_count")
    done = Reconciler(opener=lambda: table, metrics=False).reconcile(
        desired_state(snap((service(), [ep("10.244.1.1")]))))
    assert table.deleted == [gone] and done.deleted == {"IPv4": 1}
    assert metric("kubeproxy_conntrack_reconciler_deleted_entries_total") == before
    assert metric("kubeproxy_conntrack_reconciler_sync_duration_seconds_count") == count


def test_no_udp_or_sctp_service_means_no_dump() -> None:
    table = FakeTable({})
    Reconciler(opener=lambda: table).reconcile(desired_state(snap((service("web", "TCP"), [ep("10.244.1.1")]))))
    assert table.dumps == []


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _counting() -> Tuple[List[FakeTable], Clock, Reconciler]:
    """A reconciler whose every pass opens a new (empty) fake table: the list counts the passes."""
    tables: List[FakeTable] = []

    def opener() -> FakeTable:
        tables.append(FakeTable({}))
        return tables[-1]

    clock = Clock()
    return tables, clock, Reconciler(period=30.0, clock=clock, opener=opener)


def test_after_sync_runs_on_a_change_and_every_period_not_on_every_sync() -> None:
    tables, clock, rec = _counting()
    one = snap((service(), [ep("10.244.1.1")]))
    rec.after_sync(None, one)  # the first sync, e.g. after a restart: always a pass
    assert len(tables) == 1
    clock.now += 5
    rec.after_sync(one, snap((service(), [ep("10.244.1.1")])))  # nothing of ours changed
    assert len(tables) == 1
    two = snap((service(), [ep("10.244.1.2")]))
    rec.after_sync(one, two)  # endpoint replaced
    assert len(tables) == 2
    clock.now += 31
    rec.after_sync(two, two)  # a period later: a pass even without a change
    assert len(tables) == 3


def test_after_sync_told_what_changed_looks_only_at_those_ports() -> None:
    """A partial sync names the ports it changed: a TCP port's change needs no pass and no walk of
    every port; a UDP port's change (or a deleted UDP port) still does."""
    tables, clock, rec = _counting()
    web = service_port("web", "default", "http", protocol="TCP", port=80, target_port=8080, cluster_ip="10.96.0.80")
    one = snap((service(), [ep("10.244.1.1")]), (web, [ep("10.244.2.1", 8080)]))
    rec.after_sync(None, one, None)
    assert len(tables) == 1
    clock.now += 5
    tcp_moved = snap((service(), [ep("10.244.1.1")]), (web, [ep("10.244.2.2", 8080)]))
    rec.after_sync(one, tcp_moved, frozenset({web.name}))
    assert len(tables) == 1
    udp_moved = snap((service(), [ep("10.244.1.2")]), (web, [ep("10.244.2.2", 8080)]))
    rec.after_sync(tcp_moved, udp_moved, frozenset({service().name}))
    assert len(tables) == 2
    gone = snap((web, [ep("10.244.2.2", 8080)]))
    rec.after_sync(udp_moved, gone, frozenset({service().name}))  # a deleted UDP port: its flows go
    assert len(tables) == 3
    rec.after_sync(gone, gone, frozenset())
    assert len(tables) == 3


def test_after_sync_reconciles_a_deleted_port_once() -> None:
    tables: List[FakeTable] = []
    stale_flow = flow(1, DNS_IP, 53, "10.244.1.1")

    def opener() -> FakeTable:
        tables.append(FakeTable({(V4, UDP): [stale_flow]}))
        return tables[-1]

    rec = Reconciler(clock=Clock(), opener=opener)
    one = snap((service(), [ep("10.244.1.1")]), (service("other", cluster_ips=(IP("10.96.0.54"),)), [ep("10.244.1.5")]))
    rec.after_sync(None, one)
    assert tables[-1].deleted == []
    gone = snap((service("other", cluster_ips=(IP("10.96.0.54"),)), [ep("10.244.1.5")]))
    rec.after_sync(one, gone)
    assert tables[-1].deleted == [stale_flow]
    rec.after_sync(gone, gone)  # the deletion was handled: no new pass for it
    assert len(tables) == 2


def test_a_kernel_without_ctnetlink_turns_the_reconciler_off_once() -> None:
    calls: List[int] = []

    def opener() -> FakeTable:
        calls.append(1)
        raise PermissionError(1, "Operation not permitted")

    rec = Reconciler(opener=opener)
    state = desired_state(snap((service(), [ep("10.244.1.1")])))
    first: Optional[Any] = rec.reconcile(state)
    second = rec.reconcile(state)
    assert calls == [1]
    assert first is not None and "cannot open ctnetlink" in first.errors[0] and second.errors == first.errors


def test_the_view_cache_follows_changed_objects_and_forgets_deleted_ports() -> None:
    cache: Dict[Any, Any] = {}
    svc, other = service(), service("other", cluster_ips=(IP("10.96.0.54"),))
    one = snap((svc, (ep("10.244.1.1"),)), (other, (ep("10.244.1.5"),)))
    assert desired_state(one, cache=cache) == desired_state(one)
    two = Snapshot({svc.name: svc}, {svc.name: (ep("10.244.1.2"),)})  # new endpoints object; other deleted
    assert desired_state(two, cache=cache) == desired_state(two)
    assert stale(desired_state(two, cache=cache)[(V4, UDP)], DNS_IP, 53, "10.244.1.1", 5353)
    assert set(cache) == {svc.name}


def test_a_failed_pass_is_retried_at_the_next_sync() -> None:
    class Failing(FakeTable):
        def select(self, family: int, proto: int,
                   pick: Callable[[bytes, bytes, bytes], bool]) -> Tuple[int, List[bytes]]:
            raise OSError(105, "No buffer space available")

    opened: List[FakeTable] = []

    def opener() -> FakeTable:
        opened.append(Failing({}) if not opened else FakeTable({}))
        return opened[-1]

    rec = Reconciler(clock=Clock(), opener=opener)
    one = snap((service(), [ep("10.244.1.1")]))
    rec.after_sync(None, one)
    assert rec.last is not None and rec.last.errors
    rec.after_sync(one, one)  # nothing changed, but the last pass failed
    assert len(opened) == 2 and rec.last is not None and not rec.last.errors


def test_the_metrics_have_kube_proxys_names_types_labels_and_buckets() -> None:
    from netproxy import metrics

    metrics.CONNTRACK_RECONCILE_DURATION.labels("IPv6").observe(0.003)
    metrics.CONNTRACK_RECONCILE_DELETED.labels("IPv6").inc(0)
    families = {f.name: f for f in REGISTRY.collect()}
    hist = families["kubeproxy_conntrack_reconciler_sync_duration_seconds"]
    counter = families["kubeproxy_conntrack_reconciler_deleted_entries"]
    assert (hist.type, counter.type) == ("histogram", "counter")
    bounds = sorted({float(s.labels["le"]) for s in hist.samples if s.name.endswith("_bucket")})
    assert bounds[:-1] == [0.001 * 2 ** i for i in range(15)] and bounds[-1] == float("inf")
    assert {s.labels["ip_family"] for s in counter.samples} >= {"IPv6"}
    assert any(s.name == "kubeproxy_conntrack_reconciler_deleted_entries_total" for s in counter.samples)
