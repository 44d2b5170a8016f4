"""What every part of the local VM runner shares: paths, logging, the node kinds, stage timing.

The node kinds come from vagrant/nodes.json (the same list the Vagrantfile reads).  Python
3.9-compatible on purpose, like the rest of the runner: it is the project's floor.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, NoReturn

HERE = Path(__file__).resolve().parent
VAGRANT = HERE.parent
REPO = VAGRANT.parent
NODES_FILE = VAGRANT / "nodes.json"

CACHE = Path(os.environ.get("NETPROXY_VM_CACHE", "/var/cache/netproxy-vm"))

def log(msg: str) -> None:
    print(f"vm: {msg}", flush=True)


def die(msg: str) -> NoReturn:
    print(f"vm: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def run(cmd: List[str], **kw: Any) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run a command, failing loudly with the command line on error."""
    try:
        return subprocess.run(cmd, check=True, **kw)
    except subprocess.CalledProcessError as e:
        die(f"command failed ({e.returncode}): {' '.join(cmd)}")
    except FileNotFoundError:
        die(f"command not found: {cmd[0]} (run scripts/setup-system.sh qemu-system-x86 debootstrap cpio)")


def sha(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


class Timer:
    """Wall time of each stage, printed at the end and kept in last-run.json."""

    def __init__(self) -> None:
        self.stages: List[Dict[str, Any]] = []

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)


class _Stage:
    def __init__(self, timer: Timer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.t0 = time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        dt = time.monotonic() - self.t0
        self.timer.stages.append({"stage": self.name, "seconds": round(dt, 1)})
        log(f"{self.name}: {dt:.1f} s")



@dataclass
class Node:
    name: str
    suite: str
    kernel: str
    python: str
    glibc: str
    iptables: str
    kernel_args: str
    packages: List[str]
    expect_detect: str
    backends: List[str]
    raw: Dict[str, Any] = field(repr=False)

    @property
    def pytag(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def dir(self) -> Path:
        return CACHE / "guests" / self.name


def load_nodes() -> tuple[List[str], List[Node]]:
    data = json.loads(NODES_FILE.read_text())
    nodes = []
    for n in data["nodes"]:
        nodes.append(
            Node(
                name=n["name"], suite=n["suite"], kernel=n["kernel"], python=n["python"], glibc=n["glibc"],
                iptables=n["iptables"], kernel_args=n.get("kernel_args", ""), packages=n.get("packages", []),
                expect_detect=n["expect_detect"], backends=n["backends"], raw=n,
            )
        )
    return data["common_packages"], nodes


def pick(nodes: List[Node], names: List[str]) -> List[Node]:
    if not names:
        return nodes
    known = {n.name: n for n in nodes}
    for name in names:
        if name not in known:
            die(f"unknown node {name!r}; nodes.json has {', '.join(known)}")
    return [known[name] for name in names]
