"""Rendering: snapshot -> nftables objects (pure), checked through plan() text and the fake's tables."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re

import pytest

from netproxy.backends.nftables import names, render
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes, Endpoint, NodeInfo
from tests.unit.nftables.nft_helpers import backend, eps, mixed_snapshot, snap, svc

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _golden(name: str, text: str) -> None:
    """Compares the rendered text with golden/<name>. NETPROXY_UPDATE_GOLDEN=1 rewrites the file
    instead, and the test then fails: a run that wrote its own expectation has checked nothing, so it
    must never count as a pass (rerun without the variable, after reviewing the file's diff)."""
    path = os.path.join(GOLDEN, name)
    if os.environ.get("NETPROXY_UPDATE_GOLDEN") == "1":
        with open(path, "w") as f:
            f.write(text)
        pytest.fail(f"NETPROXY_UPDATE_GOLDEN=1: wrote {path}; review its diff and rerun without the variable")
    with open(path) as f:
        want = f.read()
    diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), "golden", "rendered"))
    assert text == want, f"rendered plan differs from {path}:\n{diff}"


def test_plan_matches_golden() -> None:
    b, _ = backend(ProxyConfig(hostname="node-a", cluster_cidrs=parse_cidrs("10.0.0.0/8")))
    _golden("mixed.nft", b.plan(mixed_snapshot()))


def test_plan_is_a_pure_function_of_the_snapshot() -> None:
    b, fake = backend()
    first = b.plan(mixed_snapshot())
    assert b.plan(mixed_snapshot()) == first
    assert fake.transactions == [] and fake.tables == {}, "plan must not touch the kernel"


def test_equal_odds_each_endpoint_once_under_one_random_choice() -> None:
    b, fake = backend()
    endpoints = eps(*(f"10.1.0.{i}" for i in range(1, 8)))
    b.sync(snap((svc("web", "10.96.0.10"), endpoints)), Changes())
    assert fake.elements("ip", names.SERVICE_IPS) == {"10.96.0.10 . tcp . 80": "goto cluster-tcp-pick-7"}
    assert fake.chain_rules("ip", "cluster-tcp-pick-7") == [
        "meta l4proto tcp dnat ip to ip daddr . th dport . numgen random mod 7 map @cluster-tcp-endpoints-7"]
    picked = fake.elements("ip", "cluster-tcp-endpoints-7")
    assert sorted(picked) == [f"10.96.0.10 . 80 . {i}" for i in range(7)]
    assert sorted(picked.values()) == sorted(f"{e.ip} . 8080" for e in endpoints)


def test_ipv4_affinity_is_one_lookup_in_a_shared_map_then_the_random_pick_and_is_recorded_after_dnat() -> None:
    b, fake = backend()
    b.sync(snap((svc("s", "10.96.0.20", affinity=True, timeout=42), eps("10.1.0.4", "10.1.0.5", "10.1.0.6"))),
           Changes())
    assert fake.elements("ip", names.SERVICE_IPS) == {"10.96.0.20 . tcp . 80": "goto cluster-tcp-sticky-pick-3"}
    assert fake.chain_rules("ip", "cluster-tcp-sticky-pick-3") == [
        "meta l4proto tcp dnat ip to ip saddr . ip daddr . th dport map @affinity-tcp",
        "meta l4proto tcp dnat ip to ip daddr . th dport . numgen random mod 3 map @cluster-tcp-sticky-endpoints-3"]
    # remembered right after the DNAT, by the connection's original destination, for its timeout
    assert fake.elements("ip", names.AFFINITY_SERVICES) == {"10.96.0.20 . tcp . 80": "goto affinity-tcp-42"}
    assert fake.chain_rules("ip", "affinity-tcp-42") == [
        "meta l4proto tcp update @affinity-tcp { ip saddr . ct original ip daddr . ct original proto-dst "
        "timeout 42s : ip daddr . ct reply proto-src }"]
    assert any("vmap @affinity-services" in r for r in fake.chain_rules("ip", "affinity-prerouting"))
    assert not [n for n in fake.tables["ip"].sets if n.startswith("aff-")], "no set per service port"
    assert not [c for c in fake.tables["ip"].chains if c.startswith("svc-")], "no chain per service port"


def test_ipv6_affinity_checks_every_endpoint_before_the_random_choice_and_refreshes() -> None:
    b, fake = backend()
    b.sync(snap((svc("s", "fd00::20", affinity=True, timeout=42), eps("fd01::4", "fd01::5", "fd01::6"))),
           Changes())
    aff = {i: f"aff-ns/s/http-fd01__{i}-8080" for i in (4, 5, 6)}  # one set of clients per endpoint
    step = [f"update @{aff[i]} {{ ip6 saddr }} dnat ip6 to [fd01::{i}]:8080" for i in (4, 5, 6)]
    known = [f"ip6 saddr @{aff[i]}" for i in (4, 5, 6)]
    assert fake.chain_rules("ip6", "svc-ns/s/http") == [
        # every remembered client first (iptables: recent --rcheck, then --set in the endpoint's chain)
        f"meta l4proto tcp {known[0]} {step[0]}",
        f"meta l4proto tcp {known[1]} {step[1]}",
        f"meta l4proto tcp {known[2]} {step[2]}",
        # then equal odds: 1/3, then 1/2 of the rest, then the last
        f"meta l4proto tcp numgen random mod 3 == 0 {step[0]}",
        f"meta l4proto tcp numgen random mod 2 == 0 {step[1]}",
        f"meta l4proto tcp {step[2]}",
    ]
    for name in aff.values():
        s = fake.tables["ip6"].sets[name]
        assert s.timeout == 42 and set(s.flags) == {"dynamic", "timeout"}
        assert s.key_type == "ipv6_addr"
    assert fake.elements("ip6", names.SERVICE_IPS) == {"fd00::20 . tcp . 80": "goto svc-ns/s/http"}


def test_no_endpoints_rejects_and_local_policy_without_local_endpoints_drops() -> None:
    b, fake = backend()
    s1 = svc("empty", "10.96.0.30")
    s2 = svc("local", "10.96.0.31", external=["192.0.2.31"], ext_policy="Local")
    b.sync(snap((s1, ()), (s2, eps("10.1.0.9", node="node-b")), node="node-a"), Changes())
    assert fake.elements("ip", names.NO_ENDPOINTS) == {"10.96.0.30 . tcp . 80": f"goto {names.REJECT}"}
    # No local endpoint: the local pick chain of size 0 drops -- after the exceptions (the node
    # itself, and pods with --cluster-cidr) that reach every endpoint through exempt-ips.  Not in
    # no-endpoint-services: filter-output would drop the node's own connections there.
    assert fake.elements("ip", names.SERVICE_IPS) == {"10.96.0.31 . tcp . 80": "goto cluster-tcp-pick-1",
                                                     "192.0.2.31 . tcp . 80": "goto local-tcp-pick-0"}
    mark = "meta mark set meta mark | 0x00004000"
    assert fake.chain_rules("ip", "local-tcp-pick-0") == [
        f"fib saddr type local {mark} ip daddr . meta l4proto . th dport vmap @{names.EXEMPT_IPS}", "drop"]
    assert fake.elements("ip", names.EXEMPT_IPS) == {"192.0.2.31 . tcp . 80": "goto exempt-tcp-pick-1"}
    assert fake.elements("ip", "exempt-tcp-endpoints-1") == {"192.0.2.31 . 80": "10.1.0.9 . 8080"}
    assert not any("meta mark" in r for r in fake.chain_rules("ip", "exempt-tcp-pick-1"))
    assert fake.chain_rules("ip", names.REJECT) == ["reject"]


def test_local_policy_uses_local_endpoints_without_masquerade() -> None:
    b, fake = backend()
    s = svc("local", "10.96.0.31", external=["192.0.2.31"], ext_policy="Local")
    endpoints = eps("10.1.0.8", node="node-a") + eps("10.1.0.9", node="node-b")
    b.sync(snap((s, endpoints), node="node-a"), Changes())
    assert fake.elements("ip", "local-tcp-endpoints-1") == {"192.0.2.31 . 80": "10.1.0.8 . 8080"}
    rules = fake.chain_rules("ip", "local-tcp-pick-1")
    # Only the node's own connections (fib saddr type local) are marked; the rest keep their source.
    assert [r for r in rules if "meta mark" in r] == [r for r in rules if r.startswith("fib saddr type local")]
    # One local endpoint: no random draw (kube-proxy 1.37), the map keyed without an index.
    assert rules[-1] == "meta l4proto tcp dnat ip to ip daddr . th dport map @local-tcp-endpoints-1"
    assert len(fake.elements("ip", "cluster-tcp-endpoints-2")) == 2


def test_external_addresses_are_marked_for_masquerade_cluster_ones_only_from_outside_cluster_cidr() -> None:
    config = ProxyConfig(hostname="n", cluster_cidrs=parse_cidrs("10.0.0.0/8,fd00::/8"))
    b, fake = backend(config)
    b.sync(snap((svc("web", "10.96.0.10", external=["192.0.2.10"]), eps("10.1.0.1"))), Changes())
    mark = f"meta mark set meta mark | {config.masquerade_mark:#010x}"
    assert fake.chain_rules("ip", "external-tcp-pick-1")[0] == mark
    assert fake.chain_rules("ip", "cluster-tcp-pick-1")[0] == f"ip saddr != @cluster-cidrs {mark}"
    assert list(fake.elements("ip", names.CLUSTER_CIDRS)) == ["10.0.0.0/8"]
    assert list(fake.elements("ip6", names.CLUSTER_CIDRS)) == []
    post = fake.chain_rules("ip", names.NAT_POSTROUTING)
    assert post[-1].startswith(f"meta mark & {config.masquerade_mark:#010x}") and "masquerade" in post[-1]


def test_masquerade_all_marks_cluster_traffic() -> None:
    b, fake = backend(ProxyConfig(hostname="n", masquerade_all=True))
    b.sync(snap((svc("web", "10.96.0.10"), eps("10.1.0.1"))), Changes())
    assert fake.chain_rules("ip", "cluster-tcp-pick-1")[0].startswith("meta mark set meta mark |")


def test_ipv6_service_goes_to_the_ip6_table_only() -> None:
    b, fake = backend()
    b.sync(snap((svc("v6", "fd00::10"), eps("fd01::1", "fd01::2"))), Changes())
    assert fake.elements("ip6", names.SERVICE_IPS) == {"fd00::10 . tcp . 80": "goto cluster-tcp-pick-2"}
    assert fake.elements("ip6", "cluster-tcp-endpoints-2") == {
        "fd00::10 . 80 . 0": "fd01::1 . 8080", "fd00::10 . 80 . 1": "fd01::2 . 8080"}
    assert fake.elements("ip", names.SERVICE_IPS) == {}
    assert "ip6 daddr" in fake.chain_rules("ip6", "cluster-tcp-pick-2")[0]


def test_ipv4_only_cluster_creates_no_ip6_table() -> None:
    b, fake = backend()
    b.sync(snap((svc("web", "10.96.0.10"), eps("10.1.0.1"))), Changes())
    assert set(fake.tables) == {"ip"}


def test_terminating_endpoints_used_only_when_none_ready() -> None:
    ready = Endpoint(ipaddress.ip_address("10.1.0.1"), 8080)
    terminating = Endpoint(ipaddress.ip_address("10.1.0.2"), 8080, ready=False, serving=True, terminating=True)
    b, fake = backend()
    b.sync(snap((svc("web", "10.96.0.10"), (ready, terminating))), Changes())
    assert list(fake.elements("ip", "cluster-tcp-endpoints-1").values()) == ["10.1.0.1 . 8080"]
    b.sync(snap((svc("web", "10.96.0.10"), (terminating,))), Changes())
    assert list(fake.elements("ip", "cluster-tcp-endpoints-1").values()) == ["10.1.0.2 . 8080"]


def test_names_are_readable_and_safe() -> None:
    s = svc("my-svc", "10.96.0.1", namespace="team-a", port_name="https")
    assert names.affinity_chain(s.name, "cluster") == "svc-team-a/my-svc/https"
    assert names.identifier('bad name"; drop') == "bad_name___drop"
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9/_.\-]*", names.identifier("9" + "x" * 400))
    assert len(names.identifier("a" * 400)) <= names.MAX_NAME
    long_comment = names.comment("n" * 63 + "/" + "s" * 63 + ":" + "p" * 63)
    assert len(long_comment) <= names.MAX_COMMENT
    assert names.comment('x"y\nz\\') == "x_y_z_"
    assert names.comment("n" * 300) != names.comment("n" * 299 + "m"), "truncated comments stay distinct"


def test_two_services_claiming_one_address_port_first_wins_and_sync_succeeds() -> None:
    b, fake = backend()
    a = svc("a", "10.96.0.10")
    z = svc("z", "10.96.0.10")
    b.sync(snap((a, eps("10.1.0.1")), (z, eps("10.1.0.2", "10.1.0.3"))), Changes())
    assert fake.elements("ip", names.SERVICE_IPS) == {"10.96.0.10 . tcp . 80": "goto cluster-tcp-pick-1"}
    assert list(fake.elements("ip", "cluster-tcp-endpoints-1").values()) == ["10.1.0.1 . 8080"]
    assert "cluster-tcp-pick-2" not in fake.tables["ip"].chains


def test_render_service_without_family_addresses_is_empty() -> None:
    objs = render.render_service(svc("web", "10.96.0.10"), eps("10.1.0.1"), NodeInfo(), "ip6", ProxyConfig())
    assert objs.is_empty()


def test_service_ports_alike_share_their_shared_chain_records_and_names() -> None:
    """Two service ports with as many endpoints use the same pick chain: their ``uses`` tuples, the
    ``shared`` frozensets and the chain and map names are one object each (memory of the record)."""
    a = render.render_service(svc("a", "10.96.0.10"), eps("10.1.0.1", "10.1.0.2"), NodeInfo(), "ip", ProxyConfig())
    b = render.render_service(svc("b", "10.96.0.11"), eps("10.1.0.3", "10.1.0.4"), NodeInfo(), "ip", ProxyConfig())
    assert a.shared == b.shared and a.shared is b.shared
    (ua,), (ub,) = a.uses.values(), b.uses.values()
    assert ua is ub
    (ra,), (rb,) = a.runs.values(), b.runs.values()
    assert ra.set == rb.set and ra.set is rb.set
    va = next(e.value for e in a.elements.values() if e.set == names.SERVICE_IPS)
    vb = next(e.value for e in b.elements.values() if e.set == names.SERVICE_IPS)
    assert va == vb and va is vb
