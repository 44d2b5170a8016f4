"""Keeping the kernel's ipsets in step with the rules that name them (README.md, "Sets").

Order, so that no rule ever names a missing set and no packet meets a half-made state: before a
family's rule write the sets its new rules name exist and the hairpin set holds the new endpoints;
after it, stale hairpin elements go, the clients of affinity slots that changed endpoint are
released, and sets no rule names any more are destroyed.  A full sync reads the kernel's sets again
(another program, or a crash, may have changed them) and prunes affinity elements whose
(service, slot) no longer exists.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Set, Tuple

from netproxy.backends.iptables import ipset
from netproxy.backends.iptables.ipset import Element, IpsetError, Ipsets
from netproxy.backends.iptables.render import FamilyRuleset, ServiceRules

log = logging.getLogger(__name__)
Key = Tuple[int, int, int]
"""(proto, port, service address) under which a client is remembered; address 0: a NodePort."""


def _content(ruleset: FamilyRuleset) -> List[Tuple[str, FrozenSet[Element]]]:
    """The sets whose every element netproxy decides, with what they must hold."""
    return [(ipset.hairpin_set(ruleset.family), ruleset.hairpin),
            (ipset.cluster_ip_set(ruleset.family), ruleset.cluster_ips)]


def _matches(e: Element, keys: FrozenSet[Key] | Set[Key]) -> bool:
    return (e[1], e[2], e[3]) in keys or (e[1], e[2], 0) in keys


IN_BACKGROUND = 2000
"""Hairpin elements from which the fill runs beside the rule write (a thread: the kernel does the
work, the GIL is free during the netlink calls)."""


def _compare(held: Iterable[Element], wanted: FrozenSet[Element]) -> Tuple[List[Element], FrozenSet[Element]]:
    """(wanted elements the kernel's set lacks, its elements not wanted), the set's elements read one
    at a time: at 100k services the hairpin set's 500k, read back whole and made a set, were ~120 MiB
    more under the rule write and the fingerprint after it; here only a set of references to
    ``wanted``'s own elements is made, and dropped at once."""
    lacking = set(wanted)
    extra: List[Element] = []
    for e in held:
        if e in wanted:
            lacking.discard(e)
        else:
            extra.append(e)
    return list(lacking), frozenset(extra)


def _done() -> None:
    return None


class _Background:
    """A fill running in a thread; :meth:`wait` returns when it is done and raises what it raised."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="netproxy-ipset", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class SetKeeper:
    """What netproxy knows of its sets, per family, and the releases still to do."""

    def __init__(self) -> None:
        self._known: Dict[int, Set[str]] = {}
        self._content: Dict[str, FrozenSet[Element]] = {}
        """What each set whose elements netproxy decides (hairpin, cluster IPs) holds, as far as we know."""
        self._releases: Dict[int, Dict[int, Set[Key]]] = {}

    def replaced(self, old: Mapping[int, ServiceRules], new: Mapping[int, ServiceRules]) -> None:
        """A service port was rendered again (``new`` empty: it is gone): the slots whose endpoint
        changed or left release their clients after the next write."""
        for family, before in old.items():
            if not before.affinity_slots:
                continue
            after = new.get(family)
            if after is None or after.affinity_keys != before.affinity_keys:
                gone: Iterable[Tuple[int, object]] = before.affinity_slots
            else:
                now = set(after.affinity_slots)
                gone = [x for x in before.affinity_slots if x not in now]
            for slot, _ in gone:
                self._releases.setdefault(family, {}).setdefault(slot, set()).update(before.affinity_keys)

    def before_write(self, sets: Ipsets, ruleset: FamilyRuleset, full: bool) -> Callable[[], None]:
        """Make the sets; start filling the hairpin set.  Returns what the writer calls before it
        commits (it waits for the fill): a cold sync's 50k–129k elements go in while
        ``iptables-restore`` parses, not before it starts."""
        family = ruleset.family
        if full or family not in self._known:
            self._known[family] = {n for n, info in sets.sets().items()
                                   if n.startswith(ipset.PREFIX) and info.family == family}
            for name, _ in _content(ruleset):
                self._content.pop(name, None)  # read again: someone may have changed it
        known = self._known[family]
        for name, timeout in ruleset.sets.items():
            if name not in known:
                sets.create(name, family, timeout)
                known.add(name)
        adds: List[Tuple[str, List[Element]]] = []
        for name, wanted in _content(ruleset):
            if not wanted:
                continue
            # Unsorted (the kernel takes elements in any order): sorting a 100k-service cluster's 500k
            # hairpin elements cost 1.2 s before the rule write could start.  What the set holds after
            # the fill is ``wanted`` itself when nothing else is there (no copy).
            current = self._content.get(name)
            if current is None:
                missing, extra = _compare(sets.each(name), wanted)
            else:
                missing, extra = list(wanted - current), current - wanted
            self._content[name] = wanted | extra if extra else wanted
            if missing:
                adds.append((name, missing))

        def fill() -> None:  # one thread at most: the netlink socket is not shared between threads
            for name, missing in adds:
                sets.add(name, family, missing)

        if sum(len(m) for _, m in adds) < IN_BACKGROUND:
            fill()
            return _done
        return _Background(fill).wait

    def after_write(self, sets: Ipsets, ruleset: FamilyRuleset, full: bool) -> None:
        family = ruleset.family
        known = self._known.setdefault(family, set())
        for name, wanted in _content(ruleset):
            stale = self._content.get(name, frozenset()) - wanted
            if stale and name in ruleset.sets:
                sets.delete(name, family, sorted(stale))
            self._content[name] = wanted
        for slot, keys in sorted(self._releases.pop(family, {}).items()):
            self._delete_where(sets, family, ipset.affinity_set(family, slot), keys)
        if full:
            self._prune(sets, ruleset)
        for old in sorted(known - set(ruleset.sets)):
            try:
                sets.destroy(old)
            except IpsetError as exc:  # still named by a rule we do not own: keep it, say so
                log.warning("ipset %s not destroyed: %s", old, exc)
                continue
            known.discard(old)
            self._content.pop(old, None)

    def _delete_where(self, sets: Ipsets, family: int, name: str, keys: Set[Key] | FrozenSet[Key]) -> None:
        if name not in self._known.get(family, set()):
            return
        gone: List[Element] = [e for e in sets.elements(name) if _matches(e, keys)]
        if gone:
            sets.delete(name, family, gone)

    def _prune(self, sets: Ipsets, ruleset: FamilyRuleset) -> None:
        """Affinity elements whose (service, slot) no rule holds: left by a crash or a change that
        never finished.  They would make a later endpoint in that slot inherit strangers' clients."""
        family = ruleset.family
        prefix = ipset.affinity_set(family, 0)[:-1]
        for name in sorted(self._known.get(family, set())):
            if not name.startswith(prefix):
                continue
            keys = ruleset.affinity.get(int(name[len(prefix):]), frozenset())
            bad = [e for e in sets.elements(name) if not _matches(e, keys)]
            if bad:
                sets.delete(name, family, bad)

    def destroy_all(self, sets: Ipsets) -> None:
        """``netproxy cleanup``: every set netproxy made, once no rule names them."""
        for name in sorted(sets.sets()):
            if name.startswith(ipset.PREFIX):
                try:
                    sets.destroy(name)
                except IpsetError as exc:
                    log.warning("ipset %s not destroyed: %s", name, exc)
        self._known.clear()
        self._content.clear()
        self._releases.clear()
