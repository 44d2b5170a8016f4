"""netproxy's answer to a kube-proxy flow: the table's node as ``netproxy trace`` flags, its objects
as the snapshot ``trace`` loads, the flow as the packet ``trace`` follows through the backend's own
rendered rules (``backend.trace``: no kernel), summed up as kube-proxy states its answers.

Two things a table gives that the command line would read from the node instead: the node's
addresses (what ``--dst-type LOCAL`` / ``fib daddr type local`` match, and which addresses
``--nodeport-addresses`` CIDRs select) come from the table, plus loopback, as on any node.  A flow
whose source is one of those addresses is the node's own (nat OUTPUT); any other arrives (PREROUTING).
"""

from __future__ import annotations

import ipaddress
from typing import Dict, Iterable, List, Optional, Tuple

from netproxy.backends.base import Backend, Outcome, Packet
from netproxy.cli import oneshot
from netproxy.cli.args import build_parser
from netproxy.cli.settings import make_backend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import IPAddress, NodeInfo, Snapshot
from netproxy.source.files import Loaded, flatten, parse_objects
from tests.conformance.tables import Answer, Case, Flow, Node, State

LOOPBACK = ("127.0.0.1", "::1")
BACKENDS = ("iptables", "nftables")
_VERDICTS = {"drop": "DROP", "reject": "REJECT", "accept": "", "allow": "ACCEPT"}
"""Tracer verdicts in kube-proxy's words: ``accept`` is untouched (no rule of netproxy's took it),
``allow`` an accept of netproxy's own filter rules (kube-proxy's ACCEPT)."""


def backend(mode: str, node: Node, info: Optional[NodeInfo]) -> Tuple[Backend, ProxyConfig]:
    """netproxy's ``mode`` backend configured by the table's flags, as ``netproxy trace`` builds it."""
    argv = ["trace", "--to", "192.0.2.1:1", "--backend", mode, "--iptables-flavour", "legacy",
            "--hostname-override", node.name, *node.flags]
    args = build_parser().parse_args(argv)
    return make_backend(args, info)


def local_addresses(node: Node) -> Tuple[str, ...]:
    return tuple(str(ipaddress.ip_address(a)) for a in (*node.addresses, *LOOPBACK))


def load(node: Node, state: State) -> Loaded:
    """The state's objects and the node's ``v1 Node``, as ``--source`` loads them (none rejected)."""
    loaded = parse_objects(flatten(state.manifests(node)), node.name)
    if loaded.errors:
        raise AssertionError(f"netproxy rejects objects of the table: {[str(e) for e in loaded.errors]}")
    return loaded


def snapshot(config: ProxyConfig, node: Node, loaded: Loaded) -> Snapshot:
    """The loaded state as the snapshot a one-shot command takes (``netproxy.cli.oneshot``'s own), the
    NodePort addresses being the table's node addresses inside ``--nodeport-addresses``."""
    def addresses() -> List[IPAddress]:
        addrs = [ipaddress.ip_address(a) for a in local_addresses(node)]
        return sorted((a for a in addrs if any(a.version == n.version and a in n for n in config.nodeport_addresses)),
                      key=lambda a: (a.version, a))

    return oneshot.snapshot_of(loaded, config, addresses)[0]


def packet(node: Node, flow: Flow) -> Packet:
    local = frozenset(local_addresses(node))
    source = str(ipaddress.ip_address(flow.source))
    return Packet(source, str(ipaddress.ip_address(flow.destination)), flow.port, flow.protocol.lower(),
                  hook="output" if source in local else "prerouting", local=local)


def summed(outcomes: Iterable[Outcome]) -> Answer:
    """Every way the packet can go, as one answer in kube-proxy's words: the endpoints it may reach
    (or DROP / REJECT / untouched), and whether it is masqueraded (None: on some ways only)."""
    outputs: List[str] = []
    masqs = set()
    for o in outcomes:
        outputs.append(o.target or "" if o.verdict == "dnat" else _VERDICTS.get(o.verdict, o.verdict.upper()))
        masqs.add(o.masquerade)
    distinct = sorted(set(outputs))
    output = distinct[0] if len(distinct) == 1 else ", ".join(d or "untouched" for d in distinct)
    return Answer.of(output, masqs.pop() if len(masqs) == 1 else None)


class Answers:
    """netproxy's answers for one case's state on one backend (rendered once per state)."""

    def __init__(self, mode: str, case: Case, state: State) -> None:
        self.node = case.node
        loaded = load(case.node, state)
        self.backend, config = backend(mode, case.node, loaded.node)
        self.snapshot = snapshot(config, case.node, loaded)
        self._seen: Dict[str, Answer] = {}

    def __call__(self, flow: Flow) -> Answer:
        got = self._seen.get(flow.key)
        if got is None:
            # Not part of the Backend protocol (the fake backend has none): both real backends have it.
            tracer = getattr(self.backend, "trace", None)
            assert tracer is not None, f"the {self.backend.name} backend has no tracer"
            got = self._seen[flow.key] = summed(tracer(self.snapshot, packet(self.node, flow)))
        return got
