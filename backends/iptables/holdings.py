"""What of netproxy's and kube-proxy's one iptables flavour holds on this node, and removing
kube-proxy's: the iptables side of ``netproxy detect`` and ``netproxy migrate`` (reached through
:mod:`netproxy.backends`, whose callers know no backend's internals).

Read, never written, until a removal is asked for: ``iptables-{legacy,nft}-save`` of nat, filter and
mangle of both families.  netproxy's iptables chains carry kube-proxy's names (:mod:`.names`), so a
table's ``KUBE-*`` chains are kube-proxy's when any chain only kube-proxy writes is among them
(:mod:`.kubeproxy`: ``KUBE-SEP-…``, its canary, ``KUBE-FORWARD``, ``KUBE-PROXY-FIREWALL``), and
netproxy's otherwise.
"""

from __future__ import annotations

import logging
from typing import Dict, FrozenSet, List, Optional, Sequence

from netproxy.backends.base import Backend, BackendError, Held
from netproxy.backends.iptables import kubeproxy, names, save
from netproxy.backends.iptables.assemble import JUMPS
from netproxy.backends.iptables.kernel.restore import RestoreTools, tool

log = logging.getLogger(__name__)

Saved = Dict[int, Dict[str, save.SavedTable]]
"""Per family (4, 6), per table name: one flavour's ``iptables-save`` output, parsed."""


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
    from netproxy.backends.nftables.holdings import families_with_table

    fam = "ip6" if family == 6 else "ip"
    return frozenset(t for t in kubeproxy.TABLES if fam in families_with_table(t))


def read_tables(flavour: str, tables: Sequence[str] = kubeproxy.TABLES) -> Saved:
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


def classify(saved: Saved) -> Optional[Held]:
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
    return Held("kube-proxy" if kube_proxy else "netproxy", tuple(families), marks)


def held(flavour: str) -> Optional[Held]:
    """What one flavour holds (its masquerade marks included); BackendError when its tools are missing."""
    return classify(read_tables(flavour))


def remove_kube_proxy(flavour: str, target: Backend) -> None:
    """kube-proxy's chains in one flavour and the jumps into them, in both families — but, when
    ``target`` is netproxy's iptables backend on that flavour (a takeover: its full sync rewrote the
    shared chains), the chains it wrote and its own jumps into them."""
    from netproxy.backends.iptables import IptablesBackend

    takeover = isinstance(target, IptablesBackend) and target.config.iptables_flavour == flavour
    keep = target.written_chains() if isinstance(target, IptablesBackend) and takeover else {}
    tools = RestoreTools(flavour)
    keep_jumps = frozenset((hook, chain) for rules in JUMPS.values() for hook, chain, _ in rules)
    for family, tables in sorted(read_tables(flavour).items()):
        lines: List[str] = []
        for table in kubeproxy.TABLES:
            if table in tables:
                kept = keep.get(family, {}).get(table, frozenset())
                lines.extend(kubeproxy.removal_payload(tables[table], kept, keep_jumps if kept else frozenset()))
        if lines:
            tools.restore(family, "\n".join(lines) + "\n")


def remove_rules(flavour: str) -> None:
    """netproxy's own iptables rules of one flavour, leaving the ``NETPROXY-*`` ipsets: those are the
    kernel's, not a flavour's, and the rules of the flavour that stays use them."""
    from netproxy.backends.iptables import cleanup

    cleanup.cleanup(RestoreTools(flavour))
