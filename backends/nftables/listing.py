"""The nftables backend's tables as ``nft list`` prints them (``netproxy plan --diff``).

Normalised so that a diff shows changes, not listing noise: one line per rule, set/map declaration
line and element, each prefixed by its table and chain or set; elements sorted (a hash set lists in
the kernel's order); elements that carry ``expires`` are dropped (ClientIP affinity entries that
traffic adds and time removes), and so is the table stamp (stamp.py: the generation of the last
commit, which a plan does not have).
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Tuple

from netproxy.backends.base import Outcome, Packet
from netproxy.backends.listing import run
from netproxy.backends.nftables.names import STAMP, TABLE
from netproxy.core.config import ProxyConfig

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
            if where and where[-1] == ("set", STAMP):
                continue
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

    def programmed(self) -> List[Tuple[str, str, Tuple[str, ...]]]:
        return programmed(self.kernel())

    def trace(self, packet: Packet) -> List[Outcome]:
        """The rendered rules' tracer, run on the tables read back from the kernel over netlink."""
        from netproxy.backends.nftables.kernel.readback import read_kernel
        from netproxy.backends.nftables.trace import Tracer

        kernel = read_kernel()
        if packet.family not in kernel.tables:
            return [Outcome("accept")]
        outcomes: List[Outcome] = Tracer(kernel, packet.family).trace(packet)
        return outcomes

    def rendered(self, plan: str) -> List[str]:
        return normalise(run(["nft -f -; nft list ruleset"], stdin=plan, scratch=True))


_ELEMENT = re.compile(r"^table (\S+) \S+ map (\S+) element (.*)$")
_RULE = re.compile(r"^table (\S+) \S+ chain (\S+) (.*)$")
_DISPATCH = re.compile(r'^(?P<key>.*?)(?: comment "(?P<svc>[^"]*?)(?: d:[0-9a-f]{16})?")? : goto (?P<chain>\S+)$')
FRONTS = {"service-ips": False, "no-endpoint-services": False, "service-nodeports": True,
          "no-endpoint-nodeports": True}
"""The dispatch maps: name → whether keyed by nodePort (protocol . port) rather than address . protocol . port."""


def programmed(lines: Iterable[str]) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """(service, "address:port/proto", endpoints or ("reject",)) for every service port the tables
    dispatch, read from a normalised listing (``netproxy status --kernel``)."""
    elements: Dict[Tuple[str, str], List[str]] = {}
    uses: Dict[Tuple[str, str], List[str]] = {}
    for line in lines:
        m = _ELEMENT.match(line)
        if m:
            elements.setdefault((m.group(1), m.group(2)), []).append(m.group(3))
            continue
        m = _RULE.match(line)
        if m:
            maps = [n for n in re.findall(r"map @(\S+)", m.group(3)) if not n.startswith("affinity-")]
            uses.setdefault((m.group(1), m.group(2)), []).extend(maps)
    out: List[Tuple[str, str, Tuple[str, ...]]] = []
    for (family, name), by_nodeport in [(k, FRONTS[k[1]]) for k in sorted(elements) if k[1] in FRONTS]:
        for element in elements[(family, name)]:
            d = _DISPATCH.match(element)
            if d is None:
                continue
            parts = [p.strip() for p in d.group("key").split(" . ")]
            if by_nodeport:
                proto, port = parts[0], parts[1]
                front, prefix = f"*:{port}/{proto}", f"{port} . "
            else:
                addr, proto, port = parts[0], parts[1], parts[2]
                front = f"[{addr}]:{port}/{proto}" if ":" in addr else f"{addr}:{port}/{proto}"
                prefix = f"{addr} . {port} . "
            if d.group("chain") == "reject-packet":
                out.append((d.group("svc") or "", front, ("reject",)))
                continue
            # A map of one endpoint is keyed by address . port alone, one of several by address . port . n.
            eps = [_endpoint(e.split(" : ", 1)[1]) for m in uses.get((family, d.group("chain")), ())
                   for e in elements.get((family, m), ())
                   if " : " in e and (e.split(" : ", 1)[0] + " . ").startswith(prefix)]
            out.append((d.group("svc") or "", front, tuple(sorted(eps))))
    return sorted(out)


def _endpoint(value: str) -> str:
    addr, _, port = value.rpartition(" . ")
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
