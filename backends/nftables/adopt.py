"""Restart by adoption: a new process takes over the tables a previous netproxy wrote, writing only
the service ports whose objects differ (README.md, "Restart by adoption").

:func:`plan` compares the record a full sync would write (:class:`~transaction.State`, rendered
from the snapshot) with what the kernel holds, read from the small maps only: the table stamps,
every element a service port owns alone (each carries its service stamp), the chain names, and the
node-wide sets.  The endpoint maps are never read.  Any doubt raises :class:`NotAdoptable` with the
reason, and the caller rewrites the tables whole.

Why a service's stamp can be trusted: the table stamp names the ruleset generation netproxy's last
commit got, and every commit of anyone in the network namespace moves it.  If the generation is
still that one, nobody changed anything since netproxy's last commit, so each object is as that
commit left it, and the service stamps describe them.  If it moved, someone committed something,
perhaps to netproxy's tables (a deleted endpoint element leaves no other trace that a read of the
small maps would see), so the tables are rewritten.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from netproxy.backends.nftables import layout, names, render, stamp
from netproxy.backends.nftables.kernel import Runner
from netproxy.backends.nftables.objects import Chain, Element, ElementRun
from netproxy.backends.nftables.transaction import (
    State,
    Transaction,
    add_shared,
    affinity_index,
    incremental_transaction,
    stale_affinity,
)
from netproxy.core.config import ProxyConfig


class NotAdoptable(Exception):
    """The kernel's tables cannot be adopted: the reason, logged before the full rewrite."""


DISPATCH = (names.SERVICE_IPS, names.SERVICE_NODEPORTS, names.NO_ENDPOINTS, names.NO_ENDPOINT_NODEPORTS)
"""The maps whose keys a service port claims (``dispatch_keys``)."""
PICKED = {names.SERVICE_IPS: "main", names.SERVICE_NODEPORTS: "main", names.EXEMPT_IPS: "exempt",
          names.EXEMPT_NODEPORTS: "exempt"}
"""The maps whose verdicts send a key to a pick chain, and the role of that key's endpoint run."""
NODEPORT_KEYED = frozenset({names.SERVICE_NODEPORTS, names.EXEMPT_NODEPORTS, names.AFFINITY_NODEPORTS,
                            names.NO_ENDPOINT_NODEPORTS})
REFS = (names.CLUSTER_IPS, names.HAIRPIN)
"""Sets of elements several service ports may need (reference-counted by the record)."""
NODE = (names.SERVICE_CIDRS, names.NODEPORT_IPS)

_PICK = re.compile(r"^(?P<kind>cluster|external|local|exempt)-(?P<proto>[a-z]+)(?P<nodeport>-nodeport)?"
                   r"(?P<sticky>-sticky)?-pick-(?P<size>\d+)$")
_RECORD = re.compile(r"^affinity-(?P<proto>[a-z]+)-(?P<timeout>\d+)$")


def own_sets(family: str, config: ProxyConfig) -> Tuple[str, ...]:
    """The sets and maps whose elements each belong to one service port (and carry its stamp)."""
    out: Tuple[str, ...] = DISPATCH + (names.EXEMPT_IPS, names.EXEMPT_NODEPORTS, names.FIREWALL_IPS,
                                       names.FIREWALL_ALLOW, names.SERVICE_STAMPS)
    if family in layout.affinity_families(config):
        out += (names.AFFINITY_SERVICES, names.AFFINITY_NODEPORTS)
    return out


def parse_shared(chain: str) -> Optional[layout.Shared]:
    """The shared chain called ``chain`` (the inverse of ``Pick.chain`` / ``Record.chain``), or None."""
    m = _PICK.match(chain)
    if m is not None and m.group("proto") in layout.PROTOCOLS:
        return layout.Pick(m.group("kind"), m.group("proto"), int(m.group("size")), bool(m.group("nodeport")),
                           bool(m.group("sticky")))
    m = _RECORD.match(chain)
    if m is not None and m.group("proto") in layout.PROTOCOLS:
        return layout.Record(m.group("proto"), int(m.group("timeout")))
    return None


@dataclass
class Adoption:
    tx: Transaction = field(default_factory=Transaction)
    written: Set[str] = field(default_factory=set)
    """The service ports (stamp names) whose objects ``tx`` writes: new, changed or gone."""
    tables: FrozenSet[str] = frozenset()
    generation: int = 0
    """The generation at which the kernel was read (and stamped)."""


def plan(kernel: Runner, state: State, config: ProxyConfig, config_digest: str) -> Adoption:
    """The transaction that turns the kernel's tables into ``state``'s (without the new table stamp,
    which the caller adds with the generation it is about to get); raises NotAdoptable."""
    gen = kernel.generation()
    if gen is None:
        raise NotAdoptable("the ruleset generation cannot be read")
    existing = kernel.existing_tables()
    if not existing:
        raise NotAdoptable("no netproxy table in the kernel")
    needed = {"ip"} | {fam for e in state.entries.values() for fam in e.objects}
    missing = needed - existing
    if missing:
        raise NotAdoptable(f"table {', '.join(sorted(missing))} netproxy is missing")
    out = Adoption(tables=existing, generation=gen)
    for fam in sorted(existing):
        _family(kernel, state, config, config_digest, fam, out)
    if kernel.generation() != gen:
        raise NotAdoptable("the ruleset changed while netproxy read it")
    return out


def _family(kernel: Runner, state: State, config: ProxyConfig, config_digest: str, fam: str,
            out: Adoption) -> None:
    owned = own_sets(fam, config)
    read = kernel.read_stamped(fam, (names.STAMP,) + owned + NODE)
    _check_stamp(read.get(names.STAMP), fam, config_digest, out.generation)
    absent = [n for n in owned + NODE if n not in read]
    if absent:
        raise NotAdoptable(f"{fam} netproxy has no {', '.join(absent)}")
    kernel_own = _by_service(read, owned, fam)
    bases = {stamp.service_base(name): name for name in state.entries}
    changed: List[Tuple[str, render.ServiceObjects, render.ServiceObjects]] = []
    for base, name in bases.items():
        entry = state.entries[name]
        new = entry.objects.get(fam, render.ServiceObjects())
        old = kernel_own.pop(base, {})
        if {(e.set, e.key, e.value, e.comment) for e in new.elements.values()} != \
                {(e.set, e.key, e.value, e.comment) for e in old.values()}:
            changed.append((base, _ghost(old, fam, base), new))
    for base, old in kernel_own.items():  # service ports the snapshot no longer has
        changed.append((base, _ghost(old, fam, base), render.ServiceObjects()))
    # A few changed service ports: their endpoint elements and shared elements are asked for by key
    # (the endpoint changed is then all that is rewritten); many: the shared sets are read whole and
    # the changed runs rewritten whole.
    by_key = sum(len(r.values) for _, o, _ in changed for r in o.runs.values()) <= GET_LIMIT
    if by_key:
        changed = [(base, _with_values(kernel, fam, base, o), n) for base, o, n in changed]
    tx = out.tx
    for base, old_objs, new_objs in changed:
        incremental_transaction(tx, fam, old_objs, new_objs)
        out.written.add(base)
    _shared_chains(kernel, state, config, fam, tx, {b for b, _, _ in changed})
    if changed:
        if by_key:
            _refs_by_key(kernel, state, fam, tx, changed)
        else:
            _refs(kernel, state, fam, tx)
        _forget_clients(kernel, config, fam, tx, changed)
    _node(read, state, fam, tx)


GET_LIMIT = 4096
"""Endpoint elements of changed service ports up to which they are asked for one by one (a netlink
GET each, ~30 µs) rather than rewritten whole with the shared sets read whole (100k-1M elements)."""


def _with_values(kernel: Runner, fam: str, base: str, objs: render.ServiceObjects) -> render.ServiceObjects:
    """``objs`` (rebuilt from the dispatch elements) with its endpoint runs' values asked of the kernel:
    then only the endpoints that changed are rewritten.  An element the verdict promises and the map
    lacks raises NotAdoptable."""
    runs = {}
    for k, run in objs.runs.items():
        keys = [f"{run.prefix} . {i}" for i in range(len(run.values))] if run.indexed else [run.prefix]
        got = {e.key: e.value for e in kernel.get_elements(fam, run.set, keys)}
        if len(got) != len(keys) or any(v is None for v in got.values()):
            raise NotAdoptable(f"{base}: {run.set} lacks endpoint elements its dispatch verdict promises")
        runs[k] = run._replace(values=tuple(str(got[key]) for key in keys))
    return dataclasses.replace(objs, runs=runs)


def _refs_by_key(kernel: Runner, state: State, fam: str, tx: Transaction,
                 changed: Sequence[Tuple[str, render.ServiceObjects, render.ServiceObjects]]) -> None:
    """``cluster-ips`` and ``hairpin`` made equal to the record's where the changed service ports
    touch them: the elements their old objects may have needed (their addresses, their endpoints'
    pairs) and their new ones need, asked for by key.  Every other element's users are all service
    ports whose stamps matched, so it stays as it is."""
    candidates: Dict[str, Set[str]] = {n: set() for n in REFS}
    for _, old, new in changed:
        for set_name, key in old.elements:
            if set_name in (names.SERVICE_IPS, names.NO_ENDPOINTS):
                candidates[names.CLUSTER_IPS].add(key.split(" . ")[0])
        for run in old.runs.values():
            for value in run.values:
                address = value.rpartition(" . ")[0]
                candidates[names.HAIRPIN].add(f"{address} . {address}")
        for r in new.refs:
            candidates.setdefault(r.set, set()).add(r.key)
    want = {(r.set, r.key): r for r, users in state.family(fam).refs.items() if users > 0}
    for set_name, keys in sorted(candidates.items()):
        have = {e.key for e in kernel.get_elements(fam, set_name, sorted(keys))}
        for key in sorted(keys):
            if key in have and (set_name, key) not in want:
                tx.put("delete-elements", "delete", fam, Element(set_name, key))
            elif key not in have and (set_name, key) in want:
                tx.put("elements", "add", fam, want[(set_name, key)])


def _check_stamp(found: Optional[Sequence[Element]], fam: str, config_digest: str, gen: int) -> None:
    if found is None:
        raise NotAdoptable(f"table {fam} netproxy has no stamp set (written by an older netproxy)")
    if len(found) != 1:
        raise NotAdoptable(f"table {fam} netproxy holds {len(found)} stamps, not one")
    parsed = stamp.parse_table_stamp(found[0].comment)
    if parsed is None:
        raise NotAdoptable(f"the stamp of table {fam} netproxy does not parse: {found[0].comment!r}")
    if parsed.layout != stamp.LAYOUT_VERSION or parsed.config != config_digest:
        raise NotAdoptable(f"table {fam} netproxy was written by another netproxy version, layout, configuration "
                           f"or node (stamp layout {parsed.layout} config {parsed.config}, this process "
                           f"layout {stamp.LAYOUT_VERSION} config {config_digest})")
    if parsed.generation != gen:
        raise NotAdoptable(f"the ruleset generation is {gen}, not the {parsed.generation} of netproxy's last "
                           "commit: someone committed since, perhaps to netproxy's tables")


Owned = Dict[Tuple[str, str], Element]
"""One service port's own elements, keyed by (set, key)."""


def _by_service(read: Dict[str, List[Element]], owned: Sequence[str], fam: str) -> Dict[str, Owned]:
    """The kernel's per-service elements (their stamps included), grouped by the service part of their comments."""
    out: Dict[str, Owned] = {}
    for set_name in owned:
        for e in read[set_name]:
            parsed = stamp.parse_service_comment(e.comment)
            if parsed is None:
                raise NotAdoptable(f"element {e.key} of {fam} netproxy {set_name} carries no service comment "
                                   f"(comment {e.comment!r})")
            # The element as read (set, key, value, comment: read_named's), not a copy of it.
            out.setdefault(parsed[0], {})[(set_name, e.key)] = e
    return out


def _ghost(old: Owned, fam: str, base: str) -> render.ServiceObjects:
    """What a changed service port owns in the kernel, rebuilt from its elements without reading the
    endpoint maps: each dispatch verdict names its pick chain, and so the map and the count of its
    endpoint elements (``<prefix> . 0`` .. ``N-1``, or ``<prefix>`` alone for one); their values are
    not known, so a run is written whole.  What cannot be rebuilt so raises NotAdoptable."""
    runs: Dict[render.RunKey, ElementRun] = {}
    uses: Dict[str, List[layout.Shared]] = {}
    keys = []
    for (set_name, key), e in old.items():
        if set_name in (names.FIREWALL_IPS, names.FIREWALL_ALLOW):
            raise NotAdoptable(f"{base} changed and has loadBalancerSourceRanges, whose ranges are not read back")
        if set_name in DISPATCH:
            keys.append(key)
        target = e.value[len("goto "):] if e.value is not None and e.value.startswith("goto ") else None
        if target is None or target == names.REJECT:
            continue
        shared = parse_shared(target)
        if shared is None:
            raise NotAdoptable(f"{base} changed and its {set_name} element jumps to {target}, a chain of its own "
                               "that is not read back")
        uses.setdefault(key, []).append(shared)
        if isinstance(shared, layout.Pick) and set_name in PICKED and shared.size > 0:
            parts = key.split(" . ")
            prefix = parts[-1] if set_name in NODEPORT_KEYED else f"{parts[0]} . {parts[-1]}"
            runs[(PICKED[set_name], key)] = ElementRun(shared.map, prefix, ("?",) * shared.size)
    return render.ServiceObjects(
        elements=dict(old), runs=runs, uses={k: tuple(v) for k, v in uses.items()},
        shared=frozenset(s for v in uses.values() for s in v), dispatch_keys=tuple(keys))


def _shared_chains(kernel: Runner, state: State, config: ProxyConfig, fam: str, tx: Transaction,
                   changed: Set[str]) -> None:
    """Shared chains (and their maps) the record needs and the kernel lacks are added; those the
    kernel has and the record no longer needs are deleted.  A base chain missing, or a chain that is
    none of these, raises NotAdoptable."""
    chains = kernel.chain_names(fam)
    fstate = state.family(fam)
    wanted = {s.chain: s for s, users in fstate.shared.items() if users > 0}
    base = {c.name for c, _ in layout.base_chains(fam, config)}
    own = {c for name, e in state.entries.items() if stamp.service_base(name) not in changed
           for c in (e.objects[fam].chains if fam in e.objects else ())}
    lacking = sorted((base | own) - chains)
    if lacking:
        raise NotAdoptable(f"{fam} netproxy lacks chain {', '.join(lacking)}")
    for chain in sorted(set(wanted) - chains):
        add_shared(tx, fam, wanted[chain], config)
    new_own = {c for e in state.entries.values() for c in (e.objects[fam].chains if fam in e.objects else ())}
    for chain in sorted(chains - set(wanted) - base - new_own):
        shared = parse_shared(chain)
        if shared is None:
            raise NotAdoptable(f"{fam} netproxy holds chain {chain}, which netproxy would not write")
        tx.put("flush", "flush", fam, Chain(chain))
        tx.put("delete", "delete", fam, Chain(chain))
        if isinstance(shared, layout.Pick) and shared.size > 0:
            tx.put("delete", "delete", fam, layout.endpoints_map(shared, fam))


def _refs(kernel: Runner, state: State, fam: str, tx: Transaction) -> None:
    """``cluster-ips`` and ``hairpin`` made equal to the record's (read only when a service changed:
    otherwise every user of each element is a service port whose stamp matched)."""
    read = kernel.read_stamped(fam, REFS)
    have = {(e.set, e.key) for n in REFS for e in read.get(n, ())}
    want = {(r.set, r.key): r for r, users in state.family(fam).refs.items() if users > 0}
    for set_name, key in sorted(have - set(want)):
        tx.put("delete-elements", "delete", fam, Element(set_name, key))
    for k in sorted(set(want) - have):
        tx.put("elements", "add", fam, want[k])


def _node(read: Dict[str, List[Element]], state: State, fam: str, tx: Transaction) -> None:
    """The node-wide sets (``service-cidrs``, ``nodeport-ips``) made equal to the record's."""
    have = {Element(e.set, e.key) for n in NODE for e in read[n]}
    want = state.family(fam).node
    for e in sorted(have - want):
        tx.put("delete-elements", "delete", fam, e)
    for e in sorted(want - have):
        tx.put("elements", "add", fam, e)


def _forget_clients(kernel: Runner, config: ProxyConfig, fam: str, tx: Transaction,
                    changed: Sequence[Tuple[str, render.ServiceObjects, render.ServiceObjects]]) -> None:
    """Remembered ClientIP clients of a changed service port whose endpoint it may no longer reach."""
    if fam not in layout.affinity_families(config):
        return
    old = affinity_index(o for _, o, _ in changed)
    if not old:
        return
    new = affinity_index(n for _, _, n in changed)
    for element in stale_affinity(functools.partial(kernel.read_elements, fam), old, new):
        tx.put("delete-elements", "delete", fam, element)
