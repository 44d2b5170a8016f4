"""The one place that builds netproxy's objects and joins them: the backend (every command) and
``netproxy run``'s graph — tracker, proxier, runner, /metrics, /healthz, the service health-check
servers, the conntrack reconciler — from one ProxyConfig, each collaborator passed to its
constructor.  The CLI parses flags into that ProxyConfig and starts what this returns."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

from netproxy import backends
from netproxy.backends.base import Backend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import NodeInfo, Snapshot
from netproxy.core.perport import AfterSync, Changed
from netproxy.core.tracker import ChangeTracker
from netproxy.source.base import Source

if TYPE_CHECKING:  # imported where built: the proxier pulls in prometheus_client, which only `run` needs
    from netproxy.core.proxier import Proxier
    from netproxy.core.runner import BoundedFrequencyRunner
    from netproxy.node.localports import LocalhostNodePorts
    from netproxy.node.nodeaddr import NodeAddressWatcher
    from netproxy.observe.healthcheck import ProxyHealth
    from netproxy.observe.zpages import Page

log = logging.getLogger(__name__)


def new_backend(name: str, config: ProxyConfig,
                lock_waits: Optional[Callable[[float], None]] = None) -> Backend:
    """The backend called ``name``: every command constructs its backend here.  ``lock_waits`` is
    told each wait for the xtables lock (the iptables backend only; ``run`` gives its histogram)."""
    backend = backends.create(name, config)
    if lock_waits is not None and hasattr(backend, "on_lock_wait"):
        # The iptables backend's constructor takes no hook yet: its one seam is this attribute,
        # set here and nowhere else, before the backend is used.
        backend.on_lock_wait = lock_waits
    return backend


def is_kernel(backend: Backend) -> bool:
    """Whether the backend programs this namespace's kernel (the in-memory test backend does not:
    conntrack and sysctls are then left alone)."""
    return bool(backend.name != "fake")


class QueuedChanges:
    """A change reached the tracker: kube-proxy's queued-change metrics and /healthz's clock, then a
    sync is asked for.  Keeps the tracker's counts already added to the counters (they only grow)."""

    def __init__(self, tracker: ChangeTracker, health: ProxyHealth, request: Callable[[], None]) -> None:
        self.tracker = tracker
        self.health = health
        self.request = request
        self.counted = (0, 0, 0)
        """The tracker's (service, endpoint, rejected) counts already added to the metrics."""

    def __call__(self) -> None:
        from netproxy import metrics

        tracker = self.tracker
        services, endpoints = tracker.pending_changes()
        for family in metrics.families():
            metrics.LAST_QUEUED.labels(family).set_to_current_time()
        metrics.SERVICE_CHANGES_PENDING.set(services)
        metrics.ENDPOINT_CHANGES_PENDING.set(endpoints)
        seen = self.counted
        metrics.SERVICE_CHANGES.inc(tracker.service_changes - seen[0])
        metrics.ENDPOINT_CHANGES.inc(tracker.endpoint_changes - seen[1])
        metrics.REJECTED.inc(tracker.rejected - seen[2])
        self.counted = (tracker.service_changes, tracker.endpoint_changes, tracker.rejected)
        self.health.queued()
        self.request()


@dataclass
class Proxy:
    """``netproxy run``'s objects, built and joined; :meth:`start` opens the servers and the
    source, ``runner.loop(stop)`` runs it, :meth:`close` ends the source's and watcher's threads."""

    config: ProxyConfig
    backend: Backend
    source: Source
    tracker: ChangeTracker
    proxier: Proxier
    runner: BoundedFrequencyRunner
    health: ProxyHealth
    stop: threading.Event = field(default_factory=threading.Event)
    failures: List[str] = field(default_factory=list)
    """Why the proxy stopped on its own (exit 1), e.g. the Node's pod CIDRs changed."""
    watcher: Optional[NodeAddressWatcher] = None
    relay: Optional[LocalhostNodePorts] = None
    """NodePorts on localhost in nftables mode (netproxy/node/localports.py)."""
    zpages: Dict[str, Page] = field(default_factory=dict)
    """kube-proxy's /statusz, /flagz, /configz and /proxyMode beside /metrics (netproxy/observe/zpages.py)."""

    def start(self) -> None:
        from netproxy import metrics
        from netproxy.observe import zpages

        config, backend = self.config, self.backend
        self.health.serve(config.healthz_bind_address)
        metrics.set_families(metrics.families())  # the IPv4 series exist before the first sync
        zpages.serve(config.metrics_bind_address, self.zpages)
        metrics.BACKEND.labels(backend.name, writer(config, backend.name, "")).set(1)
        if self.relay is not None:
            self.relay.start()
        self.source.start(self.tracker)
        if self.watcher is not None:
            self.watcher.start(self.tracker)

    def halt(self) -> None:
        """Ask the loop to end (a signal, or a reason in ``failures``)."""
        self.stop.set()
        self.backend.halting()  # a sync waiting for a lock gives up: the loop can see the stop
        self.runner.wake()

    def close(self) -> None:
        self.backend.stopping()
        self.source.stop()
        if self.watcher is not None:
            self.watcher.stop()
        if self.relay is not None:
            self.relay.close()


def writer(config: ProxyConfig, backend: str, other: str = "-") -> str:
    """The writer the backend ``backend`` uses under ``config`` (``other`` for a backend without one)."""
    return {"nftables": config.nftables_writer, "iptables": config.iptables_writer}.get(backend, other)


def build_proxy(config: ProxyConfig, backend: Backend, source: Source) -> Proxy:
    """``netproxy run``'s graph, every piece given its collaborators when it is made."""
    from netproxy.core.proxier import Proxier
    from netproxy.core.runner import BoundedFrequencyRunner
    from netproxy.node.conntrack import Reconciler
    from netproxy.node.nodeaddr import NodeAddressWatcher
    from netproxy.observe.healthcheck import ProxyHealth, ServiceHealthServers

    health = ProxyHealth(2 * config.sync_period)  # kube-proxy's healthz timeout
    services = ServiceHealthServers(health=health)
    hooks: List[AfterSync] = []
    if is_kernel(backend):
        hooks.append(Reconciler(period=config.sync_period).after_sync)
    hooks += [_leftovers_once(backend, config), lambda prev, cur, changed: services.update(cur, changed),
              lambda prev, cur, changed: health.synced(), lambda prev, cur, changed: health.sync_node(cur.node)]
    # The runner calls the proxier and the proxier asks the runner for syncs: the runner is made
    # first and reaches the proxier through these two calls, bound once the proxier exists.
    runner = BoundedFrequencyRunner(lambda: proxier.sync(), config.min_sync_period, config.sync_period,
                                    idle=lambda: proxier.check_tampering(), ready=lambda: tracker.ready)
    tracker = ChangeTracker(NodeInfo(name=config.hostname),  # ETP/ITP Local need the node name from the start
                            on_change=lambda: queued(), service_cidrs=config.service_cidrs,
                            external_ips=config.gate("AllowServiceExternalIPs"))
    queued = QueuedChanges(tracker, health, runner.request)
    proxier = Proxier(tracker, backend, config, retry=runner.retry_after, request=runner.request,
                      health=health, after_sync=hooks)
    watcher = NodeAddressWatcher(config.nodeport_addresses) if config.nodeport_addresses else None
    if watcher is not None:
        tracker.expect_node_addresses()
    relay = _localhost_relay(config, backend)
    if relay is not None:
        proxier.after_sync.append(lambda prev, cur, changed: relay.update(cur, changed))
    proxy = Proxy(config, backend, source, tracker, proxier, runner, health, watcher=watcher, relay=relay)
    if config.detect_local_mode == "NodeCIDR":
        proxier.after_sync.append(_pod_cidrs_kept(proxy))
    return proxy


def _localhost_relay(config: ProxyConfig, backend: Backend) -> Optional[LocalhostNodePorts]:
    """kube-proxy's nftables-mode NodePorts on 127.0.0.1 and ::1 (a userspace relay), when
    --nodeport-addresses covers them; the iptables backend DNATs them itself (route_localnet)."""
    from netproxy.node.localports import LocalhostNodePorts, families_served

    families = families_served(config.nodeport_addresses)
    wanted = config.gate("KubeProxyNFTablesLocalhostNodePorts")
    return LocalhostNodePorts(families) if backend.name == "nftables" and families and wanted else None


def _pod_cidrs_kept(proxy: Proxy) -> AfterSync:
    """The rules were written for the pod CIDRs read at start; kube-proxy exits when they change
    (its NodeManager) so that it starts again with the new ones: so does netproxy."""
    kept = proxy.config.node_pod_cidrs

    def check(prev: Optional[Snapshot], cur: Snapshot, changed: Changed) -> None:
        if cur.node.pod_cidrs and cur.node.pod_cidrs != kept:
            proxy.failures.append(f"the Node's spec.podCIDRs changed from {', '.join(map(str, kept))} "
                                  f"to {', '.join(map(str, cur.node.pod_cidrs))}: exiting to start again with them")
            proxy.halt()

    return check


def _leftovers_once(backend: Backend, config: ProxyConfig) -> AfterSync:
    """After the first successful sync (a full one: the new ruleset is complete), remove the rules of
    the other dataplane left by an earlier run (netproxy's or kube-proxy's) — ``netproxy migrate``'s
    order, at start-up."""
    done = [False]

    def step(prev: Optional[Snapshot], cur: Snapshot, changed: Changed) -> None:
        if done[0] or backend.name not in ("iptables", "nftables"):
            return
        done[0] = True
        from netproxy.migration import migrate

        migrate.remove_leftovers(backend, config)

    return step
