"""Pure rendering tests for the iptables backend: no root, no kernel."""

from __future__ import annotations

import ipaddress
from collections import Counter
from typing import Dict, List, Tuple

import pytest

from netproxy.backends.iptables import affinity, ipset, names
from netproxy.backends.iptables.assemble import Memo, assemble
from netproxy.backends.iptables.render import Rule, probability, render_service, safe_comment
from netproxy.backends.iptables.tree import LEAF_SIZE, DispatchEntry, SortedEntries, build_tree, entry_order
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from netproxy_lab.manifests import service_port

ip = ipaddress.ip_address
CFG = ProxyConfig(hostname="node")


def svc(name: str = "web", cip: str = "10.96.0.10", port: int = 80, proto: str = "TCP", pname: str = "http",
        **kw: object) -> ServicePort:
    return service_port(name, "default", pname, protocol=proto, port=port, cluster_ip=cip, **kw)


def eps(*addrs: str, port: int = 8080) -> Tuple[Endpoint, ...]:
    return tuple(Endpoint(ip(a), port) for a in addrs)


def walk(chains: Dict[str, Tuple[Rule, ...]], dst: int, proto: str, dport: int) -> List[Tuple[str, Rule]]:
    """A tiny packet tracer over KUBE-SERVICES: the rules a packet to dst:dport passes through, in order,
    down to the rule that jumps to a service chain (kube-proxy's unit tests work the same way)."""
    out: List[Tuple[str, Rule]] = []
    chain = names.SERVICES
    while True:
        for rule in chains[chain]:
            out.append((chain, rule))
            d = ipaddress.ip_network(rule[rule.index("-d") + 1])
            if int(d.network_address) != dst & int(d.netmask):
                continue
            matched = (rule[rule.index("-p") + 1], rule[rule.index("--dport") + 1]) if "--dport" in rule else None
            if matched is not None and matched != (proto, str(dport)):
                continue
            target = rule[rule.index("-j") + 1]
            if target.startswith(names.DISPATCH_PREFIX):
                chain = target
                break
            return out
        else:
            return out


def test_clusterip_dispatch_and_inline_endpoints() -> None:
    s = svc()
    rendered = render_service(s, eps("10.1.0.1", "10.1.0.2", "10.1.0.3"), NodeInfo(), 4, CFG)
    assert rendered is not None
    chain = names.service_chain(s.name, "TCP")
    assert chain.startswith("KUBE-SVC-") and len(chain) <= names.MAX_CHAIN_LEN
    (entry,) = rendered.dispatch
    assert entry.rule == ("-d", "10.96.0.10/32", "-p", "tcp", "-m", "comment", "--comment", "default/web:http",
                          "-m", "tcp", "--dport", "80", "-j", chain)
    rules = rendered.nat[chain]
    assert [r[r.index("--to-destination") + 1] for r in rules] == ["10.1.0.1:8080", "10.1.0.2:8080", "10.1.0.3:8080"]
    probs = [r[r.index("--probability") + 1] if "--probability" in r else None for r in rules]
    assert probs == ["0.3333333333", "0.5000000000", None]  # last rule unconditional
    assert all(r[r.index("--comment") + 1] == "default/web:http" for r in rules)
    assert not any(c.startswith(names.SEP_PREFIX) for c in rendered.nat)  # no per-endpoint chains


def test_no_endpoints_rejects_in_filter() -> None:
    rendered = render_service(svc(), (), NodeInfo(), 4, CFG)
    assert rendered is not None
    assert rendered.nat == {} and rendered.dispatch == ()
    (port_reject,) = rendered.filter
    assert port_reject.rule[-4:] == ("-j", "REJECT", "--reject-with", "icmp-port-unreachable")
    assert "10.96.0.10/32" in port_reject.rule and "--dport" in port_reject.rule
    # Its other ports: refused by the one rule over the cluster-IP set, of which it is an element.
    assert rendered.cluster_ips == (ipset.address(int(ip("10.96.0.10"))),)
    rs = assemble(4, [rendered], CFG)
    assert rs.cluster_ips == {ipset.address(int(ip("10.96.0.10")))}
    (refuse,) = [r for r in rs.chains("filter")[names.SERVICES] if "--match-set" in r]
    assert refuse[:5] == ("-m", "set", "--match-set", "NETPROXY-CLUSTER-IPS-4", "dst") and refuse[-3] == "REJECT"


def test_affinity_checks_before_choice_and_records_where_chosen() -> None:
    s = svc(affinity="ClientIP", affinity_timeout=77)
    endpoints = eps("10.1.0.1", "10.1.0.2")
    rendered = render_service(s, endpoints, NodeInfo(), 4, CFG)
    assert rendered is not None
    rules = rendered.nat[names.service_chain(s.name, "TCP")]
    slots = affinity.slots((int(e.ip), e.port) for e in endpoints)
    sets = [ipset.affinity_set(4, slots[(int(e.ip), e.port)]) for e in endpoints]
    assert len(rules) == 8
    held, chosen = rules[:4], rules[4:]
    remember = lambda name: ("-j", "SET", "--add-set", name, "src,dst,dst", "--exist", "--timeout", "77")  # noqa: E731
    for (refresh, dnat), name, ep in zip(zip(held[::2], held[1::2]), sets, ("10.1.0.1:8080", "10.1.0.2:8080")):
        # a remembered client: its timeout refreshed, then its endpoint — before any random choice
        assert refresh[refresh.index("--match-set") - 2:] == ("-m", "set", "--match-set", name, "src,dst,dst") + \
            remember(name)
        assert dnat[dnat.index("--match-set") + 1] == name and dnat[-1] == ep
        assert "--probability" not in refresh + dnat
    (pick0, dnat0), (pick1, dnat1) = zip(chosen[::2], chosen[1::2])
    assert "--probability" in pick0 and pick0[-8:] == remember(sets[0])
    assert dnat0[dnat0.index("--match-set") + 1] == sets[0]  # DNAT only if the record took
    assert "--probability" not in pick1 and pick1[-8:] == remember(sets[1])
    assert "--match-set" not in dnat1 and dnat1[-1] == "10.1.0.2:8080"  # the last: whatever happened
    assert rendered.affinity_keys == ((6, 80, int(ip("10.96.0.10"))),)
    assert sorted(slot for slot, _ in rendered.affinity_slots) == sorted(slots.values())


def test_affinity_slots_stay_with_their_endpoints() -> None:
    keys = [(int(ip(f"10.1.0.{i}")), 8080) for i in range(1, 31)]
    base = affinity.slots(keys)
    assert len(set(base.values())) == 30 and max(base.values()) < affinity.MIN_SLOTS
    assert affinity.slots(reversed(keys)) == base  # order does not matter
    # One endpoint leaves, one joins: the others keep their slot unless they collided with them.
    changed = affinity.slots(keys[1:] + [(int(ip("10.1.0.99")), 8080)])
    moved = [k for k in keys[1:] if changed[k] != base[k]]
    assert len(moved) <= 2
    assert affinity.slot_count(32) == 64 and affinity.slot_count(33) == 128


def test_large_clusters_leave_the_comment_off_endpoint_rules() -> None:
    s = svc()
    rendered = render_service(s, eps("10.1.0.1", "10.1.0.2"), NodeInfo(), 4, CFG, comments=False)
    assert rendered is not None
    rules = rendered.nat[names.service_chain(s.name, "TCP")]
    assert not any("--comment" in r for r in rules if "DNAT" in r)
    assert all("--comment" in e.rule for e in rendered.dispatch)  # the dispatch keeps it


def test_external_and_lb_ips_reach_the_service_chain() -> None:
    s = svc(external_ips=(ip("203.0.113.10"),), load_balancer_ips=(ip("198.51.100.10"),))
    rendered = render_service(s, eps("10.1.0.1"), NodeInfo(), 4, CFG)
    assert rendered is not None
    ext = names.service_chain(s.name, "TCP", names.EXT_PREFIX)
    targets = {e.rule[e.rule.index("-d") + 1]: e.rule[-1] for e in rendered.dispatch}
    assert targets == {"10.96.0.10/32": names.service_chain(s.name, "TCP"), "203.0.113.10/32": ext,
                       "198.51.100.10/32": ext}
    assert rendered.nat[ext][-1][-1] == names.service_chain(s.name, "TCP")
    assert rendered.nat[ext][0][-1] == names.MARK_MASQ


def test_external_traffic_policy_local_uses_local_endpoints_only() -> None:
    s = svc(external_ips=(ip("203.0.113.10"),), external_traffic_policy="Local")
    endpoints = (Endpoint(ip("10.1.0.1"), 8080, node_name="node"), Endpoint(ip("10.1.0.2"), 8080, node_name="other"))
    rendered = render_service(s, endpoints, NodeInfo(name="node"), 4, CFG)
    assert rendered is not None
    ext_rules = rendered.nat[names.service_chain(s.name, "TCP", names.EXT_PREFIX)]
    svl = names.service_chain(s.name, "TCP", names.SVL_PREFIX)
    assert ext_rules[-1][-1] == svl
    assert [r[-1] for r in rendered.nat[svl]] == ["10.1.0.1:8080"]


def test_families_are_separate() -> None:
    s = ServicePort(ServicePortName("default", "dual", ""), "UDP", 53, 53, (ip("10.96.0.53"), ip("fd00::53")))
    endpoints = eps("10.1.0.1", port=53) + eps("fd01::1", port=53)
    v4 = render_service(s, endpoints, NodeInfo(), 4, CFG)
    v6 = render_service(s, endpoints, NodeInfo(), 6, CFG)
    assert v4 is not None and v6 is not None
    assert [r[-1] for r in v4.nat[names.service_chain(s.name, "UDP")]] == ["10.1.0.1:53"]
    assert [r[-1] for r in v6.nat[names.service_chain(s.name, "UDP")]] == ["[fd01::1]:53"]
    assert v6.dispatch[0].rule[:2] == ("-d", "fd00::53/128")
    assert render_service(svc(), eps("10.1.0.1"), NodeInfo(), 6, CFG) is None


@pytest.mark.parametrize("proto", ["TCP", "UDP", "SCTP"])
def test_protocols(proto: str) -> None:
    rendered = render_service(svc(proto=proto), eps("10.1.0.1"), NodeInfo(), 4, CFG)
    assert rendered is not None
    rule = rendered.dispatch[0].rule
    assert rule[rule.index("-p") + 1] == proto.lower() and ("-m", proto.lower(), "--dport", "80") == \
        rule[rule.index("--dport") - 2:rule.index("--dport") + 2]


def test_masquerade_all_and_cluster_cidr() -> None:
    s = svc()
    every = render_service(s, eps("10.1.0.1"), NodeInfo(), 4, ProxyConfig(masquerade_all=True))
    assert every is not None and every.nat[names.service_chain(s.name, "TCP")][0][-1] == names.MARK_MASQ
    cidr = ProxyConfig(cluster_cidrs=(ipaddress.ip_network("10.0.0.0/8"),))
    outside = render_service(s, eps("10.1.0.1"), NodeInfo(), 4, cidr)
    assert outside is not None
    first = outside.nat[names.service_chain(s.name, "TCP")][0]
    # kube-proxy's rule: qualified by the cluster IP and port, so external traffic passing through is not.
    assert first[:2] == ("-d", "10.96.0.10/32") and first[-5:] == ("!", "-s", "10.0.0.0/8", "-j", names.MARK_MASQ)


def test_dispatch_tree_is_shallow_and_routes_every_service() -> None:
    n = 10_000
    services = [svc(name=f"s{i}", cip=str(ip(int(ip("10.96.0.0")) + 7 * i + 1))) for i in range(n)]
    rendered = [render_service(s, eps("10.1.0.1"), NodeInfo(), 4, CFG) for s in services]
    ruleset = assemble(4, [r for r in rendered if r is not None], CFG)
    nat = ruleset.chains("nat")
    worst = 0
    for s in services[:: 97] + [services[-1]]:
        path = walk(nat, int(s.cluster_ips[0]), "tcp", 80)
        assert path[-1][1][-1] == names.service_chain(s.name, "TCP"), s.name
        worst = max(worst, len(path))
    # A flat KUBE-SERVICES would check up to 10,000 rules; the tree checks a few dozen.
    assert worst <= 3 * 16 + LEAF_SIZE
    # ... and each service's dispatch rule appears exactly once.
    leaves = Counter(r[-1] for rules in nat.values() for r in rules if r[-1].startswith(names.SVC_PREFIX))
    assert len(leaves) == n and set(leaves.values()) == {1}


def test_dispatch_small_stays_flat_and_same_address_many_ports_is_a_leaf() -> None:
    entries = [render_service(svc(name="multi", port=p, pname=f"p{p}"), eps("10.1.0.1"), NodeInfo(), 4, CFG)
               for p in range(1, 2 * LEAF_SIZE)]
    top, sub = build_tree([e for r in entries if r for e in r.dispatch], 4, names.dispatch_chain)
    assert sub == {} and len(top) == 2 * LEAF_SIZE - 1


@pytest.mark.parametrize("unique", [False, True])
def test_sorted_entries_kept_between_syncs_equal_a_fresh_sort(unique: bool) -> None:
    """What a sync keeps sorted by the changes (identity of each service's tuple) is what sorting all
    again gives, duplicates included: shared by two services (counted, one rule when ``unique``)."""
    import random

    rng = random.Random(7)

    def group(i: int) -> Tuple[DispatchEntry, ...]:
        shared = DispatchEntry(1000, ("-d", "shared"))  # in several services' tuples
        own = tuple(DispatchEntry(rng.randrange(64), ("-j", f"c{i}-{k}"), rng.randrange(2)) for k in range(3))
        return own + ((shared,) if i % 3 == 0 else ())

    kept = SortedEntries(unique)
    inputs = [group(i) for i in range(200)]
    for step in range(60):
        at = rng.randrange(len(inputs))
        if step % 3 == 0:
            inputs.insert(at, group(1000 + step))
        elif step % 3 == 1:
            del inputs[at]
        else:
            inputs[at] = group(2000 + step)  # a service's entries replaced
        everything = [e for t in inputs for e in t]
        fresh = sorted(dict.fromkeys(everything) if unique else everything, key=entry_order)
        assert kept.update(inputs) == fresh, step


def test_assemble_after_changes_equals_assemble_from_nothing() -> None:
    """The memo (kept sorted trees) changes nothing in the result of a one-service add and remove."""
    services = [svc(name=f"s{i}", cip=str(ip(int(ip("10.96.0.0")) + 7 * i + 1))) for i in range(600)]
    rendered = [render_service(s, eps("10.1.0.1"), NodeInfo(), 4, CFG) for s in services]
    memo = Memo()
    assemble(4, [r for r in rendered if r is not None], CFG, memo=memo)
    extra = render_service(svc(name="extra", cip="10.200.0.9"), eps("10.1.0.1"), NodeInfo(), 4, CFG)
    for now in ([*rendered[:300], extra, *rendered[300:]], rendered[1:], rendered):
        got = assemble(4, [r for r in now if r is not None], CFG, memo=memo)
        want = assemble(4, [r for r in now if r is not None], CFG)
        assert got.chains("nat") == want.chains("nat") and got.chains("filter") == want.chains("filter")


def test_names_stable_distinct_and_short() -> None:
    a = names.service_chain(ServicePortName("ns", "service-a", "p"), "TCP")
    b = names.service_chain(ServicePortName("ns", "service-b", "p"), "TCP")
    assert a != b and len(a) <= 28 and len(b) <= 28
    # Same inputs, same name (stable across restarts: no randomness, no process state).
    assert a == "KUBE-SVC-" + names._hash16("ns/service-a:p" + "tcp")
    assert names.service_chain(ServicePortName("ns", "service-a", "p"), "UDP") != a


def test_probability_text_distinct_up_to_100k() -> None:
    texts = [probability(n) for n in range(1, 100_001)]
    assert len(set(texts)) == len(texts)
    assert probability(1) == "1.0000000000" and probability(3) == "0.3333333333"


@pytest.mark.parametrize("raw,expected", [
    ("default/web:http", "default/web:http"),
    ('a"b\nc', 'a"b?c'),
    ("x" * 400, "x" * 255),
    ("é" * 200, "é" * 127),  # cut on a character boundary within 255 bytes
])
def test_safe_comment(raw: str, expected: str) -> None:
    assert safe_comment(raw) == expected


def test_name_caches_are_bounded() -> None:
    from netproxy.backends.iptables import names as iptnames

    cache: dict = {}  # type: ignore[type-arg]
    for i in range(iptnames.CACHE_LIMIT + 5):
        iptnames.remember(cache, i, str(i))
    assert len(cache) <= iptnames.CACHE_LIMIT and cache[iptnames.CACHE_LIMIT + 4] == str(iptnames.CACHE_LIMIT + 4)
