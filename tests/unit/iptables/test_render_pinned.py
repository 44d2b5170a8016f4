"""iptables rendering, pinned where mutation testing found nothing watching (``make mutation``'s
``iptables-render`` group, a sample of 300 mutants; docs/testing.md): kube-proxy's chain names with
the name caches cold, the whole text of the rules iptables-restore reads (a misspelt match module
fails only in the kernel suites otherwise), which chains a policy writes, the filter order of a
source-range drop, the health-check node port without a NodePort, hairpin candidates, affinity
slot collisions, the dispatch trees' shape and :class:`SortedEntries` on small tables."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import ipaddress
import random
import zlib
from typing import Dict, Iterator, List, Tuple

import pytest

from netproxy.backends.iptables import affinity, names
from netproxy.backends.iptables.render import Rule, ServiceRules, render_service
from netproxy.backends.iptables.tree import (
    LEAF_SIZE,
    DispatchEntry,
    SortedEntries,
    build_port_tree,
    build_tree,
    entry_order,
    port_key,
)
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from netproxy_lab.manifests import service_port

ip = ipaddress.ip_address
NODE = NodeInfo("node-a")
CFG = ProxyConfig(hostname="node-a", cluster_cidrs=parse_cidrs("10.244.0.0/16"))
VETH = ProxyConfig(hostname="node-a", detect_local_mode="InterfaceNamePrefix", pod_interface_name_prefix="veth")
COMMENT = ("-m", "comment", "--comment", "ns1/svc1:p80")


@pytest.fixture(autouse=True)
def cold_name_caches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No chain name remembered: a name the test process (or the process it was forked from) made
    before would otherwise hide how a name is made."""
    monkeypatch.setattr(names, "_svc_cache", {})
    monkeypatch.setattr(names, "_net_cache", {})
    yield


def kube_hash(text: str) -> str:
    """kube-proxy's chain-name hash: the first 16 characters of base32(sha256(text))."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


def svc1(**fields: object) -> ServicePort:
    return service_port("svc1", "ns1", "p80", port=80, cluster_ip="10.96.0.10", **fields)


def ep(addr: str, node: str = "") -> Endpoint:
    return Endpoint(ip(addr), 8080, node_name=node or None)


def rendered(s: ServicePort, *endpoints: Endpoint, config: ProxyConfig = CFG) -> ServiceRules:
    got = render_service(s, endpoints, NODE, 4, config)
    assert got is not None
    return got


# -- names ----------------------------------------------------------------------------------------------

def test_chain_names_are_kube_proxys() -> None:
    name = ServicePortName("ns1", "svc1", "p80")
    # kube-proxy's own unit tests know this service port's chain by this name.
    assert names.service_chain(name, "TCP") == "KUBE-SVC-XPGD46QRK7WJZT7O"
    assert names.service_chain(name, "TCP") == "KUBE-SVC-XPGD46QRK7WJZT7O"  # again, from the cache
    for prefix in ("KUBE-EXT-", "KUBE-FW-", "KUBE-SVL-"):
        assert names.service_chain(name, "TCP", prefix) == prefix + "XPGD46QRK7WJZT7O"
    assert names.service_chain(name, "UDP") == "KUBE-SVC-" + kube_hash("ns1/svc1:p80udp")
    assert names.dispatch_chain("10.96.0.0/24") == "KUBE-SVCS-" + kube_hash("10.96.0.0/24")
    assert names.nodeport_chain("tcp/30720:30975") == "KUBE-NPS-" + kube_hash("tcp/30720:30975")


# -- the rules' text, as iptables-restore reads it --------------------------------------------------------

def test_external_traffic_policy_local_chains_word_for_word() -> None:
    """Interface-prefix local detection, one endpoint here and one elsewhere, an external IP, a
    NodePort and a health-check node port."""
    s = svc1(external_ips=(ip("203.0.113.10"),), external_traffic_policy="Local", node_port=30080,
             health_check_node_port=32000)
    r = rendered(s, ep("10.1.0.1", "node-a"), ep("10.1.0.2", "node-b"), config=VETH)
    svc, svl, ext = ("KUBE-SVC-XPGD46QRK7WJZT7O", "KUBE-SVL-XPGD46QRK7WJZT7O", "KUBE-EXT-XPGD46QRK7WJZT7O")
    dnat = ("-j", "DNAT", "--to-destination")
    assert r.nat == {
        svc: (("-d", "10.96.0.10/32", "-p", "tcp") + COMMENT + ("-m", "tcp", "--dport", "80", "!", "-i", "veth+",
                                                                "-j", "KUBE-MARK-MASQ"),
              ("-p", "tcp") + COMMENT + ("-m", "statistic", "--mode", "random", "--probability", "0.5000000000")
              + dnat + ("10.1.0.1:8080",),
              ("-p", "tcp") + COMMENT + dnat + ("10.1.0.2:8080",)),
        svl: (("-p", "tcp") + COMMENT + dnat + ("10.1.0.1:8080",),),
        ext: (("-i", "veth+") + COMMENT + ("-j", svc),
              COMMENT + ("-m", "addrtype", "--src-type", "LOCAL", "-j", "KUBE-MARK-MASQ"),
              COMMENT + ("-m", "addrtype", "--src-type", "LOCAL", "-j", svc),
              COMMENT + ("-j", svl)),
    }
    health = ("-p", "tcp", "-m", "comment", "--comment", "ns1/svc1:p80 health check node port", "-m", "tcp",
              "--dport", "32000", "-j", "ACCEPT")
    assert [e.rule for e in r.filter_nodeports] == [health]
    # Without a NodePort (allocateLoadBalancerNodePorts: false) the health check is still accepted.
    r = rendered(dataclasses.replace(s, node_port=0), ep("10.1.0.1", "node-a"), config=VETH)
    assert ([e.rule for e in r.filter_nodeports], r.nodeports) == ([health], ())


def test_an_affinity_pick_is_random_in_iptables_words() -> None:
    r = rendered(svc1(affinity="ClientIP"), ep("10.1.0.1"), ep("10.1.0.2"))
    picks = [rule for rule in r.nat["KUBE-SVC-XPGD46QRK7WJZT7O"] if "--probability" in rule]
    assert len(picks) == 1
    at = picks[0].index("statistic") - 1
    assert picks[0][at:at + 6] == ("-m", "statistic", "--mode", "random", "--probability", "0.5000000000")


# -- which chains a service writes ---------------------------------------------------------------------

POLICIES = [(i, e) for i in ("Cluster", "Local") for e in ("Cluster", "Local")]
BUILTIN_TARGETS = {"DNAT", "SET", "DROP", "REJECT", "ACCEPT", "RETURN", names.MARK_MASQ, names.MASQ_NONCLUSTER}


@pytest.mark.parametrize("itp, etp", POLICIES)
@pytest.mark.parametrize("endpoints", [(), ("node-a",), ("node-b",), ("node-a", "node-b")],
                         ids=["none", "local", "remote", "both"])
def test_every_jump_goes_to_a_chain_the_service_writes(itp: str, etp: str, endpoints: Tuple[str, ...]) -> None:
    """And only the Local policies write KUBE-SVL- (kube-proxy's layout)."""
    s = svc1(internal_traffic_policy=itp, external_traffic_policy=etp, external_ips=(ip("203.0.113.10"),),
             node_port=30080, load_balancer_ips=(ip("198.51.100.10"),),
             source_ranges=(ipaddress.ip_network("192.0.2.0/24"),))
    r = rendered(s, *(ep(f"10.1.0.{i}", node) for i, node in enumerate(endpoints, 1)))
    entries = r.dispatch + r.nodeports + r.filter + r.filter_nodeports
    for rule in [rule for rules in r.nat.values() for rule in rules] + [e.rule for e in entries]:
        target = rule[rule.index("-j") + 1]
        assert target in r.nat or target in BUILTIN_TARGETS, (rule, sorted(r.nat))
    if "Local" not in (itp, etp):
        assert not any(chain.startswith(names.SVL_PREFIX) for chain in r.nat)
    if endpoints:  # some endpoint: the load balancer goes through its firewall chain, by kube-proxy's name
        assert "KUBE-FW-XPGD46QRK7WJZT7O" in r.nat


def test_a_source_range_drop_comes_before_the_ports_own_verdict() -> None:
    """A load balancer with source ranges, externalTrafficPolicy Local and no endpoint here: filter
    has the firewall's drop of outsiders (RANK_FIREWALL) and the port's drop (no local endpoint),
    in that order (rank, then the rule) on the address's key."""
    s = svc1(load_balancer_ips=(ip("198.51.100.10"),), source_ranges=(ipaddress.ip_network("192.0.2.0/24"),),
             external_traffic_policy="Local")
    r = rendered(s, ep("10.1.0.1", "node-b"))
    lb = [e for e in sorted(r.filter, key=entry_order) if "198.51.100.10/32" in e.rule]
    assert [(e.rank, e.rule[-2:]) for e in lb] == [(0, ("-j", "DROP")), (1, ("-j", "DROP"))]


def test_internal_traffic_policy_local_hairpins_only_its_local_endpoints() -> None:
    """Cluster-IP traffic reaches only this node's endpoints: an endpoint of unknown node is not
    DNAT-ed to here, so it is no hairpin candidate."""
    r = rendered(svc1(internal_traffic_policy="Local"), ep("10.1.0.1", "node-a"), ep("10.1.0.2"))
    assert [element[0] for element in r.hairpin] == [int(ip("10.1.0.1"))]
    r = rendered(svc1(), ep("10.1.0.1", "node-a"), ep("10.1.0.2"))
    assert sorted(element[0] for element in r.hairpin) == [int(ip("10.1.0.1")), int(ip("10.1.0.2"))]


def test_affinity_books_only_the_endpoints_its_chains_dnat_to() -> None:
    """Cluster policies write KUBE-SVC- only: a terminating endpoint here, which KUBE-SVL- would
    fall back to, is in no rule while a ready one serves elsewhere, so it takes no slot."""
    terminating = Endpoint(ip("10.1.0.1"), 8080, ready=False, serving=True, terminating=True, node_name="node-a")
    r = rendered(svc1(affinity="ClientIP"), terminating, ep("10.1.0.2", "node-b"))
    assert [key for _, key in r.affinity_slots] == [(int(ip("10.1.0.2")), 8080)]


def test_an_affinity_slot_collision_moves_to_the_next_free_slot() -> None:
    """Endpoints in address order take their hash's slot (crc32 of the 16-byte address and the
    port, modulo the slot count), the next free one when it is taken."""
    count = affinity.slot_count(2)

    def preferred(key: Tuple[int, int]) -> int:
        return zlib.crc32(key[0].to_bytes(16, "big") + key[1].to_bytes(2, "big")) % count

    first = (int(ip("10.1.0.1")), 8080)
    second = next((int(ip("10.1.0.1")) + i, 8080) for i in range(1, 10_000)
                  if preferred((int(ip("10.1.0.1")) + i, 8080)) == preferred(first))
    assert affinity.slots([second, first]) == {first: preferred(first), second: (preferred(first) + 1) % count}


# -- the dispatch trees ---------------------------------------------------------------------------------

def _flatten(top: Tuple[Rule, ...], sub: Dict[str, Tuple[Rule, ...]]) -> List[Rule]:
    out: List[Rule] = []
    for rule in top:
        target = rule[rule.index("-j") + 1]
        out.extend(_flatten(sub[target], sub) if target in sub else [rule])
    return out


def _check_shape(top: Tuple[Rule, ...], sub: Dict[str, Tuple[Rule, ...]]) -> None:
    """No chain holds more than LEAF_SIZE rules; a block of two rules or fewer stays inline."""
    assert len(top) <= LEAF_SIZE
    for rules in sub.values():
        assert 2 < len(rules) <= LEAF_SIZE


def test_an_address_tree_jumps_by_prefix_with_its_label() -> None:
    rng = random.Random(5)
    addrs = sorted({int(ip("10.96.0.0")) + rng.randrange(1 << 16) for _ in range(300)})
    entries = [DispatchEntry(a, ("-d", f"{ip(a)}/32", "-j", f"svc-{a}")) for a in addrs]
    top, sub = build_tree(entries, 4, names.dispatch_chain)
    assert _flatten(top, sub) == [e.rule for e in entries]  # every address reaches its rule, in order
    _check_shape(top, sub)
    jump = next(rule for rule in top if rule[-1] in sub)
    net = jump[1]
    assert jump == ("-d", net, "-m", "comment", "--comment", f"services in {net}", "-j", names.dispatch_chain(net))


@pytest.mark.parametrize("small", [2, 3])
def test_a_block_of_more_than_two_rules_gets_its_own_chain(small: int) -> None:
    """Thirty-one addresses in 10.96.1.0/24 and two or three in 10.96.2.0/24: both /24 blocks under the
    top chain, the small one inline only with two rules (a jump would cost as much)."""
    addrs = [f"10.96.1.{i}" for i in range(1, 32)] + [f"10.96.2.{i}" for i in range(1, small + 1)]
    entries = [DispatchEntry(int(ip(a)), ("-d", f"{a}/32", "-j", f"svc-{a}")) for a in addrs]
    top, sub = build_tree(entries, 4, names.dispatch_chain)
    jumps = [rule[1] for rule in top if rule[-1] in sub]
    assert jumps == (["10.96.1.0/24"] if small == 2 else ["10.96.1.0/24", "10.96.2.0/24"])
    assert _flatten(top, sub) == [e.rule for e in entries]


def test_a_port_tree_keeps_the_given_order_of_one_ports_rules() -> None:
    """The first service claiming a NodePort wins, as in kube-proxy's flat KUBE-NODEPORTS."""
    entries = [DispatchEntry(port_key("tcp", 30000 + i), ("-p", "tcp", "--dport", str(30000 + i), "-j", f"s{i}"))
               for i in range(40)]
    claims = [DispatchEntry(port_key("tcp", 30005), ("-p", "tcp", "--dport", "30005", "-j", name))
              for name in ("zz-first", "aa-second")]
    given = entries[:6] + claims + entries[6:]
    top, sub = build_port_tree(given, names.nodeport_chain)
    flat = _flatten(top, sub)
    assert flat.index(claims[0].rule) < flat.index(claims[1].rule)
    _check_shape(top, sub)


def test_a_port_tree_across_port_32768_and_within_four_ports() -> None:
    """Ports on both sides of 32768 share only the protocol bits; forty rules on four ports end in
    one-port blocks, written ``--dport N`` as iptables-save prints them."""
    wide = [DispatchEntry(port_key("tcp", p), ("-p", "tcp", "--dport", str(p), "-j", f"s{p}"))
            for p in list(range(32748, 32768)) + list(range(32768, 32788))]
    top, sub = build_port_tree(wide, names.nodeport_chain)
    assert _flatten(top, sub) == [e.rule for e in wide]
    narrow = [DispatchEntry(port_key("tcp", 30000 + i % 4), ("-p", "tcp", "--dport", str(30000 + i % 4), "-j", f"s{i}"))
              for i in range(40)]
    top, sub = build_port_tree(narrow, names.nodeport_chain)
    ports = {rule[rule.index("--dport") + 1] for rules in [top, *sub.values()] for rule in rules if rule[-1] in sub}
    assert {"30000", "30001", "30002", "30003"} <= ports, ports


@pytest.mark.parametrize("unique", [False, True])
def test_sorted_entries_on_a_small_table_equal_a_fresh_sort(unique: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few entries, so every change takes the incremental path (not the rebuild past REBUILD), and
    an entry two services share is removed with one of them."""
    shared = DispatchEntry(5, ("-d", "shared"))
    a, b, c = (DispatchEntry(1, ("-j", "a")),), (DispatchEntry(9, ("-j", "b")), shared), (shared,)
    kept = SortedEntries(unique)
    rebuilds: List[int] = []
    rebuild = kept._rebuild

    def counted(inputs: List[Tuple[DispatchEntry, ...]]) -> None:
        rebuilds.append(1)
        rebuild(inputs)

    monkeypatch.setattr(kept, "_rebuild", counted)  # counts the full sorts
    steps = [[a, b, c], [a, b], [a, b, (DispatchEntry(3, ("-j", "d")),)], [b], [a, c], [c]]
    for inputs in steps:
        everything = [e for t in inputs for e in t]
        assert kept.update(inputs) == sorted(dict.fromkeys(everything) if unique else everything, key=entry_order)
    assert len(rebuilds) == 1  # the first: every later change was placed, not sorted again


@pytest.mark.parametrize("seed", range(5))
def test_the_name_hash_is_base32_of_sha256_for_any_text(seed: int) -> None:
    """names._hash16 reads base32 from a table of character pairs: the same 16 characters as
    kube-proxy's base32(sha256(text))[:16] for any text (random ones, and the edges of the alphabet)."""
    import random

    rng = random.Random(seed)
    texts = ["", "a", "ns/svc:p" * 40, "\u00e9/\u4e2d:tcp"] + [
        "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(1, 60))) for _ in range(500)]
    for text in texts:
        assert names._hash16(text) == kube_hash(text), text
