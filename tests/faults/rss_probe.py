"""Where a ``netproxy run``'s memory goes, sync by sync: a measuring wrapper for the storm's RSS check.

Started in place of netproxy (the lab runs ``$NETPROXY_CMD``), it runs netproxy's own ``main`` and,
after the syncs listed in ``RSS_PROBE_AT``, appends one JSON line to ``$RSS_PROBE_OUT/points.jsonl``:
VmRSS and RssAnon, glibc's ``mallinfo2`` (the heap's size, the bytes in use, the bytes free in it),
and the blocks Python has allocated (``sys.getallocatedblocks``).  With ``RSS_PROBE_TRACE=N`` it
also starts tracemalloc (N frames) and pickles a snapshot at each of those syncs, to be compared
with ``Snapshot.compare_to``.  The split it gives is what tells a leak of Python objects (blocks and
tracemalloc grow) from a heap that grows around memory in use that does not (docs/testing.md, "The
storm's RSS growth")::

    NETPROXY_CMD="$PWD/.venv/bin/python -m tests.faults.rss_probe" RSS_PROBE_OUT=/tmp/probe \\
    NETPROXY_TIER=full NETPROXY_BACKENDS=iptables-nft/restore .venv/bin/pytest -p no:xdist \\
    tests/faults/test_storm.py -k rss

Measurement only: nothing in the suite starts it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import sys
import tracemalloc
from typing import Callable, Dict, Union

from netproxy.core import proxier

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
           "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def status(fields: tuple[str, ...] = ("VmRSS", "RssAnon")) -> Dict[str, int]:
    """Those lines of /proc/self/status, in KB."""
    out: Dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                out[name] = int(value.split()[0])
    return out


def heap() -> Dict[str, int]:
    """glibc's view of its heaps, in bytes: their size, the bytes in use, the bytes free inside."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"heap": int(info.arena), "in_use": int(info.uordblks), "free": int(info.fordblks)}


def point(sync: int, out: str) -> Dict[str, Union[int, str]]:
    gc.collect()
    record: Dict[str, Union[int, str]] = {"sync": sync, **status(), **heap(), "blocks": sys.getallocatedblocks()}
    if tracemalloc.is_tracing():
        record["traced"] = tracemalloc.get_traced_memory()[0]
        path = os.path.join(out, f"snapshot-{sync}.pickle")
        with open(path, "wb") as f:
            pickle.dump(tracemalloc.take_snapshot(), f)
        record["snapshot"] = path
    return record


def wrap(sync: Callable[[proxier.Proxier], None], at: frozenset[int], out: str) -> Callable[[proxier.Proxier], None]:
    done = [0]

    def probed(self: proxier.Proxier) -> None:
        sync(self)
        done[0] += 1
        if done[0] in at:
            with open(os.path.join(out, "points.jsonl"), "a") as f:
                f.write(json.dumps(point(done[0], out)) + "\n")

    return probed


def main() -> int:
    out = os.environ.get("RSS_PROBE_OUT", "/tmp/rss-probe")
    os.makedirs(out, exist_ok=True)
    at = frozenset(int(n) for n in os.environ.get("RSS_PROBE_AT", "2,100,500,1000").split(","))
    frames = int(os.environ.get("RSS_PROBE_TRACE", "0"))
    if frames:
        tracemalloc.start(frames)
    proxier.Proxier.sync = wrap(proxier.Proxier.sync, at, out)  # type: ignore[method-assign,assignment]  # the probe's one hook
    from netproxy.cli import main as netproxy_main

    return netproxy_main()


if __name__ == "__main__":
    sys.exit(main())
