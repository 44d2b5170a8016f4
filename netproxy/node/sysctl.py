"""The few sysctls netproxy sets, as kube-proxy does (``proxyutil.EnsureSysctl``).

Network sysctls belong to the network namespace of the process that writes ``/proc/sys/net``: a
netproxy run inside a namespace sets that namespace's, never the host's.
"""

from __future__ import annotations

import os

ROUTE_LOCALNET = "net/ipv4/conf/all/route_localnet"
"""Lets the kernel route packets from and to 127/8, which a NodePort on 127.0.0.1 needs once its
DNAT sends the packet to an endpoint elsewhere (kube-proxy's iptables mode, issues.k8s.io/90259)."""

ROOT = "/proc/sys"


def read(name: str, root: str = ROOT) -> int:
    with open(os.path.join(root, name)) as f:
        return int(f.read().strip())


def ensure(name: str, value: int, root: str = ROOT) -> bool:
    """Set ``name`` to ``value`` unless it already is; whether it was changed.  OSError when it
    cannot be read or written (it names the file)."""
    if read(name, root) == value:
        return False
    with open(os.path.join(root, name), "w") as f:
        f.write(f"{value}\n")
    return True
