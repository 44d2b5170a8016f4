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
from typing import Any, List, Optional, Set, Tuple

from netproxy_lab.checks import SETTLING, TIME_SCALE
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import CLIENT4, CLIENT6, EXT4, EXT6, GATEWAY4, GATEWAY6, NODE_EXT4, NODE_EXT6, Sandbox
from netproxy_lab.traffic import ConnectResult, PendingConnect

_state = {"traced": 0, "this_test": 0}
_DNAT = re.compile(r"DNAT to \[?([0-9a-f.:]+?)\]?:\d+,")


def traced_count() -> int:
    return _state["traced"]


def install(request: Any, monkeypatch: Any) -> None:
    """Trace every batch the test's sandbox sends from now on (the test's monkeypatch undoes it).
    A test that uses no ``proxy`` is left alone: asking for one here would tie it to a combination."""
    if "proxy" not in request.fixturenames or request.node.get_closest_marker("untraced") is not None:
        return
    proxy, sb = request.getfixturevalue("proxy"), request.getfixturevalue("sandbox")
    _state["this_test"] = 0
    monkeypatch.setattr(sb, "start_connect", TracedSandbox(proxy, sb).start_connect)


def _trace_args(sb: Sandbox, address: str, kw: Any) -> Optional[List[str]]:
    v6 = ipaddress.ip_address(address).version == 6
    node_addresses = [NODE_EXT6, GATEWAY6] if v6 else [NODE_EXT4, GATEWAY4]
    flags = [a for n in node_addresses for a in ("--node-address", n)]
    source = kw.get("source") or sb.client
    sources = kw.get("sources") or ()
    if source == sb.node:
        return ["--from-node", *flags]
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


def _predicted(proxy: Proxy, sb: Sandbox, address: str, port: int, kw: Any) -> Optional[Tuple[Set[str], Set[str]]]:
    origin = _trace_args(sb, address, kw)
    if origin is None:
        return None
    to = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    proc = proxy.command("trace", "--kernel", "--source", proxy.source, "--to", to, "--protocol",
                         kw.get("proto", "tcp"), *origin, *proxy.base_flags)
    assert proc.returncode in (0, 2), f"netproxy trace --kernel {to} failed:\n{proc.stderr[-3000:]}"
    targets: Set[str] = set()
    others: Set[str] = set()
    for line in proc.stdout.splitlines()[1:]:
        m = _DNAT.search(line)
        if m:
            targets.add(str(ipaddress.ip_address(m.group(1))))
        else:
            others.add(line.split("%", 1)[1].split("via")[0].strip().split(" ")[0])
    return targets, others


def check(proxy: Proxy, sb: Sandbox, address: str, port: int, kw: Any, res: ConnectResult) -> None:
    """Assert the kernel trace of this batch's first packet covers what the batch saw.  A batch sent
    from several source addresses (``sources``, used round-robin) is checked per source for up to
    three of them: with ClientIP affinity each client has its own endpoint."""
    if SETTLING[0] or kw.get("bind") or kw.get("interval") or (TIME_SCALE > 1 and _state["this_test"]):
        return
    _state["this_test"] += 1
    sources = list(kw.get("sources") or ())
    if not sources:
        _check_group(proxy, sb, address, port, kw, res.sequence)
        return
    distinct = list(dict.fromkeys(sources))
    for src in {distinct[0], distinct[len(distinct) // 2], distinct[-1]}:
        seen = [o for i, o in enumerate(res.sequence) if sources[i % len(sources)] == src]
        _check_group(proxy, sb, address, port, dict(kw, sources=[src]), seen)


def _check_group(proxy: Proxy, sb: Sandbox, address: str, port: int, kw: Any, seen: List[str]) -> None:
    """``seen``: each attempt's outcome, a pod's name or ``!<error>``."""
    got = _predicted(proxy, sb, address, port, kw)
    if got is None:
        return
    targets, others = got
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
    elif errors and errors <= {"refused", "reset"}:
        assert "refused" in others or "not" in others, \
            f"{where}: refused at once, but the trace predicts {sorted(targets)} / {others}"
    elif errors == {"timeout"}:
        assert others & {"dropped", "not"}, f"{where}: dropped, but the trace predicts {sorted(targets)} / {others}"


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
