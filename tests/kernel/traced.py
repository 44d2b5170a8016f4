"""Trace equals traffic (issue 17): every connection batch a parity test sends is also traced with
``netproxy trace --kernel`` in the node, and the tracer's answer must cover what the batch saw.

- answered connections: every pod that answered is a DNAT target the trace predicts (the pods'
  addresses; the random choice makes "all predicted were reached" a matter of the test's own counts);
- refused at once: the trace predicts a refusal; every attempt timed out: a drop, or "untouched"
  (no rule took the packet, the kernel's own path dropped it);
- an "untouched" prediction may be answered only by the destination itself.

Batches whose outcome the rules do not decide alone are not traced: a fixed source port (``bind``:
conntrack keeps the flow's old NAT binding, which is what the UDP conntrack test checks), paced
flows running while a test changes endpoints (``interval``), and batches sent inside a wait loop
while a change is still on its way to the kernel (:func:`settling`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from typing import Any, Iterator, List, Optional, Set, Tuple

from harness import Proxy

from netproxy.sandbox import (
    CLIENT4,
    CLIENT6,
    EXT4,
    EXT6,
    GATEWAY4,
    GATEWAY6,
    NODE_EXT4,
    NODE_EXT6,
    ConnectResult,
    PendingConnect,
    Sandbox,
)

_state = {"settling": 0, "traced": 0}
_DNAT = re.compile(r"DNAT to \[?([0-9a-f.:]+?)\]?:\d+,")


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """Batches sent in here are not traced: the kernel may change between the batch and its trace."""
    _state["settling"] += 1
    try:
        yield
    finally:
        _state["settling"] -= 1


def traced_count() -> int:
    return _state["traced"]


def _trace_args(sb: Sandbox, address: str, kw: Any) -> Optional[List[str]]:
    v6 = ipaddress.ip_address(address).version == 6
    node_addresses = [NODE_EXT6, GATEWAY6] if v6 else [NODE_EXT4, GATEWAY4]
    flags = [a for n in node_addresses for a in ("--node-address", n)]
    source = kw.get("source") or sb.client
    sources = kw.get("sources") or ()
    if source == sb.node:
        return ["--from-node", *flags]
    if sources:
        return ["--from", sources[0], *flags]
    if source == sb.client:
        return ["--from", CLIENT6 if v6 else CLIENT4, *flags]
    if source == sb.ext:
        return ["--from", EXT6 if v6 else EXT4, *flags]
    pod = next((p for p in sb.pods if p.netns == source), None)
    if pod is not None:
        return ["--from", (pod.ip6 if v6 else pod.ip) or pod.ip, *flags]
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
    """Assert the kernel trace of this batch's first packet covers what the batch saw."""
    if _state["settling"] or kw.get("bind") or kw.get("interval"):
        return
    got = _predicted(proxy, sb, address, port, kw)
    if got is None:
        return
    targets, others = got
    _state["traced"] += 1
    by_name = {p.name: p for p in sb.pods}
    reached = set()
    for name in res.counts:
        pod = by_name.get(name)
        if pod is not None:
            reached |= {a for a in (pod.ip, pod.ip6) if a}
    where = f"{kw.get('proto', 'tcp')} {address}:{port} from {kw.get('source') or 'client'}"
    if res.answered:
        answered_ips = {a for a in reached if a in targets or a == address}
        missing = [n for n in res.counts if not ({by_name[n].ip, by_name[n].ip6} & answered_ips)] \
            if reached else []
        assert targets or "not" in others, f"{where}: answered by {res.counts}, but the trace predicts {others}"
        assert not missing, f"{where}: answered by {missing}, which the trace does not predict ({sorted(targets)})"
    elif res.failed and set(res.errors) <= {"refused", "reset"}:
        assert "refused" in others or "not" in others, \
            f"{where}: refused at once, but the trace predicts {sorted(targets)} / {others}"
    elif res.failed and set(res.errors) == {"timeout"}:
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
