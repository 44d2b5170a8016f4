"""Who changed the nftables ruleset since netproxy's last write: the kernel's change notifications.

Every committed nftables transaction bumps the network namespace's ruleset generation, whoever
commits it and whatever table it touches.  A periodic full sync that only checked the generation
would rebuild netproxy's tables (seconds at 10k services) whenever any other program wrote any
table.  This monitor listens to the ``NFNLGRP_NFTABLES`` multicast group, which reports each
object a transaction touched (with its table) and then the transaction's new generation, so a
full sync can tell "someone else touched ``ip/ip6 netproxy``" (rebuild) from "someone else wrote
elsewhere" (nothing to repair).  When the socket overflows, the answer is "unknown" (rebuild).
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
from typing import AbstractSet, Dict, Iterator, Optional, Tuple

from netproxy.backends.nftables import names

log = logging.getLogger(__name__)

NETLINK_NETFILTER = 12
NFNLGRP_NFTABLES = 7
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWGEN = 15
_ATTR_TABLE = 1
"""Attribute 1 is the table name in every table/chain/rule/set/element/object/flowtable message."""
_ATTR_GEN_ID = 1
_FAMILIES = {2: "ip", 10: "ip6"}
_RCVBUF = 8 << 20
SO_RCVBUFFORCE = 33


def _messages(data: bytes) -> Iterator[Tuple[int, bytes]]:
    """(type, payload) of each netlink message in one datagram."""
    offset = 0
    while offset + 16 <= len(data):
        length, msg_type = struct.unpack_from("=IH", data, offset)
        if length < 16:
            return
        yield msg_type, data[offset + 16:offset + length]
        offset += (length + 3) & ~3


def _attributes(payload: bytes) -> Dict[int, bytes]:
    attrs: Dict[int, bytes] = {}
    offset = 4  # struct nfgenmsg
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if length < 4:
            break
        attrs[kind & 0x3FFF] = payload[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return attrs


class Monitor:
    """A subscription to nftables change notifications in the calling process's network namespace."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, NETLINK_NETFILTER)
        try:
            try:  # root may exceed rmem_max; an overflow only costs a rebuild
                self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, _RCVBUF)
            except OSError:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            self._sock.bind((0, 1 << (NFNLGRP_NFTABLES - 1)))
        except OSError:
            self._sock.close()
            raise
        self._touched = False

    def close(self) -> None:
        self._sock.close()

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        """Drain the notifications: whether a transaction whose generation is not in ``own``
        touched netproxy's tables (None: notifications were lost, so it cannot be known)."""
        found = False
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except BlockingIOError:
                return found
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    log.info("nftables notifications overflowed: the next full sync rebuilds")
                    return None
                raise
            hit, self._touched = scan(data, own, self._touched)
            found = found or hit


def scan(data: bytes, own: AbstractSet[int], touched: bool) -> Tuple[bool, bool]:
    """Notifications in one datagram: (a transaction not in ``own`` touched netproxy's tables,
    whether the transaction still open at the end of ``data`` has touched them so far)."""
    found = False
    for msg_type, payload in _messages(data):
        if msg_type >> 8 != NFNL_SUBSYS_NFTABLES or len(payload) < 4:
            continue
        attrs = _attributes(payload)
        if msg_type & 0xFF == NFT_MSG_NEWGEN:
            gen_id = attrs.get(_ATTR_GEN_ID)
            gen = struct.unpack(">I", gen_id)[0] if gen_id is not None and len(gen_id) == 4 else None
            if touched and gen not in own:
                found = True
            touched = False
        elif payload[0] in _FAMILIES and attrs.get(_ATTR_TABLE, b"").rstrip(b"\0") == names.TABLE.encode():
            touched = True
    return found, touched


class Watched:
    """The change-notification side of a kernel writer, shared by both writers: a subscription
    opened and closed around netproxy's own rewrites, and asked what others did since."""

    _monitor: Optional[Monitor] = None

    def watch(self, on: bool) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if on:
            try:
                self._monitor = Monitor()
            except OSError as exc:
                log.info("no nftables change notifications (%s): every full sync after a foreign write "
                         "rebuilds netproxy's tables", exc)

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        if self._monitor is None:
            return None
        try:
            touched: Optional[bool] = self._monitor.others_touched(own)
            return touched
        except OSError as exc:
            log.info("nftables change notifications failed: %s", exc)
            self.watch(False)
            return None
