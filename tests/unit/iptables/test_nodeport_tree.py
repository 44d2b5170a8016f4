"""The (protocol, port-range) tree under nat KUBE-NODEPORTS and filter KUBE-EXTERNAL-SERVICES.

Both chains are walked by every new connection to a node address (kubelet, ssh, hostNetwork pods),
not only by NodePort traffic, so above LEAF_SIZE rules they split like KUBE-SERVICES does; up to
LEAF_SIZE they stay kube-proxy's flat list, rule for rule.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
from typing import Dict, List, Optional, Sequence, Set, Tuple

from netproxy.backends.iptables import IptablesBackend, names, save
from netproxy.backends.iptables.assemble import assemble
from netproxy.backends.iptables.cleanup import cleanup_payload
from netproxy.backends.iptables.diff import KernelTable, full_change, partial_change
from netproxy.backends.iptables.fake import FakeIptables
from netproxy.backends.iptables.render import FamilyRuleset, Rule, render_service
from netproxy.backends.iptables.tree import LEAF_SIZE, DispatchEntry, build_port_tree, port_key
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot
from tests.unit.iptables.iptables_tracer import Outcome, Packet, Tracer

ip = ipaddress.ip_address
NODE_IP = "192.168.1.10"
NODE = NodeInfo(name="node", addresses=(ip(NODE_IP),))
CFG = ProxyConfig(hostname="node", cluster_cidrs=(ipaddress.ip_network("10.244.0.0/16"),))


def node_port_of(i: int) -> int:
    return 30000 + (37 * i) % 2767  # spread over the default range, distinct for i < 2767


def services(n: int, *, udp_every: int = 3) -> List[ServicePort]:
    return [ServicePort(ServicePortName("default", f"s{i:04d}", ""), "UDP" if i % udp_every == 0 else "TCP", 80,
                        8080, (ip(f"10.96.{i // 250}.{i % 250 + 1}"),), node_port=node_port_of(i),
                        service_type="NodePort")
            for i in range(n)]


def endpoint_of(i: int) -> Endpoint:
    return Endpoint(ip(f"10.244.{i // 250}.{i % 250 + 1}"), 8080, node_name="node")


def ruleset(svcs: Sequence[ServicePort], with_endpoints: Optional[Set[int]] = None) -> FamilyRuleset:
    rendered = []
    for i, s in enumerate(svcs):
        eps = (endpoint_of(i),) if with_endpoints is None or i in with_endpoints else ()
        rendered.append(render_service(s, eps, NODE, 4, CFG))
    return assemble(4, [r for r in rendered if r is not None], CFG, NODE)


def flat_rules(svcs: Sequence[ServicePort], attr: str, with_endpoints: Optional[Set[int]] = None) -> Tuple[Rule, ...]:
    """What KUBE-NODEPORTS (``nodeports``) or KUBE-EXTERNAL-SERVICES (``filter_nodeports``) held before the
    tree: every service's rule, in service order."""
    out: List[Rule] = []
    for i, s in enumerate(svcs):
        eps = (endpoint_of(i),) if with_endpoints is None or i in with_endpoints else ()
        rendered = render_service(s, eps, NODE, 4, CFG)
        assert rendered is not None
        out.extend(e.rule for e in getattr(rendered, attr))
    return tuple(out)


def tree_chains(chains: Dict[str, Tuple[Rule, ...]]) -> Set[str]:
    return {c for c in chains if c.startswith(names.NODEPORT_PREFIX)}


def path(chains: Dict[str, Tuple[Rule, ...]], top: str, proto: str, port: int) -> List[str]:
    """The tree chains a packet to proto/port passes through below ``top``, down to its leaf."""
    out: List[str] = []
    chain = top
    while True:
        for rule in chains[chain]:
            target = rule[rule.index("-j") + 1]
            if rule[rule.index("-p") + 1] != proto or not target.startswith(names.NODEPORT_PREFIX):
                continue
            if "--dport" in rule:
                lo, _, hi = rule[rule.index("--dport") + 1].partition(":")
                if not int(lo) <= port <= int(hi or lo):
                    continue
            out.append(target)
            chain = target
            break
        else:
            return out


# ---- below the threshold: kube-proxy's flat list, unchanged -------------------------------------


def test_up_to_leaf_size_the_chains_stay_the_flat_list_in_service_order() -> None:
    svcs = services(LEAF_SIZE)
    rs = ruleset(svcs)
    nat = rs.chains("nat")
    assert nat[names.NODEPORTS] == flat_rules(svcs, "nodeports")
    assert nat[names.NODEPORTS][0] == ("-p", "udp", "-m", "comment", "--comment", "default/s0000", "-m", "udp",
                                       "--dport", "30000", "-j",
                                       names.service_chain(svcs[0].name, "UDP", names.EXT_PREFIX))
    assert not tree_chains(nat) and not tree_chains(rs.chains("filter"))
    # Service order, not port order: node_port_of is not monotonic past 2767 / 37 services.
    wrapped = services(80)[74:74 + 6]
    assert ruleset(wrapped).chains("nat")[names.NODEPORTS] == flat_rules(wrapped, "nodeports")
    # filter's per-NodePort verdicts too.
    none = services(LEAF_SIZE)
    assert ruleset(none, set()).chains("filter")[names.EXTERNAL_SERVICES] == flat_rules(none, "filter_nodeports", set())


def test_build_port_tree_keeps_the_given_order_up_to_leaf_size() -> None:
    entries = [DispatchEntry(port_key("tcp", 32000 - i), ("-p", "tcp", "--dport", str(32000 - i), "-j", "X"))
               for i in range(LEAF_SIZE)]
    top, sub = build_port_tree(entries, names.nodeport_chain)
    assert top == tuple(e.rule for e in entries) and sub == {}


# ---- above it: a protocol / port-range tree ------------------------------------------------------


def test_above_leaf_size_nodeports_split_by_protocol_then_port_range() -> None:
    svcs = services(2500)
    rs = ruleset(svcs)
    nat = rs.chains("nat")
    top = nat[names.NODEPORTS]
    assert [r[:2] for r in top] == [("-p", "tcp"), ("-p", "udp")]
    assert all(r[-2] == "-j" and r[-1].startswith(names.NODEPORT_PREFIX) and "--dport" not in r for r in top)
    chains = tree_chains(nat)
    assert all(len(c) <= names.MAX_CHAIN_LEN and names.is_owned(c) for c in chains)
    assert all(len(nat[c]) <= max(LEAF_SIZE, 16) for c in chains | {names.NODEPORTS})
    # Below the protocol level every jump is a port range of its protocol, as iptables-save prints it.
    for c in chains:
        for rule in nat[c]:
            proto = rule[rule.index("-p") + 1]
            assert rule[rule.index("--dport") - 2:rule.index("--dport")] == ("-m", proto)
            if rule[-1].startswith(names.NODEPORT_PREFIX):
                lo, hi = map(int, rule[rule.index("--dport") + 1].split(":"))
                assert lo < hi and (hi - lo + 1) & (hi - lo) == 0 and lo % (hi - lo + 1) == 0  # an aligned block
                assert rule[rule.index("--comment") + 1] == f"nodeports in {proto}/{lo}:{hi}"
    # Every NodePort's rule is in exactly one chain, and the tree holds nothing else but jumps.
    leaves = [r for c in chains | {names.NODEPORTS} for r in nat[c] if r[-1].startswith(names.EXT_PREFIX)]
    assert sorted(leaves) == sorted(flat_rules(svcs, "nodeports"))
    # A packet walks a few dozen rules, not 2,500.
    for i in (0, 1, 777, 2499):
        proto = "udp" if i % 3 == 0 else "tcp"
        walked = path(nat, names.NODEPORTS, proto, node_port_of(i))
        assert 2 <= len(walked) <= 3
        rules_checked = len(top) + sum(len(nat[c]) for c in walked)
        assert rules_checked <= 2 + 2 * 16 + LEAF_SIZE


def test_the_tree_is_deterministic_in_the_set_of_nodeports() -> None:
    svcs = services(300)
    shuffled = list(svcs)
    random.Random(7).shuffle(shuffled)
    a, b = ruleset(svcs).chains("nat"), ruleset(shuffled).chains("nat")
    assert tree_chains(a) and tree_chains(a) == tree_chains(b)
    assert all(a[c] == b[c] for c in tree_chains(a) | {names.NODEPORTS})


def test_nodeports_reach_their_endpoint_through_the_tree_and_others_do_not() -> None:
    svcs = services(200)
    t = Tracer(ruleset(svcs), local_addresses=(NODE_IP,))
    for i in (0, 1, 2, 100, 199):
        proto = "udp" if i % 3 == 0 else "tcp"
        got = t.trace(Packet("172.16.0.7", NODE_IP, node_port_of(i), proto))
        assert got == {Outcome("accept", f"{endpoint_of(i).ip}:8080", True)}, i
        # The same port over the other protocol is not a NodePort (unless another service has it).
        other = "tcp" if proto == "udp" else "udp"
        assert t.trace(Packet("172.16.0.7", NODE_IP, node_port_of(i), other)) == {Outcome("accept")}
    assert t.trace(Packet("172.16.0.7", NODE_IP, 22)) == {Outcome("accept")}  # ssh walks the tree, untouched


def test_filter_external_services_becomes_a_tree_too() -> None:
    svcs = services(120)
    with_eps = {i for i in range(120) if i % 4 == 0}
    rs = ruleset(svcs, with_eps)
    filt = rs.chains("filter")
    assert [r[:2] for r in filt[names.EXTERNAL_SERVICES]] == [("-p", "tcp"), ("-p", "udp")]
    assert tree_chains(filt)
    leaves = [r for c in tree_chains(filt) | {names.EXTERNAL_SERVICES} for r in filt[c]
              if not r[-1].startswith(names.NODEPORT_PREFIX)]
    assert sorted(leaves) == sorted(flat_rules(svcs, "filter_nodeports", with_eps))
    t = Tracer(rs, local_addresses=(NODE_IP,))
    for i in (1, 2, 5, 119):
        proto = "udp" if i % 3 == 0 else "tcp"
        assert t.trace(Packet("172.16.0.7", NODE_IP, node_port_of(i), proto)) == {Outcome("reject")}, i
    assert t.trace(Packet("172.16.0.7", NODE_IP, node_port_of(4), "tcp")) == \
        {Outcome("accept", f"{endpoint_of(4).ip}:8080", True)}


# ---- syncs: what a one-NodePort change writes, and what is deleted --------------------------------


def snapshot(svcs: Sequence[ServicePort]) -> Snapshot:
    return Snapshot.build(list(svcs), {s.name: [endpoint_of(i)] for i, s in enumerate(svcs)}, NODE)


def test_a_one_nodeport_change_rewrites_only_the_chains_on_its_paths() -> None:
    kernel = FakeIptables()
    backend = IptablesBackend(CFG, kernel=kernel)
    svcs = services(600)
    backend.sync(snapshot(svcs), Changes(full=True))
    before = kernel.chains(4, "nat")
    commits = len(kernel.commits)
    old_port, new_port = node_port_of(10), 32760
    moved = list(svcs)
    moved[10] = dataclasses.replace(svcs[10], node_port=new_port)
    result = backend.sync(snapshot(moved), Changes(full=False))
    assert not result.full
    (nat,) = kernel.commits[commits:]  # nat only: filter is not written
    assert nat.table == "nat"
    on_paths = set(path(before, names.NODEPORTS, "tcp", old_port)) | \
        set(path(kernel.chains(4, "nat"), names.NODEPORTS, "tcp", new_port))
    assert nat.written <= on_paths | {names.NODEPORTS} and nat.written
    assert len(nat.written) <= 4 and nat.deleted == ()
    commits = len(kernel.commits)
    # An endpoint change of a NodePort service leaves the tree alone.
    eps = {s.name: [endpoint_of(i)] for i, s in enumerate(moved)}
    eps[moved[20].name] = [endpoint_of(599 - 20)]
    backend.sync(Snapshot.build(moved, eps, NODE), Changes(full=False))
    assert kernel.commits[commits:]
    assert not [c for commit in kernel.commits[commits:] for c in commit.written
                if c.startswith(names.NODEPORT_PREFIX) or c == names.NODEPORTS]


def test_shrinking_below_leaf_size_deletes_the_tree_chains() -> None:
    kernel = FakeIptables()
    backend = IptablesBackend(CFG, kernel=kernel)
    backend.sync(snapshot(services(100)), Changes(full=True))
    grown = tree_chains(kernel.chains(4, "nat"))
    assert grown
    backend.sync(snapshot(services(10)), Changes(full=False))
    assert grown <= set(kernel.last(4, "nat").deleted)
    assert not tree_chains(kernel.chains(4, "nat"))


def test_stale_tree_chains_are_deleted_by_a_full_sync_and_by_cleanup() -> None:
    stale = names.nodeport_chain("tcp/30720:30975")
    change = full_change("nat", {names.NODEPORTS: ()}, KernelTable(frozenset({stale, "DOCKER"})))
    assert change.delete == [stale]
    assert partial_change("nat", {}, {stale: ()}).delete == [stale]
    saved = save.parse(f"*nat\n:{names.NODEPORTS} - [0:0]\n:{stale} - [0:0]\n:DOCKER - [0:0]\n"
                       f"-A {names.NODEPORTS} -p tcp -j {stale}\nCOMMIT\n")["nat"]
    lines = cleanup_payload(saved)
    assert f"-X {stale}" in lines and "-X DOCKER" not in lines
