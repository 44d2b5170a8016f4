"""One receive buffer per netlink socket, kept and reused, instead of a fresh one for every datagram.

``sock.recv(1 << 20)`` allocates a megabyte and shrinks it to the datagram's size: a change
notification is a few hundred bytes, and a watch reads hundreds of them a sync.  Once glibc has
raised its mmap threshold (it does when a large block is freed), each of those megabytes comes from
the heap, and the heap kept growing with the syncs while the memory in use did not: iptables-nft's
``netproxy run`` grew its malloc arena by 3.3 MB over 1,000 sync cycles, all of it free space, and
stayed flat with the buffer kept (docs/testing.md, "the storm's RSS growth").  The datagram is
copied out at its own size, so callers get ``bytes`` as before.
"""

from __future__ import annotations

import socket

DATAGRAM_MAX = 1 << 20
"""Bytes a netlink datagram may take here (what the callers passed to ``recv`` before)."""


class RecvBuffer:
    """``recv`` of one socket into a buffer made once."""

    def __init__(self, size: int = DATAGRAM_MAX) -> None:
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)

    def recv(self, sock: socket.socket, flags: int = 0) -> bytes:
        """The next datagram, as ``sock.recv(size, flags)`` would return it (a longer one is cut
        at the buffer's size, as recv cuts it)."""
        size = sock.recv_into(self._buf, 0, flags)
        return bytes(self._view[:size])
