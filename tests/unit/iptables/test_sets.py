"""The ipset side of the iptables backend, on the in-memory fake: element encoding, hairpin
elements following endpoints, affinity clients released when their endpoint leaves, sets made
before the rules that name them and destroyed after."""

from __future__ import annotations

import ipaddress
import re
from typing import List, Set

from netproxy.backends.iptables import IptablesBackend, affinity, ipset
from netproxy.backends.iptables.fake import FakeIptables
from netproxy.backends.iptables.ipset import FakeIpsets, element
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot

VIP = "10.96.0.10"


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def test_fast_element_encoding_is_the_nested_attributes() -> None:
    for family, e in ((4, element("10.1.2.3", "tcp", 8080, "10.1.2.3")),
                      (6, element("fd00::7", "sctp", 9, "fd00::8"))):
        assert ipset._element(family, e) == ipset._element_slow(family, e)


def snap(eps: List[str], affinity_on: bool = True) -> Snapshot:
    svc = ServicePort(ServicePortName("default", "web", "http"), "TCP", 80, 8080, cluster_ips=(ip(VIP),),
                      affinity="ClientIP" if affinity_on else "None", affinity_timeout=60)
    endpoints = [Endpoint(ip(e), 8080, node_name="node") for e in eps]
    return Snapshot.build([svc], {svc.name: endpoints}, NodeInfo(name="node"))


def backend() -> IptablesBackend:
    b = IptablesBackend(ProxyConfig(hostname="node"), kernel=FakeIptables())
    assert isinstance(b.ipsets, FakeIpsets)
    return b


def slot_of(addr: str, eps: List[str]) -> int:
    return affinity.slots((int(ip(e)), 8080) for e in eps)[(int(ip(addr)), 8080)]


def test_a_leaving_endpoint_releases_its_clients_and_only_those() -> None:
    b = backend()
    sets = b.ipsets
    assert isinstance(sets, FakeIpsets)
    eps = ["10.1.0.1", "10.1.0.2", "10.1.0.3"]
    b.sync(snap(eps), Changes(full=True))
    names = {ipset.affinity_set(4, slot_of(e, eps)) for e in eps}
    assert names <= set(sets.sets()) and ipset.hairpin_set(4) in sets.sets()
    # The kernel remembers two clients (what -j SET --add-set would do), one per endpoint.
    gone, stays = ipset.affinity_set(4, slot_of("10.1.0.2", eps)), ipset.affinity_set(4, slot_of("10.1.0.1", eps))
    sets.add(gone, 4, [element("10.2.0.1", "tcp", 80, VIP)])
    sets.add(stays, 4, [element("10.2.0.2", "tcp", 80, VIP), element("10.2.0.9", "tcp", 81, "10.96.0.11")])
    b.sync(snap(["10.1.0.1", "10.1.0.3"]), Changes(full=False))
    assert gone not in sets.sets() or not sets.elements(gone)
    assert element("10.2.0.2", "tcp", 80, VIP) in sets.elements(stays)
    # Another service's client in the same slot set is not touched.
    assert element("10.2.0.9", "tcp", 81, "10.96.0.11") in sets.elements(stays)
    # The endpoint left: its hairpin element goes too.
    assert element("10.1.0.2", "tcp", 8080, "10.1.0.2") not in sets.elements(ipset.hairpin_set(4))


class WriteRecorder(FakeIptables):
    """The iptables fake that marks each write in the ipset fake's call list and notes, at that
    moment, which sets the written rules name and which sets exist: the kernel refuses a rule naming
    a set that does not exist, and a set still named by a rule cannot be destroyed."""

    def __init__(self, sets: FakeIpsets) -> None:
        super().__init__()
        self.sets = sets
        self.named_at_write: List[Set[str]] = []
        self.existing_at_write: List[Set[str]] = []

    def apply(self, family, changes, before_commit=None, meanwhile=None):  # type: ignore[no-untyped-def]
        size = super().apply(family, changes, before_commit, meanwhile)
        text = "\n".join(" ".join(r) for t in self.tables.values() for rules in t.values() for r in rules)
        self.named_at_write.append(set(re.findall(r"--(?:match|add)-set (\S+)", text)))
        self.existing_at_write.append(set(self.sets.sets()))
        self.sets.calls.append(("write", str(family)))
        return size


def test_sets_are_made_before_the_write_and_destroyed_after_it() -> None:
    b = backend()
    sets = b.ipsets
    assert isinstance(sets, FakeIpsets)
    kernel = WriteRecorder(sets)
    b._kernel = kernel
    b.sync(snap(["10.1.0.1", "10.1.0.2"]), Changes(full=True))
    first_write = sets.calls.index(("write", "4"))
    created = [i for i, (op, name) in enumerate(sets.calls) if op == "create" and "AFFINITY" in name]
    assert created and max(created) < first_write, sets.calls  # made before the rules that name them
    named = {n for n in kernel.named_at_write[0] if "AFFINITY" in n}
    assert named and named <= kernel.existing_at_write[0]
    del sets.calls[:]
    b.sync(snap(["10.1.0.1", "10.1.0.2"], affinity_on=False), Changes(full=False))
    write = sets.calls.index(("write", "4"))
    destroyed = [i for i, (op, name) in enumerate(sets.calls) if op == "destroy" and "AFFINITY" in name]
    # Destroyed, and only once the rules that named them were gone from the kernel.
    assert destroyed and min(destroyed) > write, sets.calls
    assert named <= kernel.existing_at_write[-1] and not any("AFFINITY" in n for n in kernel.named_at_write[-1])
    assert not [n for n in sets.sets() if "AFFINITY" in n]  # no rule names them any more


def test_a_full_sync_prunes_clients_of_slots_no_rule_holds() -> None:
    b = backend()
    sets = b.ipsets
    assert isinstance(sets, FakeIpsets)
    eps = ["10.1.0.1", "10.1.0.2"]
    b.sync(snap(eps), Changes(full=True))
    used = ipset.affinity_set(4, slot_of("10.1.0.1", eps))
    sets.add(used, 4, [element("10.2.0.1", "tcp", 80, VIP), element("10.2.0.1", "tcp", 80, "10.96.0.99")])
    b.sync(snap(eps + ["10.1.0.77"]), Changes(full=True))  # a full sync that writes (an unchanged one is skipped)
    assert sets.elements(used) == [element("10.2.0.1", "tcp", 80, VIP)]


def test_a_large_hairpin_fill_runs_beside_the_write_and_ends_before_the_commit() -> None:
    b = backend()
    sets = b.ipsets
    assert isinstance(sets, FakeIpsets)
    seen_at_commit: List[int] = []

    class CommitWatcher(FakeIptables):
        def apply(self, family, changes, before_commit=None, meanwhile=None):  # type: ignore[no-untyped-def]
            def at_commit() -> None:  # the fake calls it at the payload's first COMMIT line
                if before_commit is not None:
                    before_commit()
                seen_at_commit.append(len(sets.content.get(ipset.hairpin_set(4), ())))

            return super().apply(family, changes, at_commit, meanwhile)

    b._kernel = CommitWatcher()
    eps = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(3000)]  # above IN_BACKGROUND
    b.sync(snap(eps, affinity_on=False), Changes(full=True))
    assert seen_at_commit[0] == 3000


def test_a_dump_of_alike_elements_parses_fast_and_odd_ones_fall_back() -> None:
    els = [element(f"10.1.0.{i}", "udp" if i % 2 else "tcp", 53 + i, f"10.1.0.{i}") for i in range(1, 200)]
    assert ipset._parse_elements(b"".join(ipset._element(4, e) for e in els)) == els
    six = [element("fd00::1", "tcp", 80, "fd00::2")]
    assert ipset._parse_elements(b"".join(ipset._element(6, e) for e in six)) == six
    odd = ipset._element(4, els[0])[:-4] + b"\1\2\3\4"  # the same layout: the fast path reads it
    assert ipset._parse_elements(odd) == [els[0][:3] + (0x01020304,)]


def _hairpin_at_each_commit(b: IptablesBackend) -> List[object]:
    """What ``b`` holds as its hairpin set's content at each commit of its rules (filled in as they come)."""
    known: List[object] = []

    class CommitWatcher(FakeIptables):
        def apply(self, family, changes, before_commit=None, meanwhile=None):  # type: ignore[no-untyped-def]
            known.append(b._sets._content.get(ipset.hairpin_set(family)))
            return super().apply(family, changes, before_commit, meanwhile)

    b._kernel = CommitWatcher()
    return known


def test_a_fill_into_an_empty_set_keeps_the_wanted_elements_without_a_copy() -> None:
    """While the rules are written, what netproxy knows the hairpin set holds after filling it from
    empty is the ruleset's own frozenset (500k elements at 100k services: no second set of them)."""
    b = backend()
    known = _hairpin_at_each_commit(b)
    eps = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(3000)]
    b.sync(snap(eps, affinity_on=False), Changes(full=True))
    assert b._assembled is not None
    hairpin = b._assembled[1][4].hairpin
    assert len(hairpin) == 3000 and known[0] is hairpin
    sets = b.ipsets
    assert isinstance(sets, FakeIpsets) and sets.content[ipset.hairpin_set(4)] == set(hairpin)


def test_a_full_sync_over_a_filled_set_keeps_its_own_elements_not_the_kernels() -> None:
    """A new process over a node whose hairpin set already holds what it wants: nothing is added, and
    the elements read back from the kernel (as many as the set holds) are not kept through the write."""
    first = backend()
    eps = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(3000)]
    first.sync(snap(eps, affinity_on=False), Changes(full=True))
    sets = first.ipsets
    assert isinstance(sets, FakeIpsets)
    sets.content[ipset.hairpin_set(4)] = {tuple(list(e)) for e in sets.content[ipset.hairpin_set(4)]}  # as read back
    b = IptablesBackend(ProxyConfig(hostname="node"), kernel=FakeIptables())
    b.ipsets = sets
    known = _hairpin_at_each_commit(b)
    del sets.calls[:]
    b.sync(snap(eps, affinity_on=False), Changes(full=True))
    assert b._assembled is not None and known[0] is b._assembled[1][4].hairpin
    assert not [c for c in sets.calls if c[0] == "add"], sets.calls


def test_a_full_sync_compares_the_kernels_elements_one_at_a_time() -> None:
    """The kernel's hairpin set is read element by element (``each``), never as a whole list, and what
    it lacks is added, what it holds beyond the rules' is deleted after the write."""
    class Streamed(FakeIpsets):
        def elements(self, name: str) -> List[ipset.Element]:
            raise AssertionError("a full sync listed a whole set")

    first = backend()
    eps = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(3000)]
    first.sync(snap(eps, affinity_on=False), Changes(full=True))
    held = first.ipsets
    assert isinstance(held, FakeIpsets)
    sets = Streamed()
    sets.info, sets.content = held.info, held.content
    hairpin = ipset.hairpin_set(4)
    stranger = element("10.9.9.9", "tcp", 8080, "10.9.9.9")
    lost = sorted(sets.content[hairpin])[5]
    sets.content[hairpin] = (sets.content[hairpin] - {lost}) | {stranger}
    b = IptablesBackend(ProxyConfig(hostname="node"), kernel=FakeIptables())
    b.ipsets = sets
    b.sync(snap(eps, affinity_on=False), Changes(full=True))
    assert b._assembled is not None
    assert sets.content[hairpin] == set(b._assembled[1][4].hairpin) and lost in sets.content[hairpin]
