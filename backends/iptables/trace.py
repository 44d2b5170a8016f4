"""A packet tracer over a rendered :class:`FamilyRuleset`: kube-proxy's unit-test idea ("this packet to
this address from this source ends at these endpoints, masqueraded or not, or is dropped/rejected").

It interprets the argument lists the renderer produced, as the kernel would for the first packet of a
connection: nat ``KUBE-SERVICES`` (from PREROUTING for a packet from elsewhere, OUTPUT for one from
the node), then filter ``KUBE-SERVICES`` (ctstate NEW, on the DNAT-ed destination), then nat
``KUBE-POSTROUTING``.  ``-m statistic`` forks the trace (each branch is one possible endpoint), so a
trace returns every possible outcome, with the chains it went through and its share of the random
choices (:meth:`Tracer.outcomes`, what ``netproxy trace --backend iptables`` prints).  Unknown matches
or targets raise: the tracer must understand every rule it walks, or it would pass packets it should
not.  The unit tests of the renderer use the same tracer.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from netproxy.backends import base
from netproxy.backends.iptables import ipset, names
from netproxy.backends.iptables.render import FamilyRuleset, Rule
from netproxy.backends.iptables.words import options

TERMINAL = ("DNAT", "DROP", "REJECT", "ACCEPT", "MASQUERADE")


@dataclass(frozen=True)
class Packet:
    src: str
    dst: str
    dport: int
    proto: str = "tcp"
    from_node: bool = False
    """Sent by the node itself (nat OUTPUT, ``--src-type LOCAL``) rather than arriving (PREROUTING)."""
    iif: str = ""
    """The interface it arrived on (``-i``); none for the node's own packets."""

    @classmethod
    def of(cls, packet: base.Packet) -> Packet:
        """The shared packet (``netproxy trace``) as this tracer reads it: one conversion for the
        rendered and the kernel trace, so neither can drop a field (the kernel trace once lost ``iif``)."""
        return cls(packet.saddr, packet.daddr, packet.dport, packet.proto, from_node=packet.hook == "output",
                   iif=packet.iif)


@dataclass(frozen=True)
class _State:
    mark: int = 0
    dnat: Optional[str] = None
    added: Tuple[Tuple[str, ipset.Element], ...] = ()
    """Elements this packet added to sets on its way (``-j SET --add-set``)."""
    chains: Tuple[str, ...] = ()
    """The chains walked so far, as "table/chain"."""
    share: float = 1.0
    """The probability of this branch (the product of the -m statistic choices on the way)."""


@dataclass
class Tracer:
    ruleset: FamilyRuleset
    local_addresses: Iterable[str] = ()
    """The node's addresses (``addrtype LOCAL``); loopback is always local."""
    members: Dict[str, Set[ipset.Element]] = field(default_factory=dict)
    """Affinity sets: name → elements (clients remembered); :meth:`remember` fills them.  The
    hairpin set is the ruleset's own."""
    steps: int = 0

    def __post_init__(self) -> None:
        self._local: FrozenSet[ipaddress._BaseAddress] = frozenset(
            ipaddress.ip_address(a) for a in self.local_addresses)

    # -- public ----------------------------------------------------------------------------------

    def trace(self, pkt: Packet) -> Set[base.Outcome]:
        """Every outcome of ``pkt`` without its chains and shares (the unit tests' view); stricter than
        :meth:`outcomes`: nat ending in anything but DNAT, or a masquerade left to chance, is a bug."""
        return {replace(o, chains=(), share=1.0) for o in self._walk(pkt, strict=True)}

    def outcomes(self, packet: base.Packet) -> List[base.Outcome]:
        """Every way ``packet`` can go, with its chains and share: what ``netproxy trace`` prints, for
        the rendered rules and the kernel's alike (the one place the shared packet is converted)."""
        return self._walk(Packet.of(packet), strict=False)

    def endpoints(self, pkt: Packet) -> Set[Optional[str]]:
        return {o.target for o in self.trace(pkt)}

    def _walk(self, pkt: Packet, strict: bool) -> List[base.Outcome]:
        out: List[base.Outcome] = []
        start = _State(chains=("nat/" + ("OUTPUT" if pkt.from_node else "PREROUTING"),))
        for state, nat_verdict in self._run("nat", names.SERVICES, pkt, pkt.dst, start, "NEW"):
            if strict and nat_verdict not in (None, "DNAT"):
                raise AssertionError(f"nat KUBE-SERVICES ended in {nat_verdict}")
            dst = _dest_ip(state.dnat) if state.dnat else pkt.dst
            for fstate, fverdict in self._run("filter", names.SERVICES, pkt, dst, state, "NEW"):
                if fverdict in ("DROP", "REJECT"):
                    out.append(base.Outcome(fverdict.lower(), state.dnat, False, fstate.chains, fstate.share))
                    continue
                post = self._run("nat", names.POSTROUTING, pkt, dst, fstate, "DNAT" if state.dnat else "NEW")
                masqs = {v == "MASQUERADE" for _, v in post}
                if strict and len(masqs) != 1:
                    raise AssertionError("postrouting must not depend on chance")
                masq = True in masqs
                # An ACCEPT of netproxy's own (the health-check NodePort) is not "untouched": it lets
                # the packet past the node's own INPUT policy.
                verdict = "dnat" if state.dnat else ("allow" if fverdict == "ACCEPT" else "accept")
                chains = fstate.chains + (("nat/" + names.POSTROUTING,) if masq else ())
                out.append(base.Outcome(verdict, state.dnat, masq, chains, fstate.share))
        return out

    def remember(self, pkt: Packet) -> None:
        """Run the packet and keep what its ``-j SET --add-set`` added, as the kernel would (affinity).
        With several possible endpoints the first branch is taken: one packet makes one choice."""
        for state, _ in self._run("nat", names.SERVICES, pkt, pkt.dst, _State(), "NEW")[:1]:
            for name, element in state.added:
                self.members.setdefault(name, set()).add(element)

    # -- the interpreter -------------------------------------------------------------------------

    def _run(self, table: str, chain: str, pkt: Packet, dst: str, state: _State,
             ctstate: str) -> List[Tuple[_State, Optional[str]]]:
        # A chain the ruleset lacks is one netproxy has not written (a kernel read after cleanup, or a
        # family without services): nothing of ours takes the packet there.
        rules = self.ruleset.chains(table).get(chain, ())
        results: List[Tuple[_State, Optional[str]]] = []
        state = replace(state, chains=state.chains + (f"{table}/{chain}",))
        pending: List[Tuple[int, _State]] = [(0, state)]

        def walk(start: int, st: _State) -> None:
            for i in range(start, len(rules)):
                self.steps += 1
                match = self._matches(rules[i], pkt, dst, st, ctstate)
                if match == "no":
                    continue
                if match == "maybe":
                    p = _probability(rules[i])
                    # the branch where the random match failed, for later
                    pending.append((i + 1, replace(st, share=st.share * (1 - p))))
                    st = replace(st, share=st.share * p)
                target, opts = _target(rules[i])
                if target is None:
                    continue
                if target == "SET":
                    st = replace(st, added=st.added + ((opts["--add-set"], self._key(pkt, dst, st)),))
                    continue
                if target == "RETURN":
                    results.append((st, None))
                    return
                if target == "MARK":
                    st = replace(st, mark=_mark(st.mark, opts))
                    continue
                if target in TERMINAL:
                    if target == "DNAT":
                        st = replace(st, dnat=opts["--to-destination"])
                    results.append((st, target))
                    return
                for sub_state, verdict in self._run(table, target, pkt, dst, st, ctstate):
                    if verdict is None:
                        walk(i + 1, sub_state)
                    else:
                        results.append((sub_state, verdict))
                return
            results.append((st, None))

        while pending:
            walk(*pending.pop())
        return results

    def _key(self, pkt: Packet, dst: str, st: _State) -> ipset.Element:
        """``src,dst,dst`` of the packet as it is now: after a DNAT, the endpoint's address and port."""
        port = int(st.dnat.rpartition(":")[2]) if st.dnat else pkt.dport
        return (int(ipaddress.ip_address(pkt.src)), ipset.PROTOS[pkt.proto], port, int(ipaddress.ip_address(dst)))

    def _member(self, name: str, key: ipset.Element, st: _State) -> bool:
        if name == ipset.hairpin_set(self.ruleset.family):
            return key in self.ruleset.hairpin
        return key in self.members.get(name, set()) or (name, key) in st.added

    def _is_local(self, addr: str) -> bool:
        ip = ipaddress.ip_address(addr)
        return ip.is_loopback or ip in self._local

    def _matches(self, rule: Rule, pkt: Packet, dst: str, st: _State, ctstate: str) -> str:
        result = "yes"
        for opt in options(rule):
            if opt.name in ("-j", "-g"):
                break
            arg, value = opt.name, opt.value
            ok: Optional[bool]
            if arg == "-s":
                ok = ipaddress.ip_address(pkt.src) in ipaddress.ip_network(value)
            elif arg == "-d":
                ok = ipaddress.ip_address(dst) in ipaddress.ip_network(value)
            elif arg == "-p":
                ok = pkt.proto == value
            elif arg == "-i":  # "br0" exactly, or "veth+": any name starting with "veth"
                iif = "" if pkt.from_node else pkt.iif
                ok = iif.startswith(value[:-1]) if value.endswith("+") else iif == value
            elif arg == "-m" or arg in ("--comment", "--mode", "--reject-with"):
                ok = None
            elif arg == "--dport":  # a port, or a range (the NodePort tree's "LO:HI")
                lo, _, hi = value.partition(":")
                ok = int(lo) <= pkt.dport <= int(hi or lo)
            elif arg == "--dst-type":
                ok = self._is_local(dst) if value == "LOCAL" else _unknown(arg, value)
            elif arg == "--src-type":
                ok = (pkt.from_node or self._is_local(pkt.src)) if value == "LOCAL" else _unknown(arg, value)
            elif arg == "--ctstate":
                ok = ctstate in value.split(",")
            elif arg == "--mark":
                want, _, mask = value.partition("/")
                ok = st.mark & int(mask or "0xffffffff", 0) == int(want, 0)
            elif arg == "--probability":
                ok = None
                if float(value) < 1.0:
                    result = "maybe"
            elif arg == "--match-set":
                ok = self._in_set(value, opt.values[1], pkt, dst, st)
            else:
                ok = _unknown(arg, value)
            if ok is not None and ok == opt.negated:
                return "no"
        return result

    def _in_set(self, name: str, flags: str, pkt: Packet, dst: str, st: _State) -> bool:
        if flags == "src,dst,dst":
            return self._member(name, self._key(pkt, dst, st), st)
        if flags == "dst" and name == ipset.cluster_ip_set(self.ruleset.family):
            return ipset.address(int(ipaddress.ip_address(dst))) in self.ruleset.cluster_ips
        return _unknown("--match-set", f"{name} {flags}")


def _probability(rule: Rule) -> float:
    return float(rule[rule.index("--probability") + 1])


def _unknown(arg: str, value: str) -> bool:
    raise AssertionError(f"the tracer does not know {arg} {value}")


def _target(rule: Rule) -> Tuple[Optional[str], Dict[str, str]]:
    if "-j" not in rule:
        return None, {}
    at = rule.index("-j")
    rest = rule[at + 2:]
    if rule[at + 1] == "SET":  # --add-set NAME FLAGS --exist --timeout T: the set's name is what matters
        return "SET", {"--add-set": rest[rest.index("--add-set") + 1]}
    return rule[at + 1], {opt.name: opt.value for opt in options(rest)}


def _mark(mark: int, opts: Dict[str, str]) -> int:
    if "--set-xmark" in opts:  # how iptables-save spells --or-mark (V/V) and --xor-mark (V/0)
        value, _, mask = opts["--set-xmark"].partition("/")
        return (mark & ~int(mask or "0xffffffff", 0)) ^ int(value, 0)
    if "--or-mark" in opts:
        return mark | int(opts["--or-mark"], 0)
    if "--xor-mark" in opts:
        return mark ^ int(opts["--xor-mark"], 0)
    raise AssertionError(f"the tracer does not know MARK {opts}")


def _dest_ip(dest: str) -> str:
    host = dest.rpartition(":")[0]
    return host.strip("[]")
