"""Rule statements, each written once and giving both forms a writer needs: the nft text (for
libnftables, ``plan`` and logs) and the kernel expressions (for the netlink writer).

:func:`rule` joins statements into a :class:`~objects.Rule`.  Every statement here emits exactly the
expression sequence ``nft`` emits for its text (checked against ``nft --debug=netlink`` by
``tests/kernel/test_nft_netlink.py``): a sequence ``nft`` never produces can load fine and still
crash ``nft list ruleset``.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import List, NamedTuple, Optional, Sequence, Tuple

from netproxy.backends.nftables import expr as ex
from netproxy.backends.nftables import wire
from netproxy.backends.nftables.objects import Rule

_PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP, "sctp": 132}


class Stmt(NamedTuple):
    text: str
    exprs: ex.Exprs


class Field(NamedTuple):
    """One part of a (possibly concatenated) selector: its text and how it loads into a register."""

    text: str
    words: int
    """32-bit register words it takes."""
    kind: str
    arg: int = 0


def addr(family: str, which: str) -> Field:
    """``ip saddr`` / ``ip6 daddr`` ..."""
    v6 = family == "ip6"
    offset = {"saddr": 8 if v6 else 12, "daddr": 24 if v6 else 16}[which]
    return Field(f"{family} {which}", 4 if v6 else 1, "payload-net", offset)


L4PROTO = Field("meta l4proto", 1, "l4proto")
DPORT = Field("th dport", 1, "dport")
CT_PROTO_DST = Field("ct original proto-dst", 1, "ct-proto-dst")
CT_REPLY_PROTO_SRC = Field("ct reply proto-src", 1, "ct-reply-proto-src")
"""The port a DNAT-ed connection's replies come from: its endpoint's port.  Used where the packet's
own ``th dport`` would do, so that nft's listing keeps the rule's ``meta l4proto`` (a ``tcp dport``
would let it elide that match, and nft 1.0.6 cannot read its own listing back without it)."""


def ct_daddr(family: str) -> Field:
    return Field(f"ct original {family} daddr", 4 if family == "ip6" else 1, "ct-daddr", 1 if family == "ip6" else 0)


def numgen(modulus: int) -> Field:
    return Field(f"numgen random mod {modulus}", 1, "numgen", modulus)


def _load(f: Field, word: int) -> ex.Expr:
    r = ex.reg(word)
    if f.kind == "payload-net":
        return ex.Payload(ex.NETWORK, f.arg, 4 * f.words, r)
    if f.kind == "l4proto":
        return ex.Meta(ex.META_L4PROTO, dreg=r)
    if f.kind == "dport":
        return ex.Payload(ex.TRANSPORT, 2, 2, r)
    if f.kind == "ct-daddr":
        return ex.Ct(ex.CT_DST_IP6 if f.arg else ex.CT_DST_IP, r, direction=0)
    if f.kind == "ct-proto-dst":
        return ex.Ct(ex.CT_PROTO_DST, r, direction=0)
    if f.kind == "ct-reply-proto-src":
        return ex.Ct(ex.CT_PROTO_SRC, r, direction=1)
    if f.kind == "numgen":
        return ex.Numgen(r, f.arg)
    raise ValueError(f"unknown field {f!r}")


def load(fields: Sequence[Field]) -> Tuple[str, List[ex.Expr]]:
    """The concatenation ``fields`` loaded from register 1 on, as ``nft`` lays it out.

    nft before 1.1 followed ``meta l4proto`` in an interval set's key with a byteorder conversion of
    one byte in units of two (a no-op); kernels with the fix that refuses a length that is not a
    multiple of the unit (Debian 13's 6.12) answer it with EOPNOTSUPP, and nft 1.1 no longer emits
    it (seen in the VM matrix).  netproxy emits nft 1.1's sequence, which every kernel takes."""
    exprs: List[ex.Expr] = []
    word = 0
    for f in fields:
        exprs.append(_load(f, word))
        word += f.words
    return " . ".join(f.text for f in fields), exprs


def lookup(fields: Sequence[Field], set_name: str, invert: bool = False) -> Stmt:
    """``<fields> @set`` (``!= @set``)."""
    text, exprs = load(fields)
    exprs.append(ex.Lookup(set_name, 1, invert=invert))
    return Stmt(f"{text} {'!= ' if invert else ''}@{set_name}", tuple(exprs))


def vmap(fields: Sequence[Field], map_name: str) -> Stmt:
    """``<fields> vmap @map``: the map's verdict for the packet's key (nothing on a miss)."""
    text, exprs = load(fields)
    exprs.append(ex.Lookup(map_name, 1, dreg=0))
    return Stmt(f"{text} vmap @{map_name}", tuple(exprs))


def dnat_map(family: str, fields: Sequence[Field], map_name: str) -> Stmt:
    """``dnat <family> to <fields> map @map``: the map gives ``address . port``."""
    text, exprs = load(fields)
    exprs.append(ex.Lookup(map_name, 1, dreg=1))
    exprs.append(ex.Nat(family, 1, ex.reg(4 if family == "ip6" else 1)))
    return Stmt(f"dnat {family} to {text} map @{map_name}", tuple(exprs))


REGISTER_WORDS = 16
"""The kernel's register file for data: four 16-byte registers, sixteen 32-bit words."""


def update(set_name: str, key: Sequence[Field], data: Sequence[Field], timeout: int) -> Stmt:
    """``update @set { <key> timeout <T>s : <data> }``: add the element, or refresh its timeout."""
    ktext, exprs = load(key)
    dtext, dexprs = load(data)
    first = sum(f.words for f in key)
    # nft 1.0.x puts the data in the registers after the key from the next 16-byte register on; an
    # IPv6 record (9 + 5 words) does not fit the 16 words that way (nft 1.0.x aborts on it), and
    # nft 1.1 packs the data right after the key instead (its --debug=netlink: sreg_data 17).
    start = (first + 3) // 4 * 4
    if start + sum(f.words for f in data) > REGISTER_WORDS:
        start = first
    dexprs = [_load(f, start + sum(g.words for g in data[:i])) for i, f in enumerate(data)]
    exprs.extend(dexprs)
    exprs.append(ex.Dynset(set_name, 1, ex.reg(start), timeout * 1000))
    return Stmt(f"update @{set_name} {{ {ktext} timeout {timeout}s : {dtext} }}", tuple(exprs))


def _flag_test(key: int, name: str, bit: int) -> Stmt:
    zero = struct.pack("=I", 0)
    return Stmt(name, (ex.Ct(key, 1), ex.Bitwise(1, struct.pack("=I", bit), zero), ex.Cmp(ex.CMP_NEQ, 1, zero)))


CT_STATE_NEW = _flag_test(ex.CT_STATE, "ct state new", 0x8)
CT_STATUS_DNAT = _flag_test(ex.CT_STATUS, "ct status dnat", 0x20)


def fib_local(which: str) -> Stmt:
    """``fib <saddr|daddr> type local``."""
    flags = ex.FIB_F_SADDR if which == "saddr" else ex.FIB_F_DADDR
    return Stmt(f"fib {which} type local", (ex.Fib(flags, 1), ex.Cmp(ex.CMP_EQ, 1, struct.pack("=I", 2))))


def addr_not_in(family: str, which: str, network: str) -> Stmt:
    """``ip daddr != 127.0.0.0/8``: ``nft`` compares only the whole bytes of a byte-aligned prefix."""
    net = ipaddress.ip_network(network)
    field = addr(family, which)
    length = (net.prefixlen + 7) // 8
    if net.prefixlen % 8:
        raise ValueError(f"{network}: only byte-aligned prefixes are supported")
    load_expr = ex.Payload(ex.NETWORK, field.arg, length, 1)
    return Stmt(f"{field.text} != {network}", (load_expr, ex.Cmp(ex.CMP_NEQ, 1, net.network_address.packed[:length])))


def iifname(name: str, prefix: bool = False, invert: bool = False) -> Stmt:
    """``iifname "br0"`` / ``iifname != "veth*"``: as ``nft`` emits them, an exact name compares the
    whole IFNAMSIZ buffer (NUL-padded), a prefix (``*``) only its own bytes.  The name was checked
    (``config.check_interface_name``): no quote or ``*`` of its own."""
    raw = name.encode()
    data = raw if prefix else raw.ljust(ex.IFNAMSIZ, b"\0")
    text = f'iifname {"!= " if invert else ""}"{name}{"*" if prefix else ""}"'
    return Stmt(text, (ex.Meta(ex.META_IIFNAME, dreg=1), ex.Cmp(ex.CMP_NEQ if invert else ex.CMP_EQ, 1, data)))


def l4proto(proto: str) -> Stmt:
    return Stmt(f"meta l4proto {proto}", (ex.Meta(ex.META_L4PROTO, dreg=1), ex.Cmp(ex.CMP_EQ, 1,
                                                                                     bytes((_PROTOCOLS[proto],)))))


def _mark(value: int) -> bytes:
    return struct.pack("=I", value & 0xFFFFFFFF)


def mark_or(mark: int) -> Stmt:
    """``meta mark set meta mark | <mark>``."""
    return Stmt(f"meta mark set meta mark | {mark:#010x}",
                (ex.Meta(ex.META_MARK, dreg=1), ex.Bitwise(1, _mark(~mark), _mark(mark), op=0),
                 ex.Meta(ex.META_MARK, sreg=1)))


def mark_xor(mark: int) -> Stmt:
    return Stmt(f"meta mark set meta mark ^ {mark:#010x}",
                (ex.Meta(ex.META_MARK, dreg=1), ex.Bitwise(1, _mark(0xFFFFFFFF), _mark(mark), op=0),
                 ex.Meta(ex.META_MARK, sreg=1)))


def mark_has(mark: int) -> Stmt:
    """``meta mark & <mark> == <mark>``."""
    return Stmt(f"meta mark & {mark:#010x} == {mark:#010x}",
                (ex.Meta(ex.META_MARK, dreg=1), ex.Bitwise(1, _mark(mark), _mark(0), op=0),
                 ex.Cmp(ex.CMP_EQ, 1, _mark(mark))))


MASQUERADE_FULLY_RANDOM = Stmt("masquerade fully-random", (ex.Masquerade(),))
DROP = Stmt("drop", (ex.Verdict(wire.NF_DROP),))


def jump(chain: str) -> Stmt:
    return Stmt(f"jump {chain}", (ex.Verdict(wire.NFT_JUMP, chain),))


def reject(family: str) -> Stmt:
    """ICMP(v6) port unreachable, what plain ``reject`` means in an ``ip``/``ip6`` table."""
    return Stmt("reject", (ex.Reject(4 if family == "ip6" else 3),))


def rule(chain: str, *stmts: Stmt, comment: Optional[str] = None) -> Rule:
    """A rule of ``stmts``, in both forms."""
    exprs: List[ex.Expr] = []
    for s in stmts:
        exprs.extend(s.exprs)
    return Rule(chain, " ".join(s.text for s in stmts), comment, tuple(exprs))


def goto(chain: str) -> Stmt:
    return Stmt(f"goto {chain}", (ex.Verdict(wire.NFT_GOTO, chain),))


# --- one set and chain per service port: IPv6 ClientIP affinity (layout.affinity_families) ---------

def _packed(family: str, address: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6 if family == "ip6" else socket.AF_INET, address)


def _addr_words(family: str) -> int:
    return 4 if family == "ip6" else 1


def remember(family: str, set_name: str) -> Stmt:
    """``update @set { ip saddr }``: the client joins (or refreshes) ``set`` with its own timeout."""
    saddr = addr(family, "saddr")
    exprs = (ex.Payload(ex.NETWORK, saddr.arg, 4 * saddr.words, 1), ex.Dynset(set_name, 1, 0, 0))
    return Stmt(f"update @{set_name} {{ {family} saddr }}", exprs)


def dnat_to(family: str, address: str, port: int) -> Stmt:
    w = _addr_words(family)
    target = f"[{address}]:{port}" if family == "ip6" else f"{address}:{port}"
    exprs = (ex.Immediate(1, _packed(family, address)), ex.Immediate(ex.reg(w), port.to_bytes(2, "big")),
             ex.Nat(family, 1, ex.reg(w), ex.NF_NAT_RANGE_PROTO_SPECIFIED))
    return Stmt(f"dnat {family} to {target}", exprs)


def numgen_is_zero(modulus: int) -> Stmt:
    """``numgen random mod N == 0``: taken with probability 1/N."""
    return Stmt(f"numgen random mod {modulus} == 0", (ex.Numgen(1, modulus), ex.Cmp(ex.CMP_EQ, 1, b"\0\0\0\0")))
