"""The nftables backend: netproxy's own ``ip netproxy`` / ``ip6 netproxy`` tables, written through
libnftables in one transaction per sync, incrementally after the first full sync (README.md)."""

from __future__ import annotations

import functools
import gc
import logging
from typing import Dict, FrozenSet, List, Optional, Tuple
from typing import Set as PySet

from netproxy.backends.base import BackendUnavailable, Outcome, Packet, SyncError, SyncResult
from netproxy.backends.nftables import adopt, kernel, layout, render, stamp
from netproxy.backends.nftables.fake import FakeNft
from netproxy.backends.nftables.kernel import Runner
from netproxy.backends.nftables.objects import Element, Set
from netproxy.backends.nftables.transaction import (
    Before,
    Entry,
    State,
    Transaction,
    add_first_used,
    affinity_allowed,
    affinity_index,
    affinity_maps,
    claim,
    count_users,
    full_transaction,
    incremental_transaction,
    node_changes,
    node_elements,
    put_stamp,
    release,
    render_entry,
    stale_affinity,
    user_changes,
)
from netproxy.backends.skip import Action, SkipPolicy
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, NodeInfo, ServicePortName, Snapshot

__all__ = ["FakeNft", "NftablesBackend"]

log = logging.getLogger(__name__)


def _name_key(name: ServicePortName) -> Tuple[str, str, str]:
    return (name.namespace, name.name, name.port)


class NftablesBackend:
    name = "nftables"

    def __init__(self, config: ProxyConfig, kernel: Optional[Runner] = None) -> None:
        self.config = config
        self._kernel = kernel
        self._state: Optional[State] = None
        """What netproxy last wrote; None until a full sync succeeded (and after any failure)."""
        self.last_transaction: Optional[Transaction] = None
        self._policy = SkipPolicy()
        """The generation has no race window (every commit moves it): no bound on full syncs that
        write only the changes (backends/skip.py)."""
        self._adopt_pending = True
        """The first full sync of this backend tries to adopt the tables in the kernel (adopt.py)."""
        self._digest: Optional[Tuple[NodeInfo, str]] = None
        """The node the config digest of the table stamps was computed for, and that digest."""
        self._stamped: Optional[int] = None
        """The generation the table stamps in the kernel name (None: not known to be right)."""
        self._partial = False
        """``_state`` holds the tables and generation of an adoption but no record of the services
        (a one-shot sync renders only what it writes): a later sync rebuilds from nothing."""

    @property
    def kernel(self) -> Runner:
        """The configured writer (``--nftables-writer``), made when first needed."""
        if self._kernel is None:
            self._kernel = kernel.create(self.config.nftables_writer)
        return self._kernel

    def probe(self) -> None:
        self.kernel.probe()

    def plan(self, snapshot: Snapshot) -> str:
        """The commands that create netproxy's tables for ``snapshot`` from nothing."""
        state = self._build_state(snapshot, None)
        return str(full_transaction(state, (), self.config))

    def sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        try:
            if changes.full or self._state is None or self._partial:
                return self._full(snapshot)
            return self._incremental(snapshot, changes.services)
        except Exception:
            # A refused write, or a bug half-way through updating the record: either way, re-read
            # the kernel and rewrite everything next time.
            self._state = None
            raise

    def trace(self, snapshot: Snapshot, packet: Packet) -> List[Outcome]:
        """Where ``packet`` would go in the tables this backend writes for ``snapshot``: the rendered
        rules' own kernel expressions run against a fake kernel (nothing is read or written)."""
        from netproxy.backends.nftables.trace import Tracer

        fake = FakeNft()
        NftablesBackend(self.config, kernel=fake).sync(snapshot, Changes(full=True))
        if packet.family not in fake.tables:
            return [Outcome("accept")]
        outcomes: List[Outcome] = Tracer(fake, packet.family).trace(packet)
        return outcomes

    def tampered(self) -> Optional[str]:
        """Whether someone else changed netproxy's tables since its last write (and how): asked by the
        runner between syncs.  The ruleset generation says whether anyone committed anything (one
        netlink request); only then do the change notifications say whether it touched our tables.
        A reason drops the record, so the next sync rewrites the tables whole."""
        state = self._state
        if state is None:
            return None  # nothing written yet: the next full sync rewrites anyway
        if state.generation is None:
            # No trusted generation (another commit landed during our last write): the notifications
            # cannot vouch for the tables, but a deleted table is still plain to see, and waiting for
            # the periodic sync to notice it left the node without services for up to --sync-period.
            gone = state.tables - self.kernel.existing_tables()
            if not gone:
                return None
            self._state = None
            log.warning("nftables: table %s netproxy deleted by someone else", ", ".join(sorted(gone)))
            return "table-deleted"
        gen = self.kernel.generation()
        if gen is None or gen == state.generation:
            return None
        vouched = self._vouched(state, gen)
        if vouched:
            return None
        missing = state.tables - self.kernel.existing_tables()
        self._state = None
        if missing:
            log.warning("nftables: table %s netproxy deleted by someone else", ", ".join(sorted(missing)))
            return "table-deleted"
        log.warning("nftables: netproxy's tables changed by someone else%s",
                    "" if vouched is False else " (or change notifications were lost)")
        return "rules-changed" if vouched is False else "unknown"

    def halting(self) -> None:
        return None  # nftables takes no lock a sync could wait for

    def stopping(self) -> None:
        """``netproxy run`` stops: if others' commits moved the generation since netproxy's last one
        and (say the change notifications) none touched its tables, re-stamp them in one small
        transaction, so that the next process adopts them instead of rewriting them."""
        state, digest = self._state, self._digest
        if state is None or digest is None or state.generation is None:
            return
        try:
            now = self.kernel.generation()
            if now is None or now == self._stamped or self._vouched(state, now) is not True:
                return
            tx = Transaction()
            put_stamp(tx, state.tables, stamp.table_stamp(digest[1], now + 1), replace=True)
            self.kernel.apply(tx.ops)
            after = self.kernel.generation()
        except (SyncError, BackendUnavailable, OSError) as exc:
            log.info("nftables: the tables were not re-stamped for the next process: %s", exc)
            return
        self._stamped = after if after == now + 1 else None
        log.info("nftables: re-stamped the tables at generation %s for the next process (others committed "
                 "since netproxy's last write, not to its tables)", after)

    def written_tables(self) -> FrozenSet[str]:
        """The families (``ip``, ``ip6``) whose netproxy table our last full sync wrote (empty before
        one succeeded); ``netproxy migrate`` checks them against the kernel."""
        return self._state.tables if self._state is not None else frozenset()

    def missing_in_kernel(self) -> List[str]:
        """The families whose table the last full sync wrote and the kernel no longer lists."""
        have = self.kernel.existing_tables()
        return [f"table {fam} netproxy" for fam in sorted(self.written_tables() - have)]

    def cleanup(self) -> None:
        gone = self.kernel.delete_tables()
        log.info("deleted nftables tables: %s", ", ".join(gone) or "none")
        self._state = None

    # --- full -------------------------------------------------------------------------------------

    def _build_state(self, snapshot: Snapshot, previous: Optional[State]) -> State:
        state = State()
        old = previous.entries if previous is not None else {}
        # Sorted on plain string tuples: ServicePortName's generated __lt__ is Python-level and
        # sorting 10k of them cost 0.15 s.
        for name in sorted(snapshot.services, key=_name_key):
            entry = render_entry(snapshot.services[name], snapshot.endpoints_of(name), snapshot.node,
                                 self.config, old.get(name))
            for fam, objs in entry.rendered.items():
                entry.objects[fam] = written = claim(state, fam, entry, objs)
                count_users(state.family(fam), written, 1)
            state.entries[name] = entry
        for fam in layout.FAMILIES:
            state.family(fam).node = node_elements(snapshot.node, fam, self.config, snapshot.service_cidrs)
        return state

    def _full(self, snapshot: Snapshot) -> SyncResult:
        # A full sync allocates ~100k small objects and strings per 10k services; the cyclic GC
        # re-scanning them as they pile up cost ~20% of the render.  None of them form cycles.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._full_sync(snapshot)
        finally:
            if was_enabled:
                gc.enable()

    def _config_digest(self, node: NodeInfo) -> str:
        """The config digest of the table stamp (stamp.py), computed again only when the node changes."""
        if self._digest is None or self._digest[0] != node:
            from netproxy import version

            self._digest = (node, stamp.config_digest(self.config, node, version()))
        return self._digest[1]

    def _full_sync(self, snapshot: Snapshot) -> SyncResult:
        if self._partial:
            self._state, self._partial = None, False
        if self._state is None and self._adopt_pending:
            self._adopt_pending = False
            adopted = self._adopt(snapshot)
            if adopted is not None:
                return adopted
            return self._rewrite(snapshot, self.kernel.generation())
        before = self.kernel.generation()
        state = self._state
        if self._policy.decide(state is not None, lambda: self._vouched(state, before)) is Action.WRITE_CHANGES:
            changed = self._changed_names(snapshot)
            log.debug("netproxy's tables unchanged by others at generation %s; %d service ports changed",
                      before, len(changed))
            return self._incremental(snapshot, changed)
        return self._rewrite(snapshot, before)

    def _vouched(self, state: Optional[State], now: Optional[int]) -> Optional[bool]:
        """Whether the kernel vouches that it still holds ``state`` at generation ``now``: the kernel
        held exactly the record at ``state.generation``; nobody committed since, or others did but
        (say the change notifications) not to our tables — then the record moves to ``now``.  False:
        someone touched our tables; None: cannot tell (no generation, notifications lost)."""
        if state is None or now is None or state.generation is None:
            return None
        if now == state.generation:
            return True  # nothing committed since: the notifications wait for the next look
        touched = self.kernel.others_touched(state.own)
        state.own.clear()
        if touched is False:
            state.generation = now
            return True
        return None if touched is None else False

    def _adopt(self, snapshot: Snapshot) -> Optional[SyncResult]:
        """Take over the tables a previous netproxy wrote, writing only the service ports whose
        stamps differ (adopt.py); None (logged at info, with the reason) when they cannot be adopted.

        Only those ports are rendered.  A one-shot ``sync`` ends there: it keeps no record of the
        others.  ``run`` renders its record whole after the write (its incremental syncs need every
        port's objects, and the counts of who uses each shared chain and element): the kernel is
        right as soon as a one-shot sync's would be, and the render it used to need first comes after."""
        digest = self._config_digest(snapshot.node)
        try:
            plan = adopt.plan(self.kernel, snapshot, self.config, digest)
        except adopt.NotAdoptable as why:
            log.info("nftables: rewriting the tables, not adopting them: %s", why)
            return None
        except (SyncError, BackendUnavailable, OSError) as exc:
            log.info("nftables: rewriting the tables, not adopting them: reading them failed: %s", exc)
            return None
        written = 0
        self.last_transaction = plan.tx
        if len(plan.tx):
            before = self.kernel.generation()
            put_stamp(plan.tx, plan.tables, stamp.table_stamp(digest, before + 1 if before is not None else 0),
                      replace=True)
            log.debug("writing the kernel: adoption, %d changed objects", len(plan.tx))
            try:
                written = self.kernel.apply(plan.tx.ops)
            except SyncError as err:
                log.info("nftables: rewriting the tables, not adopting them: the kernel refused the changes "
                         "(%s)", err)
                return None
            log.debug("written the kernel: %d bytes", written)
            self.kernel.watch(True)
            after = self.kernel.generation()
            generation = after if before is not None and after == before + 1 else None
            self._stamped = generation
        else:
            self.kernel.watch(True)
            now = self.kernel.generation()
            generation = now if now == plan.generation else None
            self._stamped = plan.generation
        if self.config.one_shot:
            state = State()
            self._partial = True
        else:
            state = self._build_state(snapshot, None)
        state.tables = plan.tables
        state.generation = generation
        self._state = state
        log.info("nftables: adopted the tables in the kernel at generation %d: %d of %d service ports written",
                 plan.generation, len(plan.written), len(snapshot.services))
        return SyncResult(full=True, services_written=len(plan.written), bytes_written=written)

    def _rewrite(self, snapshot: Snapshot, before: Optional[int], state: Optional[State] = None) -> SyncResult:
        """Delete and recreate netproxy's tables with everything in ``snapshot``, in one transaction."""
        if state is None:
            state = self._build_state(snapshot, self._state)
        existing = self.kernel.existing_tables()
        affinity = {fam: self._affinity_to_keep(fam, state) for fam in existing}
        tx = full_transaction(state, existing, self.config, affinity)
        pre = self.kernel.generation()
        created = [op[1] for op in tx.phases["tables"] if op[0] == "add"]
        put_stamp(tx, created, stamp.table_stamp(self._config_digest(snapshot.node), pre + 1 if pre is not None else 0),
                  replace=False)
        self.last_transaction = tx
        # Our own rewrite notifies every element (100k at 10k services): stop listening while it
        # commits, listen again after, and trust the record only if no one committed in between.
        self.kernel.watch(False)
        # The two debug lines bracket the kernel write: the fault suite's kill -9 test reads them to
        # prove that its kill landed while the kernel was being written (tests/faults/test_kill.py).
        log.debug("writing the kernel: the full rewrite")
        written = self.kernel.apply(tx.ops)
        log.debug("written the kernel: %d bytes", written)
        self.kernel.watch(True)
        state.tables = frozenset(op[1] for op in tx.phases["tables"] if op[0] == "add")
        after = self.kernel.generation()
        state.generation = after if before is not None and after == before + 1 else None
        self._stamped = after if pre is not None and after == pre + 1 else None
        self._state = state
        return SyncResult(full=True, services_written=len(snapshot.services), bytes_written=written)

    def _affinity_to_keep(self, fam: str, state: State) -> List[Element]:
        """Clients held by affinity sets and maps that the new table has too, with the time they
        have left (and, in the shared maps, only for endpoints still eligible)."""
        keep = self._affinity_sets_to_keep(fam, state)
        if fam not in layout.affinity_families(self.config):
            return keep
        index = affinity_index(e.objects[fam] for e in state.entries.values() if fam in e.objects)
        if not index:
            return keep
        for proto, name in affinity_maps():
            try:
                found = self.kernel.read_elements(fam, name)
            except SyncError as err:
                log.warning("cannot read %s (%s): ClientIP affinity restarts", name, err)
                continue
            for e in found:
                left = e.expires
                if affinity_allowed(index, proto, e) and (left is None or left > 0):
                    keep.append(Element(name, e.key, e.value, expires=left, timeout=e.timeout))
        return keep

    def _affinity_sets_to_keep(self, fam: str, state: State) -> List[Element]:
        wanted: Dict[str, Set] = {}
        for entry in state.entries.values():
            objs = entry.objects.get(fam)
            if objs is not None:
                wanted.update(objs.sets)
        if not wanted:
            return []
        try:
            found = self.kernel.read_sets(fam)
        except SyncError as err:
            log.warning("cannot read affinity sets (%s): ClientIP affinity restarts", err)
            return []
        keep = []
        for spec, elements in found:
            want = wanted.get(spec.name)
            if want is None or want.timeout is None:
                continue
            for e in elements:
                left = want.timeout if e.expires is None else min(e.expires, want.timeout)
                if left > 0:
                    keep.append(Element(spec.name, e.key, expires=left))
        return keep

    def _apply_incremental(self, tx: Transaction, state: State, digest: str) -> int:
        """Apply ``tx`` (with the table stamps replaced) and keep the record's generation: what the
        kernel vouches for."""
        before = self.kernel.generation()
        put_stamp(tx, state.tables, stamp.table_stamp(digest, before + 1 if before is not None else 0), replace=True)
        # Read the generation first, then the notifications: those cover every commit up to it.
        touched = self.kernel.others_touched(state.own)
        state.own.clear()
        if before is None or (before != state.generation and touched is not False):
            state.generation = None  # someone else may have touched our tables: next full sync rebuilds
        log.debug("writing the kernel: %d changed objects", len(tx))
        written: int = self.kernel.apply(tx.ops)
        log.debug("written the kernel: %d bytes", written)
        after = self.kernel.generation()
        self._stamped = after if before is not None and after == before + 1 else None
        if before is not None and after == before + 1:
            state.own.add(after)
            if state.generation is not None:
                state.generation = after
        else:
            state.generation = None  # cannot tell our transaction from someone else's
        return written

    def _changed_names(self, snapshot: Snapshot) -> FrozenSet[ServicePortName]:
        """Service ports whose inputs differ from what we last wrote (or that came or went)."""
        state = self._state
        assert state is not None
        changed = {name for name in state.entries if name not in snapshot.services}
        for name, svc in snapshot.services.items():
            entry = state.entries.get(name)
            if (entry is None or entry.service != svc or entry.endpoints != snapshot.endpoints_of(name)
                    or entry.node != snapshot.node):
                changed.add(name)
        return frozenset(changed)

    # --- incremental ------------------------------------------------------------------------------

    def _incremental(self, snapshot: Snapshot, names: FrozenSet[ServicePortName]) -> SyncResult:
        state = self._state
        assert state is not None
        tx = Transaction()
        changed = sorted(names)
        new_entries: Dict[ServicePortName, Optional[Entry]] = {}
        before: Dict[str, Before] = {}
        for name in changed:
            old = state.entries.get(name)
            if old is not None:
                for fam, objs in old.objects.items():
                    release(state, fam, name, objs)
                    count_users(state.family(fam), objs, -1, before.setdefault(fam, Before()))
        for name in changed:
            svc = snapshot.services.get(name)
            if svc is None:
                new_entries[name] = None
                continue
            entry = render_entry(svc, snapshot.endpoints_of(name), snapshot.node, self.config, state.entries.get(name))
            if any(fam not in state.tables for fam in entry.rendered):
                # First service of a new family: create its table (a rewrite, in the same transaction).
                self._state = None
                return self._rewrite(snapshot, self.kernel.generation())
            for fam, objs in entry.rendered.items():
                entry.objects[fam] = written = claim(state, fam, entry, objs)
                count_users(state.family(fam), written, 1, before.setdefault(fam, Before()))
            new_entries[name] = entry
        first = {fam: b.first_used(state.family(fam)) for fam, b in before.items()}
        written_services = self._service_changes(tx, state, new_entries, first)
        self._forget_gone_endpoints(tx, state, new_entries)
        for fam in sorted(state.families):
            fstate = state.family(fam)
            user_changes(tx, fam, fstate, before.get(fam, Before()))
            if fam in state.tables:
                node_changes(tx, fam, fstate, node_elements(snapshot.node, fam, self.config,
                                                            snapshot.service_cidrs))
        self.last_transaction = tx
        written_bytes = self._apply_incremental(tx, state, self._config_digest(snapshot.node)) if len(tx) else 0
        for name, new_entry in new_entries.items():
            if new_entry is None:
                state.entries.pop(name, None)
            else:
                state.entries[name] = new_entry
        return SyncResult(full=False, services_written=written_services, bytes_written=written_bytes)

    def _forget_gone_endpoints(self, tx: Transaction, state: State,
                               new_entries: Dict[ServicePortName, Optional[Entry]]) -> None:
        """Delete the remembered clients of endpoints (or service addresses) that went away."""
        for fam in layout.affinity_families(self.config):
            if fam not in state.tables:
                continue
            old = affinity_index(e.objects[fam] for name in new_entries
                                 for e in (state.entries.get(name),) if e is not None and fam in e.objects)
            if not old:
                continue
            new = affinity_index(e.objects[fam] for e in new_entries.values() if e is not None and fam in e.objects)
            for element in stale_affinity(functools.partial(self.kernel.read_elements, fam), old, new):
                tx.put("delete-elements", "delete", fam, element)

    def _service_changes(self, tx: Transaction, state: State, new_entries: Dict[ServicePortName, Optional[Entry]],
                         first: Dict[str, PySet[layout.Shared]]) -> int:
        """Add to ``tx`` what turns each changed service port's old objects into its new ones, and
        the shared chains they are the first to use (``first``: per family, those not created yet)."""
        written_services = 0
        for name, entry in new_entries.items():
            old_entry = state.entries.get(name)
            before = old_entry.objects if old_entry is not None else {}
            after = entry.objects if entry is not None else {}
            if before != after:
                written_services += 1
            for fam in sorted(set(before) | set(after)):
                empty = render.ServiceObjects()
                o, n = before.get(fam, empty), after.get(fam, empty)
                incremental_transaction(tx, fam, o, n)
                add_first_used(tx, fam, n.shared, first.get(fam, set()), self.config)
        return written_services
