"""What service-proxy rules a node holds now: netproxy's or kube-proxy's, iptables or nftables.

Read, never written, through what each backend offers (``netproxy.backends.held``: the iptables
flavours' saves, the nf_tables table list).  ``netproxy detect`` prints it; ``netproxy migrate``
decides from it what to remove after programming the new dataplane.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional, Sequence, Tuple

from netproxy import backends
from netproxy.backends.base import BackendError, Held

log = logging.getLogger(__name__)

FLAVOURS = ("legacy", "nft")


@dataclass(frozen=True)
class Ruleset:
    """One proxy's rules in one dataplane."""

    owner: str
    """``netproxy`` or ``kube-proxy``."""
    dataplane: str
    """``iptables`` or ``nftables``."""
    flavour: str = ""
    """For iptables: ``legacy`` or ``nft`` (which kernel tables hold them)."""
    families: Tuple[int, ...] = ()
    marks: FrozenSet[str] = frozenset()
    """The masquerade marks its rules set (``0x4000``); empty when none could be read."""

    @classmethod
    def of(cls, found: Held, dataplane: str, flavour: str = "") -> Ruleset:
        return cls(found.owner, dataplane, flavour, found.families, found.marks)

    @property
    def label(self) -> str:
        return f"{self.dataplane}-{self.flavour}" if self.flavour else self.dataplane

    def __str__(self) -> str:
        fams = ", ".join(f"IPv{f}" for f in self.families)
        return f"{self.owner}'s {self.label} rules" + (f" ({fams})" if fams else "")


@dataclass
class Holdings:
    rulesets: List[Ruleset] = field(default_factory=list)
    unread: List[str] = field(default_factory=list)
    """What could not be read, and why (a missing tool is not listed: nothing of it can be there)."""

    def find(self, owner: str, dataplane: Optional[str] = None) -> List[Ruleset]:
        return [r for r in self.rulesets if r.owner == owner and dataplane in (None, r.dataplane)]


def survey(flavours: Sequence[str] = FLAVOURS, marks: bool = True) -> Holdings:
    """Everything this node holds of netproxy's and kube-proxy's (``marks``: read their masquerade marks)."""
    held = Holdings()
    for flavour in flavours:
        try:
            found = backends.held("iptables", flavour)
        except BackendError as exc:
            log.debug("iptables-%s: %s", flavour, exc)
            continue
        held.rulesets.extend(Ruleset.of(h, "iptables", flavour) for h in found)
    try:
        held.rulesets.extend(Ruleset.of(h, "nftables") for h in backends.held("nftables", marks=marks))
    except (BackendError, OSError) as exc:
        held.unread.append(f"nftables: {exc}")
    return held
