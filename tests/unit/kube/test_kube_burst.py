"""A burst of API events ends in a few syncs: the source, the tracker and the bounded-frequency runner
together, as `netproxy run` wires them."""

from __future__ import annotations

import threading
import time
from typing import List, Tuple

from kubernetes import client

from netproxy.core.model import ServicePortName
from netproxy.core.runner import BoundedFrequencyRunner
from netproxy.source.kube import KubeSource
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import FAST, RecordingTracker, endpoint_slice, service, wait_for

MIN_INTERVAL = 0.3


def test_burst_of_1000_events_is_coalesced(api: ApiServer, api_client: client.ApiClient) -> None:
    for i in range(50):
        api.create("services", service(f"svc{i}", f"10.0.0.{i + 1}"))
        api.create("endpointslices", endpoint_slice(f"svc{i}-a", f"svc{i}", [f"10.1.{i}.0"]))
    tracker = RecordingTracker()
    syncs: List[Tuple[float, int]] = []  # (time, service ports in the change set)

    def sync() -> None:
        if tracker.ready:
            _, changes = tracker.take()
            syncs.append((time.monotonic(), len(changes.services)))

    runner = BoundedFrequencyRunner(sync, min_interval=MIN_INTERVAL, max_interval=60)
    tracker.on_change = runner.request
    stop = threading.Event()
    loop = threading.Thread(target=runner.loop, args=(stop,), daemon=True)
    loop.start()
    source = KubeSource(api_client, "node-a", settings=FAST)
    source.start(tracker)
    try:
        wait_for(lambda: syncs, what="the first sync")
        assert api.wait_watchers("endpointslices")
        time.sleep(MIN_INTERVAL)  # let the initial sync's interval pass: the burst starts from quiet
        before = len(syncs)
        mark = len(tracker.named("update_endpoints"))
        t0 = time.monotonic()
        for n in range(1000):
            i = n % 50
            api.replace("endpointslices", endpoint_slice(f"svc{i}-a", f"svc{i}", [f"10.2.{i}.{n // 50}"]))
        wait_for(lambda: len(tracker.named("update_endpoints")) - mark == 1000, timeout=20, what="1000 events")
        wait_for(lambda: not tracker.pending() and len(syncs) > before, timeout=5, what="the last sync")
        elapsed = time.monotonic() - t0
        burst = syncs[before:]
        print(f"\n1000 events in {elapsed:.2f}s -> {len(burst)} syncs "
              f"(changed ports per sync: {[c for _, c in burst]})")
        # Never closer than min_interval, so at most one sync per interval of the burst (+1 at its start).
        assert len(burst) <= 2 + elapsed / MIN_INTERVAL
        assert len(burst) <= 20
        gaps = [b[0] - a[0] for a, b in zip(syncs[before - 1:], burst)]
        assert min(gaps) >= MIN_INTERVAL * 0.9
        # Nothing lost in coalescing: the last write of every service is what the tracker holds.
        snap, _ = tracker.take()
        for i in range(50):
            eps = snap.endpoints[ServicePortName("default", f"svc{i}", "http")]
            assert [str(e.ip) for e in eps] == [f"10.2.{i}.19"]
    finally:
        source.stop()
        stop.set()
        runner.wake()
        loop.join(5)
