"""A netfilter netlink socket that sends one nf_tables batch and maps each error to its message.

Every message of a batch carries ``NLM_F_ACK``, so the kernel answers each one; a refused message
answers with its errno and the kernel aborts the whole batch (nothing applied).  The socket buffers
are raised with ``SO_SNDBUFFORCE`` / ``SO_RCVBUFFORCE`` (root may exceed ``rmem_max``) so that a
10k-service batch goes out in a few ``sendmsg`` calls; ``ENOBUFS`` on the ACKs is survived by
reading the rest (the batch itself was applied or refused as a whole already).
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from netproxy.backends.nftables import wire

SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
_BUFFER = 32 << 20
_RECV = 1 << 20


class NetlinkError(OSError):
    """The kernel refused message ``seq`` of a batch (``errno``), or a request failed."""

    errno: int  # always set, by __init__ (an OSError's may be None)

    def __init__(self, err: int, seq: int, what: str = "") -> None:
        super().__init__(err, os.strerror(err))
        self.seq = seq
        self.what = what


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_JOIN_BYTES = 1 << 18
"""A batch's messages are copied into buffers of about this size as they come (see send_batch)."""


def _vector(parts: Sequence[bytes]) -> Sequence[bytes]:
    """``parts`` as at most IOV_MAX buffers for one ``sendmsg``: neighbours joined when there are
    more (a 44k-service batch has ~1,300 parts)."""
    if len(parts) <= _IOV_MAX:
        return parts
    step = -(-len(parts) // _IOV_MAX)
    return [b"".join(parts[i:i + step]) for i in range(0, len(parts), step)]


class NlSocket:
    """``AF_NETLINK`` / ``NETLINK_NETFILTER``, bound to the calling thread's network namespace."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, wire.NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self._seq = int.from_bytes(os.urandom(2), "big") << 8

    def close(self) -> None:
        self.sock.close()

    def next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF
        return self._seq

    # --- batches ---------------------------------------------------------------------------------

    def send_batch(self, bodies: Iterable[Tuple[int, int, int, bytes]]) -> bool:
        """Send (type, flags, family, attributes) messages as one batch.  Raises
        :class:`NetlinkError` for the first message the kernel refused (``seq`` is its index in
        ``bodies``, or -1 when the commit itself failed).  Returns False when some answers were
        lost (``ENOBUFS``) and no error was seen: the caller confirms by the generation.

        ``bodies`` may be a generator (the netlink writer's encoder): each message is copied into a
        buffer of ~256 KB as it comes and can be freed at once, so the batch is in memory once.  A
        list of every message, then joined into at most IOV_MAX buffers for the one ``sendmsg``,
        held it twice at 100k services (78 MB each, the sync's peak of memory); the copy costs
        ~1 ms per 6 MB."""
        first = self.next_seq()
        seqs: List[int] = []
        buffers: List[bytes] = []
        pending: List[bytes] = [wire.batch_begin(first)]
        held = 0
        for t, f, fam, body in bodies:
            s = self.next_seq()
            seqs.append(s)
            pending.append(wire.message_head(t, f | wire.NLM_F_REQUEST | wire.NLM_F_ACK, s, fam, len(body)))
            pending.append(body)
            held += len(body)
            if held >= _JOIN_BYTES:
                buffers.append(b"".join(pending))
                pending, held = [], 0
        pending.append(wire.batch_end(self.next_seq()))
        buffers.append(b"".join(pending))
        del pending
        size = sum(len(b) for b in buffers)
        # The kernel takes a batch only whole, in one sendmsg: the send buffer must hold it.  Each
        # answer is its own skb (~1 KB of buffer), as nft sizes it.
        self._buffer(SO_SNDBUFFORCE, socket.SO_SNDBUF, size + 65536)
        self._buffer(SO_RCVBUFFORCE, socket.SO_RCVBUF, max(_BUFFER, 2048 * (len(seqs) + 2)))
        sent = self.sock.sendmsg(_vector(buffers))
        if sent != size:  # netlink sends a datagram whole or not at all; never seen, but never silent
            raise OSError(errno.EMSGSIZE, f"sent {sent} of the batch's {size} bytes")
        index = {s: i for i, s in enumerate(seqs)}
        index[first] = -1
        return self._acks(set(seqs), index)

    def _buffer(self, force: int, plain: int, size: int) -> None:
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, force, size)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, plain, size)

    def _acks(self, pending: set[int], index: Dict[int, int]) -> bool:
        """Read one answer per message; the first error wins (the kernel aborted the batch)."""
        failure: Optional[NetlinkError] = None
        lost = False
        while pending:
            if (failure is not None or lost) and not self._more_waiting():
                break  # a failed commit answers once, for the batch; lost answers never come
            try:
                data = self.sock.recv(_RECV)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                lost = True
                continue
            for msg_type, _, seq, payload in wire.messages(data):
                if msg_type != wire.NLMSG_ERROR:
                    continue
                err, _ = wire.error_code(payload)
                pending.discard(seq)
                if err and failure is None:
                    failure = NetlinkError(err, index.get(seq, -1))
        if failure is not None:
            raise failure
        return not lost

    def _more_waiting(self) -> bool:
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return False

    # --- requests --------------------------------------------------------------------------------

    def dump(self, msg_type: int, family: int, body: bytes = b"",
             subsys: int = wire.NFNL_SUBSYS_NFTABLES) -> Iterator[Dict[int, bytes]]:
        """The attributes of each object a ``GET`` dump returns."""
        seq = self.next_seq()
        self.sock.sendall(wire.message(msg_type, wire.NLM_F_REQUEST | wire.NLM_F_DUMP, seq, family, body,
                                       subsys=subsys))
        yield from self._replies(seq)

    def send_each(self, bodies: Sequence[Tuple[int, int, int, bytes]], subsys: int) -> None:
        """Send (type, flags, family, attributes) messages that are not a transaction (ipset has
        none), all in one ``sendall``, and wait for every ACK.  Raises :class:`NetlinkError` for the
        first refused one (``seq`` is its index in ``bodies``); the kernel still ran the others."""
        seqs = [self.next_seq() for _ in bodies]
        data = b"".join(wire.message(t, f | wire.NLM_F_REQUEST | wire.NLM_F_ACK, s, fam, body, subsys=subsys)
                        for (t, f, fam, body), s in zip(bodies, seqs))
        self._buffer(SO_SNDBUFFORCE, socket.SO_SNDBUF, len(data) + 65536)
        self._buffer(SO_RCVBUFFORCE, socket.SO_RCVBUF, max(_BUFFER, 2048 * (len(bodies) + 2)))
        self.sock.sendall(data)
        index = {s: i for i, s in enumerate(seqs)}
        pending = set(seqs)
        failure: Optional[NetlinkError] = None
        while pending:
            for msg_type, _, seq, payload in wire.messages(self.sock.recv(_RECV)):
                if msg_type != wire.NLMSG_ERROR or seq not in pending:
                    continue
                pending.discard(seq)
                err, _ = wire.error_code(payload)
                if err and failure is None:
                    failure = NetlinkError(err, index[seq])
        if failure is not None:
            raise failure

    def get(self, msg_type: int, family: int, body: bytes = b"") -> Dict[int, bytes]:
        """The attributes of the one object a plain ``GET`` returns."""
        seq = self.next_seq()
        self.sock.sendall(wire.message(msg_type, wire.NLM_F_REQUEST | wire.NLM_F_ACK, seq, family, body))
        found: Dict[int, bytes] = {}
        for attrs in self._replies(seq):
            found = attrs
        return found

    def _replies(self, seq: int) -> Iterator[Dict[int, bytes]]:
        while True:
            data = self.sock.recv(_RECV)
            for msg_type, _, got, payload in wire.messages(data):
                if got != seq:
                    continue
                if msg_type == wire.NLMSG_DONE:
                    return
                if msg_type == wire.NLMSG_ERROR:
                    err, _ = wire.error_code(payload)
                    if err:
                        raise NetlinkError(err, seq)
                    return
                yield wire.attributes(payload, 4)
