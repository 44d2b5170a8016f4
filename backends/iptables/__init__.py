"""The iptables backend: one rendered ruleset, two writers (save/restore and libiptc).

Rendering is pure (:mod:`.render`); :class:`IptablesBackend` caches each service port's rendered
rules, diffs the desired chains against what it last wrote (partial syncs) or against the kernel
(full syncs), and hands the same :class:`~.diff.TableChange` list to its kernel: whichever writer is
configured (:mod:`.kernel`), or the in-memory :mod:`.fake` in unit tests.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, Union

from netproxy.backends.base import BackendError, BackendUnavailable, Outcome, Packet, SyncResult
from netproxy.backends.iptables import adopt, guard, names
from netproxy.backends.iptables import cleanup as cleanup_mod
from netproxy.backends.iptables.assemble import JUMPS, TABLES, Memo, assemble
from netproxy.backends.iptables.diff import KernelTable, TableChange, full_change, partial_change
from netproxy.backends.iptables.ipset import Ipsets, KernelIpsets
from netproxy.backends.iptables.kernel import Writer, create
from netproxy.backends.iptables.kernel.restore import supports_random_fully
from netproxy.backends.iptables.kernel.stamp import Stamp, stamp_value
from netproxy.backends.iptables.payload import plan_text, table_text
from netproxy.backends.iptables.render import Chains, FamilyRuleset, Rule, ServiceRules, render_service
from netproxy.backends.iptables.sets import SetKeeper
from netproxy.backends.iptables.xtlock import XtablesLock
from netproxy.backends.skip import Action, SkipPolicy
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot

__all__ = ["IptablesBackend"]

log = logging.getLogger(__name__)
FAMILIES = (4, 6)
MAX_SKIPS = 10
"""Periodic full syncs skipped in a row at most (untouched tables): every 11th writes anyway, so that a
change the fingerprint could not see (made in the instant between a write and its fingerprint) lives
at most that many sync periods (~5 min at the default 30 s)."""
LARGE_CLUSTER_ENDPOINTS = 1000
"""kube-proxy's largeClusterEndpointsThreshold: above it, endpoint rules carry no comment."""


@dataclass
class _Rendered:
    svc: ServicePort
    endpoints: Tuple[Endpoint, ...]
    node: NodeInfo
    rules: Dict[int, ServiceRules]


class IptablesBackend:
    """Backend protocol implementation for iptables (legacy or nft flavour)."""

    name = "iptables"

    def __init__(self, config: ProxyConfig, kernel: Optional[Writer] = None) -> None:
        self.config = config
        self.on_lock_wait: Callable[[float], None] = lambda seconds: None
        """Told every wait for the xtables lock (``netproxy run`` points it at its histogram)."""
        self.lock = XtablesLock(config.iptables_lock_timeout, waits=lambda seconds: self.on_lock_wait(seconds))
        self._kernel = kernel
        self._cache: Dict[ServicePortName, _Rendered] = {}
        self._written: Dict[int, Dict[str, Chains]] = {}
        self._need_full = True
        self._random_fully: Optional[bool] = None
        self._order: List[ServicePortName] = []
        self._stamps: Dict[int, Optional[Stamp]] = {}
        """Per family: its tables' fingerprints right after our last full write (gone after any other write)."""
        self._policy = SkipPolicy(bound=MAX_SKIPS)
        """A full sync of vouched tables writes what changed, or nothing (backends/skip.py).  A write of
        changes drops the legacy fingerprint; ``run`` takes it again between syncs (:meth:`_restamp`),
        so the periodic full sync after partial writes need not rewrite every chain (the mixed 10k
        cluster on legacy: ~8 s, against ~1.5 s for the change)."""
        self._rules_written: Dict[Tuple[str, str], int] = {}
        self._comments = True
        self.ipsets: Ipsets = KernelIpsets()
        """The kernel's ipsets (hairpin and affinity sets); unit tests put a FakeIpsets here."""
        self._sets = SetKeeper()
        self._memo = {f: Memo() for f in FAMILIES}
        self._assembled: Optional[Tuple[object, Dict[int, FamilyRuleset]]] = None
        """The last assembly and its node-wide inputs: a render that re-rendered no service port
        hands it over again (the periodic full sync with nothing changed: assembling both families
        anew was 30 of its ~50 ms at 10k on iptables-nft)."""
        self._watch: Optional[guard.Watch] = None
        self._commits = 0
        """Notices writes by others between syncs (``netproxy run`` only): see :meth:`tampered`."""
        self._fresh = True
        """No sync yet in this process: the first full sync may adopt the tables (adopt.py)."""
        self._stamp_ok: Set[int] = set()
        """Families whose stamp in the kernel (adopt.py) describes their tables as they are now."""
        self._digests = adopt.Digests()
        self._prepared: Dict[int, adopt.StampBody] = {}
        """Per family: the stamp's chain digests of its last full write, made while the restore tool
        committed it (:meth:`_prepare_stamp`), for :meth:`_write_stamps`."""
        self._config_digests: Optional[Tuple[NodeInfo, str]] = None
        self._node: Optional[NodeInfo] = None
        self._suspected = False
        """The guard suspected a foreign write since our last full sync (even one :meth:`_verify` found
        harmless: it compares rule counts, not rules), so :meth:`stopping` does not vouch for the tables."""

    @property
    def kernel(self) -> Writer:
        """The configured writer (``--iptables-writer``), made when first needed."""
        if self._kernel is None:
            self._kernel = create(self.config.iptables_writer, self.config.iptables_flavour, self.lock,
                                  keep_text=not self.config.one_shot)
        return self._kernel

    # -- rendering -------------------------------------------------------------------------------

    def _render(self, snapshot: Snapshot) -> Tuple[Dict[int, FamilyRuleset], int]:
        """Desired state per family, re-rendering only service ports whose inputs changed."""
        rerendered = 0
        comments = sum(len(snapshot.endpoints_of(n)) for n in snapshot.services) <= LARGE_CLUSTER_ENDPOINTS
        gone = [n for n in self._cache if n not in snapshot.services]
        for name in gone:  # their chain names leave the name cache with them: it holds the ruleset's
            names.forget(name, self._cache[name].svc.protocol)
        if comments != self._comments:
            self._comments = comments
            self._cache.clear()  # every endpoint rule changes: render them all again
            self._order = []
            gone = []
        for name in gone:
            self._sets.replaced(self._cache[name].rules, {})
            del self._cache[name]
            rerendered += 1
        renamed = not self._order
        added: List[ServicePortName] = []
        node = snapshot.node
        for name, svc in snapshot.services.items():
            eps = snapshot.endpoints_of(name)
            cached = self._cache.get(name)
            # Identity first: the tracker hands unchanged services over as the same objects, and
            # comparing 100k endpoint dataclasses field by field cost 0.3 s per sync at 10k.
            if cached is not None and (cached.svc is svc or cached.svc == svc) and \
                    (cached.endpoints is eps or cached.endpoints == eps) and cached.node == node:
                continue
            if cached is not None and cached.svc.protocol != svc.protocol:
                names.forget(name, cached.svc.protocol)
            rules = {}
            for family in FAMILIES:
                rendered = render_service(svc, eps, node, family, self.config, comments)
                if rendered is not None:
                    rules[family] = rendered
            self._sets.replaced(cached.rules if cached is not None else {}, rules)
            if cached is None:
                added.append(name)
            self._cache[name] = _Rendered(svc, eps, node, rules)
            rerendered += 1
        if renamed or len(added) + len(gone) > 64:
            self._order = sorted(self._cache)
        else:  # a few services came or went: placed by bisection, not 10k comparisons (0.13 s at 10k)
            for name in gone:
                at = bisect.bisect_left(self._order, name)
                if at < len(self._order) and self._order[at] == name:
                    del self._order[at]
            for name in added:
                bisect.insort(self._order, name)
        if self._random_fully is None:
            self._random_fully = supports_random_fully(self.config.iptables_flavour)
        inputs = (node, snapshot.service_cidrs, self._random_fully, comments)
        if rerendered == 0 and not added and self._assembled is not None and self._assembled[0] == inputs:
            # Every service port's rules are the cached objects of the last assembly, in its order.
            return self._assembled[1], 0
        ordered = [self._cache[n] for n in self._order]
        desired = {f: assemble(f, (r.rules[f] for r in ordered if f in r.rules), self.config, node,
                               self._random_fully, self._memo[f], snapshot.service_cidrs) for f in FAMILIES}
        self._assembled = (inputs, desired)
        return desired, rerendered

    def _has_family(self, family: int) -> bool:
        return any(family in r.rules for r in self._cache.values())

    # -- Backend protocol ------------------------------------------------------------------------

    def probe(self) -> None:
        self.kernel.probe()

    def plan(self, snapshot: Snapshot) -> str:
        desired, _ = self._render(snapshot)
        jumps: Dict[str, Tuple[Tuple[str, Rule], ...]] = {
            t: tuple((hook, rule) for hook, _target, rule in JUMPS[t]) for t in TABLES}
        text: str = plan_text((f, desired[f].tables, jumps) for f in FAMILIES)
        return text

    def trace(self, snapshot: Snapshot, packet: Packet) -> List[Outcome]:
        """Where ``packet`` goes in the rules this backend renders for ``snapshot`` (``netproxy trace``):
        the rendered rules interpreted as the kernel would; nothing is read or written."""
        from netproxy.backends.iptables.trace import Tracer

        desired, _ = self._render(snapshot)
        family = 6 if packet.family == "ip6" else 4
        outcomes: List[Outcome] = Tracer(desired[family], packet.local).outcomes(packet)
        return outcomes

    def sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        if not (changes.full or self._need_full) or not gc.isenabled():
            return self._sync(snapshot, changes)
        # A full sync allocates ~1M small objects at 10k services (rules, chain texts, set
        # elements); none form cycles, and the cyclic GC re-scanning them as they pile up costs
        # seconds at the mixed 10k cluster.  (The nftables backend does the same.)
        gc.disable()
        try:
            return self._sync(snapshot, changes)
        finally:
            gc.enable()

    def _sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        if self._watch is None and not self.config.one_shot:
            self._watch = self._open_watch()  # before the first write, so that it sees every later one
        watch = self._watch
        full = changes.full or self._need_full
        self._commits = 0
        if watch is not None and full:
            watch.pause()
        try:
            result = self._sync_tables(snapshot, changes)
        finally:
            if watch is not None and full:
                watch.resume(self._commits)
        if watch is not None:
            watch.rebase()  # the tables as just written (or found untouched) are the reference
        return result

    def _sync_tables(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        full = changes.full or self._need_full
        fresh, self._fresh = self._fresh and self._need_full, False
        self._node = snapshot.node
        # A first (or after-failure) full sync always writes: read the kernel before rendering, so
        # that its table blob (30 MB at 10k services) is gone before the render's objects arrive.
        early = self._early_stamps(snapshot.node) if fresh and self.config.iptables_flavour == "nft" else {}
        legacy = self._legacy_stamps(snapshot.node) if fresh and self.config.iptables_flavour == "legacy" else {}
        read = self._read_kernel(early, legacy) if self._need_full else {}
        desired, rerendered = self._render(snapshot)
        adopted = self._adopt(snapshot.node, desired, read, early, legacy) if fresh else {}
        nft = self.config.iptables_flavour == "nft"
        # iptables-nft: the generation before our writes, so that the stamp vouches only for them.
        before = self._generation() if full and nft else None
        sets_full = full
        if full and self._policy.decide(not self._need_full, self._vouched) is Action.WRITE_CHANGES:
            if not self._changed(desired):
                # The periodic full sync of tables nobody touched since our last write, with nothing
                # to change: writing them again would only pay the kernel's table swap (seconds at 10k).
                log.debug("iptables: tables as netproxy left them and nothing to change: full sync skipped")
                return SyncResult(full=True, services_written=0, bytes_written=0)
            # Vouched tables and some changes (a periodic full sync that coincides with events): our
            # record is the kernel, so the changes alone are written, as a partial sync writes them.
            log.debug("iptables: tables as netproxy left them: the full sync writes only what changed")
            full, sets_full = False, True
        total = 0
        self._rules_written = {(_ip_family(f), t): 0 for f in FAMILIES if f == 4 or self._has_family(f) for t in TABLES}
        try:
            for family in FAMILIES:
                written = self._sync_family(desired[family], full, read.get(family), adopted.get(family), sets_full)
                if written is not None:
                    total += written
        except BackendError:
            self._need_full = True  # our record of the kernel may be wrong now: re-read next time
            self._stamps.clear()
            self._prepared.clear()
            raise
        self._need_full = False
        if full:
            self._suspected = False  # every chain of ours rewritten, or proven untouched (adopted, skipped)
            after = self._generation() if nft else None
            # Each changed table is at most one commit (iptables-nft-restore sends none for a block
            # that changes nothing, such as an empty chain flushed): more means someone else's
            # (the guard's NftWatch.resume judges the same way).
            if nft and (before is None or after is None or not before <= after <= before + self._commits):
                log.info("iptables: the nf_tables generation moved from %s to %s over our %d commits: someone else "
                         "committed meanwhile, so the tables are not stamped (the next start rewrites them)",
                         before, after, self._commits)
                self._stamp_ok.clear()
            else:
                self._write_stamps(snapshot.node, after)
        if self.config.iptables_flavour == "nft" and not self.config.one_shot:
            # The nf_tables generation is one for both families and every write, ours too: taken
            # once after this sync's last write, it vouches for every family we hold (a partial
            # write included: one GETGEN, not the legacy fingerprint's table blob).
            stamp = self.kernel.stamp(tuple(self._written))
            self._stamps.update((f, stamp) for f in self._written)
        return SyncResult(full=full, services_written=len(snapshot.services) if full else rerendered,
                          bytes_written=total, rules_owned=_rule_counts(self._written),
                          rules_written=tuple(sorted((f, t, n) for (f, t), n in self._rules_written.items())))

    def _read_kernel(self, early: Mapping[int, adopt.KernelStamp],
                     legacy: Mapping[int, Union[adopt.KernelStamp, adopt.NotAdoptable]]
                     ) -> Dict[int, Union[Dict[str, KernelTable], BackendError]]:
        """A full sync's read of each family's tables (or why not), before the render (``early``:
        :meth:`_early_stamps`, ``legacy``: :meth:`_legacy_stamps`)."""
        read: Dict[int, Union[Dict[str, KernelTable], BackendError]] = {}
        for family in FAMILIES:
            if family in early:  # iptables-nft, stamp and generation hold: the stamp says what is there
                read[family] = adopt.as_read(early[family])
                continue
            # A new process on legacy tables whose stamp may hold: their fingerprints from the same
            # read, for its check (a stale or missing stamp: not worth the walk's masking and hash).
            prints = isinstance(legacy.get(family), adopt.KernelStamp)
            try:
                read[family] = self.kernel.read(family, fingerprint=prints)
            except BackendError as exc:
                read[family] = exc
        return read

    def _changed(self, desired: Dict[int, FamilyRuleset]) -> bool:
        """Whether a full sync would write other rules than those of our last write."""
        for family in FAMILIES:
            written = self._written.get(family)
            if written is None:
                if self._has_family(family):
                    return True  # a family skipped last time (no IPv6) that now has services
                continue
            if any(written[t] != desired[family].chains(t) for t in TABLES):
                return True
        return False

    def _vouched(self) -> Optional[bool]:
        """Whether the tables' fingerprints are those taken right after our last full write (nobody
        else wrote them since); None without a fingerprint to compare (a partial write since, or
        tables that could not be read)."""
        if any(self._stamps.get(f) is None for f in self._written):
            return None
        for family in self._written:
            now = self.kernel.stamp((family,))
            if now != self._stamps[family]:
                return None if now is None else False
        return True

    def _sync_family(self, ruleset: FamilyRuleset, full: bool,
                     read: Optional[Union[Dict[str, KernelTable], BackendError]] = None,
                     adopted: Optional[List[TableChange]] = None, sets_full: Optional[bool] = None) -> Optional[int]:
        """One family's write; ``sets_full``: the ipsets are read back and pruned as by a full sync
        (default: ``full``) — the tables' evidence does not cover them."""
        family = ruleset.family
        sets_full = full if sets_full is None else sets_full
        if full:
            try:
                if isinstance(read, BackendError):
                    raise read
                kernel = read if read is not None else self.kernel.read(family)
            except BackendError as exc:
                if family == 6 and not self._has_family(6):
                    # A node without IPv6 (or ip6tables) still runs IPv4 services.
                    log.debug("skipping IPv6: %s", exc)
                    self._written.pop(6, None)
                    self._stamps.pop(6, None)
                    return None
                raise
            table_changes = adopted if adopted is not None else [
                full_change(t, ruleset.chains(t), kernel[t]) for t in TABLES]
        else:
            if family not in self._written:
                return None if family == 6 and not self._has_family(6) else self._sync_family(ruleset, True)
            written = self._written[family]
            table_changes = [partial_change(t, ruleset.chains(t), written.get(t, {})) for t in TABLES]
        changed: List[TableChange] = [c for c in table_changes if not c.empty()]
        self._commits += len(changed)  # iptables-nft-restore commits each table's block on its own
        for c in changed:  # kube-proxy's sync_proxy_rules_iptables_last{ip_family,table}
            key = (_ip_family(family), c.table)
            self._rules_written[key] = self._rules_written.get(key, 0) + c.rule_count()
        if changed:
            self._stamps.pop(family, None)  # the write changes the tables: the old fingerprint means nothing
            if self.config.iptables_flavour == "nft":
                self._stamp_ok.clear()  # one generation for every family: all their stamps are stale
            else:
                self._stamp_ok.discard(family)
        # Sets the new rules name exist, with the new hairpin elements, before the rules do; what
        # the old rules alone needed goes after them (sets.py).
        filled = self._sets.before_write(self.ipsets, ruleset, sets_full)
        self._prepared.pop(family, None)  # made from the tables it wrote: a write here makes it stale
        # After a full write the family is stamped (_write_stamps): the stamp's digests are made while
        # the restore tool commits (the kernel checks and swaps the table; this process only waits).
        meanwhile = (lambda: self._prepare_stamp(ruleset)) if full else None
        try:
            # The two debug lines bracket the kernel write: the fault suite's kill -9 test reads them
            # to prove that its kill landed while the kernel was being written (tests/faults/test_kill.py).
            log.debug("writing the kernel: IPv%d, %d tables", family, len(changed))
            size = self.kernel.apply(family, changed, before_commit=filled, meanwhile=meanwhile) if changed else 0
            log.debug("written the kernel: IPv%d, %d bytes", family, size)
        except BaseException:
            with contextlib.suppress(Exception):
                filled()  # the write's own error is the one to report
            raise
        filled()  # idempotent: returns at once when the writer already waited
        self._written[family] = {t: dict(ruleset.chains(t)) for t in TABLES}
        self._sets.after_write(self.ipsets, ruleset, sets_full)
        if full:
            self._fingerprint_written(ruleset)
        return size

    def _prepare_stamp(self, ruleset: FamilyRuleset) -> None:
        """The stamp of ``ruleset``'s family but its header (config, validator): the digest of every
        chain a full write wrote, packed (adopt.stamp_body).  Called by the writer while the kernel
        commits the write; the header needs the fingerprint taken after the commit.  A one-shot sync
        keeps no memo of the digests (no later sync reuses them; ~32 MiB at 100k services that would
        sit under the fingerprint's table blob)."""
        family = ruleset.family
        remember = not self.config.one_shot
        self._prepared[family] = adopt.stamp_body(
            {t: self._digests.pairs(family, t, ruleset.chains(t), remember) for t in TABLES})

    def _fingerprint_written(self, ruleset: FamilyRuleset) -> None:
        """Legacy, right after a full write of ``ruleset``'s family: the tables' fingerprint (the
        window in which another writer's change would be taken for ours is this read), only if they
        hold our chains with our rule counts: a write that went elsewhere (nf_tables behind a "legacy"
        name) is not trusted.  (iptables-nft: one generation for both families, read once after the
        sync's last write in _sync_tables.  One sync and done: taken only for the stamp, when this
        family's must be written.)"""
        family = ruleset.family
        if self.config.iptables_flavour == "nft" or (self.config.one_shot and (
                family in self._stamp_ok or self._stamps.get(family) is not None)):
            return
        expect = {(family, t): {c: len(r) for c, r in ruleset.chains(t).items()} for t in TABLES}
        self._stamps[family] = self.kernel.stamp((family,), expect)

    # -- restart by adoption (adopt.py) -----------------------------------------------------------

    def _config_digest(self, node: NodeInfo) -> str:
        if self._config_digests is None or self._config_digests[0] != node:
            from netproxy import version

            random_fully = bool(self._random_fully) if self._random_fully is not None else True
            self._config_digests = (node, adopt.config_digest(self.config, node, version(), random_fully))
        return self._config_digests[1]

    def _generation(self) -> Optional[int]:
        now = self.kernel.stamp(FAMILIES)
        found = adopt.validator("nft", now, 4)
        return int(found[len("gen:"):]) if found is not None else None

    def _early_stamps(self, node: NodeInfo) -> Dict[int, adopt.KernelStamp]:
        """iptables-nft, a new process: the families whose stamp holds *before* the full sync's read.
        Their nat and filter are then not read at all (``iptables-nft-save`` of 10k services' rules:
        seconds): the generation proves nothing changed since the stamp, which lists every chain of
        ours, and the stamp was written only with every jump in place.  :meth:`_adopt` checks the
        generation again after the render, and reads the tables after all if it moved."""
        if self._random_fully is None:
            self._random_fully = supports_random_fully(self.config.iptables_flavour)
        config = self._config_digest(node)
        generation = self.kernel.stamp(FAMILIES)
        out: Dict[int, adopt.KernelStamp] = {}
        for family in FAMILIES:
            try:
                found = adopt.parse(self.kernel.save(family, adopt.STAMP_TABLE))
                adopt.check(found, config, adopt.validator("nft", generation, family))
            except (adopt.NotAdoptable, BackendError):
                continue  # _adopt reads the stamp again, with the tables, and says why
            out[family] = found
        return out

    def _legacy_stamps(self, node: NodeInfo) -> Dict[int, Union[adopt.KernelStamp, adopt.NotAdoptable]]:
        """Legacy, a new process, before the full sync's read: per family, its stamp if it parses, is
        this config's and its nat and filter headers are the tables' now (``adopt.check_headers``),
        else why not.  Only a family whose stamp may hold has its tables fingerprinted as they are
        read: a stale stamp (a foreign chain, a partial write since) is known from the headers, without
        masking and hashing a blob of ~250 MB at 100k services; the stamp is read once, here."""
        if self._random_fully is None:
            self._random_fully = supports_random_fully(self.config.iptables_flavour)
        config = self._config_digest(node)
        out: Dict[int, Union[adopt.KernelStamp, adopt.NotAdoptable]] = {}
        for family in FAMILIES:
            try:
                found = self._read_stamp(family)
                adopt.check_headers(found, config, [self.kernel.header(family, t) for t in TABLES])
            except adopt.NotAdoptable as exc:
                out[family] = exc  # _adopt says why, if the tables can be read at all
                continue
            out[family] = found
        return out

    def _adopt(self, node: NodeInfo, desired: Dict[int, FamilyRuleset],
               read: Dict[int, Union[Dict[str, KernelTable], BackendError]],
               early: Mapping[int, adopt.KernelStamp],
               legacy: Mapping[int, Union[adopt.KernelStamp, adopt.NotAdoptable]]) -> Dict[int, List[TableChange]]:
        """Per family whose stamp holds: the changes that turn its tables into ``desired`` (only the
        chains that differ).  A family missing here is rewritten whole, as before adoption (read now
        if :meth:`_early_stamps` spared its read).  ``legacy``: :meth:`_legacy_stamps`."""
        out: Dict[int, List[TableChange]] = {}
        flavour = self.config.iptables_flavour
        config = self._config_digest(node)
        generation = self.kernel.stamp(FAMILIES) if flavour == "nft" else None  # one for every family
        for family in FAMILIES:
            kernel = read.get(family)
            if not isinstance(kernel, dict):
                continue  # unreadable: the full sync reports (or skips) it as before
            try:
                pre = legacy.get(family)
                if isinstance(pre, adopt.NotAdoptable):
                    raise pre
                found = early.get(family) or pre or self._read_stamp(family)
                now = generation if flavour == "nft" else self._fingerprints(family, kernel)
                adopt.check(found, config, adopt.validator(flavour, now, family))
                chains = {t: desired[family].chains(t) for t in TABLES}
                # Remembered: the stamp after an adopting write packs the same digests (_prepare_stamp).
                digests = {t: self._digests.of(family, t, chains[t]) for t in TABLES}
                changes = adopt.changes(chains, digests, found, kernel)
            except adopt.NotAdoptable as exc:
                log.info("iptables: IPv%d tables not adopted, rewriting them all: %s", family, exc)
                if family in early:  # its tables were not read: the full rewrite needs them
                    try:
                        read[family] = self.kernel.read(family)
                    except BackendError as err:
                        read[family] = err
                continue
            out[family] = changes
            if flavour != "nft":
                self._stamps[family] = now  # nat and filter as our last write left them
            if all(c.empty() for c in changes):
                self._stamp_ok.add(family)
            log.info("iptables: IPv%d tables adopted: %d chains to write, %d to delete, %d jumps to add", family,
                     sum(len(c.write) for c in changes), sum(len(c.delete) for c in changes),
                     sum(len(c.jumps) for c in changes))
        return out

    def _read_stamp(self, family: int) -> adopt.KernelStamp:
        try:
            text = self.kernel.save(family, adopt.STAMP_TABLE)
        except BackendError as exc:
            raise adopt.NotAdoptable(f"the mangle table cannot be read: {exc}") from None
        return adopt.parse(text)

    def _fingerprints(self, family: int, kernel: Mapping[str, KernelTable]) -> Optional[Stamp]:
        """Legacy: the tables' fingerprints from the full sync's read (one walk of each blob, not two),
        if the tables' headers still are what they were then (any write since, but a same-size edit in
        that second, changes a header); otherwise read now."""
        prints: Stamp = {}
        for table in TABLES:
            got = kernel.get(table)
            if got is None or got.fingerprint is None or got.header is None:
                return self.kernel.stamp((family,))
            prints[(family, table)] = stamp_value(got.fingerprint, got.header)
        moved = [t for t in TABLES if self.kernel.header(family, t) != kernel[t].header]
        if moved:
            raise adopt.NotAdoptable(f"the {moved[0]} table changed while netproxy read it")
        return prints

    def _write_stamps(self, node: NodeInfo, generation: Optional[int]) -> None:
        """Stamp every family we hold whose stamp is not current (``generation``: iptables-nft's, now,
        with nothing but our writes since the tables were last compared)."""
        nft = self.config.iptables_flavour == "nft"
        todo = [f for f in sorted(self._written) if f not in self._stamp_ok]
        if not todo:
            return
        if nft:
            if generation is None:
                return
            todo = sorted(self._written)  # each stamp names the generation after the last stamp's commit
        config = self._config_digest(node)
        for family in todo:
            valid = f"gen:{generation + len(todo)}" if nft and generation is not None else \
                adopt.validator("legacy", self._stamps.get(family), family)
            if valid is None:
                log.debug("iptables: IPv%d tables have no fingerprint: not stamped", family)
                continue
            body = self._prepared.pop(family, None)
            if body is None:  # no full write of this family in this sync (stopping() after partial writes)
                tables = self._written[family]
                body = adopt.stamp_body({t: self._digests.pairs(family, t, tables.get(t, {}), not self.config.one_shot)
                                         for t in TABLES})
            rules = adopt.stamp_rules(config, valid, body)
            try:
                self.kernel.restore(family, "\n".join(table_text(adopt.stamp_change(rules))) + "\n")
            except BackendError as exc:  # the next process rewrites everything: slower, not wrong
                log.warning("iptables: cannot stamp the IPv%d tables (%s): the next start rewrites them", family, exc)
                self._stamp_ok.clear() if nft else self._stamp_ok.discard(family)
                return
            self._commits += 1
            self._stamp_ok.add(family)
        self._digests.keep(self._written)

    def halting(self) -> None:
        # A sync waiting for the xtables lock gives up, and so does the stamp at exit: a stop is
        # not delayed by another program's write (xtlock.XtablesLock.stop_waiting).
        self.lock.stop_waiting()

    def stopping(self) -> None:
        """``netproxy run`` is stopping: if the tables are ours as we last wrote them (partial writes
        since the last stamp), stamp them, so that the next process adopts them."""
        if self.config.one_shot or self._need_full or not self._written or self._node is None or \
                all(f in self._stamp_ok for f in self._written):
            return
        watch = self._watch
        if watch is None:
            return  # nobody watched the tables since our last write: no stamp vouches for them
        try:
            if self._suspected or watch.suspect():
                # Someone else wrote nat or filter since our last full sync: the guard can tell a missing
                # rule, not an edited one, so no stamp vouches for these tables (the next start rewrites).
                log.info("iptables: tables not stamped at exit: written by someone else since netproxy's last "
                         "full sync")
                return
            generation: Optional[int] = None
            if self.config.iptables_flavour == "nft":
                generation = self._generation()
            else:
                for family, tables in self._written.items():
                    expect = {(family, t): {c: len(r) for c, r in tables.get(t, {}).items()} for t in TABLES}
                    self._stamps[family] = self.kernel.stamp((family,), expect)
            self._write_stamps(self._node, generation)
            if all(f in self._stamp_ok for f in self._written):
                log.info("iptables: stamped the tables at exit: the next start adopts them")
        except (OSError, ValueError, BackendError) as exc:
            log.info("iptables: tables not stamped at exit (%s): the next start rewrites them", exc)

    # -- rules changed behind our back ---------------------------------------------------------

    def _open_watch(self) -> Optional[guard.Watch]:
        if self.config.iptables_flavour == "legacy":
            return guard.LegacyWatch()
        try:
            return guard.NftWatch(self.kernel.own_pids)
        except OSError as exc:
            log.info("no nftables change notifications (%s): changes behind netproxy's back wait for the "
                     "next full sync", exc)
            return None

    def tampered(self) -> Optional[str]:
        """Whether netproxy's rules were changed by someone else since its last write (and why): the
        runner asks between syncs; a reason means the next sync re-reads the kernel and rewrites all."""
        watch = self._watch
        if watch is None or self._need_full or not self._written:
            return None
        try:
            suspect = watch.suspect()
        except OSError as exc:  # the notification socket broke: stop looking rather than fail every look
            log.warning("cannot watch the iptables tables any more (%s): changes behind netproxy's back wait "
                        "for the next full sync", exc)
            watch.close()
            self._watch = None
            return None
        if not suspect:
            self._restamp()
            return None
        self._suspected = True
        watch.rebase()  # first: what changes while the tables are read below shows at the next look
        reason = self._verify()
        if reason is not None:
            self._need_full = True
            self._stamps.clear()
        return reason

    def _restamp(self) -> None:
        """Legacy, between syncs: fingerprint the tables again where a partial write dropped their
        fingerprint, as after a full write (with our chains' rule counts checked), so that the next
        periodic full sync can skip, or write only its changes, instead of rewriting everything.
        Only while nobody else is known to have written the tables since our last full sync: the
        watch saw no header move since our last write, and no suspicion since the full sync (an
        ``iptables -R`` of our rule passes the rule-count check and must not be vouched for).  The
        window in which a foreign write is taken for ours is our write → this look, bounded as the
        fingerprint's own window is, by MAX_SKIPS."""
        if self.config.iptables_flavour != "legacy" or self._suspected:
            return
        for family, tables in self._written.items():
            # Once per write: a fingerprint that cannot be had (None: a table unreadable, or not holding
            # our rule counts) is not asked again at every look (~0.3 s at 10k each), only after the
            # next write of this family drops it.
            if family not in self._stamps:
                expect = {(family, t): {c: len(r) for c, r in tables.get(t, {}).items()} for t in TABLES}
                self._stamps[family] = self.kernel.stamp((family,), expect)

    def _verify(self) -> Optional[str]:
        """The kernel's tables against what we last wrote into them (guard.compare)."""
        for family, tables in sorted(self._written.items()):
            for table in TABLES:
                try:
                    counts, jumps = self.kernel.counts(family, table)
                except (OSError, ValueError, BackendError) as exc:
                    log.warning("cannot read the IPv%d %s table back (%s): rewriting it", family, table, exc)
                    return "unreadable"
                if counts is None:
                    return "table-deleted"
                reason: Optional[str] = guard.compare(table, tables.get(table, {}), counts, jumps)
                if reason is not None:
                    return reason
        return None

    def written_chains(self) -> Dict[int, Dict[str, FrozenSet[str]]]:
        """Per family and table, the chains the kernel holds from our writes (``netproxy migrate``
        checks them against a fresh read of the kernel before it removes the old ruleset)."""
        return {f: {t: frozenset(chains) for t, chains in tables.items()} for f, tables in self._written.items()}

    def missing_in_kernel(self) -> List[str]:
        """The chains and built-in jumps of the last full sync that a fresh read of the kernel lacks."""
        missing: List[str] = []
        for family, tables in sorted(self.written_chains().items()):
            kernel = self.kernel.read(family)
            for table, chains in sorted(tables.items()):
                have = kernel[table].chains if table in kernel else frozenset()
                missing.extend(f"IPv{family} {table} chain {c}" for c in sorted(chains - have))
                if chains:
                    jumps = kernel[table].jumps if table in kernel else frozenset()
                    missing.extend(f"IPv{family} {table} jump {hook} -> {target}"
                                   for hook, target, _ in JUMPS.get(table, ()) if (hook, target) not in jumps)
        return missing

    def cleanup(self) -> None:
        if self.config.iptables_writer == "libiptc" and self.config.iptables_flavour == "nft":
            raise BackendUnavailable("libiptc cannot reach nf_tables; use the restore writer on this node")
        cleanup_mod.cleanup(self.kernel)
        self._stamp_ok.clear()
        self._sets.destroy_all(self.ipsets)
        self._stamps.clear()
        self._written.clear()
        self._prepared.clear()
        self._need_full = True


def _ip_family(family: int) -> str:
    return "IPv6" if family == 6 else "IPv4"


def _rule_counts(written: Mapping[int, Mapping[str, Mapping[str, Sequence[object]]]]) \
        -> Tuple[Tuple[str, str, int], ...]:
    """(ip family, table, rules in our chains): kube-proxy's sync_proxy_rules_iptables_total."""
    return tuple(sorted((_ip_family(family), table, sum(len(rules) for rules in chains.values()))
                        for family, tables in written.items() for table, chains in tables.items()))
