"""A pure tracer: one packet through netproxy's rendered nftables tables, by the rules' own kernel
expressions (the same ``exprs`` the netlink writer sends), every random choice enumerated.

It runs what the kernel would run: registers, payload loads from the packet's headers, lookups in
the sets and maps as the fake kernel holds them (:mod:`fake`), jumps and gotos, ``numgen`` as one
branch per value.  So a trace answers "where can a packet to 10.96.0.10:53/udp from this client
go, and why" from the same objects the writers send, without a kernel (``netproxy trace``, the
flow-table unit tests).
"""

from __future__ import annotations

import ipaddress
import struct
import sys
from dataclasses import dataclass, field, replace
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

from netproxy.backends.base import Outcome, Packet
from netproxy.backends.nftables import encode, names, wire
from netproxy.backends.nftables import expr as ex
from netproxy.backends.nftables.fake import FakeNft
from netproxy.backends.nftables.objects import Rule, Set

_PROTOS = {"tcp": 6, "udp": 17, "sctp": 132}
_NAT_CHAINS = {"prerouting": names.NAT_PREROUTING, "output": names.NAT_OUTPUT}
_FILTER_CHAINS = {"input": names.FILTER_INPUT, "forward": names.FILTER_FORWARD, "output": names.FILTER_OUTPUT}
_MAX_DEPTH = 100
"""Rule steps one path may take (each rule that does not end the path and each chain it enters is
a step deeper): netproxy's rules go about ten deep. A loop is caught here, before Python's own
recursion limit (about three frames a step) would end the trace with a RecursionError."""
_IPS_DST_NAT = 0x20
"""``ct status``'s dnat bit (the kernel's IPS_DST_NAT)."""
_MASQUERADED = "masquerade"
"""The outcome of a ``masquerade`` statement (nat postrouting): a verdict of its own."""


@dataclass
class _State:
    regs: bytearray = field(default_factory=lambda: bytearray(64))
    mark: int = 0
    chains: Tuple[str, ...] = ()
    share: float = 1.0
    dnat: bool = False
    """Whether nat has DNAT-ed the connection (``ct status dnat``): true in postrouting after a DNAT."""

    def copy(self) -> _State:
        return _State(bytearray(self.regs), self.mark, self.chains, self.share, self.dnat)


_CONTINUE = "continue"
"""A chain's end reached without a verdict: back to the caller (a base chain: its policy, accept)."""
_BREAK = "break"


class _Verdict(NamedTuple):
    verb: str
    chain: str


_Step = Union[None, str, Outcome, _Verdict]


def _word(reg: int) -> int:
    return (reg - 1) * 4 if reg <= 4 else reg - 8


def _store(regs: bytearray, reg: int, data: bytes) -> None:
    """Write ``data`` at ``reg``, zeroing the rest of its last 32-bit word, as the kernel's loads do."""
    at = 4 * _word(reg)
    size = (len(data) + 3) // 4 * 4
    regs[at:at + size] = data + b"\0" * (size - len(data))


def _load(regs: bytearray, reg: int, size: int) -> bytes:
    at = 4 * _word(reg)
    return bytes(regs[at:at + size])


class Tracer:
    """Traces packets through the tables a :class:`FakeNft` holds for one family."""

    def __init__(self, kernel: FakeNft, family: str) -> None:
        t = kernel.tables.get(family)
        if t is None:
            raise ValueError(f"no {family} netproxy table")
        self.table = t
        self.family = family
        self.depth = 0
        self._lookups: Dict[str, Dict[bytes, Optional[str]]] = {}

    # --- the packet's bytes ------------------------------------------------------------------------

    def _network(self, p: Packet, daddr: str) -> bytes:
        src, dst = ipaddress.ip_address(p.saddr).packed, ipaddress.ip_address(daddr).packed
        if self.family == "ip6":
            return b"\0" * 8 + src + dst
        return b"\0" * 12 + src + dst

    @staticmethod
    def _transport(p: Packet, dport: int) -> bytes:
        return struct.pack(">HH", p.sport, dport)

    # --- sets ------------------------------------------------------------------------------------

    def _set(self, name: str) -> Set:
        return self.table.sets[name]

    def _entries(self, name: str) -> Dict[bytes, Optional[str]]:
        got = self._lookups.get(name)
        if got is None:
            s = self._set(name)
            key = encode.Packer(encode._fields(s.key_type, s.typeof))
            got = {}
            for e in self.table.elements[name].values():  # not an interval set: _find sends those elsewhere
                got[key(e.key)] = e.value
            self._lookups[name] = got
        return got

    def _interval_match(self, name: str, key: bytes) -> Optional[str]:
        """An interval set's element holding ``key`` (its last field a CIDR), or None."""
        s = self._set(name)
        fields = encode._fields(s.key_type, s.typeof)
        pack = encode.Packer(fields[:-1]) if len(fields) > 1 else None
        head_len = encode._length(fields[:-1]) if len(fields) > 1 else 0
        addr = key[head_len:]
        for e in self.table.elements[name].values():
            parts = e.key.split(" . ")
            net = ipaddress.ip_network(parts[-1], strict=False)
            if pack is not None and pack(" . ".join(parts[:-1])) != key[:head_len]:
                continue
            if ipaddress.ip_address(bytes(addr[:len(net.network_address.packed)])) in net:
                found: str = e.key
                return found
        return None

    def _find(self, name: str, key: bytes) -> Tuple[bool, Optional[str]]:
        s = self._set(name)
        if "interval" in s.flags:
            return self._interval_match(name, key) is not None, None
        entries = self._entries(name)
        if key in entries:
            return True, entries[key]
        return False, None

    # --- evaluation --------------------------------------------------------------------------------

    def trace(self, p: Packet) -> List[Outcome]:
        """Every way ``p`` can go through nat (DNAT) and then filter (refusals)."""
        out: List[Outcome] = []
        nat = _NAT_CHAINS[p.hook]
        for o in self._chain(p, nat, _State(), p.daddr, p.dport):
            if o.verdict in ("drop", "reject", "dnat"):
                out.append(o)
                continue
            out.extend(self._filter(p, o))
        return [replace(o, verdict="accept") if o.verdict in (_CONTINUE, "return") else o for o in out]

    def _filter(self, p: Packet, after_nat: Outcome) -> List[Outcome]:
        hook = "output" if p.hook == "output" else ("input" if p.daddr in p.local else "forward")
        chain = _FILTER_CHAINS[hook]
        if chain not in self.table.chains:
            return [after_nat]
        return list(self._chain(p, chain, _State(chains=after_nat.chains, share=after_nat.share), p.daddr, p.dport))

    def _chain(self, p: Packet, chain: str, st: _State, daddr: str, dport: int) -> List[Outcome]:
        st.chains = st.chains + (chain,)
        return self._rules(p, chain, 0, st, daddr, dport)

    def _rules(self, p: Packet, chain: str, index: int, st: _State, daddr: str, dport: int) -> List[Outcome]:
        # The depth of this path, not a count of every step: the count grew over every packet one
        # tracer traced, and at 10,000 it was never reached (recursion ended the trace first).
        if self.depth >= _MAX_DEPTH:
            # The kernel refuses loops, so a ruleset that gets here was not read right: stop, say so.
            raise ValueError(f"trace: more than {_MAX_DEPTH} rule steps deep at chain {chain}; is the ruleset looping?")
        self.depth += 1
        try:
            rules = self.table.rules.get(chain, [])
            if index >= len(rules):
                return [Outcome(_CONTINUE, chains=st.chains, share=st.share)]
            return self._exprs(p, chain, index, rules[index], 0, st, daddr, dport)
        finally:
            self.depth -= 1

    def _exprs(self, p: Packet, chain: str, index: int, rule: Rule, k: int, st: _State, daddr: str,
               dport: int) -> List[Outcome]:
        exprs = rule.exprs
        while k < len(exprs):
            e = exprs[k]
            k += 1
            if isinstance(e, ex.Numgen):
                branches: List[Outcome] = []
                for v in range(e.modulus):
                    branch = st.copy()
                    branch.share = st.share / e.modulus
                    _store(branch.regs, e.dreg, struct.pack("=I", v))
                    branches.extend(self._exprs(p, chain, index, rule, k, branch, daddr, dport))
                return branches
            result = self._one(p, e, st, daddr, dport)
            if result is None:
                continue
            if isinstance(result, Outcome):
                return [result]
            if isinstance(result, str):  # the rule does not match: on to the next one
                return self._rules(p, chain, index + 1, st, daddr, dport)
            if result.verb == "jump":
                out: List[Outcome] = []
                for o in self._chain(p, result.chain, st.copy(), daddr, dport):
                    if o.verdict not in (_CONTINUE, "return"):
                        out.append(o)
                        continue
                    resumed = st.copy()  # fell off the end (or returned): on in this chain
                    resumed.share, resumed.chains = o.share, o.chains
                    out.extend(self._rules(p, chain, index + 1, resumed, daddr, dport))
                return out
            if result.verb == "goto":
                return self._chain(p, result.chain, st, daddr, dport)
            return [Outcome(result.verb, chains=st.chains, share=st.share)]
        return self._rules(p, chain, index + 1, st, daddr, dport)

    def _one(self, p: Packet, e: object, st: _State, daddr: str, dport: int) -> _Step:
        """One expression: None (go on), ``_BREAK`` (the rule does not match), a verdict, or an outcome."""
        regs = st.regs
        if isinstance(e, ex.Payload):
            data = self._network(p, daddr) if e.base == ex.NETWORK else self._transport(p, dport)
            _store(regs, e.dreg, data[e.offset:e.offset + e.length])
            return None
        if isinstance(e, ex.Meta):
            if e.sreg:
                st.mark = struct.unpack("=I", _load(regs, e.sreg, 4))[0]
                return None
            if e.key == ex.META_IIFNAME:  # the node's own packets have no input interface
                value = ("" if p.hook == "output" else p.iif).encode().ljust(ex.IFNAMSIZ, b"\0")
            elif e.key == ex.META_L4PROTO:
                value = bytes((_PROTOS[p.proto],))
            else:
                value = struct.pack("=I", st.mark)
            _store(regs, e.dreg, value)
            return None
        if isinstance(e, ex.Ct):
            if e.key == ex.CT_STATE:
                _store(regs, e.dreg, struct.pack("=I", 0x8))  # a first packet: new
            elif e.key == ex.CT_STATUS:  # before the DNAT nat has not run for it; after it, dnat is set
                _store(regs, e.dreg, struct.pack("=I", _IPS_DST_NAT if st.dnat else 0))
            elif e.key in (ex.CT_DST_IP, ex.CT_DST_IP6):
                _store(regs, e.dreg, ipaddress.ip_address(p.daddr).packed)
            elif e.key == ex.CT_PROTO_DST:
                _store(regs, e.dreg, struct.pack(">H", p.dport))
            elif e.key == ex.CT_PROTO_SRC:  # the reply's source: the port the packet is DNAT-ed to
                _store(regs, e.dreg, struct.pack(">H", dport))
            return None
        if isinstance(e, ex.Cmp):
            equal = _load(regs, e.sreg, len(e.data)) == e.data
            return None if equal == (e.op == ex.CMP_EQ) else _BREAK
        if isinstance(e, ex.Bitwise):
            have = _load(regs, e.reg, len(e.mask))
            _store(regs, e.reg, bytes((a & m) ^ x for a, m, x in zip(have, e.mask, e.xor)))
            return None
        if isinstance(e, ex.Byteorder):
            data = _load(regs, e.sreg, e.length)
            if sys.byteorder == "little" and e.size > 1:  # host order <-> network order, unit by unit
                data = b"".join(data[i:i + e.size][::-1] for i in range(0, len(data), e.size))
            _store(regs, e.dreg, data)
            return None
        if isinstance(e, ex.Fib):
            which = p.saddr if e.flags & ex.FIB_F_SADDR else daddr
            _store(regs, e.dreg, struct.pack("=I", 2 if which in p.local else 1))
            return None
        if isinstance(e, ex.Immediate):
            _store(regs, e.dreg, e.value)
            return None
        if isinstance(e, ex.Lookup):
            return self._lookup(e, st)
        if isinstance(e, ex.Verdict):
            verb = {wire.NF_DROP: "drop", wire.NF_ACCEPT: "accept", wire.NFT_JUMP: "jump",
                    wire.NFT_GOTO: "goto", wire.NFT_RETURN: "return"}[e.code]
            return _Verdict(verb, e.chain)
        if isinstance(e, ex.Nat):
            addr = str(ipaddress.ip_address(_load(regs, e.addr_reg, 16 if e.family == "ip6" else 4)))
            port = struct.unpack(">H", _load(regs, e.proto_reg, 2))[0]
            target = f"[{addr}]:{port}" if e.family == "ip6" else f"{addr}:{port}"
            masquerade, chains = self._postrouting(p, st, addr, port)
            return Outcome("dnat", target, masquerade=masquerade, chains=chains, share=st.share)
        if isinstance(e, ex.Reject):
            return Outcome("reject", chains=st.chains, share=st.share)
        if isinstance(e, ex.Masquerade):  # a nat verdict: the packet leaves with the node's address
            return Outcome(_MASQUERADED, chains=st.chains, share=st.share)
        if isinstance(e, ex.Dynset):
            return None
        raise ValueError(f"the tracer does not know {e!r}")

    def _postrouting(self, p: Packet, st: _State, addr: str, port: int) -> Tuple[bool, Tuple[str, ...]]:
        """Whether the DNAT-ed packet leaves masqueraded, and the chains on its way: the nat
        postrouting hook run on the packet as DNAT left it (its destination the endpoint), with the
        mark the chains before set and ``ct status dnat``.  A mark alone is not the answer: postrouting
        also marks hairpin traffic (a pod reaching itself through its service), which the mark set
        before the DNAT never saw."""
        if names.NAT_POSTROUTING not in self.table.chains:
            return bool(st.mark), st.chains
        after = replace(st.copy(), dnat=True)
        outs = self._chain(p, names.NAT_POSTROUTING, after, addr, port)
        # No random choice in postrouting: every way through it is one answer.
        masq = [o for o in outs if o.verdict == _MASQUERADED]
        return (True, masq[0].chains) if masq else (False, st.chains)

    def _lookup(self, e: ex.Lookup, st: _State) -> _Step:
        s = self._set(e.set)
        fields = encode._fields(s.key_type, s.typeof)
        key = _load(st.regs, e.sreg, encode._length(fields))
        found, value = self._find(e.set, key)
        value = str(value) if value is not None else None
        if e.invert:
            return None if not found else _BREAK
        if not found:
            return _BREAK
        if e.dreg is None:
            return None
        if e.dreg == 0:
            verb, _, target = str(value).partition(" ")
            return _Verdict(verb, target)
        _store(st.regs, e.dreg, encode.Packer(encode._fields(str(s.value_type), s.typeof))(str(value)))
        return None

