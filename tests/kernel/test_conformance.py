"""kube-proxy's packet-flow tables by traffic: a sample of every table (``tests/conformance/sample.py``)
sent through netproxy in namespaces, so that the rendered-rule trace (``tests/conformance/test_trace.py``)
and the kernel give one answer.

One sandbox per table and combination, built to the table: a pod for every endpoint address (the
table's own addresses, IPv4 and IPv6), the table's node addresses on the node, each flow's source
where such a packet comes from — a pod-network address on the client, an endpoint's own address in
that pod (hairpin), a node address or 127.0.0.1 on the node itself, anything else on ``ext``
(off-cluster, beyond the node's default route).  Each state is one ``netproxy sync`` of its objects
with the table's flags on an emptied node; its flows then run at once, each a batch of connections.

A flow's answer must be the table's (or, where ``differences.yaml`` lists the flow for this backend,
netproxy's listed answer), by traffic and by trace:

- endpoints: answered by exactly those pods (every one of them, in 10 connections an endpoint), each
  seeing the client's own address (not masqueraded) or another (masqueraded);
- DROP: every attempt times out; REJECT: refused at once; untouched (or kube-proxy's filter ACCEPT):
  no pod answers (the node's own stack refuses or the packet dies beyond it).

The traffic shows which pod answered, not on which of its ports: the target port is the trace's.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import pytest

from netproxy_lab.combos import Combo
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import Pod, Sandbox
from netproxy_lab.traffic import ConnectResult, PendingConnect
from tests.conformance import differences
from tests.conformance.netproxy_answer import Answers, local_addresses
from tests.conformance.sample import SAMPLE
from tests.conformance.tables import Answer, Case, Flow, State, Table, flow_id, load_all

pytestmark = [pytest.mark.kernel, pytest.mark.quick_combos("nftables", "iptables-legacy/restore")]

TABLES: Dict[str, Table] = {t.name: t for t in load_all()}
DIFFERENCES = differences.load()
POD_NETWORKS = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00:10::/64"))
"""The tables' pod addresses (their cluster CIDRs): such a source is a pod on this node (the client)."""
PER_ENDPOINT = 10
"""Connections per expected endpoint: all three of three are reached but for 3 x (2/3)^30, 1.6e-5."""


@dataclass
class Sent:
    flow: Flow
    expect: Answer
    traced: Answer
    pending: PendingConnect


def picked(table: Table) -> List[Tuple[Case, State, List[Flow]]]:
    """The sampled flows of ``table``, grouped by the state (one sync) they run in."""
    wanted = {f"{table.name}::{s}" for s in SAMPLE[table.name]}
    out: List[Tuple[Case, State, List[Flow]]] = []
    for case in table.cases:
        for state in case.states:
            flows = [f for f in state.flows if flow_id(case, state, f) in wanted]
            if flows:
                out.append((case, state, flows))
    return out


def _endpoint_addresses(groups: Sequence[Tuple[Case, State, List[Flow]]]) -> List[str]:
    seen: Dict[str, None] = {}
    for _, state, _ in groups:
        for obj in state.objects:
            if obj.get("kind") == "EndpointSlice":
                for ep in obj.get("endpoints") or ():
                    for a in ep.get("addresses") or ():
                        seen[str(ipaddress.ip_address(a))] = None
    return list(seen)


def _ports(groups: Sequence[Tuple[Case, State, List[Flow]]], proto: str) -> Tuple[int, ...]:
    ports = {p["port"] for _, state, _ in groups for obj in state.objects if obj.get("kind") == "EndpointSlice"
             for p in obj.get("ports") or () if p.get("protocol", "TCP") == proto}
    return tuple(sorted(ports)) or (80,)


def _add_address(sb: Sandbox, ns: str, ifname: str, address: str) -> None:
    v6 = ":" in address
    argv = ["ip", *(["-6"] if v6 else []), "addr", "add", f"{address}/{128 if v6 else 32}", "dev", ifname]
    sb.exec(ns, argv + (["nodad"] if v6 else []), check=True)


class TableSandbox:
    """A sandbox wired to one table's addresses (see the module's docstring)."""

    def __init__(self, sb: Sandbox, groups: Sequence[Tuple[Case, State, List[Flow]]]) -> None:
        self.sb = sb
        self.pods: Dict[str, Pod] = {}
        for i, address in enumerate(_endpoint_addresses(groups)):
            v6 = ":" in address
            self.pods[address] = sb.add_pod(f"ep-{i}", ip=None if v6 else address, ip6=address if v6 else None)
        self.by_name = {p.name: addr for addr, p in self.pods.items()}
        node = groups[0][0].node
        self.local = set(local_addresses(node))
        for a in node.addresses:  # on lo: local addresses of the node, beside the lab's own
            _add_address(sb, sb.node, "lo", str(ipaddress.ip_address(a)))
        self._placed: Set[str] = set()

    def origin(self, source: str) -> Tuple[str, List[str]]:
        """(namespace, source addresses to bind) for a flow from ``source``, wiring it on first use."""
        sb = self.sb
        if source in self.pods:
            return self.pods[source].netns, []
        if source in self.local:
            return sb.node, [source]
        ip = ipaddress.ip_address(source)
        ns = sb.client if any(ip.version == n.version and ip in n for n in POD_NETWORKS) else sb.ext
        if source not in self._placed:
            _add_address(sb, ns, "eth0", source)
            if ns == sb.client:
                sb.exec(sb.node, ["ip", *(["-6"] if ip.version == 6 else []), "route", "add",
                                  f"{source}/{ip.max_prefixlen}", "dev", "v-client"], check=True)
            self._placed.add(source)
        return ns, [source]


def _sync(proxy: Proxy, case: Case, state: State, workdir: str) -> None:
    source = os.path.join(workdir, "cluster.yaml")
    with open(source, "w") as f:
        f.write("".join("---\n" + json.dumps(o) + "\n" for o in state.manifests(case.node)))
    proc = proxy.command("sync", "--source", source, "--hostname-override", case.node.name,
                         "--iptables-lock-timeout", "60s", *case.node.flags)
    assert proc.returncode == 0, f"netproxy sync of {case.table} {case.subtest} {state.name} exited " \
                                 f"{proc.returncode}:\n{proc.stderr[-3000:]}"


def _start(tsb: TableSandbox, flow: Flow, expect: Answer) -> PendingConnect:
    ns, sources = tsb.origin(flow.source)
    proto = flow.protocol.lower()
    if expect.output in ("DROP", "REJECT", "", "ACCEPT"):
        # Two attempts (the kernel rate-limits ICMP errors); a drop costs its timeout, a refusal none.
        return tsb.sb.start_connect(flow.destination, flow.port, proto=proto, count=2,
                                    timeout=2.0 if expect.output == "REJECT" else 1.0, source=ns, sources=sources)
    n = PER_ENDPOINT * len(expect.output.split(", "))
    return tsb.sb.start_connect(flow.destination, flow.port, proto=proto, count=n, timeout=5.0, source=ns,
                                sources=sources)


def _host(endpoint: str) -> str:
    return str(ipaddress.ip_address(endpoint.rpartition(":")[0].strip("[]")))


def by_traffic(tsb: TableSandbox, flow: Flow, expect: Answer, res: ConnectResult) -> Optional[str]:
    """None when what the batch saw is ``expect``; else what it saw instead."""
    answered = {tsb.by_name.get(n, n) for n, c in res.counts.items() if c}
    errors = {k for k, v in res.errors.items() if v}
    saw = f"answered by {sorted(answered)}, errors {res.errors}, sources {res.sources}"
    if expect.output == "DROP":
        return None if not answered and errors == {"timeout"} else saw
    if expect.output == "REJECT":
        return None if not answered and errors and errors <= {"refused", "reset"} else saw
    if expect.output in ("", "ACCEPT"):
        return None if not answered else saw
    want = {_host(e) for e in expect.output.split(", ")}
    if answered != want or errors:
        return saw
    seen = {str(ipaddress.ip_address(s)) for per_pod in res.sources.values() for s in per_pod}
    source = str(ipaddress.ip_address(flow.source))
    if expect.masq and source in seen:
        return f"not masqueraded: {saw}"
    if not expect.masq and seen != {source}:
        return f"masqueraded: {saw}"
    return None


@pytest.mark.parametrize("table", sorted(SAMPLE))
def test_a_sample_of_the_table_by_traffic(combo: Combo, table: str, tmp_path: Any) -> None:
    groups = picked(TABLES[table])
    udp = _ports(groups, "UDP")
    problems: List[str] = []
    with Sandbox(pods=0, tcp_ports=_ports(groups, "TCP"), udp_ports=udp) as sb:
        tsb = TableSandbox(sb, groups)
        proxy = Proxy(sb, combo, str(tmp_path))
        for i, (case, state, flows) in enumerate(groups):
            if i:  # the sandbox starts empty; a later sync starts from an emptied node too
                sb.reset_netfilter()
            _sync(proxy, case, state, str(tmp_path))
            trace = Answers(combo.backend, case, state)
            sent: List[Sent] = []
            for flow in flows:
                fid = flow_id(case, state, flow)
                listed = differences.find(DIFFERENCES, fid, combo.backend)
                expect = listed.netproxy if listed is not None else flow.expect
                sent.append(Sent(flow, expect, trace(flow), _start(tsb, flow, expect)))
            for s in sent:
                fid = flow_id(case, state, s.flow)
                what = f"{fid} ({s.flow.protocol} {s.flow.source} -> {s.flow.destination}:{s.flow.port})"
                wrong = by_traffic(tsb, s.flow, s.expect, s.pending.result())
                if wrong is not None:
                    problems.append(f"{what}: expected {s.expect}; the traffic: {wrong}")
                if s.traced != s.expect:
                    problems.append(f"{what}: expected {s.expect}; the trace says {s.traced}")
    assert not problems, "\n".join(problems)
