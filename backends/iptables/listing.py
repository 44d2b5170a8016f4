"""The iptables backend's rules as ``iptables-save`` lists them (``netproxy plan --diff``).

Only what netproxy owns is kept: the declarations and rules of ``KUBE-`` chains, and rules of the
built-in chains that jump to one.  Counters are dropped (traffic moves them).
"""

from __future__ import annotations

import re
import shlex
from typing import Dict, List, Tuple

from netproxy.backends.iptables.restore import tool
from netproxy.backends.listing import run
from netproxy.config import ProxyConfig

PREFIX = "KUBE-"
_FAMILY = re.compile(r"^# IPv([46]) ")
_JUMP = re.compile(r"\s-[jg]\s+" + PREFIX)


def _ours(save: str, family: int) -> List[str]:
    """Our lines, declarations first (sorted: chain order is creation order), then each chain's rules
    in order (chains sorted by name, for the same reason)."""
    decls: List[str] = []
    rules: List[Tuple[str, str]] = []
    table = ""
    for line in save.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":" + PREFIX):
            decls.append(f"ipv{family} {table} :{line[1:].split()[0]}")
        elif line.startswith("-A "):
            chain = line.split(None, 2)[1]
            if chain.startswith(PREFIX) or _JUMP.search(line):
                rules.append((f"{table} {chain}", f"ipv{family} {table} {line}"))
    return sorted(decls) + [line for _, line in sorted(rules, key=lambda item: item[0])]


def split_plan(plan: str) -> Dict[int, str]:
    """The plan text per family (it holds one restore payload per family, each under a header)."""
    parts: Dict[int, List[str]] = {}
    family = 4
    for line in plan.splitlines():
        m = _FAMILY.match(line)
        if m:
            family = int(m.group(1))
        parts.setdefault(family, []).append(line)
    return {f: "\n".join(lines) + "\n" for f, lines in parts.items()}


class IptablesListing:
    def __init__(self, config: ProxyConfig) -> None:
        self.flavour = config.iptables_flavour

    def kernel(self) -> List[str]:
        out: List[str] = []
        for family in (4, 6):
            out += _ours(run([tool(family, self.flavour, "save")]), family)
        return out

    def rendered(self, plan: str) -> List[str]:
        out: List[str] = []
        for family, payload in sorted(split_plan(plan).items()):
            restore, save = (shlex.quote(tool(family, self.flavour, v)) for v in ("restore", "save"))
            out += _ours(run([f"{restore} --noflush; {save}"], stdin=payload, scratch=True), family)
        return out
