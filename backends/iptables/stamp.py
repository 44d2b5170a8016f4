"""A fingerprint of the legacy kernel tables, so that a periodic full sync of an untouched table
can be skipped.

A legacy table has no generation counter, and every write swaps the whole table: a full sync with
nothing changed still costs the kernel's swap (3.5 s at 10k services; 99 s with 23k ClientIP-affinity
endpoints, docs/parity.md).  Instead the backend remembers this fingerprint right after its own full
write and, at the next full sync, skips the write when the kernel's tables still give the same one
and the rules it would write are the ones it wrote.

The fingerprint is the table blob as the kernel hands it to iptables-save (``IPT_SO_GET_INFO`` then
``IPT_SO_GET_ENTRIES``, one ``getsockopt`` each), with each entry's packet/byte counters and
``comefrom`` zeroed (traffic changes the counters; ``comefrom`` is the kernel's loop-check
scratch), hashed.  Anything else anyone changes in the table — a rule, a chain, its order — changes
it.  Kernel pointers do not leak into the copy (``xt_match_to_user``/``xt_target_to_user`` give names
and the user-visible part of each match's data), so an unchanged table gives the same bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import socket
import struct
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

TABLE_NAME_LEN = 32


@dataclass(frozen=True)
class _Layout:
    """Where a family's ``getsockopt`` lives and the offsets inside one ``ipt_entry``/``ip6t_entry``
    (checked against python-iptables' ctypes structures in the unit tests)."""

    domain: int
    level: int
    next_offset: int
    """Offset of ``u16 next_offset``."""
    volatile: Tuple[int, int]
    """[start, end) of ``comefrom`` and ``counters`` (with the padding between them)."""


SO_GET_INFO, SO_GET_ENTRIES = 64, 65  # IPT_/IP6T_SO_GET_INFO and _ENTRIES: IPT_BASE_CTL + 0 and + 1
_GETINFO = struct.Struct(f"={TABLE_NAME_LEN}sI5I5III")  # name, valid_hooks, hook_entry[5], underflow[5], num, size
_ENTRIES_HEADER = 40  # struct ipt_get_entries: name[32], u32 size, then 8-byte aligned entries
LAYOUTS = {
    4: _Layout(socket.AF_INET, socket.IPPROTO_IP, 90, (92, 112)),
    6: _Layout(socket.AF_INET6, socket.IPPROTO_IPV6, 142, (144, 168)),
}

_libc: Optional[ctypes.CDLL] = None


def _getsockopt(fd: int, level: int, option: int, buf: bytearray) -> int:
    """getsockopt into ``buf``, which we filled first (Python's socket.getsockopt passes zeros, and
    the kernel reads the table name from the buffer); the kernel writes straight into it."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    size = ctypes.c_uint32(len(buf))
    cbuf = (ctypes.c_char * len(buf)).from_buffer(buf)
    if _libc.getsockopt(fd, level, option, cbuf, ctypes.byref(size)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    del cbuf  # release the export, so the bytearray may be resized or freed
    return size.value


def mask(blob: bytearray, family: int, start: int = 0) -> None:
    """Zero every entry's ``comefrom`` and counters in place (walking ``next_offset`` from ``start``)."""
    layout = LAYOUTS[family]
    lo, hi = layout.volatile
    zeros = bytes(hi - lo)
    next_at = layout.next_offset
    unpack = struct.Struct("=H").unpack_from
    at, size = start, len(blob)
    while at < size:
        step = unpack(blob, at + next_at)[0]
        if step <= 0:
            raise ValueError(f"entry at {at - start} has next_offset {step}")
        blob[at + lo:at + hi] = zeros
        at += step


def table_fingerprint(family: int, table: str) -> bytes:
    """One legacy table's fingerprint (OSError when it cannot be read: no such table, no privilege,
    nf_tables-only kernel).  At 10k services (~140k entries, 28 MB): ~0.3 s, most of it the walk."""
    layout = LAYOUTS[family]
    with socket.socket(layout.domain, socket.SOCK_RAW, socket.IPPROTO_RAW) as sock:
        info = bytearray(_GETINFO.pack(table.encode(), *([0] * 13)))
        _getsockopt(sock.fileno(), layout.level, SO_GET_INFO, info)
        head = _GETINFO.unpack(bytes(info))
        size = head[-1]
        buf = bytearray(_ENTRIES_HEADER + size)
        struct.pack_into(f"={TABLE_NAME_LEN}sI", buf, 0, table.encode(), size)
        if _getsockopt(sock.fileno(), layout.level, SO_GET_ENTRIES, buf) != len(buf):
            # The table changed size between the two calls (someone is writing): no stable answer.
            raise OSError(errno.EAGAIN, "table changed while being read")
    mask(buf, family, _ENTRIES_HEADER)
    digest = hashlib.blake2b(repr(head[1:]).encode(), digest_size=32)
    digest.update(memoryview(buf)[_ENTRIES_HEADER:])
    return digest.digest()


def fingerprint(families: Sequence[int], tables: Sequence[str]) -> Optional[Dict[Tuple[int, str], bytes]]:
    """Every (family, table)'s fingerprint, or None if any cannot be read (then nothing is skipped)."""
    out: Dict[Tuple[int, str], bytes] = {}
    for family in families:
        for table in tables:
            try:
                out[(family, table)] = table_fingerprint(family, table)
            except (OSError, ValueError):
                return None
    return out
