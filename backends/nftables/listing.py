"""The nftables backend's tables as ``nft list`` prints them (``netproxy plan --diff``).

Normalised so that a diff shows changes, not listing noise: one line per rule, set/map declaration
line and element, each prefixed by its table and chain or set; elements sorted (a hash set lists in
the kernel's order); elements that carry ``expires`` are dropped (ClientIP affinity entries that
traffic adds and time removes).
"""

from __future__ import annotations

import re
from typing import List, Tuple

from netproxy.backends.listing import run
from netproxy.backends.nftables.names import TABLE
from netproxy.config import ProxyConfig

FAMILIES = ("ip", "ip6")
_OPEN = re.compile(r"^(table|chain|set|map|flowtable)\s+(\S+(?:\s+\S+)?)\s*\{$")


def _elements(text: str) -> List[str]:
    """The elements of one ``elements = { a, b, ... }`` block, split at top-level commas."""
    out: List[str] = []
    cur: List[str] = []
    depth = 0
    for ch in text:
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        depth += ch in "{["
        depth -= ch in "}]"
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return [e for e in out if "expires" not in e]


def normalise(listing: str) -> List[str]:
    """One line per object, grouped by table and chain/set (the kernel lists chains and sets in
    creation order, which differs between a long-lived table and a fresh one) with each chain's
    rules in their order."""
    out: List[Tuple[str, str]] = []
    where: List[Tuple[str, str]] = []
    lines = iter(listing.splitlines())
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        m = _OPEN.match(line)
        if m:
            where.append((m.group(1), m.group(2)))
            continue
        if line == "}":
            if where:
                where.pop()
            continue
        ctx = " ".join(f"{k} {n}" for k, n in where)
        if line.startswith("elements = {"):
            block = line[len("elements = {"):]
            while not block.rstrip().endswith("}"):
                block += " " + next(lines).strip()
            out += sorted((ctx, f"{ctx} element {e}") for e in _elements(block.rstrip()[:-1]))
            continue
        out.append((ctx, f"{ctx} {line}"))
    return [line for _, line in sorted(out, key=lambda item: item[0])]


class NftablesListing:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config

    def kernel(self) -> List[str]:
        text = ""
        tables = run(["nft", "list", "tables"])
        for family in FAMILIES:
            if f"table {family} {TABLE}" in tables.splitlines():
                text += run(["nft", "list", "table", family, TABLE])
        return normalise(text)

    def rendered(self, plan: str) -> List[str]:
        return normalise(run(["nft -f -; nft list ruleset"], stdin=plan, scratch=True))
