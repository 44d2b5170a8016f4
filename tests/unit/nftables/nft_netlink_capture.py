"""The netlink messages ``nft`` itself sends for netproxy's transactions: the independent expectation
of the netlink encoder's test (tests/unit/nftables/test_nft_netlink_nft_bytes.py).

    sudo .venv/bin/python -m tests.unit.nftables.nft_netlink_capture   # rewrites data/nft-netlink.json

Two transactions of the nftables backend (a full sync of a mixed snapshot, then an incremental one
that deletes a service, moves endpoints and adds a service) are written as nft text (the libnftables
writer's serialiser) and given to ``nft --debug=mnl -f`` in a throwaway network namespace
(``unshare --net``: the host's ruleset is never touched). libmnl prints every message it sends as a
table: the header's fields, then each attribute's header (length, N for nested, B for network byte
order, type) and its payload four bytes a row; the messages between the batch's begin and end are
put back together byte for byte (the header's flags print as R/M/A/E only, so only the payload is
kept). The JSON holds nft's version, the text given to it and each message's type and payload.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Tuple
from unittest import mock

from netproxy.backends.nftables import serialise, stamp
from netproxy.backends.nftables.serialise import Op
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes
from tests.unit.nftables.nft_helpers import backend, eps, mixed_snapshot, snap, svc

DATA = os.path.join(os.path.dirname(__file__), "data", "nft-netlink.json")
NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END = 16, 17
NLA_F_NESTED, NLA_F_NET_BYTEORDER = 0x8000, 0x4000


def transactions() -> List[List[Op]]:
    """The backend's two transactions: a first full sync, then an incremental one."""
    first = mixed_snapshot()
    second = snap(
        (svc("dns", "10.96.0.53", 53, proto="UDP", port_name="dns"), eps("10.1.0.8", "10.1.0.9", port=53)),
        (svc("sticky", "10.96.0.20", affinity=True, timeout=60), eps("10.1.0.4", "10.1.0.5")),
        (svc("empty", "10.96.0.30"), eps("10.1.0.6")),
        (svc("v6", "fd00::10"), eps("fd01::1", "fd01::2")),
        (svc("new", "10.96.0.40", 443, ext_policy="Local"), eps("10.1.0.10")),
    )
    changed = frozenset(s.name for s in first.services.values()) | frozenset(s.name for s in second.services.values())
    b, fake = backend(ProxyConfig(hostname="node-a", cluster_cidrs=parse_cidrs("10.0.0.0/8")))
    # The table stamp's config digest covers the rendering code (stamp.code_digest): a fixed one here,
    # or every edit of the backend's modules would change the recorded text.
    with mock.patch.object(stamp, "code_digest", return_value="0" * 16):
        b.sync(first, Changes())
        b.sync(second, Changes(full=False, services=changed))
    assert len(fake.transactions) == 2, fake.transactions
    return [list(t) for t in fake.transactions]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class _Message:
    length: int
    kind: int = 0
    payload: bytearray = field(default_factory=bytearray)


def parse_mnl_dump(text: str) -> List[Tuple[int, bytes]]:
    """Every message in libmnl's debug print, as (type with subsystem, payload after the header)."""
    messages: List[_Message] = []
    for raw in text.splitlines():
        cells = [c.strip() for c in _ANSI.sub("", raw).split("\t")]
        if len(cells) < 2:
            continue
        left, right = cells[0].strip("| "), cells[1]
        if "message length" in right:
            messages.append(_Message(int(left)))
        elif "type | flags" in right:
            messages[-1].kind = int(left.split("|")[0])
        elif "extra header" in right or "data" in right:
            messages[-1].payload += bytes(int(x, 16) for x in left.split())
        elif "len |flags| type" in right:
            length, flags, kind = (x.strip() for x in left.split("|"))
            kind_bits = int(kind) | (NLA_F_NESTED if "N" in flags else 0) | (NLA_F_NET_BYTEORDER if "B" in flags else 0)
            messages[-1].payload += struct.pack("=HH", int(length), kind_bits)
    for m in messages:
        if len(m.payload) != m.length - 16:
            raise ValueError(f"message of type {m.kind}: {len(m.payload)} payload bytes, its header says {m.length}")
    return [(m.kind, bytes(m.payload)) for m in messages]


def batch(messages: List[Tuple[int, bytes]]) -> List[Tuple[int, bytes]]:
    """The messages inside the (one) batch: nft's cache queries before it are not the transaction."""
    kinds = [k for k, _ in messages]
    begin, end = kinds.index(NFNL_MSG_BATCH_BEGIN), kinds.index(NFNL_MSG_BATCH_END)
    return messages[begin + 1:end]


def capture() -> Dict[str, object]:
    texts = [serialise.ops_text(t) for t in transactions()]
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, text in enumerate(texts):
            files.append(os.path.join(tmp, f"t{i}.nft"))
            with open(files[-1], "w") as out:
                out.write(text)
        # One namespace for both: the second transaction changes what the first wrote. Each dump
        # goes to its own file (stdout would interleave them).
        script = "; ".join(f"nft --debug=mnl -f {name} > {name}.mnl 2>&1" for name in files)
        subprocess.run(["unshare", "--net", "sh", "-ec", script], check=True)
        dumps = []
        for name in files:
            with open(name + ".mnl") as d:
                dumps.append(d.read())
    version = subprocess.run(["nft", "--version"], capture_output=True, text=True, check=True).stdout.strip()
    return {"nft": version, "transactions": [
        {"input": text, "messages": [[kind, body.hex()] for kind, body in batch(parse_mnl_dump(dump))]}
        for text, dump in zip(texts, dumps)]}


if __name__ == "__main__":
    data = capture()
    with open(DATA, "w") as out:
        json.dump(data, out, indent=1)
        out.write("\n")
    sys.stdout.write(f"{DATA}: {data['nft']}\n")
