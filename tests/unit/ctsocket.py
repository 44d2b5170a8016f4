"""A ctnetlink socket's side of one dump, for unit tests of the one dump loop (netproxy/node/ctnetlink.py)."""

from __future__ import annotations

import struct
from typing import List, Optional, Sequence

from netproxy.node import ctnetlink


class DumpSocket:
    """The replies (numbered ``seq``) in buffers of ``per_buffer`` messages, with a stray message of
    another request among them (when there are replies), then NLMSG_DONE (or ``end``)."""

    def __init__(self, messages: Sequence[bytes], seq: int = 1, end: Optional[bytes] = None,
                 per_buffer: int = 2) -> None:
        def numbered(msg: bytes, n: int) -> bytes:
            return msg[:8] + struct.pack("=I", n) + msg[12:]

        stray = [numbered(messages[0], seq + 7)] if messages else []
        done = struct.pack("=IHHII", 20, ctnetlink.NLMSG_DONE, 2, seq, 0) + b"\0" * 4
        msgs = stray + [numbered(m, seq) for m in messages]
        self.buffers = [b"".join(msgs[i:i + per_buffer]) for i in range(0, len(msgs), per_buffer)] + [end or done]
        self.sent: List[bytes] = []

    def send(self, data: bytes, /) -> int:
        self.sent.append(data)
        return len(data)

    def recv(self, size: int, /) -> bytes:
        return self.buffers.pop(0)

    def close(self) -> None:
        pass
