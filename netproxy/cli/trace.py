"""``netproxy trace``: a traced packet's outcomes, as an operator reads them.

The tracing itself is the backend's (``backend.trace``): it follows the rendered rules, touching no
kernel.  This module only parses ``--to`` and prints the answer: each outcome with its share of the
random choices and the chains on the way.
"""

from __future__ import annotations

import ipaddress
from typing import Dict, List, Sequence, Tuple

from netproxy.backends.base import Outcome, Packet


def parse_destination(text: str) -> Tuple[str, int]:
    """``10.96.0.10:53`` or ``[fd00::10]:80`` → (address, port); ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not ADDRESS:PORT (port 1..65535)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address") from None
    if getattr(ip, "scope_id", None):
        raise ValueError(f"{host!r}: no %zone allowed")
    return str(ip), int(port)


def report(packet: Packet, outcomes: Sequence[Outcome]) -> str:
    where = "from this node" if packet.hook == "output" else "from the network"
    dest = f"[{packet.daddr}]" if ":" in packet.daddr else packet.daddr
    lines = [f"{packet.proto} {packet.saddr} -> {dest}:{packet.dport} ({where})"]
    merged: Dict[Tuple[str, str, bool, Tuple[str, ...]], float] = {}
    for o in outcomes:
        key = (o.verdict, o.target or "", o.masquerade, o.chains)
        merged[key] = merged.get(key, 0.0) + o.share
    rows: List[str] = []
    for (verdict, target, masq, chains), share in sorted(merged.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        what = {"dnat": f"DNAT to {target}", "accept": "not a service here: untouched",
                "allow": "accepted by netproxy's filter rules (a health-check NodePort)",
                "drop": "dropped", "reject": "refused (ICMP port unreachable)"}.get(verdict, verdict)
        if verdict == "dnat":
            what += ", masqueraded" if masq else ", source kept"
        rows.append(f"  {share * 100:5.1f}%  {what}   via {' > '.join(chains)}")
    return "\n".join(lines + rows) + "\n"
