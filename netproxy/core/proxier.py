"""The proxier: takes snapshots from the tracker and hands them to the backend, one step at a time.

kube-proxy's syncProxyRules, split into named steps: decide whether this sync is full, take the
snapshot, write it, record the outcome.  It knows the backend only through the Backend protocol.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from netproxy import metrics
from netproxy.backends.base import Backend, BackendError, SyncResult
from netproxy.core.config import ProxyConfig
from netproxy.core.endpoints import no_local_kinds
from netproxy.core.model import Changes, Endpoint, NodeInfo, ServicePort, Snapshot
from netproxy.core.perport import AfterSync, Changed, Tally
from netproxy.core.tracker import ChangeTracker

log = logging.getLogger(__name__)

MIN_BACKOFF = 1.0


class Proxier:
    def __init__(self, tracker: ChangeTracker, backend: Backend, config: ProxyConfig,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time, *,
                 retry: Callable[[float], None] = lambda delay: None, request: Callable[[], None] = lambda: None,
                 health: Optional[Any] = None, after_sync: Sequence[AfterSync] = ()) -> None:
        self.tracker = tracker
        self.backend = backend
        self.config = config
        self.clock = clock
        self.wall = wall
        self._last_full: Optional[float] = None
        self._need_full = True  # at start: re-read the kernel and write everything
        self._failures = 0
        self.last_error: Optional[BackendError] = None
        self.last_result: Optional[SyncResult] = None
        self.retry = retry
        """Asks the runner for a sync after a delay: the back-off after a failed write."""
        self.request = request
        """Asks the runner for a sync soon: a repair."""
        self.after_sync: List[AfterSync] = list(after_sync)
        """Called with (previous, current snapshot, changed ports) after each successful sync: conntrack
        cleanup, health-check servers.  A failing hook is logged and does not fail the sync."""
        self._previous: Optional[Snapshot] = None
        self.health = health
        """The /healthz state (``netproxy run``): a sync that changes nothing still counts as synced."""
        self._no_local: Tally[Tuple[int, str]] = Tally(no_local_kinds)
        self._versions: Tally[int] = Tally(_versions)
        """The metrics' per-sync figures, kept from the changed ports only (core/perport.py)."""

    def sync(self) -> None:
        """One sync; the runner calls this.  Never raises for a kernel error: it schedules a retry."""
        if not self.tracker.ready:
            log.debug("not syncing yet: waiting for the first services and endpoints")
            return
        now = self.clock()
        full = self._need_full or self._last_full is None or now - self._last_full >= self.config.sync_period
        snapshot, changes = self._take()
        if not full and not changes.full and not changes.services:
            # The queued events changed nothing (a node update without news, a slice re-sent as is):
            # they are handled, so /healthz must not keep counting them as waiting.  Without this a
            # no-op event left healthz "pending" until the next full sync (503 if the timeout is shorter).
            if self.health is not None:
                self.health.synced()
            return
        full = full or changes.full
        start = time.perf_counter()
        try:
            self.last_result = self.backend.sync(snapshot, Changes(full=full, services=changes.services))
        except BackendError as err:  # a refused write, or e.g. a binary gone: retry either way
            metrics.record_failure(self.backend.name, full)
            self._failed(err)
            return
        elapsed = time.perf_counter() - start
        changed: Changed = None if full else changes.services
        self._record(snapshot, changed, elapsed)
        self._record_result(self.last_result)
        programmed = self.wall()
        for stamp in self.tracker.last_trigger_times:
            # From the EndpointSlice controller's trigger time to rules in the kernel; a stamp from
            # a clock ahead of ours would be negative, and kube-proxy's histogram has no such bucket.
            for family in metrics.families():
                metrics.NETWORK_PROGRAMMING.labels(family).observe(max(0.0, programmed - stamp))
        if full:
            self._last_full = now
            # A full sync leaves ~100k long-lived objects (snapshot, the backend's record); moving them
            # to the permanent generation keeps the next incremental sync from paying a GC pass over
            # them (measured: 15-40 ms spikes on a 1-endpoint change at 10k).  They are plain
            # refcounted objects, still freed when the next snapshot replaces them.
            gc.freeze()
        self._need_full = False
        self._failures = 0
        self.last_error = None
        log.info("synced %s: %d service ports (%d written) in %.3f s", "full" if full else "partial",
                 len(snapshot.services), self.last_result.services_written, elapsed)
        for hook in self.after_sync:
            try:
                hook(self._previous, snapshot, changed)
            except Exception:  # noqa: BLE001 - a hook must never stop the proxy from syncing
                log.exception("post-sync step %r failed", hook)
        self._previous = snapshot

    def _take(self) -> Tuple[Snapshot, Changes]:
        """The tracker's snapshot, built with the cyclic collector paused: after a 10k-service load
        it allocates ~200k objects (none in cycles), and the collector's passes over the loaded model
        while they piled up made ``run``'s first snapshot take twice a one-shot ``sync``'s."""
        was = gc.isenabled()
        gc.disable()
        try:
            return self.tracker.take()
        finally:
            if was:
                gc.enable()

    def check_tampering(self) -> Optional[str]:
        """Between syncs: ask the backend whether its rules were changed behind its back (a flush,
        a deleted table, an emptied chain); if so, count the repair and ask for a full sync now
        rather than at the next --sync-period.  Returns the reason, or None."""
        if self._need_full or self._last_full is None:
            return None  # nothing written yet, or a full sync is already due
        reason: Optional[str] = self.backend.tampered()
        if reason is None:
            return None
        metrics.REPAIRS.labels(reason).inc()
        log.warning("netproxy's rules were changed behind its back (%s): repairing with a full sync", reason)
        self._need_full = True
        self.request()
        return reason

    def _record(self, snapshot: Snapshot, changed: Changed, elapsed: float) -> None:
        """kube-proxy's metrics of one successful sync."""
        full = changed is None
        no_local = self._no_local.update(snapshot, changed)
        metrics.set_families(_families(self._versions.update(snapshot, changed)))
        for family in metrics.families():
            metrics.SYNC_DURATION.labels(family).observe(elapsed)
            (metrics.SYNC_FULL_DURATION if full else metrics.SYNC_PARTIAL_DURATION).labels(family).observe(elapsed)
            metrics.LAST_SYNC.labels(family).set_to_current_time()
            version = 6 if family == metrics.IPV6 else 4
            for policy in ("internal", "external"):
                metrics.NO_LOCAL_ENDPOINTS.labels(family, policy).set(no_local.get((version, policy), 0))
        metrics.SYNC_TOTAL.labels("ok").inc()
        metrics.LAST_DURATION.set(elapsed)
        metrics.SERVICES.set(len(snapshot.services))
        metrics.SERVICE_CHANGES_PENDING.set(0)
        metrics.ENDPOINT_CHANGES_PENDING.set(0)

    @staticmethod
    def _record_result(result: SyncResult) -> None:
        """What the backend reported of its own write (rule counts by table, when it keeps them)."""
        for family, table, count in result.rules_owned:
            metrics.IPTABLES_RULES.labels(family, table).set(count)
        for family, table, count in result.rules_written:
            metrics.IPTABLES_RULES_LAST.labels(family, table).set(count)

    def _failed(self, err: BackendError) -> None:
        # The backend left the previous ruleset in place; the changes taken from the tracker are not
        # lost because the next sync is full.
        self._need_full = True
        self._failures += 1
        self.last_error = err
        metrics.SYNC_TOTAL.labels("error").inc()
        delay = min(self.config.sync_period, MIN_BACKOFF * 2 ** (self._failures - 1))
        log.error("sync failed (attempt %d), retrying in %.1f s: %s", self._failures, delay, err)
        self.retry(delay)


def _versions(svc: ServicePort, endpoints: Tuple[Endpoint, ...], node: NodeInfo) -> Optional[Tuple[int, ...]]:
    """The IP versions of a service port's cluster IPs."""
    return tuple(sorted({a.version for a in svc.cluster_ips})) or None


def _families(versions: Dict[int, int]) -> Tuple[str, ...]:
    """The families of the service addresses (``versions``: service ports per IP version; IPv4 when
    there are none)."""
    if versions.get(6):
        return (metrics.IPV4, metrics.IPV6) if versions.get(4) else (metrics.IPV6,)
    return (metrics.IPV4,)
