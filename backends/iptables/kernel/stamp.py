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

import contextlib
import ctypes
import errno
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from netproxy.core import hashes as hashlib  # hashlib's hashes without OpenSSL (core/hashes.py)

TABLE_NAME_LEN = 32
log = logging.getLogger(__name__)

Stamp = Dict[Tuple[int, str], bytes]
"""(family, table) → that kernel table's stamp value: on legacy tables :func:`stamp_value` (the
fingerprint's digest, then the table's header); on iptables-nft the generation (:data:`GENERATION_KEY`)."""
DIGEST_SIZE = 32
"""Bytes of a fingerprint's digest: the start of a legacy stamp value; the header follows."""
Expected = Mapping[Tuple[int, str], Mapping[str, int]]
"""(family, table) → chain → rule count: what a fingerprinted table must hold to be trusted."""


@dataclass(frozen=True)
class _Layout:
    """Where a family's ``getsockopt`` lives and the offsets inside one ``ipt_entry``/``ip6t_entry``
    (checked against python-iptables' ctypes structures in the unit tests)."""

    domain: int
    level: int
    target_offset: int
    """Offset of ``u16 target_offset`` (the entry's target: ``u16 size``, ``char name[29]``, revision, data)."""
    next_offset: int
    """Offset of ``u16 next_offset``."""
    entry_size: int
    """``sizeof`` the entry header: no entry is shorter."""
    volatile: Tuple[int, int]
    """[start, end) of ``comefrom`` and ``counters`` (with the padding between them)."""


SO_GET_INFO, SO_GET_ENTRIES = 64, 65  # IPT_/IP6T_SO_GET_INFO and _ENTRIES: IPT_BASE_CTL + 0 and + 1
_GETINFO = struct.Struct(f"={TABLE_NAME_LEN}sI5I5III")  # name, valid_hooks, hook_entry[5], underflow[5], num, size
_ENTRIES_HEADER = 40  # struct ipt_get_entries: name[32], u32 size, then 8-byte aligned entries
LAYOUTS = {
    4: _Layout(socket.AF_INET, socket.IPPROTO_IP, 88, 90, 112, (92, 112)),
    6: _Layout(socket.AF_INET6, socket.IPPROTO_IPV6, 140, 142, 168, (144, 168)),
}

_libc: Optional[ctypes.CDLL] = None


def _getsockopt(fd: int, level: int, option: int, buf: bytearray) -> int:
    """getsockopt into ``buf``, which we filled first (Python's socket.getsockopt passes zeros, and
    the kernel reads the table name from the buffer); the kernel writes straight into it."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc
    size = ctypes.c_uint32(len(buf))
    cbuf = (ctypes.c_char * len(buf)).from_buffer(buf)
    if _libc.getsockopt(fd, level, option, cbuf, ctypes.byref(size)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    del cbuf  # release the export, so the bytearray may be resized or freed
    return size.value


_TARGET_NAME = slice(2, 2 + 29)  # xt_entry_target.u.user.name, after u16 target_size
_TARGET_DATA = 32  # sizeof(struct xt_entry_target): an ERROR target's data (a chain's name) follows
_ERROR_NAME = b"ERROR".ljust(_TARGET_NAME.stop - _TARGET_NAME.start, b"\0")
"""An ``ERROR`` target's whole name field: the head the kernel puts before each user-defined chain."""


def _halves(blob: bytearray, start: int) -> memoryview:
    """``blob`` as native ``u16`` words (an even length of it), so that the walk reads an entry's
    ``target_offset`` and ``next_offset`` by indexing, not with a ``struct`` call per entry.  Entries
    are 8-byte aligned in the kernel's copy; a walk that reaches an odd offset is refused."""
    if start & 1:
        raise ValueError(f"a table's entries cannot start at the odd offset {start}")
    return memoryview(blob)[:len(blob) & ~1].cast("H")


@contextlib.contextmanager
def _corrupt_is_refused() -> Iterator[None]:
    """:func:`read_table`: a target offset that points past the blob is a ValueError, as a bad
    ``next_offset`` is (the writer then reads the table with ``iptables-save``), not an IndexError."""
    try:
        yield
    except IndexError as exc:
        raise ValueError(f"an entry points past the table's end: {exc}") from None


def mask(blob: bytearray, family: int, start: int = 0) -> Tuple[int, Dict[str, int]]:
    """Zero every entry's ``comefrom`` and counters in place (walking ``next_offset`` from ``start``);
    returns the number of entries and each user-defined chain's rule count (its entries between the
    ``ERROR`` head the kernel puts before it and its ``RETURN`` tail).  A walk that does not land
    exactly on the end is refused.

    The loop does per entry only what the walk cannot do without: two indexed ``u16`` reads (the
    adjacent ``target_offset``/``next_offset``, through :func:`_halves`), one ``startswith`` for an
    ``ERROR`` head (no slice copied), the masking through a memoryview; a chain's rule count is the
    distance between its head and the next one, reckoned when the next one is met.  On a 1.2M-entry
    blob (100k services) the walk went from ~2.2 s to ~0.9 s and the whole ``table_fingerprint`` from
    1.8–2.2 s to 1.3–1.6 s (the sixth pass); the indexed reads took the 132k-entry walk of 10k
    services from ~0.12 s to ~0.05 s (docs/performance.md, the eighth pass)."""
    layout = LAYOUTS[family]
    lo, hi = layout.volatile
    zeros = bytes(hi - lo)
    least = layout.entry_size
    target_word, next_word = layout.target_offset >> 1, layout.next_offset >> 1
    chains: Dict[str, int] = {}
    chain: Optional[str] = None  # the chain whose entries the walk is in (None: before the first head)
    began = 0  # the entry number of its head
    is_error = blob.startswith
    entries = 0
    at, size = start, len(blob)
    with memoryview(blob) as view, _halves(blob, start) as half:
        while at < size:
            word = at >> 1
            step = half[word + next_word]
            if step < least or step & 1 or at + step > size:
                raise ValueError(f"entry at {at - start} has next_offset {step}")
            name = at + half[word + target_word] + _TARGET_NAME.start
            # One indexed byte first ("E"): most entries are no head, and a method call costs more.
            # (A target past the blob, which no kernel copy has, is no head, as startswith says.)
            if name < size and blob[name] == 0x45 and is_error(_ERROR_NAME, name):
                target = name - _TARGET_NAME.start
                if chain is not None:  # the previous chain's entries end here (no list of heads: 17 MB at 100k)
                    chains[chain] = entries - began - 2 if chain else -1  # less its head and its RETURN tail
                chain = bytes(blob[target + _TARGET_DATA:at + step]).split(b"\0", 1)[0].decode(errors="replace")
                began = entries
            view[at + lo:at + hi] = zeros
            entries += 1
            at += step
    if chain is not None:
        chains[chain] = entries - began - 2 if chain else -1
    chains.pop("ERROR", None)  # the table's end marker
    return entries, chains


@dataclass(frozen=True)
class Table:
    """One table's fingerprint, and its user-defined chains' rule counts (to check that what was
    fingerprinted holds what we wrote)."""

    digest: bytes
    chains: Dict[str, int]
    header: bytes
    """The table's ``ipt_getinfo`` from the same read (as :func:`TableRead`'s ``header``)."""


BLOB_TRIES = 20
"""Reads of a table that another program keeps changing between its two ``getsockopt`` calls."""


def _blob(family: int, table: str) -> Tuple[Tuple[object, ...], bytearray]:
    """(``ipt_getinfo`` fields, the ``ipt_get_entries`` buffer) of one legacy table.

    The two calls are not atomic: a write by someone else in between changes the table's size and
    the kernel answers ``EAGAIN``.  iptables-save does not take the xtables lock, nor does this; it
    reads again (measured under a foreign ``iptables -A``/``-D`` loop: tests/faults/test_lock.py)."""
    layout = LAYOUTS[family]
    with socket.socket(layout.domain, socket.SOCK_RAW, socket.IPPROTO_RAW) as sock:
        for attempt in range(BLOB_TRIES):
            info = bytearray(_GETINFO.pack(table.encode(), *([0] * 13)))
            _getsockopt(sock.fileno(), layout.level, SO_GET_INFO, info)
            head = _GETINFO.unpack(bytes(info))
            size = head[-1]
            buf = bytearray(_ENTRIES_HEADER + size)
            struct.pack_into(f"={TABLE_NAME_LEN}sI", buf, 0, table.encode(), size)
            try:
                if _getsockopt(sock.fileno(), layout.level, SO_GET_ENTRIES, buf) == len(buf):
                    return head, buf
            except OSError as exc:
                if exc.errno != errno.EAGAIN or attempt == BLOB_TRIES - 1:
                    raise
    # The table changed size between the two calls every time (someone keeps writing).
    raise OSError(errno.EAGAIN, "table changed while being read")


HOOKS = ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")


@dataclass(frozen=True)
class TableRead:
    """One legacy table as a full sync reads it (see :func:`read_table`)."""

    names: List[str]
    jumps: Set[Tuple[str, str]]
    fingerprint: Optional[bytes]
    """:func:`table_fingerprint`'s digest, from the same blob (None unless asked for)."""
    header: bytes
    """The table's ``ipt_getinfo`` (as ``guard.table_info`` reads it): any write changes it."""


def chains_and_jumps(family: int, table: str) -> Tuple[List[str], Set[Tuple[str, str]]]:
    """A legacy table's chain names and its built-in chains' (chain, target) pairs, from the blob —
    what a full sync reads, without python-iptables (0.3–0.7 s to load) and without
    ``iptables-save`` printing 100k+ rules.  A jump is a standard target holding the offset of the
    chain it goes to; any other target is named by its extension."""
    read = read_table(family, table)
    return read.names, read.jumps


def read_table(family: int, table: str, fingerprint: bool = False) -> TableRead:
    """:func:`chains_and_jumps`, and with ``fingerprint`` the table's fingerprint too, in the same walk
    of the same blob (a new process checking its stamp: one read of the table instead of two)."""
    layout = LAYOUTS[family]
    head, buf = _blob(family, table)
    lo, hi = layout.volatile
    zeros = bytes(hi - lo)
    entries = 0
    valid, hooks = int(head[1]), head[2:7]  # type: ignore[call-overload]
    builtin = {int(hooks[h]): HOOKS[h] for h in range(5) if valid & (1 << h)}  # type: ignore[call-overload]
    policies = {int(head[7 + h]) for h in range(5) if valid & (1 << h)}  # type: ignore[call-overload]
    i32 = struct.Struct("=i").unpack_from
    start, size = _ENTRIES_HEADER, len(buf)
    names: List[str] = [HOOKS[h] for h in range(5) if valid & (1 << h)]
    begins: Dict[int, str] = {}
    rules: List[Tuple[str, int]] = []  # (built-in chain, offset of its entry's target)
    chain = ""
    at = start
    next_word, target_word, least = layout.next_offset >> 1, layout.target_offset >> 1, layout.entry_size
    with memoryview(buf) as view, _halves(buf, start) as half, _corrupt_is_refused():
        # ~0.5 µs per entry: only what a chain head or a built-in chain's rule needs (as in mask())
        while at < size:
            word = at >> 1
            step = half[word + next_word]
            if step < least or step & 1 or at + step > size:
                raise ValueError(f"entry at {at - start} has next_offset {step}")
            if fingerprint:
                view[at + lo:at + hi] = zeros  # as mask(): counters and comefrom are not the table's content
                entries += 1
            target = at + half[word + target_word]
            if buf[target + 2] == 0x45 and buf[target + 2:target + 8] == b"ERROR\0":
                chain = bytes(buf[target + _TARGET_DATA:at + step]).split(b"\0", 1)[0].decode(errors="replace")
                if chain != "ERROR":  # the table's end marker
                    names.append(chain)
                    begins[at + step - start] = chain
                chain = ""
            else:
                rel = at - start
                if rel in builtin:
                    chain = builtin[rel]
                if chain and rel not in policies:  # a built-in chain's last entry is its policy
                    rules.append((chain, target))
            at += step
    jumps: Set[Tuple[str, str]] = set()
    verdicts = {-1: "DROP", -2: "ACCEPT", -5: "RETURN"}  # -NF_DROP-1, -NF_ACCEPT-1, XT_RETURN
    for chain, target in rules:
        name = bytes(buf[target + _TARGET_NAME.start:target + _TARGET_NAME.stop]).split(b"\0", 1)[0]
        if name:
            jumps.add((chain, name.decode(errors="replace")))
            continue
        verdict = i32(buf, target + _TARGET_DATA)[0]
        to = begins.get(verdict) if verdict >= 0 else verdicts.get(verdict)
        if to:
            jumps.add((chain, to))
    digest: Optional[bytes] = None
    if fingerprint:
        if entries != head[-2]:
            raise ValueError(f"walked {entries} entries, the kernel counts {head[-2]}")
        hashed = hashlib.blake2b(repr(head[1:]).encode(), digest_size=DIGEST_SIZE)  # as table_fingerprint()
        hashed.update(memoryview(buf)[_ENTRIES_HEADER:])
        digest = hashed.digest()
    return TableRead(names, jumps, digest, _GETINFO.pack(*head))


def table_fingerprint(family: int, table: str) -> Table:
    """One legacy table's fingerprint (OSError when it cannot be read: no such table, no privilege,
    nf_tables-only kernel).  At 10k services (~140k entries, 28 MB): ~0.3 s, most of it the walk."""
    head, buf = _blob(family, table)
    entries, chains = mask(buf, family, _ENTRIES_HEADER)
    if entries != head[-2]:
        raise ValueError(f"walked {entries} entries, the kernel counts {head[-2]}")
    digest = hashlib.blake2b(repr(head[1:]).encode(), digest_size=DIGEST_SIZE)
    digest.update(memoryview(buf)[_ENTRIES_HEADER:])
    return Table(digest.digest(), chains, _GETINFO.pack(*head))


def stamp_value(digest: bytes, header: bytes) -> bytes:
    """A legacy table's stamp value: the fingerprint's digest (:data:`DIGEST_SIZE` bytes), then the
    table's header from the same read.  The header (entry count, size, hook offsets; no counters) is
    what a new process can compare without reading and walking the blob: a stamp whose headers are
    not the tables' is stale (adopt.py), and only one whose headers hold needs the fingerprint."""
    return digest + header


def header_of(value: bytes) -> bytes:
    """The header part of :func:`stamp_value`."""
    return value[DIGEST_SIZE:]


def fingerprint(families: Sequence[int], tables: Sequence[str], expect: Optional[Expected] = None
                ) -> Optional[Stamp]:
    """Every (family, table)'s fingerprint, or None if any cannot be read — or, with ``expect``
    ((family, table) → chain → rule count), if a table does not hold those chains with those
    counts (someone wrote between our write and this read, or the rules went to other tables than
    these: an nf_tables iptables behind a "legacy" name).  None means: nothing is ever skipped."""
    out: Stamp = {}
    for family in families:
        for table in tables:
            try:
                got = table_fingerprint(family, table)
            except Exception as exc:  # noqa: BLE001 - a fingerprint is an optimisation: never fail a sync
                log.debug("no fingerprint of the IPv%d %s table: %s", family, table, exc)
                return None
            wanted = (expect or {}).get((family, table), {})
            wrong = [c for c, n in wanted.items() if got.chains.get(c) != n]
            if wrong:
                log.debug("IPv%d %s table does not hold what was written (%s): not trusting it", family, table,
                          ", ".join(wrong[:3]))
                return None
            out[(family, table)] = stamp_value(got.digest, got.header)
    return out


GENERATION_KEY = (0, "nf_tables generation")
"""The one key of an iptables-nft stamp: the generation is the whole nf_tables ruleset's, no family's."""


def generation_stamp() -> Optional[Stamp]:
    """iptables-nft's tables live in nf_tables, whose ruleset generation (``NFT_MSG_GETGEN``) the
    kernel bumps at every commit, anyone's, to any table: an unchanged generation means nobody
    changed anything since it was read.  One netlink round trip, where reading the tables back
    (``iptables-nft-save`` and its parse) took 20 s at 10k services.  None when it cannot be read
    (then nothing is skipped).  Unlike the legacy fingerprint it cannot check the tables' rule
    counts: the window in which another commit is taken for ours is the time between our write and
    this read, bounded as the fingerprint's is by the backend's MAX_SKIPS."""
    # The guard's GETGEN (it watches the same generation between syncs); imported here because the
    # guard imports this module's blob reader.
    from netproxy.backends.iptables.guard import generation

    gen = generation()
    return {GENERATION_KEY: gen.to_bytes(4, "big")} if gen is not None else None
