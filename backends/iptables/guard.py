"""Rules changed behind netproxy's back (``iptables -F``, a firewalld reload, one of our chains
emptied): noticed between syncs, within a second, instead of at the next ``--sync-period``.

kube-proxy notices a flush by polling for its ``KUBE-PROXY-CANARY`` chains (``iptables -L``, once a
sync period): a missing canary means "the table was flushed".  netproxy looks at the tables
themselves, so that an edit that leaves the canary in place (``iptables -t nat -F KUBE-SERVICES``)
is seen too, and it can afford to look every half second because the look is cheap:

- legacy tables: each table's header (``IPT_SO_GET_INFO``: its hooks, entry count and size, one
  ``getsockopt``, microseconds at any size) is compared with the one right after netproxy's last
  write; every write by anyone changes it;
- iptables-nft: the kernel's nftables change notifications (``NFNLGRP_NFTABLES``), filtered to the
  ``nat``/``filter`` tables and to transactions that another process committed (the committing
  process's pid rides on each transaction's ``NEWGEN`` message).

A change there is only a suspicion (Docker adding its own rule changes a header too): the tables
are then read (the table blob, or ``iptables-save`` on nf_tables) and compared with what netproxy
last wrote — every chain of ours with its rule count, every jump into them.  Only a difference is a
repair, named by :func:`compare`'s reason.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from typing import AbstractSet, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple

try:
    from typing import Protocol
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol  # type: ignore[assignment]

from netproxy.backends.iptables.assemble import JUMPS, TABLES
from netproxy.backends.iptables.kernel.stamp import _GETINFO, LAYOUTS, SO_GET_INFO, _getsockopt
from netproxy.backends.nftables.monitor import (
    _RCVBUF,
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFNLGRP_NFTABLES,
    NFT_MSG_NEWGEN,
    SO_RCVBUFFORCE,
    _attributes,
    _messages,
)
from netproxy.backends.recvbuffer import RecvBuffer

log = logging.getLogger(__name__)

"""Seconds between two looks (the runner's idle step): a repair starts within this of the fault."""
_ATTR_TABLE = 1
_ATTR_GEN_PID = 2  # NFTA_GEN_PROC_PID: the pid of the process that committed the transaction
_NFT_MSG_GETGEN = 16
_FAMILIES = (socket.AF_INET, socket.AF_INET6)

Counts = Tuple[Dict[str, int], Set[Tuple[str, str]]]
"""One table as read back: chain → rule count, and the (built-in chain, target) jumps."""


def table_info(family: int, table: str) -> bytes:
    """A legacy table's ``ipt_getinfo`` (valid hooks, hook entries, underflows, entry count, size)."""
    layout = LAYOUTS[family]
    with socket.socket(layout.domain, socket.SOCK_RAW, socket.IPPROTO_RAW) as sock:
        info = bytearray(_GETINFO.pack(table.encode(), *([0] * 13)))
        _getsockopt(sock.fileno(), layout.level, SO_GET_INFO, info)
    return bytes(info)


class LegacyWatch:
    """Legacy tables: a suspicion whenever a table's header differs from the last :meth:`rebase`."""

    def __init__(self, families: Sequence[int] = (4, 6), tables: Sequence[str] = TABLES) -> None:
        self.keys = [(f, t) for f in families for t in tables]
        self._base: Dict[Tuple[int, str], Optional[bytes]] = {}

    def _read(self, key: Tuple[int, str]) -> Optional[bytes]:
        try:
            return table_info(*key)
        except OSError:
            return None  # no such table (no IPv6 here): stays None, so it never differs

    def rebase(self) -> None:
        self._base = {k: self._read(k) for k in self.keys}

    def suspect(self) -> bool:
        return any(self._read(k) != self._base.get(k) for k in self.keys)

    def pause(self) -> None:
        return None  # a header read costs our writes nothing

    def resume(self, commits: int) -> None:
        return None

    def close(self) -> None:
        return None


def generation() -> Optional[int]:
    """The network namespace's nftables ruleset generation (``NFT_MSG_GETGEN``), or None."""
    request = struct.pack("=IHHII", 20, (NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETGEN, 1, 1, 0) + bytes(4)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
            sock.settimeout(2.0)
            sock.send(request)
            data = sock.recv(4096)
    except OSError:
        return None
    for msg_type, payload in _messages(data):
        if msg_type & 0xFF == NFT_MSG_NEWGEN:
            gen_id = _attributes(payload).get(_ATTR_TABLE)  # NFTA_GEN_ID is attribute 1 too
            if gen_id is not None and len(gen_id) == 4:
                return int(struct.unpack(">I", gen_id)[0])
    return None


def _subscribe() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, NETLINK_NETFILTER)
    try:
        try:  # an overflow only costs a read of the tables
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, _RCVBUF)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        sock.bind((0, 1 << (NFNLGRP_NFTABLES - 1)))
    except OSError:
        sock.close()
        raise
    return sock


class NftWatch:
    """iptables-nft: a suspicion whenever a transaction that ``own()`` does not claim touched the
    ip/ip6 ``nat`` or ``filter`` table (or notifications were lost).

    Around netproxy's own full writes the subscription is closed (:meth:`pause`/:meth:`resume`): a
    subscriber makes the kernel build one notification per rule, and 100k of them slowed a 10k
    batch 2–10× (the nftables backend measured the same and does the same).  What others commit
    meanwhile is then known only by the generation moving by more than netproxy's own commits."""

    def __init__(self, own: Callable[[], AbstractSet[int]], tables: Sequence[str] = TABLES) -> None:
        self.own = own
        self.tables = {t.encode() for t in tables}
        self._open_touched = False
        self._found = False
        self._sock: Optional[socket.socket] = _subscribe()
        self._paused_at: Optional[int] = None
        self._buffer = RecvBuffer()
        """Kept across reads: a fresh megabyte per notification fragmented the heap (recvbuffer.py)."""

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def rebase(self) -> None:
        return None  # notifications are attributed by pid: nothing to remember

    def pause(self) -> None:
        self.suspect_pending()
        self._paused_at = generation()
        self.close()

    def resume(self, commits: int) -> None:
        """Subscribe again after our own write of ``commits`` transactions (at most)."""
        if self._sock is None:
            self._sock = _subscribe()
        self._open_touched = False
        now = generation()
        if self._paused_at is None or now is None or now - self._paused_at > commits:
            self._found = True  # someone else may have committed while we were not listening
        self._paused_at = None

    def suspect_pending(self) -> None:
        """Drain what arrived so far into the pending suspicion (before closing the socket)."""
        if self._sock is not None:
            self._drain(self._sock)

    def suspect(self) -> bool:
        if self._sock is not None:
            self._drain(self._sock)
        found, self._found = self._found, False
        return found

    def _drain(self, sock: socket.socket) -> None:
        while True:
            try:
                data = self._buffer.recv(sock)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                log.info("nftables notifications overflowed: reading the iptables tables to check them")
                self._found = True
                continue
            self._scan(data, self.own() | {os.getpid()})

    def _scan(self, data: bytes, own: AbstractSet[int]) -> None:
        for msg_type, payload in _messages(data):
            if msg_type >> 8 != NFNL_SUBSYS_NFTABLES or len(payload) < 4:
                continue
            attrs = _attributes(payload)
            if msg_type & 0xFF == NFT_MSG_NEWGEN:
                pid_attr = attrs.get(_ATTR_GEN_PID)
                pid = struct.unpack(">I", pid_attr)[0] if pid_attr is not None and len(pid_attr) == 4 else None
                if self._open_touched and pid not in own:
                    self._found = True
                self._open_touched = False
            elif payload[0] in _FAMILIES and attrs.get(_ATTR_TABLE, b"").rstrip(b"\0") in self.tables:
                self._open_touched = True


class Watch(Protocol):
    """What both watches do."""

    def suspect(self) -> bool:
        """Whether anyone else may have written the tables since the last look."""

    def rebase(self) -> None:
        """The tables as they are now are the reference (right after netproxy's own write)."""

    def pause(self) -> None:
        """netproxy is about to write a lot: stop looking if looking slows the write."""

    def resume(self, commits: int) -> None:
        """netproxy wrote (at most ``commits`` transactions): look again."""

    def close(self) -> None: ...


def legacy_counts(family: int, table: str) -> Counts:
    """Chain rule counts and built-in jumps of a legacy table, from its blob."""
    from netproxy.backends.iptables.kernel.stamp import chains_and_jumps, table_fingerprint

    counts = table_fingerprint(family, table).chains
    return counts, set(chains_and_jumps(family, table)[1])


def compare(table: str, written: Mapping[str, Sequence[object]], counts: Dict[str, int],
            jumps: Set[Tuple[str, str]]) -> Optional[str]:
    """Why the kernel's ``table`` no longer holds what netproxy wrote into it (None: it does).  The
    reason is the ``reason`` label of ``netproxy_sync_proxy_rules_repairs_total``."""
    missing = [c for c in written if c not in counts]
    if missing:
        log.warning("iptables %s: chain %s%s is gone", table, missing[0],
                    f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        return "chain-deleted"
    for chain, rules in written.items():
        if counts[chain] != len(rules):
            log.warning("iptables %s: chain %s holds %d rules, netproxy wrote %d", table, chain, counts[chain],
                        len(rules))
            return "rules-deleted" if counts[chain] < len(rules) else "rules-added"
    for hook, target, _rule in JUMPS[table]:
        if (hook, target) not in jumps:
            log.warning("iptables %s: the jump from %s to %s is gone", table, hook, target)
            return "jump-deleted"
    return None
