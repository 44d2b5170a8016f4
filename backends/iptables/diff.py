"""What to write: the desired rules against what the kernel (or our record of it) holds.

Every writer (kernel/) applies the same :class:`TableChange`, so they cannot disagree on what a sync means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

from netproxy.backends.iptables import names
from netproxy.backends.iptables.assemble import JUMPS
from netproxy.backends.iptables.tree import Chains, Rule


@dataclass(frozen=True)
class KernelTable:
    """What a full sync needs to know of one kernel table: its chains, and which built-in chains
    already jump to which of our chains."""

    chains: FrozenSet[str] = frozenset()
    jumps: FrozenSet[Tuple[str, str]] = frozenset()
    """(built-in chain, target) pairs present in the kernel."""
    fingerprint: Optional[bytes] = field(default=None, compare=False)
    """Legacy tables read with ``fingerprint=True``: the table's fingerprint (kernel/stamp.py) from
    the same read, and its header (``IPT_SO_GET_INFO``), to tell later whether it changed since."""
    header: Optional[bytes] = field(default=None, compare=False)


@dataclass
class TableChange:
    """One table's write: chains to (create and) fill, chains to delete, jump rules to insert."""

    table: str
    write: Dict[str, Tuple[Rule, ...]] = field(default_factory=dict)
    delete: List[str] = field(default_factory=list)
    jumps: List[Tuple[str, Rule]] = field(default_factory=list)
    existing: FrozenSet[str] = frozenset()
    """Chains known to exist before the write (a full sync's kernel read; our record otherwise)."""

    def empty(self) -> bool:
        return not (self.write or self.delete or self.jumps)

    def rule_count(self) -> int:
        return sum(len(r) for r in self.write.values()) + len(self.jumps)


STALE_EXACT = frozenset({names.MASQ_NONCLUSTER, names.HAIRPIN})
"""Exactly named chains that only our own chains jump to, so a full sync may delete them: KUBE-HAIRPIN
is an earlier version's hairpin tree (an ipset replaced it), whose KUBE-HP- chains could not be
deleted while it still jumped to them."""


def full_change(table: str, desired: Chains, kernel: KernelTable) -> TableChange:
    """Rewrite every chain we own, delete our stale per-service chains, add missing jump rules.

    Only per-service prefixes (KUBE-SVC-, KUBE-SEP-, ...) count as stale here: the chains of kube-proxy's
    old userspace mode (KUBE-PORTALS-*, KUBE-NODEPORT-CONTAINER/-HOST) are still jumped to from built-in
    chains until ``cleanup`` removes them with those jumps.
    """
    stale = sorted(c for c in kernel.chains
                   if (c.startswith(names.OWNED_PREFIXES) or c in STALE_EXACT) and c not in desired)
    jumps = [(hook, rule) for hook, target, rule in JUMPS[table] if (hook, target) not in kernel.jumps]
    return TableChange(table, dict(desired), stale, jumps, kernel.chains)


def partial_change(table: str, desired: Chains, written: Mapping[str, Tuple[Rule, ...]]) -> TableChange:
    """Only chains whose rules differ from what we last wrote; chains we wrote and no longer want."""
    write = {c: rules for c, rules in desired.items() if written.get(c) != rules}
    delete = sorted(c for c in written if c not in desired)
    return TableChange(table, write, delete, [], frozenset(written))
