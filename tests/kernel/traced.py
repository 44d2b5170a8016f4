"""Trace equals traffic: every connection batch a parity test sends is also traced with
``netproxy trace --kernel`` in the node, and the tracer's answer must cover what the batch saw.

- answered connections: every pod that answered is a DNAT target the trace predicts (the pods'
  addresses; the random choice makes "all predicted were reached" a matter of the test's own counts);
- refused at once: the trace predicts a refusal; every attempt timed out: a drop, or "untouched"
  (no rule took the packet, the kernel's own path dropped it);
- an "untouched" prediction may be answered only by the destination itself.

Batches whose outcome the rules do not decide alone are not traced: a fixed source port (``bind``:
conntrack keeps the flow's old NAT binding, which is what the UDP conntrack test checks), paced
flows running while a test changes endpoints (``interval``), and batches sent inside a wait loop
while a change is still on its way to the kernel (any :func:`netproxy_lab.checks.wait_for` loop).

Under software emulation (the VM matrix: ``NETPROXY_TEST_TIME_SCALE`` > 1) a ``netproxy trace``
process costs seconds, so there only the first batch of each test is traced.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pytest

from netproxy_lab.checks import SETTLING, TIME_SCALE
from netproxy_lab.proxy import Proxy
from netproxy_lab.pytest_plugin import CALL_REPORT
from netproxy_lab.topology import CLIENT4, CLIENT6, EXT4, EXT6, GATEWAY4, GATEWAY6, NODE_EXT4, NODE_EXT6, Sandbox
from netproxy_lab.traffic import ConnectResult, PendingConnect

_state = {"traced": 0, "this_test": 0}
_DNAT = re.compile(r"DNAT to \[?([0-9a-f.:]+?)\]?:\d+, (masqueraded|source kept)")


def traced_count() -> int:
    return _state["traced"]


def install(request: Any, monkeypatch: Any) -> Iterator[None]:
    """Trace every batch the test's sandbox sends (the test's monkeypatch undoes it), and, once the
    test passed, require that at least one was traced: a check that never ran would otherwise pass
    unseen (a skipped or failed test is not asked).  A test that uses no ``proxy`` is left alone:
    asking for one here would tie it to a combination; one marked ``untraced`` says why in its
    marker's comment.  A generator for an autouse fixture to ``yield from``."""
    if "proxy" not in request.fixturenames or request.node.get_closest_marker("untraced") is not None:
        yield
        return
    proxy, sb = request.getfixturevalue("proxy"), request.getfixturevalue("sandbox")
    _state["this_test"] = 0
    monkeypatch.setattr(sb, "start_connect", TracedSandbox(proxy, sb).start_connect)
    before = _state["traced"]
    yield
    report = request.node.stash.get(CALL_REPORT, None)
    if report is not None and report.passed and _state["traced"] == before:
        pytest.fail("trace equals traffic: not one batch of this test was traced (only untraceable batches: "
                    "mark it untraced and say why)", pytrace=False)


def _trace_args(sb: Sandbox, address: str, kw: Any) -> Optional[List[str]]:
    v6 = ipaddress.ip_address(address).version == 6
    node_addresses = [NODE_EXT6, GATEWAY6] if v6 else [NODE_EXT4, GATEWAY4]
    flags = [a for n in node_addresses for a in ("--node-address", n)]
    source = kw.get("source") or sb.client
    sources = kw.get("sources") or ()
    if source == sb.node:  # from the node: its own address, or the one it binds (e.g. an LB IP it holds)
        return ["--from-node", *(("--from", sources[0]) if sources else ()), *flags]
    # The node-side interface the packet comes in on (the sandbox names them; detect-local-mode
    # BridgeInterface / InterfaceNamePrefix decide by it).
    if source == sb.client:
        return ["--from", sources[0] if sources else CLIENT6 if v6 else CLIENT4, "--from-interface", "v-client",
                *flags]
    if source == sb.ext:
        return ["--from", sources[0] if sources else EXT6 if v6 else EXT4, "--from-interface", "ext0", *flags]
    pod = next((p for p in sb.pods if p.netns == source), None)
    if pod is not None:
        role = pod.netns.split("-")[1]  # np-pod<n>-<id>: the node side is v-pod<n>
        return ["--from", sources[0] if sources else (pod.ip6 if v6 else pod.ip) or pod.ip,
                "--from-interface", f"v-{role}"[:15], *flags]
    return None


Prediction = Tuple[Set[str], Set[str], Dict[str, Set[bool]]]
"""DNAT targets, the other outcomes, and per target whether the trace masquerades it."""


def _predicted(proxy: Proxy, sb: Sandbox, address: str, port: int, kw: Any) -> Optional[Prediction]:
    origin = _trace_args(sb, address, kw)
    if origin is None:
        return None
    to = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    proc = proxy.command("trace", "--kernel", "--source", proxy.source, "--to", to, "--protocol",
                         kw.get("proto", "tcp"), *origin, *proxy.base_flags)
    assert proc.returncode in (0, 2), f"netproxy trace --kernel {to} failed:\n{proc.stderr[-3000:]}"
    targets: Set[str] = set()
    others: Set[str] = set()
    masq: Dict[str, Set[bool]] = {}
    for line in proc.stdout.splitlines()[1:]:
        m = _DNAT.search(line)
        if m:
            target = str(ipaddress.ip_address(m.group(1)))
            targets.add(target)
            masq.setdefault(target, set()).add(m.group(2) == "masqueraded")
        else:
            others.add(line.split("%", 1)[1].split("via")[0].strip().split(" ")[0])
    return targets, others, masq


def _client_address(sb: Sandbox, address: str, kw: Any) -> Optional[str]:
    """The address the batch's connections leave from, where the test knows it: the pods then see
    it when the source is kept and a node address when it is masqueraded.  None from the node
    itself (both look alike there)."""
    v6 = ipaddress.ip_address(address).version == 6
    source, sources = kw.get("source") or sb.client, kw.get("sources") or ()
    if source == sb.node or len(set(sources)) > 1:
        return None
    if sources:
        return str(sources[0])
    if source == sb.client:
        return CLIENT6 if v6 else CLIENT4
    if source == sb.ext:
        return EXT6 if v6 else EXT4
    pod = next((p for p in sb.pods if p.netns == source), None)
    return None if pod is None else str(pod.ip6 if v6 else pod.ip)


def check(proxy: Proxy, sb: Sandbox, address: str, port: int, kw: Any, res: ConnectResult) -> None:
    """Assert the kernel trace of this batch's first packet covers what the batch saw.  A batch sent
    from several source addresses (``sources``, used round-robin) is checked per source for up to
    three of them: with ClientIP affinity each client has its own endpoint."""
    if SETTLING[0] or kw.get("bind") or kw.get("interval") or (TIME_SCALE > 1 and _state["this_test"]):
        return
    _state["this_test"] += 1
    sources = list(kw.get("sources") or ())
    if not sources:
        _check_group(proxy, sb, address, port, kw, res.sequence, res)
        return
    distinct = list(dict.fromkeys(sources))
    for src in {distinct[0], distinct[len(distinct) // 2], distinct[-1]}:
        seen = [o for i, o in enumerate(res.sequence) if sources[i % len(sources)] == src]
        _check_group(proxy, sb, address, port, dict(kw, sources=[src]), seen)


def _check_group(proxy: Proxy, sb: Sandbox, address: str, port: int, kw: Any, seen: List[str],
                 res: Optional[ConnectResult] = None) -> None:
    """``seen``: each attempt's outcome, a pod's name or ``!<error>``; ``res``: the whole batch, when
    ``seen`` is all of it (the sources each pod saw are then checked against the trace's masquerade)."""
    got = _predicted(proxy, sb, address, port, kw)
    if got is None:
        return
    targets, others, masq = got
    _state["traced"] += 1
    by_name = {p.name: p for p in sb.pods}
    answered = {o for o in seen if o and not o.startswith("!")}
    errors = {o[1:] for o in seen if o.startswith("!")}
    where = f"{kw.get('proto', 'tcp')} {address}:{port} from {kw.get('sources') or kw.get('source') or 'client'}"
    if answered:
        assert targets or "not" in others, f"{where}: answered by {answered}, but the trace predicts {others}"
        missing = sorted(n for n in answered if n in by_name
                         and not ({by_name[n].ip, by_name[n].ip6} & (targets | {address})))
        assert not missing, f"{where}: answered by {missing}, which the trace does not predict ({sorted(targets)})"
        client = _client_address(sb, address, kw)
        if res is not None and client is not None:
            _check_masquerade(where, client, masq, res, by_name)
    elif errors and errors <= {"refused", "reset"}:
        assert "refused" in others or "not" in others, \
            f"{where}: refused at once, but the trace predicts {sorted(targets)} / {others}"
    elif errors == {"timeout"}:
        assert others & {"dropped", "not"}, f"{where}: dropped, but the trace predicts {sorted(targets)} / {others}"


def _check_masquerade(where: str, client: str, masq: Dict[str, Set[bool]], res: ConnectResult,
                      by_name: Dict[str, Any]) -> None:
    """Each answering pod saw the client's own address exactly when the trace keeps the source for it
    (a pod reaching itself through its service is masqueraded: hairpin)."""
    for name, seen in res.sources.items():
        pod = by_name.get(name)
        predicted = set().union(*(masq.get(a, set()) for a in (pod.ip, pod.ip6) if a)) if pod else set()
        if len(predicted) != 1:
            continue  # not a DNAT target the trace names, or both answers (checked above)
        masqueraded = predicted.pop()
        assert (client in seen) != masqueraded, (
            f"{where}: pod {name} saw sources {sorted(seen)} (the client is {client}), but the trace "
            f"predicts {'masqueraded' if masqueraded else 'source kept'}")


class TracedSandbox:
    """Wraps a sandbox's ``start_connect`` (which its ``connect`` calls too) so that each batch is
    checked by :func:`check` when its result is taken."""

    def __init__(self, proxy: Proxy, sb: Sandbox) -> None:
        self.proxy, self.sb = proxy, sb
        self.start_real = sb.start_connect

    def start_connect(self, address: str, port: int, **kw: Any) -> PendingConnect:
        pending = self.start_real(address, port, **kw)
        real_result = pending.result

        def result() -> ConnectResult:
            res = real_result()
            check(self.proxy, self.sb, address, port, kw, res)
            return res

        pending.result = result  # type: ignore[method-assign]
        return pending
