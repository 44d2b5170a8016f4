"""Parse ``iptables-save`` output: tables → chains (with their declaration lines) → rule lines."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

from netproxy.backends.iptables.diff import KernelTable


@dataclass
class SavedChain:
    name: str
    policy: str
    counters: str
    rules: List[str] = field(default_factory=list)
    """Rule lines as saved, without the ``-A <chain> `` prefix (and without a ``[p:b]`` prefix)."""


@dataclass
class SavedTable:
    name: str
    chains: Dict[str, SavedChain] = field(default_factory=dict)

    def kernel_table(self) -> KernelTable:
        """The chains, and which (built-in chain, target) jumps exist."""
        jumps = set()
        for chain in self.chains.values():
            if chain.policy == "-":
                continue
            for rule in chain.rules:
                target = rule_target(rule)
                if target:
                    jumps.add((chain.name, target))
        return KernelTable(frozenset(self.chains), frozenset(jumps))

    def references_to(self, targets: FrozenSet[str]) -> List[Tuple[str, str]]:
        """(chain, rule) for every rule that jumps to one of ``targets``."""
        return [(c.name, r) for c in self.chains.values() for r in c.rules if rule_target(r) in targets]


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_TARGET = re.compile(r"(?:^|\s)-[jg]\s+(\S+)")


class SaveParseError(ValueError):
    pass


def rule_target(rule: str) -> Optional[str]:
    """The ``-j``/``-g`` target of a saved rule line, if any.

    Quoted strings (comments) are blanked first, so a comment saying "-j X" is not taken for a jump;
    a regex rather than shlex because cleanup scans every rule of a 100k-rule table.
    """
    found = _TARGET.findall(_QUOTED.sub('""', rule))
    return found[-1] if found else None


def parse(text: str) -> Dict[str, SavedTable]:
    """Tables by name. Counter prefixes (``[p:b] -A ...`` with ``-c``) are dropped from rule lines."""
    tables: Dict[str, SavedTable] = {}
    current: Optional[SavedTable] = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = tables.setdefault(line[1:], SavedTable(line[1:]))
        elif line == "COMMIT":
            current = None
        elif current is None:
            raise SaveParseError(f"line {lineno}: {line!r} outside a table")
        elif line.startswith(":"):
            parts = line[1:].split(None, 2)
            if len(parts) < 2:
                raise SaveParseError(f"line {lineno}: bad chain line {line!r}")
            counters = parts[2] if len(parts) > 2 else "[0:0]"
            current.chains[parts[0]] = SavedChain(parts[0], parts[1], counters)
        else:
            if line.startswith("["):
                line = line.split("]", 1)[1].lstrip()
            if not line.startswith("-A "):
                raise SaveParseError(f"line {lineno}: unexpected {line!r}")
            chain, _, rest = line[3:].partition(" ")
            saved = current.chains.get(chain)
            if saved is None:
                raise SaveParseError(f"line {lineno}: rule for undeclared chain {chain!r}")
            saved.rules.append(rest)
    return tables
