"""Make a proxy's writes fail the way a node makes them fail, for the tests of what it then reports.

- nf_tables (the nftables backend, iptables' nft flavour): another process takes the tables the
  proxy writes as *owned* tables (``NFT_TABLE_F_OWNER``, Linux >= 5.12): the kernel refuses every
  change to them from any other socket (EPERM) and deletes them when the owner's socket closes.
  The proxy's rules in those tables are gone while it holds them: traffic to services stops, which
  is what a proxy whose writes fail leads to anyway.
- legacy iptables: the xtables lock, held by this process, with the proxy's ``XTABLES_LOCKFILE``
  pointing at a file of the test's own (the machine's ``/run/xtables.lock`` stays untouched, so
  tests running beside this one are not held up).

    with WritesRefused(sandbox, combo, workdir) as refused:    # start the proxy with refused.env first
        ...

``python -m netproxy_lab.refuse FAMILY:TABLE ...`` is the holder, run inside the node namespace:
it prints ``held`` once the tables are its own and keeps them until it is stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from netproxy_lab.cleanup import stop_process
from netproxy_lab.combos import Combo
from netproxy_lab.topology import Sandbox

NFT_TABLE_F_OWNER = 0x2
_FAMILIES = {"ip": socket.AF_INET, "ip6": socket.AF_INET6}


def nf_tables_of(combo: Combo) -> List[str]:
    """The nf_tables tables a combination writes (none for legacy iptables)."""
    if combo.backend == "nftables":
        return ["ip:netproxy", "ip6:netproxy"]
    if combo.flavour == "nft":
        return ["ip:nat", "ip:filter", "ip6:nat", "ip6:filter"]
    return []


class WritesRefused:
    """While entered, every write of the combination's proxy in ``sandbox`` is refused by the kernel
    (nf_tables) or waits on the xtables lock (legacy).  Start the proxy with :attr:`env`."""

    def __init__(self, sandbox: Sandbox, combo: Combo, workdir: str) -> None:
        self.sandbox, self.combo = sandbox, combo
        self.tables = nf_tables_of(combo)
        self.lockfile = os.path.join(workdir, "xtables.lock")
        self.env: Dict[str, str] = {} if self.tables else {"XTABLES_LOCKFILE": self.lockfile}
        self._holder: Optional[subprocess.Popen[bytes]] = None
        self._lock_fd: Optional[int] = None

    def __enter__(self) -> WritesRefused:
        if not self.tables:
            self._lock_fd = os.open(self.lockfile, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            return self
        self._holder = self.sandbox.popen(self.sandbox.node, [sys.executable, "-m", "netproxy_lab.refuse",
                                                              *self.tables], stdout=subprocess.PIPE)
        out = self._holder.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], 15)
        line = out.readline().decode().strip() if ready else ""
        if line != "held":
            self.__exit__()
            raise RuntimeError(f"could not take {self.tables} in {self.sandbox.node}: {line or 'no answer'}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if self._holder is not None:
            stop_process(self._holder, timeout=5)  # its socket closes: the kernel drops the owned tables
            self._holder = None


def _take(spec: Sequence[Tuple[int, str]]) -> Any:
    """Delete each table (if there) and create it again owned by a socket kept open; that socket."""
    from netproxy.backends.nftables import wire
    from netproxy.backends.nftables.kernel.nlsocket import NetlinkError, NlSocket

    sock = NlSocket()
    for family, name in spec:
        with contextlib.suppress(NetlinkError):  # not there
            sock.send_batch([(wire.DELTABLE, 0, family, wire.string(wire.TABLE_NAME, name))])
    sock.send_batch([(wire.NEWTABLE, wire.NLM_F_CREATE, family,
                      wire.string(wire.TABLE_NAME, name) + wire.u32(wire.TABLE_FLAGS, NFT_TABLE_F_OWNER))
                     for family, name in spec])
    return sock


def main(argv: Sequence[str]) -> int:
    spec = []
    for item in argv:
        family, _, name = item.partition(":")
        if family not in _FAMILIES or not name:
            raise SystemExit(f"usage: python -m netproxy_lab.refuse FAMILY:TABLE ... ({item!r}?)")
        spec.append((_FAMILIES[family], name))
    sock = _take(spec)
    print("held", flush=True)
    try:
        select.select([], [], [])  # until stopped; the tables go with the socket
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
