"""nf_tables expressions: one small type per kernel expression, each encoding itself to its netlink
attributes and printing itself as libnftnl does (``nft --debug=netlink``), which is how the golden
tests compare them with what ``nft`` sends for the same rule text.

Registers are the kernel's numbers: 0 is the verdict, 1-4 the 16-byte registers, 8-23 the 32-bit
ones.  :func:`reg` maps a 32-bit word offset to the number ``nft`` uses for it, so that expression
sequences match ``nft``'s exactly (``nft list ruleset`` must be able to read them back).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Tuple

from netproxy.backends.nftables import wire

# payload bases, meta / ct keys, and other kernel enum values used below
LINK, NETWORK, TRANSPORT = 0, 1, 2
_BASES = {LINK: "link", NETWORK: "network", TRANSPORT: "transport"}
META_MARK, META_IIFNAME, META_L4PROTO = 3, 6, 16
_META_KEYS = {META_MARK: "mark", META_IIFNAME: "iifname", META_L4PROTO: "l4proto"}
IFNAMSIZ = 16
CT_STATE, CT_STATUS, CT_PROTO_SRC, CT_PROTO_DST, CT_DST_IP, CT_DST_IP6 = 0, 2, 11, 12, 20, 22
_CT_KEYS = {CT_STATE: "state", CT_STATUS: "status", CT_PROTO_SRC: "proto_src", CT_PROTO_DST: "proto_dst",
            CT_DST_IP: "dst_ip", CT_DST_IP6: "dst_ip6"}
CMP_EQ, CMP_NEQ = 0, 1
_CMP_OPS = {CMP_EQ: "eq", CMP_NEQ: "neq"}
NAT_DNAT = 1
NF_NAT_RANGE_PROTO_SPECIFIED = 0x2
NF_NAT_RANGE_PROTO_RANDOM_FULLY = 0x10
FIB_F_SADDR, FIB_F_DADDR = 0x1, 0x2
FIB_RESULT_ADDRTYPE = 3
NG_RANDOM = 1
DYNSET_UPDATE = 1
LOOKUP_F_INV = 1
_FAMILY_NUMBERS = {"ip": 2, "ip6": 10}
_VERDICTS = {wire.NF_DROP: "drop", wire.NF_ACCEPT: "accept", wire.NFT_JUMP: "jump", wire.NFT_GOTO: "goto",
             wire.NFT_RETURN: "return"}


def reg(word: int) -> int:
    """The register ``nft`` names for the 32-bit word at ``word`` of the register file: a 16-byte
    register when the word starts one (1-4), else the 32-bit register (8-23)."""
    return 1 + word // 4 if word % 4 == 0 else 8 + word


def words(data: bytes) -> str:
    """Data as libnftnl prints it: 32-bit words in host order, ``0x%08x`` each."""
    padded = data + b"\0" * (-len(data) % 4)
    return " ".join(f"0x{w:08x}" for w in struct.unpack(f"={len(padded) // 4}I", padded))


def _expr(name: str, body: bytes) -> bytes:
    out: bytes = wire.nest(wire.LIST_ELEM, wire.string(wire.EXPR_NAME, name), wire.nest(wire.EXPR_DATA, body))
    return out


@dataclass(frozen=True)
class Payload:
    base: int
    offset: int
    length: int
    dreg: int

    def encode(self) -> bytes:
        return _expr("payload", wire.u32(1, self.dreg) + wire.u32(2, self.base) + wire.u32(3, self.offset)
                     + wire.u32(4, self.length))

    def debug(self) -> str:
        return f"[ payload load {self.length}b @ {_BASES[self.base]} header + {self.offset} => reg {self.dreg} ]"


@dataclass(frozen=True)
class Meta:
    key: int
    dreg: int = 0
    sreg: int = 0
    """Set when the expression writes the key (``meta set``) instead of loading it."""

    def encode(self) -> bytes:
        if self.sreg:
            return _expr("meta", wire.u32(2, self.key) + wire.u32(3, self.sreg))
        return _expr("meta", wire.u32(2, self.key) + wire.u32(1, self.dreg))

    def debug(self) -> str:
        if self.sreg:
            return f"[ meta set {_META_KEYS[self.key]} with reg {self.sreg} ]"
        return f"[ meta load {_META_KEYS[self.key]} => reg {self.dreg} ]"


@dataclass(frozen=True)
class Ct:
    key: int
    dreg: int
    direction: Optional[int] = None

    def encode(self) -> bytes:
        body = wire.u32(1, self.dreg) + wire.u32(2, self.key)
        if self.direction is not None:
            body += wire.u8(3, self.direction)
        return _expr("ct", body)

    def debug(self) -> str:
        where = "" if self.direction is None else f", dir {('original', 'reply')[self.direction]} "
        return f"[ ct load {_CT_KEYS[self.key]} => reg {self.dreg} {where}]"


@dataclass(frozen=True)
class Cmp:
    op: int
    sreg: int
    data: bytes

    def encode(self) -> bytes:
        return _expr("cmp", wire.u32(1, self.sreg) + wire.u32(2, self.op) + wire.data_value(3, self.data))

    def debug(self) -> str:
        return f"[ cmp {_CMP_OPS[self.op]} reg {self.sreg} {words(self.data)} ]"


@dataclass(frozen=True)
class Bitwise:
    reg: int
    mask: bytes
    xor: bytes
    op: Optional[int] = field(default=None, compare=False)
    """NFTA_BITWISE_OP, sent when set: nft 1.0.6 sends 0 (mask and xor) for an expression written
    with an operator (``meta mark & x == x``, ``mark set mark | x``) and nothing for a flag test
    (``ct state new``); the kernel reads both alike."""

    def encode(self) -> bytes:
        op = b"" if self.op is None else wire.u32(6, self.op)
        return _expr("bitwise", wire.u32(1, self.reg) + wire.u32(2, self.reg) + wire.u32(3, len(self.mask))
                     + wire.data_value(4, self.mask) + wire.data_value(5, self.xor) + op)

    def debug(self) -> str:
        return f"[ bitwise reg {self.reg} = ( reg {self.reg} & {words(self.mask)} ) ^ {words(self.xor)} ]"


@dataclass(frozen=True)
class Lookup:
    set: str
    sreg: int
    dreg: Optional[int] = None
    invert: bool = False

    def encode(self) -> bytes:
        body = wire.string(1, self.set) + wire.u32(2, self.sreg)
        if self.dreg is not None:
            body += wire.u32(3, self.dreg)
        if self.invert:
            body += wire.u32(5, LOOKUP_F_INV)
        return _expr("lookup", body)

    def debug(self) -> str:
        text = f"[ lookup reg {self.sreg} set {self.set} "
        if self.dreg is not None:
            text += f"dreg {self.dreg} "
        if self.invert:
            text += f"0x{LOOKUP_F_INV:x} "
        return text + "]"


@dataclass(frozen=True)
class Verdict:
    code: int
    chain: str = ""

    def encode(self) -> bytes:
        return _expr("immediate", wire.u32(1, 0) + wire.data_verdict(2, self.code, self.chain))

    def debug(self) -> str:
        target = f" -> {self.chain}" if self.chain else ""
        return f"[ immediate reg 0 {_VERDICTS[self.code]}{target} ]"


@dataclass(frozen=True)
class Immediate:
    """A constant into a data register."""

    dreg: int
    value: bytes

    def encode(self) -> bytes:
        return _expr("immediate", wire.u32(1, self.dreg) + wire.data_value(2, self.value))

    def debug(self) -> str:
        return f"[ immediate reg {self.dreg} {words(self.value)} ]"


@dataclass(frozen=True)
class Nat:
    family: str
    addr_reg: int
    proto_reg: int
    flags: int = 0

    def encode(self) -> bytes:
        body = (wire.u32(1, NAT_DNAT) + wire.u32(2, _FAMILY_NUMBERS[self.family])
                + wire.u32(3, self.addr_reg) + wire.u32(5, self.proto_reg))
        if self.flags:
            body += wire.u32(7, self.flags)
        return _expr("nat", body)

    def debug(self) -> str:
        flags = f" flags 0x{self.flags:x}" if self.flags else ""
        return f"[ nat dnat {self.family} addr_min reg {self.addr_reg} proto_min reg {self.proto_reg}{flags} ]"


@dataclass(frozen=True)
class Masquerade:
    flags: int = NF_NAT_RANGE_PROTO_RANDOM_FULLY

    def encode(self) -> bytes:
        return _expr("masq", wire.u32(1, self.flags))

    def debug(self) -> str:
        return f"[ masq flags 0x{self.flags:x} ]"


@dataclass(frozen=True)
class Numgen:
    dreg: int
    modulus: int

    def encode(self) -> bytes:
        # offset 0, sent as nft sends it
        return _expr("numgen", wire.u32(1, self.dreg) + wire.u32(2, self.modulus) + wire.u32(3, NG_RANDOM)
                     + wire.u32(4, 0))

    def debug(self) -> str:
        return f"[ numgen reg {self.dreg} = random mod {self.modulus} ]"


@dataclass(frozen=True)
class Fib:
    flags: int
    dreg: int

    def encode(self) -> bytes:
        return _expr("fib", wire.u32(1, self.dreg) + wire.u32(2, FIB_RESULT_ADDRTYPE) + wire.u32(3, self.flags))

    def debug(self) -> str:
        which = "saddr" if self.flags & FIB_F_SADDR else "daddr"
        return f"[ fib {which} type => reg {self.dreg} ]"


@dataclass(frozen=True)
class Reject:
    code: int
    """ICMP port unreachable: 3 for IPv4, 4 for ICMPv6 (type 0: NFT_REJECT_ICMP_UNREACH)."""

    def encode(self) -> bytes:
        return _expr("reject", wire.u32(1, 0) + wire.u8(2, self.code))

    def debug(self) -> str:
        return f"[ reject type 0 code {self.code} ]"


@dataclass(frozen=True)
class Dynset:
    """``update @set``: add the key (and data) or refresh its timeout; 0 leaves data / the set's timeout out."""

    set: str
    key_reg: int
    data_reg: int
    timeout_ms: int

    def encode(self) -> bytes:
        body = wire.string(1, self.set) + wire.u32(3, DYNSET_UPDATE) + wire.u32(4, self.key_reg)
        if self.data_reg:
            body += wire.u32(5, self.data_reg)
        if self.timeout_ms:
            body += wire.u64(6, self.timeout_ms)
        return _expr("dynset", body)

    def debug(self) -> str:
        text = f"[ dynset update reg_key {self.key_reg} set {self.set} "
        if self.data_reg:
            text += f"sreg_data {self.data_reg} "
        if self.timeout_ms:
            text += f"timeout {self.timeout_ms}ms "
        return text + "]"


@dataclass(frozen=True)
class Byteorder:
    """Not written by netproxy's netlink writer; ``nft`` 1.0 emits it (a no-op on one-byte units) and
    the libnftables writer's rules carry it, so a kernel read-back must know it."""

    sreg: int
    dreg: int
    op: int
    length: int
    size: int

    def encode(self) -> bytes:
        return _expr("byteorder", wire.u32(1, self.sreg) + wire.u32(2, self.dreg) + wire.u32(3, self.op)
                     + wire.u32(4, self.length) + wire.u32(5, self.size))

    def debug(self) -> str:
        op = ("ntoh", "hton")[self.op]
        return f"[ byteorder reg {self.dreg} = {op}(reg {self.sreg}, {self.size}, {self.length}) ]"


class Expr(Protocol):
    """Any of the classes above."""

    def encode(self) -> bytes: ...

    def debug(self) -> str: ...


Exprs = Tuple[Expr, ...]


# --- reading back: the kernel's dump of a rule → the same objects ---------------------------------

def _u32(attrs: Dict[int, bytes], kind: int, default: int = 0) -> int:
    return struct.unpack(">I", attrs[kind])[0] if kind in attrs else default


def _data(attrs: Dict[int, bytes], kind: int) -> bytes:
    return bytes(wire.attributes(attrs.get(kind, b"")).get(wire.DATA_VALUE, b""))


def verdict_of(nested: bytes) -> Tuple[int, str]:
    """(code, chain) of an ``nft_data`` holding a verdict."""
    inner = wire.attributes(wire.attributes(nested).get(wire.DATA_VERDICT, b""))
    code = struct.unpack(">i", inner[wire.VERDICT_CODE])[0]
    chain = wire.text(inner[wire.VERDICT_CHAIN]) if wire.VERDICT_CHAIN in inner else ""
    return code, chain


def _immediate(a: Dict[int, bytes]) -> Expr:
    dreg = _u32(a, 1)
    if dreg == 0:
        return Verdict(*verdict_of(a[2]))
    return Immediate(dreg, _data(a, 2))


def _lookup(a: Dict[int, bytes]) -> Expr:
    return Lookup(wire.text(a[1]), _u32(a, 2), _u32(a, 3) if 3 in a else None, bool(_u32(a, 5) & LOOKUP_F_INV))


def _meta(a: Dict[int, bytes]) -> Expr:
    return Meta(_u32(a, 2), sreg=_u32(a, 3)) if 3 in a else Meta(_u32(a, 2), _u32(a, 1))


_DECODERS: Dict[str, Callable[[Dict[int, bytes]], Expr]] = {
    "payload": lambda a: Payload(_u32(a, 2), _u32(a, 3), _u32(a, 4), _u32(a, 1)),
    "meta": _meta,
    "ct": lambda a: Ct(_u32(a, 2), _u32(a, 1), a[3][0] if 3 in a else None),
    "cmp": lambda a: Cmp(_u32(a, 2), _u32(a, 1), _data(a, 3)),
    "bitwise": lambda a: Bitwise(_u32(a, 1), _data(a, 4), _data(a, 5)),
    "lookup": _lookup,
    "immediate": _immediate,
    "nat": lambda a: Nat({v: k for k, v in _FAMILY_NUMBERS.items()}[_u32(a, 2)], _u32(a, 3), _u32(a, 5), _u32(a, 7)),
    "masq": lambda a: Masquerade(_u32(a, 1)),
    "numgen": lambda a: Numgen(_u32(a, 1), _u32(a, 2)),
    "fib": lambda a: Fib(_u32(a, 3), _u32(a, 1)),
    "reject": lambda a: Reject(a[2][0]),
    "byteorder": lambda a: Byteorder(_u32(a, 1), _u32(a, 2), _u32(a, 3), _u32(a, 4), _u32(a, 5)),
    "dynset": lambda a: Dynset(wire.text(a[1]), _u32(a, 4), _u32(a, 5),
                               struct.unpack(">Q", a[6])[0] if 6 in a else 0),
}


def decode_rule(expressions: bytes) -> Exprs:
    """A rule's ``NFTA_RULE_EXPRESSIONS`` as the kernel dumps them, back into the objects above
    (``netproxy trace --kernel``).  An expression netproxy never writes is an error naming it: the
    tracer must not guess what a rule it does not know does."""
    out: List[Expr] = []
    for _, elem in wire.attribute_list(expressions):
        attrs = wire.attributes(elem)
        name = wire.text(attrs.get(wire.EXPR_NAME, b""))
        decoder = _DECODERS.get(name)
        if decoder is None:
            raise ValueError(f"expression {name!r} is not one netproxy writes")
        out.append(decoder(wire.attributes(attrs.get(wire.EXPR_DATA, b""))))
    return tuple(out)
