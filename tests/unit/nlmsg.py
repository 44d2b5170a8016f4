"""A netlink message as the kernel sends a notification: header, nfgenmsg, attributes (unit tests)."""

from __future__ import annotations

import struct
from typing import Dict


def nlmsg(msg_type: int, family: int, attrs: Dict[int, bytes]) -> bytes:
    body = struct.pack("=BBH", family, 0, 0)
    for kind, data in attrs.items():
        attr = struct.pack("=HH", 4 + len(data), kind) + data
        body += attr + b"\0" * (-len(attr) % 4)
    return struct.pack("=IHHII", 16 + len(body), msg_type, 0, 0, 0) + body
