"""The lab's client: N connections to one address, answers counted per pod, printed as JSON.

Runs inside a client (or node, or pod) namespace as one subprocess per batch, so that 600
connections cost one process start, not 600.  Connections run concurrently (``--concurrency``)
on one selector, each with its own deadline, so a batch that cannot connect costs about one
``--timeout`` rather than N of them.

Output (one JSON object on stdout)::

    {"counts": {"pod-0": 201, ...},            # answers per pod name
     "sources": {"pod-0": {"10.244.1.2": 201}}, # the source address each pod saw
     "errors": {"timeout": 3, "refused": 1},   # failed attempts by kind
     "refusals": {"icmp port-unreachable": 1},  # how each failure that came back was sent (below)
     "sequence": ["pod-0", "!timeout", ...],    # every attempt in start order
     "elapsed": 0.21,
     "first_start": 1796000000.1, "last_start": 1796000000.3,  # wall clock (time.time()) of the
                                                # first and the last attempt's start
     "starts": [1796000000.1, ...]}            # and of every attempt's, in start order

SIGUSR1 stops a batch early: no attempt starts after it, those in flight finish, and the result
covers the attempts started (a loop kept running until a test saw what it waited for).
``--announce`` writes ``started`` on stderr once the first attempt has finished, so that a test
can wait for a loop to be under way before it changes what the loop goes through; ``--progress``
writes every attempt's outcome there as it ends (``pod-0``, ``!timeout``), one a line, so that a
test can wait for what a paced flow has seen so far (read them: a full pipe would stall the flow).

A failure that came back (not a timeout) is told apart by what refused the attempt: the ICMP error
the kernel queued for the socket (``IP_RECVERR``: ``icmp port-unreachable``, ``icmp6
admin-prohibited``, ``icmp host-unreachable`` ...) or, with none queued, a TCP reset (``rst``).  A
REJECT rule, a closed port, a missing route and a pod's RST all read "refused" or "unreachable" in
``errors``; ``refusals`` says which.

``--proto sctp`` opens one-to-one SCTP associations (``SOCK_STREAM``, ``IPPROTO_SCTP``) and reads
them as TCP connections: the pod's line, then its SHUTDOWN as the end.

``--session`` instead keeps one connection (TCP, or a UDP flow from one source port) open: each
line read on stdin is sent on it and the answer printed as one JSON line (``{"answer": "pod-1
10.244.1.2 40000 ping"}`` or ``{"error": "reset"}``), so a test holds a long-lived connection open
across a dataplane switch and exchanges data over it both ways (``netproxy migrate``).

Stdlib only and runnable as a plain file, like :mod:`netproxy_lab.pods`.
"""

from __future__ import annotations

import argparse
import errno
import json
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

_ERRNO_KIND = {
    errno.ECONNREFUSED: "refused",
    errno.EHOSTUNREACH: "unreachable",
    errno.ENETUNREACH: "unreachable",
    errno.ECONNRESET: "reset",
    errno.ETIMEDOUT: "timeout",
    errno.EACCES: "prohibited",
    errno.EPERM: "prohibited",
}


IP_RECVERR, IPV6_RECVERR = 11, 25  # <linux/in.h>, <linux/in6.h> (not in Python's socket module)
SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6 = 2, 3
_EXTENDED_ERR = struct.Struct("=IBBBB")  # struct sock_extended_err: errno, origin, type, code, pad
_ICMP_NAMES = {
    (SO_EE_ORIGIN_ICMP, 3): {0: "net-unreachable", 1: "host-unreachable", 3: "port-unreachable",
                             9: "admin-prohibited", 10: "admin-prohibited", 13: "admin-prohibited"},
    (SO_EE_ORIGIN_ICMP6, 1): {0: "no-route", 1: "admin-prohibited", 3: "addr-unreachable",
                              4: "port-unreachable", 5: "admin-prohibited", 6: "reject-route"},
}


def refusal_kind(sock: socket.socket, outcome: str) -> str:
    """What refused an attempt on ``sock`` (opened with the RECVERR option): the ICMP error its
    error queue holds; else ``rst`` (a connection refused or reset with no ICMP error: a TCP reset),
    or ``local`` (any other error: this host's own, e.g. no route)."""
    fallback = "rst" if outcome in ("refused", "reset") else "local"
    try:
        _data, ancillary, _flags, _addr = sock.recvmsg(1, 512, socket.MSG_ERRQUEUE)
    except OSError:  # EAGAIN: nothing queued
        return fallback
    for _level, _type, data in ancillary:
        if len(data) < _EXTENDED_ERR.size:
            continue
        _errno, origin, icmp_type, code, _pad = _EXTENDED_ERR.unpack_from(data)
        if origin in (SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6):
            prefix = "icmp" if origin == SO_EE_ORIGIN_ICMP else "icmp6"
            name = _ICMP_NAMES.get((origin, icmp_type), {}).get(code, f"type {icmp_type} code {code}")
            return f"{prefix} {name}"
    return fallback


def error_kind(err: OSError) -> str:
    """A short word for a socket error, stable across kernels (tests compare these)."""
    if isinstance(err, socket.timeout):
        return "timeout"
    return _ERRNO_KIND.get(err.errno or 0, errno.errorcode.get(err.errno or 0, "error").lower())


@dataclass
class Attempt:
    index: int
    sock: socket.socket
    deadline: float
    connected: bool = False
    data: bytes = b""


@dataclass
class Result:
    counts: Dict[str, int] = field(default_factory=dict)
    sources: Dict[str, Dict[str, int]] = field(default_factory=dict)
    errors: Dict[str, int] = field(default_factory=dict)
    refusals: Dict[str, int] = field(default_factory=dict)
    sequence: List[str] = field(default_factory=list)
    elapsed: float = 0.0
    first_start: float = 0.0
    last_start: float = 0.0
    starts: List[float] = field(default_factory=list)

    def record(self, index: int, outcome: str, answer: bytes = b"", how: str = "") -> None:
        if outcome == "ok":
            parts = answer.decode(errors="replace").split()
            pod = parts[0] if parts else "?"
            source = parts[1] if len(parts) > 1 else "?"
            self.counts[pod] = self.counts.get(pod, 0) + 1
            per_pod = self.sources.setdefault(pod, {})
            per_pod[source] = per_pod.get(source, 0) + 1
            self.sequence[index] = pod
        else:
            self.errors[outcome] = self.errors.get(outcome, 0) + 1
            self.sequence[index] = "!" + outcome
            if how:
                self.refusals[how] = self.refusals.get(how, 0) + 1

    def as_dict(self) -> Dict[str, object]:
        return {"counts": self.counts, "sources": self.sources, "errors": self.errors, "refusals": self.refusals,
                "sequence": self.sequence, "elapsed": round(self.elapsed, 4),
                "first_start": self.first_start, "last_start": self.last_start, "starts": self.starts}


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


STREAMS = ("tcp", "sctp")
"""Connection-oriented protocols: connected, then answered with one line and closed."""
PROTOCOLS = STREAMS + ("udp",)


SOL_SCTP = IPPROTO_SCTP = 132
SCTP_PEER_ADDR_PARAMS, SPP_HB_DISABLE = 9, 2
# struct sctp_paddrparams up to spp_flags (packed; the kernel takes this shorter form, 4-byte aligned):
# assoc id (0: the socket's defaults), sockaddr_storage (zero: no one address), hbinterval,
# pathmaxrxt, pathmtu, sackdelay, flags.
_PADDRPARAMS = struct.Struct("=i128sIHIII2x")


def _socket(proto: str, address: str) -> socket.socket:
    if proto != "sctp":
        return socket.socket(_family(address), socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM)
    sock = socket.socket(_family(address), socket.SOCK_STREAM, IPPROTO_SCTP)
    try:
        # No HEARTBEATs: the pod's INIT-ACK lists its own address, which the client would probe
        # straight (not through the service address); conntrack finds that path's reply tuple taken
        # by the DNAT-ed association's, remaps its source port, and the pod answers the stranger
        # with an ABORT that ends the real association (seen as resets under emulation, where an
        # answer can take longer than the probe's first RTO).  Multihoming through DNAT is not
        # what the lab tests; one path, the service address, is.
        sock.setsockopt(SOL_SCTP, SCTP_PEER_ADDR_PARAMS, _PADDRPARAMS.pack(0, b"", 0, 0, 0, 0, SPP_HB_DISABLE))
    except OSError:
        sock.close()
        raise
    return sock


def _open(proto: str, address: str, port: int, bind: Optional[Tuple[str, int]]) -> socket.socket:
    sock = _socket(proto, address)
    if proto != "sctp":
        # ICMP errors queued on the socket: refusal_kind tells a REJECT's ICMP from a reset.  Only on a
        # batch's short-lived attempts: on a long-lived session it would also make soft ICMP errors fatal.
        if _family(address) == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVERR, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
    if bind is not None:
        # A fixed source port (or address) is reused attempt after attempt (the UDP "same flow" case).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(bind)
    sock.setblocking(False)
    return sock


class Batch:
    """Runs ``count`` attempts with at most ``concurrency`` in flight."""

    def __init__(self, proto: str, address: str, port: int, *, count: int, timeout: float, concurrency: int,
                 interval: float = 0.0, bind: Optional[Tuple[str, int]] = None,
                 sources: Sequence[str] = (), announce: bool = False, progress: bool = False) -> None:
        self.proto, self.address, self.port = proto, address, port
        self.announce, self.progress = announce, progress
        self.stopping = False  # set by SIGUSR1 (main): start no more attempts
        self.count, self.timeout, self.interval, self.bind = count, timeout, interval, bind
        # Attempt i leaves from sources[i % len(sources)]: many "clients" in one batch (affinity tests).
        self.sources = list(sources)
        # A fixed source port or a pacing interval means one flow at a time, in order.
        self.concurrency = 1 if (bind is not None or interval > 0) else max(1, concurrency)
        self.sel = selectors.DefaultSelector()
        self.result = Result(sequence=[""] * count)
        self.started = 0
        self.live: Dict[int, Attempt] = {}

    def run(self) -> Result:
        t0 = time.monotonic()
        next_start = t0
        while (self.started < self.count and not self.stopping) or self.live:
            now = time.monotonic()
            while (self.started < self.count and not self.stopping and len(self.live) < self.concurrency
                   and now >= next_start):
                self._start(now)
                next_start = now + self.interval
            wait = min([a.deadline for a in self.live.values()] + [now + 0.5]) - now
            if self.started < self.count and len(self.live) < self.concurrency:
                wait = min(wait, next_start - now)
            for key, _ in self.sel.select(max(0.0, wait)):
                self._progress(key.data)
            self._expire(time.monotonic())
        self.result.elapsed = time.monotonic() - t0
        del self.result.sequence[self.started:]  # stopped early: only the attempts made
        return self.result

    def _start(self, now: float) -> None:
        index = self.started
        self.started += 1
        self.result.last_start = time.time()
        self.result.starts.append(self.result.last_start)
        if index == 0:
            self.result.first_start = self.result.last_start
        bind = self.bind
        if self.sources:
            bind = (self.sources[index % len(self.sources)], 0)
        try:
            sock = _open(self.proto, self.address, self.port, bind)
        except OSError as err:
            self.result.record(index, error_kind(err))
            return
        attempt = Attempt(index, sock, now + self.timeout)
        if self.proto in STREAMS:
            code = sock.connect_ex((self.address, self.port))
            if code not in (0, errno.EINPROGRESS):
                kind = error_kind(OSError(code, ""))
                self._finish(attempt, kind, registered=False, how=refusal_kind(sock, kind))
                return
            self.sel.register(sock, selectors.EVENT_WRITE, attempt)
        else:
            try:
                sock.connect((self.address, self.port))  # connected UDP: ICMP errors come back as errno
                sock.send(b"who\n")
            except OSError as err:
                kind = error_kind(err)
                self._finish(attempt, kind, registered=False, how=refusal_kind(sock, kind))
                return
            attempt.connected = True
            self.sel.register(sock, selectors.EVENT_READ, attempt)
        self.live[index] = attempt

    def _progress(self, attempt: Attempt) -> None:
        sock = attempt.sock
        if not attempt.connected:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                kind = error_kind(OSError(code, ""))
                self._finish(attempt, kind, how=refusal_kind(sock, kind))
                return
            attempt.connected = True
            self.sel.modify(sock, selectors.EVENT_READ, attempt)
            return
        try:
            chunk = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            kind = error_kind(err)
            self._finish(attempt, kind, how=refusal_kind(sock, kind))
            return
        attempt.data += chunk
        # TCP, SCTP: the pod closes after its line (EOF); UDP: one datagram is the whole answer.
        if self.proto == "udp" or not chunk or attempt.data.endswith(b"\n"):
            if attempt.data:
                self._finish(attempt, "ok")
            else:
                self._finish(attempt, "reset", how="closed")

    def _expire(self, now: float) -> None:
        for attempt in [a for a in self.live.values() if a.deadline <= now]:
            self._finish(attempt, "timeout")

    def _finish(self, attempt: Attempt, outcome: str, registered: bool = True, how: str = "") -> None:
        if registered:
            self.sel.unregister(attempt.sock)
        attempt.sock.close()
        self.live.pop(attempt.index, None)
        self.result.record(attempt.index, outcome, attempt.data, how)
        if self.progress:
            sys.stderr.write(self.result.sequence[attempt.index] + "\n")
            sys.stderr.flush()
        if self.announce:
            self.announce = False
            sys.stderr.write("started\n")
            sys.stderr.flush()


def session(proto: str, address: str, port: int, timeout: float, bind: Optional[Tuple[str, int]]) -> int:
    """One connection kept open; a line on stdin → sent; the answer line → stdout (see the module)."""

    def emit(**what: object) -> None:
        sys.stdout.write(json.dumps(what) + "\n")
        sys.stdout.flush()

    sock = _socket(proto, address)
    sock.settimeout(timeout)
    try:
        if bind is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(bind)
        sock.connect((address, port))
    except OSError as err:
        emit(error=error_kind(err))
        return 1
    emit(ready=True, local=list(sock.getsockname()[:2]))
    pending = b""
    for line in sys.stdin:
        data = line.strip().encode() + b"\n"
        try:
            if proto in STREAMS:
                sock.sendall(data)
                while b"\n" not in pending:
                    chunk = sock.recv(4096)
                    if not chunk:
                        raise ConnectionResetError(errno.ECONNRESET, "closed by the peer")
                    pending += chunk
                answer, pending = pending.split(b"\n", 1)
            else:
                sock.send(data)
                answer = sock.recv(4096).rstrip(b"\n")
        except OSError as err:
            emit(error=error_kind(err))
            return 1
        emit(answer=answer.decode(errors="replace"))
    sock.close()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="connect N times and count answers per pod")
    parser.add_argument("address")
    parser.add_argument("port", type=int)
    parser.add_argument("--proto", choices=PROTOCOLS, default="tcp")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1.0, help="seconds per attempt")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between attempt starts (serialises)")
    parser.add_argument("--bind", default=None, help="source ADDRESS:PORT (or :PORT) for every attempt")
    parser.add_argument("--sources", default="", help="comma-separated source addresses, used round-robin")
    parser.add_argument("--announce", action="store_true", help="'started' on stderr after the first attempt")
    parser.add_argument("--progress", action="store_true", help="each attempt's outcome on stderr as it ends")
    parser.add_argument("--session", action="store_true", help="one connection kept open: stdin lines out, "
                        "answers in (see the module)")
    args = parser.parse_args(argv)
    bind: Optional[Tuple[str, int]] = None
    if args.bind:
        host, _, port = args.bind.rpartition(":")
        host = host.strip("[]") or ("::" if ":" in args.address else "0.0.0.0")
        bind = (host, int(port))
    if args.session:
        return session(args.proto, args.address, args.port, args.timeout, bind)
    batch = Batch(args.proto, args.address, args.port, count=args.count, timeout=args.timeout,
                  concurrency=args.concurrency, interval=args.interval, bind=bind,
                  sources=[a for a in args.sources.split(",") if a], announce=args.announce,
                  progress=args.progress)
    signal.signal(signal.SIGUSR1, lambda _sig, _frame: setattr(batch, "stopping", True))
    json.dump(batch.run().as_dict(), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
