"""Restart by adoption: a new process takes over the tables a previous netproxy wrote, writing only
the service ports whose objects differ (README.md, "Restart by adoption").

:func:`plan` first computes every service port's stamp from the snapshot, without rendering it
(:func:`wanted`: the digest of its inputs, stamp.py), then compares them with the kernel's service
stamps (``service-stamps-0`` .. ``-f``) and renders only the ports whose stamps differ.  What it
reads: the table stamps, the service stamps, the node-wide sets and the chains with their use
counts; a changed port's own elements by key (or the small per-service maps whole when that cannot
be done), its endpoint elements by key.  The endpoint maps are never read whole.  Any doubt raises
:class:`NotAdoptable` with the reason, and the caller rewrites the tables whole.

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
import ipaddress
import itertools
import operator
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from netproxy.backends.nftables import layout, names, render, stamp
from netproxy.backends.nftables.kernel import Runner
from netproxy.backends.nftables.objects import Chain, Element, ElementRun
from netproxy.backends.nftables.transaction import (
    Transaction,
    add_shared,
    affinity_index,
    drop_keys,
    incremental_transaction,
    node_elements,
    stale_affinity,
)
from netproxy.core.config import ProxyConfig
from netproxy.core.model import ServicePort, ServicePortName, Snapshot


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
                                       names.FIREWALL_ALLOW) + names.SERVICE_STAMP_SETS
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


class Want(NamedTuple):
    """One service port in one family as the snapshot asks for it, known before any render."""

    name: ServicePortName
    taken: Tuple[str, ...]
    """Its dispatch keys that another service port owns (the first in name order claims a key)."""
    digest: str
    """Its service stamp's digest (:func:`stamp.input_digest`)."""


def _name_key(name: ServicePortName) -> Tuple[str, str, str]:
    return (name.namespace, name.name, name.port)


_FAMILY = {4: "ip", 6: "ip6"}


def wanted(snapshot: Snapshot, addresses: Optional[List[int]] = None) -> Dict[str, Dict[str, Want]]:
    """Per family, every service port the snapshot renders there, by its stamp's service part, with
    the digest its stamp must carry: its inputs and the keys another port owns (which a full sync
    leaves out of its objects: ``transaction.claim``, in name order).  No render: ~8 µs a service
    port with ten endpoints, against ~38 µs for its render.

    ``addresses``, when given, gets the address (as an integer) of every endpoint of every port
    returned, read off its inputs: :func:`_still_used` looks there rather than walking the 1M
    endpoints of a 100k-service snapshot again (~0.25 s out of cache; ~0.03 s here)."""
    services = snapshot.services
    endpoints = snapshot.endpoints
    # Which keys two ports claim: first as (address, protocol, port) values, cheap to make; the
    # keys' text (render.dispatch_keys) only for the ports that share one.
    first: Dict[Tuple[object, ...], ServicePortName] = {}
    contested: Dict[Tuple[object, ...], List[ServicePortName]] = {}
    ports: List[Tuple[ServicePortName, ServicePort, Tuple[str, ...]]] = []
    for name, svc in services.items():
        fams: Dict[str, None] = {}
        proto, port = svc.protocol.lower(), svc.port
        for ip in svc.addresses():
            value, version = _address(ip)
            fam = _FAMILY[version]
            fams[fam] = None
            w = first.setdefault((fam, value, proto, port), name)
            if w is not name:
                contested.setdefault((fam, value, proto, port), [w]).append(name)
        if svc.node_port:
            for fam in fams:
                w = first.setdefault((fam, proto, svc.node_port), name)
                if w is not name:
                    contested.setdefault((fam, proto, svc.node_port), [w]).append(name)
        if fams:
            ports.append((name, svc, tuple(fams)))
    taken = _taken(snapshot, contested) if contested else {}
    out: Dict[str, Dict[str, Want]] = {fam: {} for fam in layout.FAMILIES}
    none: Tuple[str, ...] = ()
    # The port's name is hashed (a Python-level __hash__) only for its endpoints: the services and
    # the ports' families are carried along, and ``taken`` is looked in only when a key is shared.
    endpoints_of = endpoints.get
    for name, svc, in_families in ports:
        made_of = stamp.inputs(svc, endpoints_of(name, ()))
        if addresses is not None:
            addresses.extend(stamp.endpoint_addresses(made_of))
        base = stamp.service_base(name)
        for fam in in_families:
            lost = taken.get((fam, name), none) if taken else none
            out[fam][base] = Want(name, lost, stamp.digest_of(made_of, fam, lost))
    return out


_address = operator.attrgetter("_ip", "_version")  # as stamp.py: in C; pinned to int() and .version by a unit test


def _taken(snapshot: Snapshot, contested: Dict[Tuple[object, ...], List[ServicePortName]]
           ) -> Dict[Tuple[str, ServicePortName], Tuple[str, ...]]:
    """The keys (text, in render order) each port that shares one loses to the ports before it in
    name order, as ``transaction.claim`` leaves them out in a full sync.  Only the ports that share
    a key take part: every other key has one claimant."""
    out: Dict[Tuple[str, ServicePortName], Tuple[str, ...]] = {}
    sharing: Dict[str, Set[ServicePortName]] = {}
    for key, claimants in contested.items():
        sharing.setdefault(str(key[0]), set()).update(claimants)
    for fam, group in sharing.items():
        owners: Dict[str, ServicePortName] = {}
        for name in sorted(group, key=_name_key):
            keys = render.dispatch_keys(snapshot.services[name], fam)
            lost = tuple(k for k in keys if owners.get(k, name) != name)
            for k in keys:
                owners.setdefault(k, name)
            if lost:
                out[(fam, name)] = lost
    return out


def plan(kernel: Runner, snapshot: Snapshot, config: ProxyConfig, config_digest: str) -> Adoption:
    """The transaction that turns the kernel's tables into what a full sync of ``snapshot`` writes
    (without the new table stamp, which the caller adds with the generation it is about to get);
    raises NotAdoptable.  Only the service ports whose stamps differ are rendered."""
    gen = kernel.generation()
    if gen is None:
        raise NotAdoptable("the ruleset generation cannot be read")
    existing = kernel.existing_tables()
    if not existing:
        raise NotAdoptable("no netproxy table in the kernel")
    addresses: List[int] = []
    wants = wanted(snapshot, addresses)
    needed = {"ip"} | {fam for fam, w in wants.items() if w}
    missing = needed - existing
    if missing:
        raise NotAdoptable(f"table {', '.join(sorted(missing))} netproxy is missing")
    out = Adoption(tables=existing, generation=gen)
    for fam in sorted(existing):
        _family(kernel, snapshot, config, config_digest, fam, wants.get(fam, {}), addresses, out)
    if kernel.generation() != gen:
        raise NotAdoptable("the ruleset changed while netproxy read it")
    return out


Changed = Tuple[str, render.ServiceObjects, render.ServiceObjects]
"""A service port whose stamp differs: its stamp's service part, its objects in the kernel, its new ones."""


def _family(kernel: Runner, snapshot: Snapshot, config: ProxyConfig, config_digest: str, fam: str,
            wants: Dict[str, Want], addresses: Sequence[int], out: Adoption) -> None:
    read = kernel.read_stamped(fam, (names.STAMP,) + names.SERVICE_STAMP_SETS + NODE)
    _check_stamp(read.get(names.STAMP), fam, config_digest, out.generation)
    absent = [n for n in names.SERVICE_STAMP_SETS + NODE if n not in read]
    if absent:
        raise NotAdoptable(f"{fam} netproxy has no {', '.join(absent)}")
    have = _stamps(read, fam)
    new: Dict[str, render.ServiceObjects] = {}
    for base, want in wants.items():
        found = have.get(base)
        if found is None or found[0] != want.digest:
            new[base] = _render(snapshot, config, fam, want)
    gone = [base for base in have if base not in wants]
    uses = _chains(kernel, config, fam)
    tx = out.tx
    if new or gone:
        bases = list(new) + gone
        olds = _old_elements(kernel, config, fam, bases, have, new)
        changed: List[Changed] = [(base, _ghost(olds.get(base, {}), fam, base), new.get(base, render.ServiceObjects()))
                                  for base in bases]
        # A few changed service ports: their endpoint elements and shared elements are asked for by
        # key (the endpoint changed is then all that is rewritten); many: the shared sets are read
        # whole and the changed runs rewritten whole.
        by_key = sum(len(r.values) for _, o, _ in changed for r in o.runs.values()) <= GET_LIMIT
        if by_key:
            changed = [(base, _with_values(kernel, fam, base, o), n) for base, o, n in changed]
        for base, old_objs, new_objs in changed:
            incremental_transaction(tx, fam, old_objs, new_objs)
            out.written.add(base)
        _shared_chains(uses, config, fam, tx, changed)
        unchanged = [w for base, w in wants.items() if base not in new]
        if by_key:
            _refs_by_key(kernel, snapshot, config, fam, tx, changed, unchanged, addresses)
        else:
            _refs(kernel, snapshot, config, fam, tx, changed, unchanged)
        _forget_clients(kernel, config, fam, tx, changed)
    _node(read, node_elements(snapshot.node, fam, config, snapshot.service_cidrs), fam, tx)


Stamps = Dict[str, Tuple[str, Element]]
"""The kernel's service stamps by service part: the rest of the comment (digest and count), the element."""


def _stamps(read: Dict[str, List[Element]], fam: str) -> Stamps:
    """The service stamps read (every set of names.SERVICE_STAMP_SETS), by service part.  Split at
    their last " d:" (service parts hold no blank): the regular expression of
    stamp.parse_service_comment costs ~3 µs an element, and a digest that is not one simply differs
    from every digest."""
    out: Stamps = {}
    for set_name in names.SERVICE_STAMP_SETS:
        for e in read[set_name]:
            if not e.comment:
                raise NotAdoptable(f"element {e.key} of {fam} netproxy {set_name} carries no service "
                                   f"comment (comment {e.comment!r})")
            base, sep, rest = e.comment.rpartition(" d:")
            out[base if sep else e.comment] = (rest[:_DIGEST] if sep else "", e)
    return out


_DIGEST = 16


def _render(snapshot: Snapshot, config: ProxyConfig, fam: str, want: Want) -> render.ServiceObjects:
    """What a full sync writes for ``want``'s service port in ``fam``: its render, less the keys
    another port owns, stamped."""
    svc = snapshot.services[want.name]
    objs = render.render_service(svc, snapshot.endpoints_of(want.name), snapshot.node, fam, config)
    if want.taken:
        objs = drop_keys(objs, set(want.taken))
    return stamp.stamped(objs, want.name, want.digest)


def _old_elements(kernel: Runner, config: ProxyConfig, fam: str, bases: Sequence[str], have: Stamps,
                  new: Dict[str, render.ServiceObjects]) -> Dict[str, Owned]:
    """The own elements the kernel holds for each of ``bases`` (service ports whose stamps differ),
    their service stamps included.  Asked for by key when every one of them is still in the
    snapshot, its stamp counts its own elements, and its new objects' keys find them all (the
    common case: its endpoints changed, not its addresses); otherwise the per-service maps are read
    whole (10k-100k elements)."""
    owned = own_sets(fam, config)
    out: Dict[str, Owned] = {}
    wanted_keys: Dict[str, List[str]] = {}
    counts: Dict[str, int] = {}
    for base in bases:
        found = have.get(base)
        if found is None:
            continue  # new: nothing of it in the kernel (its keys, if anyone's, are another's)
        element = found[1]
        parsed = stamp.parse_service_comment(element.comment)
        objs = new.get(base)
        if objs is None or parsed is None or parsed.elements is None or \
                any(s in (names.FIREWALL_IPS, names.FIREWALL_ALLOW) for s, _ in objs.elements):
            return _read_whole(kernel, fam, owned, bases, have)
        out[base] = {(element.set, element.key): element}
        counts[base] = parsed.elements
        for set_name, key in objs.elements:
            if set_name not in _STAMP_SETS:
                wanted_keys.setdefault(set_name, []).append(key)
    for set_name, keys in sorted(wanted_keys.items()):
        for e in kernel.get_elements(fam, set_name, keys):
            owner = stamp.parse_service_comment(e.comment)
            if owner is not None and owner.service in out:
                out[owner.service][(set_name, e.key)] = e
    if any(len(out[base]) - 1 != n for base, n in counts.items()):
        return _read_whole(kernel, fam, owned, bases, have)
    return out


def _read_whole(kernel: Runner, fam: str, owned: Sequence[str], bases: Sequence[str], have: Stamps
                ) -> Dict[str, Owned]:
    read = kernel.read_stamped(fam, owned)
    absent = [n for n in owned if n not in read]
    if absent:
        raise NotAdoptable(f"{fam} netproxy has no {', '.join(absent)}")
    every = _by_service(read, owned, fam)
    return {base: every.get(base, {}) for base in bases}


_STAMP_SETS = frozenset(names.SERVICE_STAMP_SETS)

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


_Ref = Tuple[str, str]
"""(set, key) of a shared element."""


def _old_candidates(changed: Sequence[Changed]) -> Set[_Ref]:
    """The shared elements the old objects of the changed service ports may have needed: their
    addresses in ``cluster-ips``, their endpoints' pairs in ``hairpin``."""
    out: Set[_Ref] = set()
    for _, old, _ in changed:
        for set_name, key in old.elements:
            if set_name in (names.SERVICE_IPS, names.NO_ENDPOINTS):
                out.add((names.CLUSTER_IPS, key.split(" . ")[0]))
        for run in old.runs.values():
            for value in run.values:
                address = value.rpartition(" . ")[0]
                out.add((names.HAIRPIN, f"{address} . {address}"))
    return out


def _refs_by_key(kernel: Runner, snapshot: Snapshot, config: ProxyConfig, fam: str, tx: Transaction,
                 changed: Sequence[Changed], unchanged: Sequence[Want], endpoint_addresses: Sequence[int]) -> None:
    """``cluster-ips`` and ``hairpin`` made equal to a full sync's where the changed service ports
    touch them: the elements their old objects may have needed and their new ones need, asked for
    by key.  One the kernel holds and no changed port needs any more stays if an unchanged port
    needs it (found in the snapshot: ports with that cluster IP, ports with an endpoint at that
    address, rendered).  Every other element's users all have matching stamps: it stays as it is.
    ``endpoint_addresses``: :func:`wanted`'s, every endpoint address of every port it returned."""
    new_refs = {ref for _, _, n in changed for ref in render.shared_keys(n, fam)}
    candidates = _old_candidates(changed) | new_refs
    by_set: Dict[str, List[str]] = {}
    for set_name, key in sorted(candidates):
        by_set.setdefault(set_name, []).append(key)
    have = {(set_name, e.key) for set_name, keys in by_set.items() for e in kernel.get_elements(fam, set_name, keys)}
    doubtful = have - new_refs
    kept = _still_used(snapshot, config, fam, doubtful, unchanged, endpoint_addresses) if doubtful else set()
    for set_name, key in sorted(candidates):
        if (set_name, key) in have and (set_name, key) not in new_refs and (set_name, key) not in kept:
            tx.put("delete-elements", "delete", fam, Element(set_name, key))
        elif (set_name, key) not in have and (set_name, key) in new_refs:
            tx.put("elements", "add", fam, Element(set_name, key))


_address_int = operator.attrgetter("_ip")  # as stamp.py: C-level; pinned to int() by a unit test
_endpoint_int = operator.attrgetter("ip._ip")


def _still_used(snapshot: Snapshot, config: ProxyConfig, fam: str, refs: Set[_Ref],
                unchanged: Sequence[Want], endpoint_addresses: Sequence[int]) -> Set[_Ref]:
    """Those of ``refs`` that a service port in ``unchanged`` needs.  The ports that may need one
    are found in the snapshot without rendering (a cluster IP: one pass in C over them all; an
    endpoint at the hairpin's address: one look in ``endpoint_addresses``, which holds every
    endpoint of every port :func:`wanted` returned, ``unchanged`` among them; then per port only
    when one is there); those few are rendered to be sure."""
    addresses = {int(ipaddress.ip_address(key)) for set_name, key in refs if set_name == names.CLUSTER_IPS}
    hairpin = {int(ipaddress.ip_address(key.partition(" . ")[0])) for set_name, key in refs
               if set_name == names.HAIRPIN}
    services, endpoints = snapshot.services, snapshot.endpoints
    suspects: Set[ServicePortName] = set()
    every = itertools.chain.from_iterable
    if addresses and not addresses.isdisjoint(map(_address_int, every(s.cluster_ips for s in services.values()))):
        suspects.update(n for n, s in services.items() if not addresses.isdisjoint(map(_address_int, s.cluster_ips)))
    if hairpin and not hairpin.isdisjoint(endpoint_addresses):
        suspects.update(n for n, e in endpoints.items() if not hairpin.isdisjoint(map(_endpoint_int, e)))
    used: Set[_Ref] = set()
    for want in unchanged:
        if want.name in suspects:
            used.update(render.shared_keys(_render(snapshot, config, fam, want), fam))
    return used & refs


def _refs(kernel: Runner, snapshot: Snapshot, config: ProxyConfig, fam: str, tx: Transaction,
          changed: Sequence[Changed], unchanged: Sequence[Want]) -> None:
    """Many changed service ports, whose old endpoints are not known: ``cluster-ips`` and
    ``hairpin`` read whole and made equal to a full sync's, every service port rendered for the
    elements it needs (as many changed ports are, this is about a full sync's render)."""
    read = kernel.read_stamped(fam, REFS)
    have = {(e.set, e.key) for n in REFS for e in read.get(n, ())}
    want = {ref for _, _, n in changed for ref in render.shared_keys(n, fam)}
    for w in unchanged:
        want.update(render.shared_keys(_render(snapshot, config, fam, w), fam))
    for set_name, key in sorted(have - want):
        tx.put("delete-elements", "delete", fam, Element(set_name, key))
    for set_name, key in sorted(want - have):
        tx.put("elements", "add", fam, Element(set_name, key))


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
            out.setdefault(parsed.service, {})[(set_name, e.key)] = e
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
            runs[(PICKED[set_name], key)] = ElementRun.unknown(shared.map, prefix, shared.size, fam)
    return render.ServiceObjects(
        elements=dict(old), runs=runs, uses={k: tuple(v) for k, v in uses.items()},
        shared=frozenset(s for v in uses.values() for s in v), dispatch_keys=tuple(keys))


_OWN_CHAIN = re.compile(r"^(?:svc|ext|all)-")
"""A service port's own ClientIP affinity chain (``names.affinity_chain``: IPv6 in the sets layout)."""


def _chains(kernel: Runner, config: ProxyConfig, fam: str) -> Dict[str, int]:
    """The kernel's chains and their use counts (one dump of ~50 chains); a base chain missing, or
    a chain netproxy would not write, raises NotAdoptable."""
    uses = kernel.chain_uses(fam)
    base = {c.name for c, _ in layout.base_chains(fam, config)}
    lacking = sorted(base - set(uses))
    if lacking:
        raise NotAdoptable(f"{fam} netproxy lacks chain {', '.join(lacking)}")
    for chain in sorted(set(uses) - base):
        if parse_shared(chain) is None and not _OWN_CHAIN.match(chain):
            raise NotAdoptable(f"{fam} netproxy holds chain {chain}, which netproxy would not write")
    return uses


def _shared_chains(uses: Dict[str, int], config: ProxyConfig, fam: str, tx: Transaction,
                   changed: Sequence[Changed]) -> None:
    """Shared chains the changed service ports' new objects need and the kernel lacks are added;
    those nobody will use any more are deleted (with their maps).  Who uses a shared chain is the
    kernel's use count of it (its rules, plus every verdict-map element that goes to it): less the
    elements the changed ports' old objects hold, plus those their new ones will."""
    leaving = _references(o for _, o, _ in changed)
    coming = _references(n for _, _, n in changed)
    needed = {s for _, _, n in changed for s in n.shared}
    for first in sorted(needed, key=lambda s: s.chain):
        if first.chain not in uses:
            add_shared(tx, fam, first, config)
    for chain, use in sorted(uses.items()):
        shared = parse_shared(chain)
        if shared is None:
            continue  # a base chain, or an unchanged port's own (a changed one's is never adopted: _ghost)
        users = use - len(layout.shared_chain(shared, fam, config)[1]) - leaving.get(chain, 0) + coming.get(chain, 0)
        if users < 0:
            raise NotAdoptable(f"{fam} netproxy chain {chain}: the kernel counts fewer users ({use}) than "
                               "netproxy's objects hold")
        if users == 0:
            tx.put("flush", "flush", fam, Chain(chain))
            tx.put("delete", "delete", fam, Chain(chain))
            if isinstance(shared, layout.Pick) and shared.size > 0:
                tx.put("delete", "delete", fam, layout.endpoints_map(shared, fam))


def _references(objects: Iterable[render.ServiceObjects]) -> Dict[str, int]:
    """How many of ``objects``' elements go to each chain (each one a use the kernel counts)."""
    out: Dict[str, int] = {}
    for objs in objects:
        for e in objs.elements.values():
            if e.value is not None and e.value.startswith(("goto ", "jump ")):
                target = e.value.split(" ", 1)[1]
                out[target] = out.get(target, 0) + 1
    return out


def _node(read: Dict[str, List[Element]], want: FrozenSet[Element], fam: str, tx: Transaction) -> None:
    """The node-wide sets (``service-cidrs``, ``nodeport-ips``) made equal to a full sync's."""
    have = {Element(e.set, e.key) for n in NODE for e in read[n]}
    for e in sorted(have - want):
        tx.put("delete-elements", "delete", fam, e)
    for e in sorted(want - have):
        tx.put("elements", "add", fam, e)


def _forget_clients(kernel: Runner, config: ProxyConfig, fam: str, tx: Transaction,
                    changed: Sequence[Changed]) -> None:
    """Remembered ClientIP clients of a changed service port whose endpoint it may no longer reach."""
    if fam not in layout.affinity_families(config):
        return
    old = affinity_index(o for _, o, _ in changed)
    if not old:
        return
    new = affinity_index(n for _, _, n in changed)
    for element in stale_affinity(functools.partial(kernel.read_elements, fam), old, new):
        tx.put("delete-elements", "delete", fam, element)
