"""An in-memory backend with real semantics, for unit tests of the core.

Like knftables' Fake: a sync applies all-or-nothing to an in-memory table, stale service ports are
removed, and the state can be dumped and asserted on.  ``fail_next`` makes the next sync raise a
:class:`SyncError` without changing the state, as a refused kernel write would.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from netproxy.backends.base import SyncError, SyncResult
from netproxy.core.config import ProxyConfig
from netproxy.core.endpoints import cluster_endpoints
from netproxy.core.model import Changes, Endpoint, ServicePort, ServicePortName, Snapshot

Entry = Tuple[ServicePort, Tuple[Endpoint, ...]]


class FakeBackend:
    name = "fake"

    def __init__(self, config: Optional[ProxyConfig] = None) -> None:
        self.config = config or ProxyConfig()
        self.state: Dict[ServicePortName, Entry] = {}
        self.syncs: List[Changes] = []
        self.fail_next: Optional[str] = None
        self.cleaned = False
        self.halted = False
        """Whether ``run`` was asked to stop (:meth:`halting`)."""
        self.tamper: Optional[str] = None
        """What the next :meth:`tampered` reports (unit tests play "someone flushed the rules")."""
        self.looks = 0

    def probe(self) -> None:
        return None

    def plan(self, snapshot: Snapshot) -> str:
        lines = []
        for name in snapshot.sorted_names():
            svc = snapshot.services[name]
            eps = cluster_endpoints(svc, snapshot.endpoints_of(name), snapshot.node)
            dests = " ".join(str(e) for e in eps) or "reject"
            for addr in svc.addresses():
                lines.append(f"{addr} {svc.protocol.lower()} {svc.port} -> {dests}  # {name}")
        return "\n".join(lines) + ("\n" if lines else "")

    def sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        self.syncs.append(changes)
        if self.fail_next is not None:
            line, self.fail_next = self.fail_next, None
            raise SyncError("fake kernel refused the write", line=line)
        desired = {n: (s, snapshot.endpoints_of(n)) for n, s in snapshot.services.items()}
        if changes.full:
            written = len(desired)
        else:
            written = sum(1 for n in set(desired) | set(self.state) if desired.get(n) != self.state.get(n))
        self.state = desired  # one assignment: all or nothing
        return SyncResult(full=changes.full, services_written=written)

    def cleanup(self) -> None:
        self.state = {}
        self.cleaned = True

    def missing_in_kernel(self) -> List[str]:
        return []  # its "kernel" is the state the last sync assigned, all or nothing

    def halting(self) -> None:
        self.halted = True

    def stopping(self) -> None:
        return None

    def tampered(self) -> Optional[str]:
        self.looks += 1
        reason, self.tamper = self.tamper, None
        return reason
