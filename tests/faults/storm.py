"""Helpers of the update-storm tests (fault 5), shared with the soak in ``make bench``:
a file storm writer, sync counting from a run's log, and a process's resident memory."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from netproxy_lab.manifests import endpoint_slice, port, service, slice_port

Obj = Dict[str, Any]
SYNCED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO netproxy\.core\.proxier: "
                    r"synced (full|partial)", re.M)


def cluster(count: int, pods: Sequence[str], first_ip: str = "10.96.3.1", rng: Optional[random.Random] = None,
            prefix: str = "s") -> List[Obj]:
    """``count`` one-port services and their slices, each with a random non-empty subset of ``pods``;
    cluster IPs count up from ``first_ip``."""
    rng = rng or random.Random(0)
    base = ipaddress.IPv4Address(first_ip)
    out: List[Obj] = []
    for i in range(count):
        name = f"{prefix}-{i}"
        out.append(service(name, str(base + i), [port(80, name="http")]))
        out.append(slice_of(name, rng.sample(list(pods), rng.randint(1, len(pods)))))
    return out


def slice_of(service_name: str, addresses: Sequence[str]) -> Obj:
    return endpoint_slice(service_name, addresses, [slice_port(name="http")])


def write_atomically(path: str, objects: Sequence[Obj]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write("".join("---\n" + json.dumps(o) + "\n" for o in objects))
    os.replace(tmp, path)


@dataclass
class StormResult:
    changes: int = 0
    writes: int = 0
    seconds: float = 0.0
    final: List[Obj] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.changes / self.seconds if self.seconds else 0.0


def file_storm(path: str, objects: List[Obj], pods: Sequence[str], rate: float, seconds: float,
               batch_every: float = 0.01, seed: int = 1) -> StormResult:
    """Change ``rate`` endpoint slices a second for ``seconds``: every ``batch_every`` the due changes
    are made and the file is replaced once (a file write per change would measure the disk, not us)."""
    rng = random.Random(seed)
    slices = [i for i, o in enumerate(objects) if o["kind"] == "EndpointSlice"]
    out = StormResult()
    start = time.monotonic()
    while True:
        now = time.monotonic()
        if now - start >= seconds:
            break
        due = int((now - start) * rate) - out.changes
        for _ in range(max(0, due)):
            i = rng.choice(slices)
            svc = objects[i]["metadata"]["labels"]["kubernetes.io/service-name"]
            objects[i] = slice_of(svc, rng.sample(list(pods), rng.randint(1, len(pods))))
            out.changes += 1
        if due > 0:
            write_atomically(path, objects)
            out.writes += 1
        time.sleep(max(0.0, batch_every - (time.monotonic() - now)))
    out.seconds = time.monotonic() - start
    out.final = objects
    return out


def sync_times(log: str) -> List[float]:
    """Wall-clock seconds of each "synced" line of a ``netproxy run`` text log."""
    import datetime

    out = []
    for m in SYNCED.finditer(log):
        stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        out.append(stamp.timestamp())
    return out


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory in KB: ``VmRSS`` (all of it), or ``RssAnon`` (its heap and stacks,
    without the file pages the kernel maps in and reclaims as it likes)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def netproxy_pid(root: int) -> int:
    """The netproxy process under ``root`` (``ip netns exec`` may exec it or start it as a child)."""
    def cmdline(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    todo = [root]
    while todo:
        pid = todo.pop()
        if "netproxy" in cmdline(pid) and "ip netns" not in cmdline(pid):
            return pid
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                            todo.append(int(entry))
                except (OSError, ValueError, IndexError):
                    continue
    raise RuntimeError(f"no netproxy process under {root}")


def wait_until(check: Callable[[], Optional[str]], timeout: float, step: float = 0.2) -> float:
    t0 = time.monotonic()
    why: Optional[str] = "never checked"
    while time.monotonic() - t0 < timeout:
        why = check()
        if why is None:
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError(f"not within {timeout}s: {why}")
