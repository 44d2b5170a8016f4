"""Desired state vs. what netproxy wrote: one transaction per sync, built without walking the table.

:class:`State` is netproxy's own record of its tables: per service port and family the objects it
owns (:class:`~render.ServiceObjects`), how many services use each shared pick chain, and which
service owns each ``address . protocol . port`` key.  An incremental sync compares the old and new
objects of the changed service ports only; a full sync reads the table's shape (chains and sets,
never elements) and rewrites everything, which also repairs a table changed behind our back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple
from typing import Set as PySet

from netproxy.backends.nftables import names, render
from netproxy.backends.nftables.objects import Chain, Object, Rule, Set
from netproxy.backends.nftables.runner import TableInfo
from netproxy.backends.nftables.serialise import Op, ops_text
from netproxy.config import ProxyConfig
from netproxy.model import Endpoint, NodeInfo, ServicePort, ServicePortName

log = logging.getLogger(__name__)

_STATIC_SETS = (names.SERVICE_IPS, names.NO_ENDPOINTS, names.ENDPOINTS)


class Transaction:
    """Operations in phases, emitted in an order the kernel accepts within one batch.

    Adds of containers come first, then flushes and deletions of what goes away, then the contents,
    and deletions of the emptied containers last, so no command refers to an object that is not
    there yet or is gone already.
    """

    PHASES = ("tables", "containers", "flush", "delete-elements", "replace", "rules", "elements", "delete")

    def __init__(self) -> None:
        self.phases: Dict[str, List[Op]] = {p: [] for p in self.PHASES}

    def put(self, phase: str, verb: str, family: str, obj: Object) -> None:
        self.phases[phase].append((verb, family, obj))

    @property
    def ops(self) -> List[Op]:
        out: List[Op] = []
        for p in self.PHASES:
            out.extend(self.phases[p])
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self.phases.values())

    def __str__(self) -> str:
        text: str = ops_text(self.ops)
        return text


@dataclass
class Entry:
    """One service port as last written: its inputs (to skip re-rendering) and its objects per family."""

    service: ServicePort
    endpoints: Tuple[Endpoint, ...]
    node: NodeInfo
    rendered: Dict[str, render.ServiceObjects] = field(default_factory=dict)
    """What render produced, per family."""
    objects: Dict[str, render.ServiceObjects] = field(default_factory=dict)
    """What was written: ``rendered`` less the keys another service owns."""


@dataclass
class FamilyState:
    shared: Dict[str, int] = field(default_factory=dict)
    owners: Dict[str, ServicePortName] = field(default_factory=dict)


@dataclass
class State:
    entries: Dict[ServicePortName, Entry] = field(default_factory=dict)
    families: Dict[str, FamilyState] = field(default_factory=dict)
    tables: FrozenSet[str] = frozenset()
    """Families whose table exists (written by the last full sync)."""

    def family(self, fam: str) -> FamilyState:
        return self.families.setdefault(fam, FamilyState())


def render_entry(svc: ServicePort, eps: Tuple[Endpoint, ...], node: NodeInfo, config: ProxyConfig,
                 previous: Optional[Entry]) -> Entry:
    """Render one service port for every family, reusing ``previous`` when nothing it depends on changed."""
    if previous is not None and previous.service == svc and previous.endpoints == eps and previous.node == node:
        return Entry(svc, eps, node, previous.rendered)
    rendered = {}
    for fam in render.FAMILIES:
        objs = render.render_service(svc, eps, node, fam, config)
        if not objs.is_empty():
            rendered[fam] = objs
    return Entry(svc, eps, node, rendered)


def _drop_keys(objs: render.ServiceObjects, taken: PySet[str]) -> render.ServiceObjects:
    """``objs`` without the dispatch keys another service owns (a duplicate address . port)."""
    keep = {k: e for k, e in objs.elements.items()
            if (e.key if k[0] != names.ENDPOINTS else e.key.rsplit(" . ", 1)[0]) not in taken}
    shared = frozenset(str(e.value)[5:] for e in keep.values()
                       if e.set == names.SERVICE_IPS and str(e.value)[5:] in objs.shared)
    return render.ServiceObjects(keep, objs.chains, objs.sets, shared,
                                 tuple(k for k in objs.dispatch_keys if k not in taken))


def claim(state: State, fam: str, name: ServicePortName, objs: render.ServiceObjects) -> render.ServiceObjects:
    """Record ``name`` as the owner of its keys; keys owned by another service are left out and logged."""
    owners = state.family(fam).owners
    taken = {k for k in objs.dispatch_keys if owners.get(k, name) != name}
    for k in taken:
        log.warning("service port %s: %s is already used by %s; not routed", name, k, owners[k])
    if taken:
        objs = _drop_keys(objs, taken)
    for k in objs.dispatch_keys:
        owners[k] = name
    return objs


def release(state: State, fam: str, name: ServicePortName, objs: render.ServiceObjects) -> None:
    owners = state.family(fam).owners
    for k in objs.dispatch_keys:
        if owners.get(k) == name:
            del owners[k]


def _add_chain(tx: Transaction, fam: str, chain: Chain, rules: Iterable[Rule]) -> None:
    tx.put("containers", "add", fam, chain)
    for r in rules:
        tx.put("rules", "add", fam, r)


# --- full sync ------------------------------------------------------------------------------------

def full_transaction(state: State, kernel: Mapping[str, Optional[TableInfo]], config: ProxyConfig,
                     rebuild: bool = False) -> Transaction:
    """Everything in ``state``, written over whatever ``kernel`` says the tables hold.

    Existing chains and the static maps are flushed and refilled; chains and sets netproxy no longer
    wants are deleted; affinity sets that stay are kept, so clients keep their endpoint.  With
    ``rebuild`` the tables are deleted and created again (the fallback when the kernel refuses the
    normal full sync, e.g. because a map was replaced by one of another type).
    """
    tx = Transaction()
    for fam in render.FAMILIES:
        have = kernel.get(fam)
        objs = [e.objects[fam] for _, e in sorted(state.entries.items()) if fam in e.objects]
        if have is None and not objs and fam != "ip":
            continue  # no IPv6 service and no ip6 table: do not create one
        if rebuild and have is not None:
            tx.put("tables", "delete", fam, render.table(fam))
            have = None
        _full_family(tx, fam, have, objs, state.family(fam), config)
    return tx


def _full_family(tx: Transaction, fam: str, have: Optional[TableInfo], objs: Sequence[render.ServiceObjects],
                 fstate: FamilyState, config: ProxyConfig) -> None:
    tx.put("tables", "add", fam, render.table(fam))
    chains: Dict[str, Tuple[Chain, Tuple[Rule, ...]]] = {}
    for chain, rules in render.base_chains(fam):
        if chain.name == names.NAT_POSTROUTING:
            rules = render.postrouting_rules(config)
        chains[chain.name] = (chain, rules)
    for name in sorted(fstate.shared):
        kind_count = render.parse_pick_chain(name)
        if kind_count is not None:
            chains[name] = render.pick_chain(kind_count[0], kind_count[1], fam, config)
    sets: Dict[str, Set] = {s.name: s for s in render.base_sets(fam)}
    for o in objs:
        for cname, rules in o.chains.items():
            chains[cname] = (Chain(cname), rules)
        sets.update(o.sets)
    if have is not None:
        for cname in sorted(have.chains):
            tx.put("flush", "flush", fam, Chain(cname))
            want = chains.get(cname)
            if want is None or want[0].hook != have.chains[cname]:
                tx.put("delete", "delete", fam, Chain(cname, have.chains[cname]))
        for sname in sorted(have.sets):
            old, want_set = have.sets[sname], sets.get(sname)
            keep = (want_set is not None and sname not in _STATIC_SETS and old.timeout == want_set.timeout
                    and not old.is_map)
            if sname in _STATIC_SETS and want_set is not None:
                tx.put("flush", "flush", fam, want_set)
            elif not keep:
                tx.put("flush", "flush", fam, old)
                tx.put("replace", "delete", fam, old)
    # Deleting a base chain whose hook changed must happen before it is added again: move those.
    readd = [op for op in tx.phases["delete"] if isinstance(op[2], Chain) and op[2].name in chains]
    for op in readd:
        tx.phases["delete"].remove(op)
        tx.phases["replace"].insert(0, op)
    for s in sets.values():
        tx.put("replace" if have is not None else "containers", "add", fam, s)
    for chain, rules in chains.values():
        tx.put("replace" if have is not None else "containers", "add", fam, chain)
        for r in rules:
            tx.put("rules", "add", fam, r)
    for set_name in _STATIC_SETS:
        for o in objs:
            for e in o.elements.values():
                if e.set == set_name:
                    tx.put("elements", "add", fam, e)


# --- incremental sync -----------------------------------------------------------------------------

def incremental_transaction(tx: Transaction, fam: str, old: render.ServiceObjects, new: render.ServiceObjects) -> None:
    """Add to ``tx`` what turns one service port's ``old`` objects into ``new`` (shared chains aside)."""
    replaced_sets = [n for n, s in new.sets.items() if n in old.sets and old.sets[n] != s]
    for n, s in new.sets.items():
        if n not in old.sets:
            tx.put("containers", "add", fam, s)
    for cname, rules in new.chains.items():
        before = old.chains.get(cname)
        if before is None:
            _add_chain(tx, fam, Chain(cname), rules)
        elif before != rules or replaced_sets:
            tx.put("flush", "flush", fam, Chain(cname))
            for r in rules:
                tx.put("rules", "add", fam, r)
    for cname in old.chains:
        if cname not in new.chains:
            tx.put("flush", "flush", fam, Chain(cname))
            tx.put("delete", "delete", fam, Chain(cname))
    for n in replaced_sets:
        tx.put("replace", "delete", fam, old.sets[n])
        tx.put("replace", "add", fam, new.sets[n])
    for n, s in old.sets.items():
        if n not in new.sets:
            tx.put("delete", "delete", fam, s)
    for k, e in old.elements.items():
        now = new.elements.get(k)
        if now is None or now != e:
            tx.put("delete-elements", "delete", fam, e)
    for k, e in new.elements.items():
        if old.elements.get(k) != e:
            tx.put("elements", "add", fam, e)


def shared_changes(tx: Transaction, fam: str, fstate: FamilyState, old: Iterable[str], new: Iterable[str],
                   config: ProxyConfig) -> None:
    """Reference-count the shared pick chains; add the first use, delete after the last."""
    for name in old:
        fstate.shared[name] -= 1
    for name in new:
        count = fstate.shared.get(name, 0)
        if count == 0 and name not in fstate.shared:
            kc = render.parse_pick_chain(name)
            if kc is not None:
                chain, rules = render.pick_chain(kc[0], kc[1], fam, config)
                _add_chain(tx, fam, chain, rules)
        fstate.shared[name] = count + 1


def drop_unused_shared(tx: Transaction, fam: str, fstate: FamilyState) -> None:
    for name in sorted(n for n, c in fstate.shared.items() if c <= 0):
        tx.put("flush", "flush", fam, Chain(name))
        tx.put("delete", "delete", fam, Chain(name))
        del fstate.shared[name]
