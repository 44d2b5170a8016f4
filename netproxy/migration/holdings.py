"""What service-proxy rules a node holds now: netproxy's or kube-proxy's, iptables or nftables.

Read, never written: ``iptables-{legacy,nft}-save`` of nat, filter and mangle (both families) and the
nf_tables table list over netlink.  ``netproxy detect`` prints it; ``netproxy migrate`` decides from
it what to remove after programming the new dataplane.

netproxy's iptables chains carry kube-proxy's names (``backends/iptables/names.py``), so a table's
``KUBE-*`` chains are kube-proxy's when any chain only kube-proxy writes is among them
(``backends/iptables/kubeproxy.py``: ``KUBE-SEP-…``, its canary, ``KUBE-FORWARD``,
``KUBE-PROXY-FIREWALL``), and netproxy's otherwise.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from netproxy.backends.base import BackendError
from netproxy.backends.iptables import kubeproxy, names, save
from netproxy.backends.iptables.kernel.restore import RestoreTools, tool

log = logging.getLogger(__name__)

KUBE_PROXY_TABLE = "kube-proxy"
NETPROXY_TABLE = "netproxy"
FLAVOURS = ("legacy", "nft")
_NFT_MARK = re.compile(r"meta mark set meta mark \| (0x[0-9a-f]+)")

Saved = Dict[int, Dict[str, save.SavedTable]]
"""Per family (4, 6), per table name: one flavour's ``iptables-save`` output, parsed."""


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


def existing_tables(flavour: str, family: int) -> FrozenSet[str]:
    """The tables of one flavour and family that exist now, found without creating any: listing a
    legacy table that does not exist would make the kernel create it (an empty one, but a change to
    a node that only reads), so legacy tables come from ``/proc/net/ip*_tables_names`` and
    iptables-nft's from the nf_tables table list."""
    if flavour == "legacy":
        path = f"/proc/net/ip{'6' if family == 6 else ''}_tables_names"
        try:
            with open(path, encoding="ascii") as f:
                return frozenset(f.read().split())
        except OSError:
            return frozenset()  # no legacy tables module loaded: no legacy table
    fam = "ip6" if family == 6 else "ip"
    return frozenset(t for t in kubeproxy.TABLES if fam in nft_tables(t))


def read_iptables(flavour: str, tables: Sequence[str] = kubeproxy.TABLES) -> Saved:
    """One flavour's existing tables of both families (none is created by reading it); a table that
    cannot be listed is left out.  BackendError when the flavour's tools are missing."""
    tools = RestoreTools(flavour)
    tool(4, flavour, "save")
    out: Saved = {}
    for family in (4, 6):
        try:
            present = existing_tables(flavour, family)
        except (BackendError, OSError) as exc:
            log.debug("iptables-%s IPv%d: cannot list the tables: %s", flavour, family, exc)
            continue
        for table in tables:
            if table not in present:
                continue
            try:
                parsed = save.parse(tools.save(family, table))
            except (BackendError, save.SaveParseError) as exc:
                log.debug("iptables-%s IPv%d %s: %s", flavour, family, table, exc)
                continue
            if table in parsed:
                out.setdefault(family, {})[table] = parsed[table]
    return out


def classify_iptables(flavour: str, saved: Saved) -> Optional[Ruleset]:
    """netproxy's or kube-proxy's ``KUBE-*`` rules in one flavour's tables, or None."""
    families: List[int] = []
    kube_proxy = False
    marks: FrozenSet[str] = frozenset()
    for family, tables in sorted(saved.items()):
        chains = {c for t in tables.values() for c in t.chains}
        if any(names.is_owned(c) or kubeproxy.is_kube_proxy(c) for c in chains):
            families.append(family)
            kube_proxy = kube_proxy or any(kubeproxy.is_marker(c) for c in chains)
            if "nat" in tables:
                marks = marks | kubeproxy.masquerade_marks(tables["nat"])
    if not families:
        return None
    return Ruleset("kube-proxy" if kube_proxy else "netproxy", "iptables", flavour, tuple(families), marks)


def nft_marks(table: str, families: Sequence[str]) -> FrozenSet[str]:
    """The marks a table's rules OR into the packet mark, read with ``nft --terse list table`` (rules
    without set elements: seconds less at 10k services; empty without nft)."""
    nft = shutil.which("nft")
    if nft is None:
        return frozenset()
    found: Set[str] = set()
    for fam in families:
        proc = subprocess.run([nft, "--terse", "list", "table", fam, table], capture_output=True, text=True,
                              timeout=120, check=False)
        found.update(hex(int(m, 16)) for m in _NFT_MARK.findall(proc.stdout))
    return frozenset(found)


def nft_tables(table: str) -> FrozenSet[str]:
    """The families (``ip``, ``ip6``) with a table of this name; BackendError when nf_tables is unreadable."""
    from netproxy.backends.nftables.kernel.netlink import NetlinkRunner

    fams: FrozenSet[str] = NetlinkRunner().existing_tables(table)
    return fams


def survey(flavours: Sequence[str] = FLAVOURS, marks: bool = True) -> Holdings:
    """Everything this node holds of netproxy's and kube-proxy's (``marks``: read their masquerade marks)."""
    held = Holdings()
    for flavour in flavours:
        try:
            saved = read_iptables(flavour)
        except BackendError as exc:
            log.debug("iptables-%s: %s", flavour, exc)
            continue
        found = classify_iptables(flavour, saved)
        if found is not None:
            held.rulesets.append(found)
    for owner, table in (("netproxy", NETPROXY_TABLE), ("kube-proxy", KUBE_PROXY_TABLE)):
        try:
            fams = nft_tables(table)
        except (BackendError, OSError) as exc:
            held.unread.append(f"nftables: {exc}")
            break
        if fams:
            families = tuple(4 if f == "ip" else 6 for f in sorted(fams))
            held.rulesets.append(Ruleset(owner, "nftables", "", families,
                                         nft_marks(table, sorted(fams)) if marks else frozenset()))
    return held
