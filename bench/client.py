"""The benchmark's TCP client in Python: the same two modes and output as ``bench/connect.c``, used
when no C compiler is installed (its figures then include Python's per-call overhead, and say so).

    python -m bench.client rate ADDR PORT COUNT SECONDS WARMUP
    python -m bench.client poll ADDR PORT SECONDS ATTEMPT_MS
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from typing import List, Optional, Sequence

_LINGER0 = struct.pack("ii", 1, 0)
_HERE = os.path.dirname(os.path.abspath(__file__))


def _one(addr: str, port: int) -> Optional[float]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        t0 = time.monotonic()
        sock.connect((addr, port))
        return time.monotonic() - t0
    except OSError:
        return None
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
        sock.close()


def rate(addr: str, port: int, count: int, seconds: float, warmup: int) -> int:
    warm_end = time.monotonic() + 1.0
    for _ in range(warmup):
        if time.monotonic() >= warm_end:
            break
        _one(addr, port)
    lat: List[float] = []
    errors = 0
    start = time.monotonic()
    deadline = start + seconds
    for _ in range(count):
        if time.monotonic() >= deadline:
            break
        d = _one(addr, port)
        if d is None:
            errors += 1
        else:
            lat.append(d)
    elapsed = time.monotonic() - start
    lat.sort()
    ok = len(lat)
    out = {"client": "python", "ok": ok, "errors": errors, "elapsed": elapsed, "rate": ok / elapsed if elapsed else 0,
           "p50_us": lat[ok // 2] * 1e6 if ok else 0, "p99_us": lat[int(ok * 0.99)] * 1e6 if ok else 0,
           "mean_us": sum(lat) / ok * 1e6 if ok else 0, "min_us": lat[0] * 1e6 if ok else 0,
           "max_us": lat[-1] * 1e6 if ok else 0}
    print(json.dumps(out))
    return 0 if ok else 1


def poll(addr: str, port: int, seconds: float, attempt_ms: float) -> int:
    deadline = time.monotonic() + seconds
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            code = sock.connect_ex((addr, port))
            if code == errno.EINPROGRESS:
                import select

                _, writable, _ = select.select([], [sock], [], attempt_ms / 1000)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if writable else -1
                if writable and code:
                    time.sleep(attempt_ms / 1000)
            if code == 0:
                t = time.monotonic()
                print(json.dumps({"client": "python", "ok": 1, "t": t, "attempts": attempts}))
                return 0
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
            sock.close()
    print(json.dumps({"client": "python", "ok": 0, "attempts": attempts}))
    return 1


def build(workdir: str) -> List[str]:
    """The client command: the C client compiled into ``workdir`` if ``cc`` exists, else this module."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        out = os.path.join(workdir, "connect")
        proc = subprocess.run([cc, "-O2", "-o", out, os.path.join(_HERE, "connect.c")], capture_output=True,
                              check=False)
        if proc.returncode == 0:
            return [out]
        print(f"bench: cc failed, using the Python client: {proc.stderr.decode(errors='replace')[:500]}",
              file=sys.stderr)
    return [sys.executable, os.path.join(_HERE, "client.py")]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 6 and args[0] == "rate":
        return rate(args[1], int(args[2]), int(args[3]), float(args[4]), int(args[5]))
    if len(args) == 5 and args[0] == "poll":
        return poll(args[1], int(args[2]), float(args[3]), float(args[4]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
