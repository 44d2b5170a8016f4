"""Desired state vs. what netproxy wrote: one transaction per sync, built without walking the table.

:class:`State` is netproxy's own record of its tables: per service port and family the objects it
owns (:class:`~render.ServiceObjects`), how many services use each shared pick chain, and which
service owns each ``address . protocol . port`` key.  An incremental sync compares the old and new
objects of the changed service ports only; a full sync reads the table's shape (chains and sets,
never elements) and rewrites everything, which also repairs a table changed behind our back.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union
from typing import Set as PySet

from netproxy.backends.nftables import layout, names, render, stamp
from netproxy.backends.nftables.objects import Chain, Element, ElementRun, Elements, Object, Rule, endpoint_text
from netproxy.backends.nftables.serialise import Op, ops_text
from netproxy.core.config import ProxyConfig
from netproxy.core.model import SLOTS, Endpoint, IPNetwork, NodeInfo, ServicePort, ServicePortName

log = logging.getLogger(__name__)


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


@dataclass(**SLOTS)
class Entry:
    """One service port as last written: its inputs (to skip re-rendering) and its objects per family.
    Slotted, as :class:`~render.ServiceObjects`: one per service port."""

    service: ServicePort
    endpoints: Tuple[Endpoint, ...]
    node: NodeInfo
    rendered: Dict[str, render.ServiceObjects] = field(default_factory=dict)
    """What render produced, per family."""
    objects: Dict[str, render.ServiceObjects] = field(default_factory=dict)
    """What was written: ``rendered`` less the keys another service owns (stamped again then)."""


@dataclass
class FamilyState:
    shared: Dict[layout.Shared, int] = field(default_factory=dict)
    """Users of each shared chain (pick chains, affinity record chains)."""
    owners: Dict[str, ServicePortName] = field(default_factory=dict)
    refs: Dict[Element, int] = field(default_factory=dict)
    """Users of each shared element (cluster IPs).  The counts come from what each service port's
    rendered objects declare they use (:func:`count_users`), never from chain or element names
    parsed back."""
    hairpin: Dict[int, int] = field(default_factory=dict)
    """Users of each ``hairpin`` pair, by endpoint address (``ServiceObjects.hairpin``)."""
    node: FrozenSet[Element] = frozenset()
    """Elements that come from the node rather than a service (``nodeport-ips``)."""


@dataclass
class State:
    entries: Dict[ServicePortName, Entry] = field(default_factory=dict)
    families: Dict[str, FamilyState] = field(default_factory=dict)
    tables: FrozenSet[str] = frozenset()
    """Families whose table exists (written by the last full sync)."""
    generation: Optional[int] = None
    """A ruleset generation at which the kernel held exactly this record (None: not known)."""
    own: PySet[int] = field(default_factory=set)
    """Generations of our own transactions since the last check of the change notifications."""

    def family(self, fam: str) -> FamilyState:
        got = self.families.get(fam)
        if got is None:  # (not setdefault: a FamilyState made for nothing, twice per port of a full sync)
            got = self.families[fam] = FamilyState()
        return got


def render_entry(svc: ServicePort, eps: Tuple[Endpoint, ...], node: NodeInfo, config: ProxyConfig,
                 previous: Optional[Entry]) -> Entry:
    """Render one service port for every family, reusing ``previous`` when nothing it depends on changed."""
    if previous is not None and previous.service == svc and previous.endpoints == eps and previous.node == node:
        return Entry(svc, eps, node, previous.rendered)
    rendered = {}
    # type() rather than the Python-level .version property: this runs for every service port.
    versions = {4 if type(ip) is ipaddress.IPv4Address else 6 for ip in svc.addresses()}
    for fam in layout.FAMILIES:
        if layout.VERSIONS[fam] not in versions:
            continue
        objs = render.render_service(svc, eps, node, fam, config)
        if not objs.is_empty():
            # Stamped as if it owned every key it claims (the common case); :func:`claim` stamps it
            # again when another port owns some (stamp.py).
            rendered[fam] = stamp.stamped(objs, svc.name, stamp.input_digest(svc, eps, fam))
    return Entry(svc, eps, node, rendered)


def _owned_by(key: str, taken: PySet[str]) -> bool:
    """Whether element ``key`` belongs to a dispatch key in ``taken`` (``firewall-allow`` keys extend
    the LB address's dispatch key with the source range)."""
    return key in taken or any(key.startswith(f"{t} . ") for t in taken)


def drop_keys(objs: render.ServiceObjects, taken: PySet[str]) -> render.ServiceObjects:
    """``objs`` without the dispatch keys another service owns (a duplicate address . port)."""
    keep = {k: e for k, e in objs.elements.items() if not _owned_by(e.key, taken)}
    runs = {k: r for k, r in objs.runs.items() if k[1] not in taken}
    uses = {k: used for k, used in objs.uses.items() if k not in taken}
    kept = {s for used in uses.values() for s in used}
    shared = frozenset(s for s in objs.shared if s in kept)
    return render.ServiceObjects(keep, runs, objs.chains, objs.sets, shared, uses,
                                 tuple(k for k in objs.dispatch_keys if k not in taken), objs.refs, objs.hairpin)


def claim(state: State, fam: str, entry: Entry, objs: render.ServiceObjects) -> render.ServiceObjects:
    """Record ``entry``'s service port as the owner of its keys; keys owned by another service are
    left out and logged, and its service stamp (stamp.py) then names them."""
    name = entry.service.name
    owners = state.family(fam).owners
    taken = tuple(k for k in objs.dispatch_keys if owners.get(k) not in (None, name))
    for k in taken:
        log.warning("service port %s: %s is already used by %s; not routed", name, k, owners[k])
    if taken:
        objs = drop_keys(objs, set(taken))
    for k in objs.dispatch_keys:
        owners[k] = name
    if taken:
        objs = stamp.stamped(objs, name, stamp.input_digest(entry.service, entry.endpoints, fam, taken))
    return objs


def release(state: State, fam: str, name: ServicePortName, objs: render.ServiceObjects) -> None:
    owners = state.family(fam).owners
    for k in objs.dispatch_keys:
        if owners.get(k) == name:
            del owners[k]


_K = TypeVar("_K")


@dataclass
class Before:
    """One family's user counts, before this sync, of the shared chains and elements it touched."""

    shared: Dict[layout.Shared, int] = field(default_factory=dict)
    refs: Dict[Element, int] = field(default_factory=dict)
    hairpin: Dict[int, int] = field(default_factory=dict)

    def first_used(self, fstate: FamilyState) -> PySet[layout.Shared]:
        """The shared chains that gained their first user (to create with it)."""
        return {s for s, was in self.shared.items() if was <= 0 < fstate.shared.get(s, 0)}


def _tally(counts: Dict[_K, int], used: Iterable[_K], step: int, before: Optional[Dict[_K, int]]) -> None:
    if before is None:  # a full sync's render: every port counted up, nothing to remember
        get = counts.get
        for r in used:
            counts[r] = get(r, 0) + step
        return
    for r in used:
        n = counts.get(r, 0)
        before.setdefault(r, n)
        counts[r] = n + step


def count_users(fstate: FamilyState, objs: render.ServiceObjects, step: int, before: Optional[Before] = None) -> None:
    """Count one service port's uses of shared chains and shared elements up or down: what its
    rendered objects declare they use (``shared``, ``refs``, ``hairpin``); ``before`` keeps the counts
    from before this sync of what it touched."""
    _tally(fstate.shared, objs.shared, step, before.shared if before is not None else None)
    _tally(fstate.refs, objs.refs, step, before.refs if before is not None else None)
    _tally(fstate.hairpin, objs.hairpin, step, before.hairpin if before is not None else None)


def user_changes(tx: Transaction, fam: str, fstate: FamilyState, before: Before) -> None:
    """Add the shared elements that gained their first user; delete the elements and the shared
    chains (with their maps) that lost their last.  (Shared chains that gained their first user
    are created with it: :func:`add_first_used`.)"""
    for ref, was in sorted(before.refs.items()):
        now = fstate.refs.get(ref, 0)
        if was <= 0 < now:
            tx.put("elements", "add", fam, ref)
        elif now <= 0 < was:
            tx.put("delete-elements", "delete", fam, ref)
        if now <= 0:
            fstate.refs.pop(ref, None)
    for address in sorted(before.hairpin):  # pairs in numeric order (no text made to sort on)
        was = before.hairpin[address]
        now = fstate.hairpin.get(address, 0)
        if was <= 0 < now:
            tx.put("elements", "add", fam, render.hairpin_element(address, fam))
        elif now <= 0 < was:
            tx.put("delete-elements", "delete", fam, render.hairpin_element(address, fam))
        if now <= 0:
            fstate.hairpin.pop(address, None)
    unused = [s for s in before.shared if fstate.shared.get(s, 0) <= 0]
    for shared in sorted(unused, key=_shared_key):
        tx.put("flush", "flush", fam, Chain(shared.chain))
        tx.put("delete", "delete", fam, Chain(shared.chain))
        if isinstance(shared, layout.Pick) and shared.size > 0:
            tx.put("delete", "delete", fam, layout.endpoints_map(shared, fam))
        fstate.shared.pop(shared, None)


def node_elements(node: NodeInfo, fam: str, config: ProxyConfig,
                  service_cidrs: Sequence[IPNetwork] = ()) -> FrozenSet[Element]:
    """The node-wide elements that follow the snapshot, not one service:

    - ``nodeport-ips``: with --nodeport-addresses, the node's addresses inside those CIDRs (the core
      fills ``node.addresses`` already filtered; filtered again here by family and CIDR);
    - ``service-cidrs``: the snapshot's service CIDRs of ``fam``, overlaps merged (an interval set
      refuses them)."""
    version = layout.VERSIONS[fam]
    out = {Element(names.SERVICE_CIDRS, str(n))
           for n in _collapse([c for c in service_cidrs if c.version == version])}
    if config.nodeport_addresses:
        # Never loopback: kube-proxy's nftables mode does not serve NodePorts on 127.0.0.1 (no
        # route_localnet), even when --nodeport-addresses holds 127.0.0.0/8.
        out.update(Element(names.NODEPORT_IPS, render.ip_text(a)) for a in node.addresses
                   if a.version == version and not a.is_loopback
                   and any(a.version == c.version and a in c for c in config.nodeport_addresses))
    return frozenset(out)


def config_elements(fam: str, config: ProxyConfig) -> List[Element]:
    """``cluster-cidrs``: ``--cluster-cidr`` of ``fam``, overlaps merged (an interval set refuses them)."""
    version = layout.VERSIONS[fam]
    nets = [c for c in config.local_cidrs if c.version == version]
    return [Element(names.CLUSTER_CIDRS, str(n)) for n in _collapse(nets)]


def _collapse(nets: Sequence[object]) -> List[object]:
    return list(ipaddress.collapse_addresses(nets))  # type: ignore[type-var]


def node_changes(tx: Transaction, fam: str, fstate: FamilyState, wanted: FrozenSet[Element]) -> None:
    for e in sorted(fstate.node - wanted):
        tx.put("delete-elements", "delete", fam, e)
    for e in sorted(wanted - fstate.node):
        tx.put("elements", "add", fam, e)
    fstate.node = wanted


def put_stamp(tx: Transaction, families: Iterable[str], element: Element, replace: bool) -> None:
    """Write the table stamp (stamp.py) into each of ``families``' tables, replacing the one there
    (``replace``) in the same transaction: a stamp is always the one of the last commit."""
    for fam in sorted(families):
        if replace:
            tx.put("delete-elements", "delete", fam, Element(element.set, element.key))
        tx.put("elements", "add", fam, element)


def _add_chain(tx: Transaction, fam: str, chain: Chain, rules: Iterable[Rule]) -> None:
    tx.put("containers", "add", fam, chain)
    for r in rules:
        tx.put("rules", "add", fam, r)


# --- full sync ------------------------------------------------------------------------------------

def full_transaction(state: State, existing: Iterable[str], config: ProxyConfig,
                     affinity: Optional[Mapping[str, Sequence[Element]]] = None) -> Transaction:
    """Delete netproxy's tables (those in ``existing``) and create them again with everything in ``state``.

    One transaction, so packets see the old table or the new one, never a mix, and anything changed
    behind our back is gone.  ``affinity`` carries the clients that the affinity sets held, with
    the time they have left, so a full sync does not reset ClientIP affinity.  Recreating rather
    than flushing in place also sidesteps nft 1.0.x's failure to add a rule that refers to a
    ``typeof`` map already in the kernel (render.py).
    """
    tx = Transaction()
    existing = set(existing)
    for fam in layout.FAMILIES:
        # Entries are in the order the backend rendered them (sorted by name): no sort here.
        objs = [e.objects[fam] for e in state.entries.values() if fam in e.objects]
        if fam not in existing and not objs and fam != "ip":
            continue  # no IPv6 service and no ip6 table: do not create one
        if fam in existing:
            tx.put("tables", "delete", fam, layout.table(fam))
        _create_family(tx, fam, objs, state.family(fam), config)
        for e in (affinity or {}).get(fam, ()):
            tx.put("elements", "add", fam, e)
    return tx


_Item = Union[Element, ElementRun]


def _create_family(tx: Transaction, fam: str, objs: Sequence[render.ServiceObjects], fstate: FamilyState,
                   config: ProxyConfig) -> None:
    tx.put("tables", "add", fam, layout.table(fam))
    for s in layout.base_sets(fam, config):
        tx.put("containers", "add", fam, s)
    for chain, rules in layout.base_chains(fam, config):
        _add_chain(tx, fam, chain, rules)
    for shared in sorted(fstate.shared, key=_shared_key):
        add_shared(tx, fam, shared, config)
    for o in objs:
        for s in o.sets.values():
            tx.put("containers", "add", fam, s)
        for cname, rules in o.chains.items():
            _add_chain(tx, fam, Chain(cname), rules)
    # Grouped per map, one operation each (objects.Elements): the serialiser writes one command per
    # map, and the transaction holds no tuple per element.  ``lists``: the buckets that are lists.
    lists: Dict[str, List[_Item]] = {}
    buckets: Dict[str, Sequence[_Item]] = {}
    for o in objs:
        # Annotated: two NamedTuples' join is their common base, a plain tuple with no .set.
        contents: Iterable[Union[Element, ElementRun]] = itertools.chain(o.elements.values(), o.runs.values())
        for item in contents:
            bucket = lists.get(item.set)
            if bucket is None:
                bucket = buckets[item.set] = lists[item.set] = []
            bucket.append(item)
    for ref, count in sorted(fstate.refs.items()):
        if count > 0:
            _bucket(buckets, lists, ref.set).append(ref)
    # The pairs made as the writer reads them (render.HairpinElements), from the addresses alone.
    pairs = sorted(a for a, count in fstate.hairpin.items() if count > 0)  # numeric, as user_changes
    if pairs:
        buckets[names.HAIRPIN] = render.HairpinElements(fam, pairs)
    for e in sorted(fstate.node):
        _bucket(buckets, lists, e.set).append(e)
    for e in config_elements(fam, config):
        _bucket(buckets, lists, e.set).append(e)
    for set_name, items in buckets.items():
        tx.put("elements", "add", fam, Elements(set_name, tuple(items) if set_name in lists else items))


def _bucket(buckets: Dict[str, Sequence[_Item]], lists: Dict[str, List[_Item]], set_name: str) -> List[_Item]:
    """The list of ``set_name``'s elements in a full sync's buckets (made, in the buckets' order, if new)."""
    bucket = lists.get(set_name)
    if bucket is None:
        bucket = buckets[set_name] = lists[set_name] = []
    return bucket


def _shared_key(shared: layout.Shared) -> str:
    name: str = shared.chain
    return name


def add_shared(tx: Transaction, fam: str, shared: layout.Shared, config: ProxyConfig) -> None:
    chain, rules, emap = layout.shared_chain(shared, fam, config)
    if emap is not None:
        tx.put("containers", "add", fam, emap)
    _add_chain(tx, fam, chain, rules)


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
    _diff_runs(tx, fam, old.runs, new.runs)


def _diff_runs(tx: Transaction, fam: str, old: Dict[render.RunKey, ElementRun],
               new: Dict[render.RunKey, ElementRun]) -> None:
    """Endpoint elements: a whole run when its map changes, else only the indexes whose endpoint changed."""
    for key, run in old.items():
        now = new.get(key)
        if now == run:
            continue
        if now is None or (now.set, now.prefix) != (run.set, run.prefix):
            tx.put("delete-elements", "delete", fam, run)
            continue
        # Same map, so the same count: replace the changed indexes only (a one-endpoint change),
        # compared as bytes; text only for the elements written.
        for i in range(min(run.size, now.size)):
            was, will = run.value(i), now.value(i)
            if was != will:
                element_key = f"{run.prefix} . {i}" if run.indexed else run.prefix
                tx.put("delete-elements", "delete", fam, Element(run.set, element_key, endpoint_text(was)))
                tx.put("elements", "add", fam, Element(run.set, element_key, endpoint_text(will)))
    for key, run in new.items():
        before = old.get(key)
        if before is None or (before.set, before.prefix) != (run.set, run.prefix):
            tx.put("elements", "add", fam, run)


def add_first_used(tx: Transaction, fam: str, used: Iterable[layout.Shared], pending: PySet[layout.Shared],
                   config: ProxyConfig) -> None:
    """Create the shared chains (and maps) in ``used`` that are still ``pending`` (first used in this
    sync), where their first user's objects are added."""
    for shared in used:
        if shared in pending:
            pending.discard(shared)
            add_shared(tx, fam, shared, config)


# --- ClientIP affinity as map elements (layout.affinity_families) ----------------------------------

AffinityKey = Tuple[str, str]
"""(protocol, ``address . port`` or, for a nodePort, ``port``) of a remembered client's service: the
endpoint run's prefix, as render wrote it."""


def affinity_index(objects: Iterable[render.ServiceObjects]) -> Dict[AffinityKey, FrozenSet[str]]:
    """The endpoints (``address . port`` text) a client of each sticky service address may be
    remembered for: any endpoint of its sticky pick chains (own and policy Local's exceptions)."""
    found: Dict[AffinityKey, PySet[str]] = {}
    for objs in objects:
        for (_, key), run in objs.runs.items():
            picks = [s for s in objs.uses.get(key, ()) if isinstance(s, layout.Pick) and s.sticky]
            if picks:
                found.setdefault((picks[0].proto, run.prefix), set()).update(run.values)
    return {k: frozenset(v) for k, v in found.items()}


def affinity_allowed(index: Mapping[AffinityKey, FrozenSet[str]], proto: str, element: Element) -> Optional[bool]:
    """Whether a remembered client (an element of ``affinity-<proto>``, keyed ``client . address .
    port`` by the kernel) may stay: True / False, or None when its service is not in ``index``."""
    service = element.key.partition(" . ")[2]  # address . port
    if service.count(" . ") != 1:
        return False
    allowed = index.get((proto, service))
    if allowed is None:
        allowed = index.get((proto, service.rpartition(" . ")[2]))  # a nodePort: any node address
    if allowed is None:
        return None
    return element.value in allowed


def affinity_maps() -> Iterable[Tuple[str, str]]:
    """(protocol, map name) of every shared affinity map."""
    return ((p, names.affinity_map(p)) for p in layout.PROTOCOLS)


def stale_affinity(read: Callable[[str], Sequence[Element]], old: Mapping[AffinityKey, FrozenSet[str]],
                   new: Mapping[AffinityKey, FrozenSet[str]]) -> List[Element]:
    """Remembered clients of the changed services whose endpoint is gone (or whose service address
    is): to delete in the same transaction, so that no client sticks to a gone endpoint.  ``read``
    gives a map's elements; it is called only for protocols that lost something."""
    lost = {k for k, eps in old.items() if eps - new.get(k, frozenset())}
    if not lost:
        return []
    out = []
    for proto, name in affinity_maps():
        if not any(k[0] == proto for k in lost):
            continue
        for e in read(name):
            if affinity_allowed(old, proto, e) is None:
                continue  # a client of a service that did not change
            if not affinity_allowed(new, proto, e):
                out.append(Element(name, e.key))
    return out
