"""A tiny TCP + UDP (+ SCTP) echo-who server that the lab runs inside each pod namespace.

Every TCP connection, SCTP association and UDP datagram is answered with one line::

    <pod name> <source address> <source port>\\n

so a test knows which endpoint a connection reached *and* which source address that endpoint saw
(masquerade versus source preservation is then asserted, not assumed).  TCP connections and SCTP
associations (one-to-one style: ``SOCK_STREAM``, ``IPPROTO_SCTP``, served as TCP is) are closed
right after the answer, except on the ``--hold`` ports: there a connection stays open and every
line the client sends is answered with that line (a long-lived connection across a dataplane
switch, ``netproxy migrate``).

Deliberately stdlib only and importable as a plain file (``python3 pods.py ...``): it runs
inside namespaces of VMs where netproxy itself may not be installed.  One thread and a selector,
because a test sends hundreds of connections in a burst and must not wait on thread start-up.

It prints ``ready`` on stdout once every socket is bound, so that the lab never races the
first connection against ``bind()``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import selectors
import signal
import socket
import sys
from typing import List, Optional, Sequence, Tuple


def _ports(text: str) -> List[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def _plain(address: str) -> str:
    # A dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d; tests compare with plain IPv4.
    return address[7:] if address.startswith("::ffff:") and "." in address else address


SCTP = getattr(socket, "IPPROTO_SCTP", 132)


def _bind(kind: int, port: int, ipv6: bool, proto: int = 0) -> socket.socket:
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if ipv6:
        # One socket for both families, so that pods answer IPv4 and IPv6 services alike.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::" if ipv6 else "0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        sock.listen(1024)
    sock.setblocking(False)
    return sock


def _has_ipv6() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
        return True
    except OSError:
        return False


def answer(name: str, peer: Tuple[str, int]) -> bytes:
    """The line a pod sends back to ``peer``."""
    return f"{name} {_plain(peer[0])} {peer[1]}\n".encode()


def serve(name: str, tcp_ports: Sequence[int], udp_ports: Sequence[int], hold_ports: Sequence[int] = (),
          sctp_ports: Sequence[int] = ()) -> None:
    """Answer forever on the given ports; returns only when interrupted.  A kernel without SCTP
    fails the start on an SCTP port (EPROTONOSUPPORT): the lab asks for them only where it has it."""
    ipv6 = _has_ipv6()
    sel = selectors.DefaultSelector()
    for port in tcp_ports:
        sel.register(_bind(socket.SOCK_STREAM, port, ipv6), selectors.EVENT_READ, "tcp")
    for port in sctp_ports:
        # Answered exactly as TCP: accept, one line, close (the association's SHUTDOWN is the EOF).
        sel.register(_bind(socket.SOCK_STREAM, port, ipv6, SCTP), selectors.EVENT_READ, "tcp")
    for port in hold_ports:
        sel.register(_bind(socket.SOCK_STREAM, port, ipv6), selectors.EVENT_READ, "hold")
    for port in udp_ports:
        sel.register(_bind(socket.SOCK_DGRAM, port, ipv6), selectors.EVENT_READ, "udp")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if key.data == "tcp":
                _accept_all(sock, name)
            elif key.data == "hold":
                _accept_held(sel, sock)
            elif key.data == "udp":
                _answer_datagrams(sock, name)
            else:
                _answer_held(sel, sock, name, key.data)


class _Held:
    """A held connection's peer (as accepted) and its unanswered partial line."""

    def __init__(self, peer: Tuple[str, int]) -> None:
        self.peer = peer
        self.buf = b""


def _accept_held(sel: selectors.BaseSelector, listener: socket.socket) -> None:
    while True:
        try:
            conn, peer = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ, _Held(peer))


def _answer_held(sel: selectors.BaseSelector, conn: socket.socket, name: str, held: _Held) -> None:
    """Each complete line: ``<pod> <source address> <source port> <the line>``; EOF closes."""
    try:
        chunk = conn.recv(4096)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        chunk = b""
    if not chunk:
        sel.unregister(conn)
        conn.close()
        return
    held.buf += chunk
    while b"\n" in held.buf:
        line, held.buf = held.buf.split(b"\n", 1)
        with contextlib.suppress(OSError):
            conn.sendall(answer(name, held.peer)[:-1] + b" " + line + b"\n")


def _accept_all(listener: socket.socket, name: str) -> None:
    while True:
        try:
            conn, peer = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:  # e.g. ECONNABORTED: the client gave up; keep serving the others
            if err.errno in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE):
                return
            raise
        try:
            # The answer is far below the socket buffer, so one non-blocking send always takes it.
            conn.send(answer(name, peer))
        except OSError:
            pass
        finally:
            conn.close()


def _answer_datagrams(sock: socket.socket, name: str) -> None:
    while True:
        try:
            _, peer = sock.recvfrom(2048)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # an ICMP error queued on the socket; nothing to answer
            continue
        with contextlib.suppress(OSError):
            sock.sendto(answer(name, peer), peer)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="the pod name to answer with")
    parser.add_argument("--tcp", default="", help="comma-separated TCP ports")
    parser.add_argument("--udp", default="", help="comma-separated UDP ports")
    parser.add_argument("--hold", default="", help="comma-separated TCP ports whose connections stay open")
    parser.add_argument("--sctp", default="", help="comma-separated SCTP ports (one-to-one associations)")
    args = parser.parse_args(argv)
    # SIGTERM from the lab should end the process quietly, without a traceback on stderr.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.name, _ports(args.tcp), _ports(args.udp), _ports(args.hold), _ports(args.sctp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
