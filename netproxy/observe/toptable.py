"""``netproxy top --once``'s output: the figures of netproxy/observe/traffic.py as text that fits an
80-column terminal (one line a service port, one an endpoint under it) or as JSON for scripts."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from typing import List, Optional, Sequence, Tuple

from netproxy.observe.traffic import PortFigures, Report

ACCOUNTING_OFF = ("bytes/packets: not counted (nf_conntrack_acct is 0); to count them, in the node's "
                  "network namespace: sysctl -w net.netfilter.nf_conntrack_acct=1 (connections that start "
                  "after it are counted; netproxy never turns it on itself)")
HEADER = ("SERVICE PORT / ENDPOINT", "STATE", "CONNS", "EST", "NEW/S", "SHARE", "EXPECT", "BYTES")
WIDTHS = (25, 11, 6, 6, 6, 6, 6, 6)
"""Column widths: 79 characters with a space between columns, for a plain 80-column terminal."""


def human(value: Optional[float]) -> str:
    """1234567 → 1.2M; None → -."""
    if value is None:
        return "-"
    for unit in ("", "K", "M", "G", "T"):
        if abs(value) < 1000 or unit == "T":
            return f"{value:.0f}{unit}" if not unit else f"{value:.1f}{unit}"
        value /= 1000
    return "-"  # not reached


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def _rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def rows(ports: Sequence[PortFigures], accounting: bool) -> List[Tuple[str, ...]]:
    """The table's rows: a port's row (its imbalance under SHARE and EXPECT as ``gap N%``: the
    largest difference between an endpoint's share and its expected share), then one row for each
    of its endpoints, then its top clients (``--clients``) under each."""
    out: List[Tuple[str, ...]] = []
    for port in ports:
        total_bytes = sum(e.bytes or 0 for e in port.endpoints) if accounting else None
        out.append((port.name, port.protocol.lower(), str(port.connections), str(port.established),
                    _rate(port.rate), "gap", f"{port.imbalance * 100:.0f}%", human(total_bytes)))
        for ep in port.endpoints:
            out.append(("  " + ep.address, ep.state, str(ep.connections), str(ep.established), _rate(ep.rate),
                        _pct(ep.share), _pct(ep.expected), human(ep.bytes)))
            for client, count in ep.clients:
                out.append((f"    client {client}", "", str(count), "", "", "", "", ""))
        if port.unanswered:
            out.append(("  (not sent to an endpoint)", "", str(port.unanswered), "", "", "", "", ""))
    return out


def table(report: Report, ports: Sequence[PortFigures]) -> str:
    """The text of ``--once -o table``: a name longer than its column gets a line of its own."""
    lines = [f"{report.entries} conntrack entries read; "
             + (f"rates over {report.interval:.1f} s" if report.interval else "no rates (one refresh)")]
    lines.append(_line(HEADER))
    for row in rows(ports, report.accounting):
        if len(row[0]) > WIDTHS[0]:
            lines.append(row[0])
            row = ("",) + row[1:]
        lines.append(_line(row))
    if not ports:
        lines.append("(no connections to a service port)")
    if not report.accounting:
        lines += textwrap.wrap(ACCOUNTING_OFF, 79)
    return "\n".join(lines) + "\n"


def _line(row: Sequence[str]) -> str:
    head = f"{row[0]:<{WIDTHS[0]}} {row[1]:<{WIDTHS[1]}}"
    return (head + "".join(f" {cell:>{w}}" for cell, w in zip(row[2:], WIDTHS[2:]))).rstrip()


def as_json(report: Report, ports: Sequence[PortFigures]) -> str:
    doc = asdict(report)
    doc["ports"] = [asdict(p) for p in ports]
    if not report.accounting:
        doc["accounting_off"] = ACCOUNTING_OFF
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
