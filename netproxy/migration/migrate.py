"""``netproxy migrate``: switch a live node's dataplane (iptables ⇄ nftables), or take over from kube-proxy.

The order is what keeps every connection: **program the new ruleset in full, check that the kernel
holds it, then remove the old one** — never the other way round, so at every instant one complete
ruleset handles new connections, and a failure before the removal leaves the old one as it was.

While both are installed, the first of them in the kernel's NAT hook order decides a new
connection: iptables' nat table and netproxy's (and kube-proxy's) nftables nat chains all sit at
priority -100 (dstnat) of the same hooks, and the kernel's NAT core consults its chains in order
and stops at the first that binds the connection (``nf_nat_inet_fn``); chains of equal priority run
newest-registered first, so a freshly created table takes new connections at once, and a legacy
iptables nat table registered long ago runs after an nftables chain (from nftables to legacy
iptables, the old tables DNAT until they are deleted).  Both are complete either way.  NAT is
decided on a connection's first packet only and kept in its conntrack entry: an established
connection (TCP, or a UDP flow) keeps the binding it got, whichever ruleset gave it, through the
switch and after the old ruleset is gone — it is never NAT-ed a second time.  Masquerade works the
same way with the mark: the ruleset that DNATs sets the mark bit, and either ruleset's postrouting
masquerades a marked packet and clears the bit, so the bit must be the same on both sides (checked
before anything is written).

kube-proxy's iptables rules use netproxy's iptables names (``backends/iptables/kubeproxy.py``):
migrating from them to netproxy's iptables backend in the same iptables flavour is a **takeover by a
full rewrite**: netproxy's full sync rewrites ``KUBE-SERVICES`` and the other shared chains and
deletes kube-proxy's per-service and per-endpoint chains in one ``iptables-restore`` per table (the
kernel swaps each table atomically: no instant with both, none with neither); what only kube-proxy
has (its canaries, ``KUBE-FORWARD``, ``KUBE-PROXY-FIREWALL``, extra jumps) is removed after,
keeping netproxy's chains.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from netproxy import backends
from netproxy.backends.base import Backend, BackendError
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Snapshot
from netproxy.migration.holdings import FLAVOURS, Holdings, Ruleset, survey

log = logging.getLogger(__name__)


class MigrateError(Exception):
    """A step failed; ``step`` names it, the message says what failed and what the node holds now."""

    def __init__(self, step: str, message: str) -> None:
        self.step = step
        super().__init__(message)


@dataclass
class Step:
    name: str
    seconds: float
    detail: str = ""


@dataclass
class Report:
    target: str
    """The dataplane programmed, e.g. ``nftables`` or ``iptables-legacy``."""
    removed: List[str] = field(default_factory=list)
    steps: List[Step] = field(default_factory=list)
    switch_seconds: float = 0.0
    """From the start of the new ruleset's write to the old one's removal."""
    overlap_seconds: float = 0.0
    """How long two complete rulesets were installed: from the new one's commit to the old one's removal."""
    takeover: bool = False

    def lines(self) -> List[str]:
        out = [f"{s.name}: {s.detail} ({s.seconds:.3f} s)" for s in self.steps]
        how = "taken over by a full rewrite" if self.takeover else "switched"
        out.append(f"done: {how} to {self.target} in {self.switch_seconds:.3f} s; two rulesets were installed "
                   f"together for {self.overlap_seconds:.3f} s")
        return out


@dataclass(frozen=True)
class Plan:
    """What the migration removes after programming the target."""

    target: Ruleset
    remove: Tuple[Ruleset, ...]
    takeover: Optional[Ruleset] = None
    """kube-proxy's iptables rules in the target's own flavour: rewritten by the target's full sync."""
    kept: Tuple[Ruleset, ...] = ()
    """Rules of the other proxy left alone (kube-proxy's, without --from-kube-proxy)."""

    def describe(self) -> List[str]:
        what = "taking the KUBE-* chains over" if self.takeover else "netproxy's rules"
        out = [f"program {self.target.label} in full ({what}), check the kernel holds it"]
        out.extend(f"then remove {r}" for r in self.remove)
        if not self.remove:
            out.append("nothing to remove")
        out.extend(f"leave {r} (pass --from-kube-proxy to remove them)" for r in self.kept)
        return out


def plan(held: Holdings, target: Ruleset, from_kube_proxy: bool) -> Plan:
    """Which rulesets go once ``target`` is programmed.  MigrateError when the switch would not be
    clean: kube-proxy's iptables rules in the target's flavour without ``--from-kube-proxy`` (the
    target's sync would rewrite them without saying so)."""
    same = [r for r in held.find("kube-proxy", "iptables") if target.dataplane == "iptables"
            and r.flavour == target.flavour]
    # netproxy's own in another dataplane always go; kube-proxy's when asked (those in the target's
    # own chains are taken over by its sync, and their leftovers removed after).
    remove = tuple(r for r in held.find("netproxy") if (r.dataplane, r.flavour) != (target.dataplane, target.flavour))
    if from_kube_proxy:
        remove = tuple(r for r in held.find("kube-proxy") if r not in same) + remove
    kept: Tuple[Ruleset, ...] = ()
    if not from_kube_proxy:
        if same:
            raise MigrateError("plan", f"the node holds {same[0]}, which use the same chain names as netproxy's "
                               f"{target.label} rules: pass --from-kube-proxy to take them over")
        kept = tuple(held.find("kube-proxy"))
    takeover = same[0] if from_kube_proxy and same else None
    return Plan(target, remove + ((takeover,) if takeover else ()), takeover, kept)


def check_marks(p: Plan, config: ProxyConfig) -> None:
    """The masquerade bit must be the same on both sides (see the module): refuse before writing."""
    want = hex(config.masquerade_mark)
    for old in p.remove:
        other = sorted(m for m in old.marks if m != want)
        if other:
            bit = int(other[0], 16).bit_length() - 1
            raise MigrateError("plan", f"{old} mark packets for masquerade with {other[0]}, netproxy with {want} "
                               f"(--masquerade-bit {config.masquerade_bit}): pass --masquerade-bit {bit} so that "
                               "both rulesets use the same bit while both are installed")


Remover = Callable[[Ruleset], None]


def default_remover(config: ProxyConfig, target: Backend) -> Remover:
    """How each kind of old ruleset is removed: by its owner's own cleanup, nothing else."""

    def remove(old: Ruleset) -> None:
        if old.owner == "kube-proxy":
            backends.remove_kube_proxy(old.dataplane, old.flavour, target)
        elif old.dataplane == "nftables":
            backends.create("nftables", config).cleanup()
        elif target.name == "iptables":
            backends.remove_rules_only(old.flavour)  # the target's rules use the NETPROXY-* ipsets
        else:
            old_config = dataclasses.replace(config, backend="iptables", iptables_flavour=old.flavour,
                                             iptables_writer="restore")
            backends.create("iptables", old_config).cleanup()

    return remove


def target_ruleset(backend: Backend, config: ProxyConfig) -> Ruleset:
    flavour = config.iptables_flavour if backend.name == "iptables" else ""
    return Ruleset("netproxy", backend.name, flavour)


def migrate(backend: Backend, config: ProxyConfig, snapshot: Snapshot, *, from_kube_proxy: bool = False,
            held: Optional[Holdings] = None, remover: Optional[Remover] = None,
            clock: Callable[[], float] = time.monotonic) -> Report:
    """Program ``backend`` from ``snapshot`` in full, check the kernel, then remove the old rulesets.

    MigrateError names the step that failed; up to the check, the old rulesets are untouched (and a
    target written from nothing is removed again); a failed removal leaves the new ruleset working.
    """
    t0 = clock()
    held = held if held is not None else survey()
    target = target_ruleset(backend, config)
    p = plan(held, target, from_kube_proxy)
    if from_kube_proxy and not held.find("kube-proxy"):
        log.warning("--from-kube-proxy: this node holds none of kube-proxy's rules (stopped and cleaned up already?)")
    check_marks(p, config)
    report = Report(target.label, takeover=p.takeover is not None)
    found = ", ".join(str(r) for r in held.rulesets) or "no proxy rules"
    report.steps.append(Step("survey", clock() - t0, f"the node holds {found}"))
    had_target = any((r.owner, r.dataplane, r.flavour) == ("netproxy", target.dataplane, target.flavour)
                     for r in held.rulesets)
    start = clock()
    try:
        result = backend.sync(snapshot, Changes(full=True))
    except BackendError as exc:
        _roll_back(backend, had_target or p.takeover is not None)
        raise MigrateError("program", f"programming {target.label} failed, the old rules are untouched: {exc}") \
            from exc
    committed = clock()
    report.steps.append(Step("program", committed - start,
                             f"{target.label}: {result.services_written} service ports written in full"))
    try:
        missing = backend.missing_in_kernel()
    except BackendError as exc:
        missing = [f"the kernel could not be read: {exc}"]
    if missing:
        _roll_back(backend, had_target or p.takeover is not None)
        shown = "; ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise MigrateError("verify", f"the kernel does not hold the new {target.label} rules ({shown}); "
                           "the old rules are untouched")
    checked = clock()
    report.steps.append(Step("verify", checked - committed, f"the kernel holds the new {target.label} rules"))
    remove = remover if remover is not None else default_remover(config, backend)
    for old in p.remove:
        t = clock()
        try:
            remove(old)
        except BackendError as exc:
            raise MigrateError("remove", f"removing {old} failed ({exc}); the new {target.label} rules are "
                               f"installed and handle new connections; remove the rest with `netproxy cleanup`"
                               if old.owner == "netproxy" else
                               f"removing {old} failed ({exc}); the new {target.label} rules are installed and "
                               "handle new connections") from exc
        report.removed.append(str(old))
        report.steps.append(Step("remove", clock() - t, str(old)))
    end = clock()
    report.switch_seconds = end - start
    report.overlap_seconds = end - committed if p.remove else 0.0
    for kept in p.kept:
        log.warning("left %s in place (not asked to remove them: --from-kube-proxy)", kept)
    return report


def _roll_back(backend: Backend, keep: bool) -> None:
    """After a failed write or check, remove what the target wrote — unless it held rules before
    (a re-run, or a takeover of the same chains): then removing them would remove the old ones."""
    if keep:
        return
    try:
        backend.cleanup()
    except BackendError as exc:
        log.error("could not remove the partly written %s rules: %s", backend.name, exc)


def remove_leftovers(backend: Backend, config: ProxyConfig, skip_written: bool = False) -> List[str]:
    """After the first full write of ``netproxy sync`` or ``run``: the rules of the dataplane this node
    no longer runs — netproxy's own (a run with the other backend or flavour) and kube-proxy's (an
    earlier kube-proxy, as kube-proxy itself removes the other modes' rules when it starts) — go as
    ``migrate --from-kube-proxy`` would remove them: the new ruleset is complete in the kernel by then,
    so no connection meets neither, as in a live migration.  One line each; what was removed.

    ``skip_written``: the iptables flavour just written is not read back (a one-shot ``sync`` at 10k
    services would pay a whole ``iptables-save`` for it; its kube-proxy chains were taken over by the
    full write itself)."""
    flavours = tuple(f for f in FLAVOURS if not (skip_written and backend.name == "iptables"
                                                 and f == config.iptables_flavour))
    held = survey(flavours, marks=False)
    target = target_ruleset(backend, config)
    kube_proxy = held.find("kube-proxy")
    if kube_proxy:
        log.warning("this node also holds %s: removing them now that netproxy's rules are in place (stop "
                    "kube-proxy first, or its next sync puts them back)", ", ".join(map(str, kube_proxy)))
    try:
        p = plan(held, target, from_kube_proxy=bool(kube_proxy))
    except MigrateError as err:
        log.warning("leftover rules not removed: %s", err)
        return []
    remove = default_remover(config, backend)
    done = []
    for old in p.remove:
        try:
            remove(old)
        except BackendError as err:
            log.warning("could not remove %s left from an earlier run: %s", old, err)
            continue
        log.info("removed %s left from an earlier run: this node now runs %s", old, target.label)
        done.append(str(old))
    return done
