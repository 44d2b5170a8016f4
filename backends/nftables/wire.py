"""nf_tables netlink on the wire: attributes, messages and batches, with ``struct`` and nothing else.

Hand-written because no maintained Python library builds nf_tables batches at 10k services:
pyroute2's nftables layer (0.9.x) takes ~180 µs per element, concatenates bytes quadratically, has
no per-message ACKs in a batch and overflows a 64 KB element nest (docs/performance.md).  This
module knows the kernel's constants and the TLV layout only; :mod:`encode` turns netproxy's objects
into messages, :mod:`kernel.netlink` sends them.  Attribute numbers are from the kernel's
``include/uapi/linux/netfilter/nf_tables.h``; multi-byte numbers in nf_tables attributes are big
endian, the netlink header is host order.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterator, List, Tuple

# --- netlink / nfnetlink ---------------------------------------------------------------------------
NETLINK_NETFILTER = 12
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_APPEND = 0x800
NLA_F_NESTED = 0x8000
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11

# --- message types ---------------------------------------------------------------------------------
NEWTABLE, GETTABLE, DELTABLE = 0, 1, 2
NEWCHAIN, GETCHAIN, DELCHAIN = 3, 4, 5
NEWRULE, GETRULE, DELRULE = 6, 7, 8
NEWSET, GETSET, DELSET = 9, 10, 11
NEWSETELEM, GETSETELEM, DELSETELEM = 12, 13, 14
GETGEN = 16

# --- attributes ------------------------------------------------------------------------------------
TABLE_NAME, TABLE_FLAGS, TABLE_USERDATA = 1, 2, 6
CHAIN_TABLE, CHAIN_NAME, CHAIN_HOOK, CHAIN_POLICY, CHAIN_USE, CHAIN_TYPE, CHAIN_USERDATA = 1, 3, 4, 5, 6, 7, 12
HOOK_HOOKNUM, HOOK_PRIORITY = 1, 2
RULE_TABLE, RULE_CHAIN, RULE_EXPRESSIONS, RULE_USERDATA = 1, 2, 4, 7
LIST_ELEM = 1
EXPR_NAME, EXPR_DATA = 1, 2
SET_TABLE, SET_NAME, SET_FLAGS, SET_KEY_TYPE, SET_KEY_LEN = 1, 2, 3, 4, 5
SET_DATA_TYPE, SET_DATA_LEN, SET_DESC, SET_ID, SET_TIMEOUT, SET_USERDATA = 6, 7, 9, 10, 11, 13
SET_DESC_SIZE, SET_DESC_CONCAT, SET_FIELD_LEN = 1, 2, 1
SET_ELEM_LIST_TABLE, SET_ELEM_LIST_SET, SET_ELEM_LIST_ELEMENTS = 1, 2, 3
ELEM_KEY, ELEM_DATA, ELEM_FLAGS, ELEM_TIMEOUT, ELEM_EXPIRATION, ELEM_USERDATA, ELEM_KEY_END = 1, 2, 3, 4, 5, 6, 10
DATA_VALUE, DATA_VERDICT = 1, 2
VERDICT_CODE, VERDICT_CHAIN = 1, 2
GEN_ID = 1

SET_F_INTERVAL, SET_F_MAP = 0x4, 0x8
SET_F_TIMEOUT, SET_F_EVAL, SET_F_CONCAT = 0x10, 0x20, 0x80
ELEM_F_INTERVAL_END = 0x1
DATA_TYPE_VERDICT = 0xFFFFFF00

NF_DROP, NF_ACCEPT = 0, 1
NFT_JUMP, NFT_GOTO, NFT_RETURN = -3, -4, -5

_HDR = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")
_ATTR = struct.Struct("=HH")
ATTR_HEADER = _ATTR
"""A netlink attribute header: (length including the header, type)."""


def _pad(n: int) -> int:
    return (n + 3) & ~3


def attr(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    n = 4 + len(payload)
    return _ATTR.pack(n, kind) + payload + b"\0" * (_pad(n) - n)


def nest(kind: int, *parts: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, b"".join(parts))


def u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack(">I", value & 0xFFFFFFFF))


def u64(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack(">Q", value))


def u8(kind: int, value: int) -> bytes:
    return attr(kind, bytes((value,)))


def string(kind: int, value: str) -> bytes:
    return attr(kind, value.encode() + b"\0")


def data_value(kind: int, value: bytes) -> bytes:
    """An ``nft_data`` holding a plain value (a key, a constant)."""
    return nest(kind, attr(DATA_VALUE, value))


def data_verdict(kind: int, code: int, chain: str = "") -> bytes:
    inner = u32(VERDICT_CODE, code) + (string(VERDICT_CHAIN, chain) if chain else b"")
    return nest(kind, nest(DATA_VERDICT, inner))


def udata(*items: Tuple[int, bytes]) -> bytes:
    """libnftnl's user data: type (u8), length (u8), value; what ``nft`` reads back to print comments and types."""
    return b"".join(bytes((t, len(v))) + v for t, v in items)


def udata_strz(text: str) -> bytes:
    return text.encode() + b"\0"


def message(msg_type: int, flags: int, seq: int, family: int, body: bytes, subsys: int = NFNL_SUBSYS_NFTABLES,
            res_id: int = 0) -> bytes:
    """One nfnetlink message: netlink header, ``nfgenmsg`` (family, version 0, resource id), attributes."""
    return message_head(msg_type, flags, seq, family, len(body), subsys, res_id) + body


def message_head(msg_type: int, flags: int, seq: int, family: int, body_length: int,
                 subsys: int = NFNL_SUBSYS_NFTABLES, res_id: int = 0) -> bytes:
    """The headers of :func:`message` alone (netlink header and ``nfgenmsg``): a batch sends them
    beside the bodies (``sendmsg`` with a vector) instead of copying every body into a new message."""
    size = _HDR.size + 4 + body_length
    return (_HDR.pack(size, (subsys << 8) | msg_type, flags, seq, 0) + _NFGEN.pack(family, 0, 0)[:2]
            + res_id.to_bytes(2, "big"))


def batch_begin(seq: int) -> bytes:
    return message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, 0, b"", subsys=0, res_id=NFNL_SUBSYS_NFTABLES)


def batch_end(seq: int) -> bytes:
    return message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq, 0, b"", subsys=0, res_id=NFNL_SUBSYS_NFTABLES)


# --- parsing replies -------------------------------------------------------------------------------

def messages(data: bytes) -> Iterator[Tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload) of each netlink message in one datagram."""
    offset = 0
    while offset + _HDR.size <= len(data):
        length, msg_type, flags, seq, _ = _HDR.unpack_from(data, offset)
        if length < _HDR.size:
            return
        yield msg_type, flags, seq, data[offset + _HDR.size:offset + length]
        offset += _pad(length)


def attributes(payload: bytes, offset: int = 0) -> Dict[int, bytes]:
    """The attributes of ``payload`` from ``offset`` (last one wins for a repeated type)."""
    return dict(attribute_list(payload, offset))


def attribute_list(payload: bytes, offset: int = 0) -> List[Tuple[int, bytes]]:
    out = []
    while offset + 4 <= len(payload):
        length, kind = _ATTR.unpack_from(payload, offset)
        if length < 4:
            break
        out.append((kind & 0x3FFF, payload[offset + 4:offset + length]))
        offset += _pad(length)
    return out


def error_code(payload: bytes) -> Tuple[int, int]:
    """(errno, sequence number of the message it answers) of an ``NLMSG_ERROR`` payload (errno 0 is an ACK)."""
    err = struct.unpack_from("=i", payload, 0)[0]
    seq = _HDR.unpack_from(payload, 4)[3] if len(payload) >= 4 + _HDR.size else -1
    return -err, seq


def text(value: bytes) -> str:
    return value.rstrip(b"\0").decode(errors="replace")


def be32(value: bytes) -> int:
    return int(struct.unpack(">I", value[:4])[0])


def be64(value: bytes) -> int:
    return int(struct.unpack(">Q", value[:8])[0])
