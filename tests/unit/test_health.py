"""/healthz and /livez as kube-proxy answers them (its proxierHealthServer), with an injected clock."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import List, Tuple

from netproxy.core.model import NodeInfo
from netproxy.observe.healthcheck import ProxyHealth
from netproxy.source.convert import parse_node

EPOCH = 1_700_000_000.0


def _health(timeout: float = 60) -> Tuple[ProxyHealth, List[float]]:
    now = [100.0]
    return ProxyHealth(timeout=timeout, clock=lambda: now[0], wall=lambda: EPOCH + now[0]), now


def test_healthy_while_starting_and_nothing_waits() -> None:
    health, now = _health()
    code, body = health.status("/healthz")
    assert code == 200 and body["nodeEligible"] is True
    assert body["lastUpdated"] == body["currentTime"], "a healthy answer says 'recent', as kube-proxy"
    now[0] += 10_000
    assert health.status()[0] == 200, "no change queued: the age of the last sync is not a fault"


def test_503_once_a_queued_change_waited_the_timeout_and_200_after_the_sync() -> None:
    health, now = _health(timeout=60)
    health.synced()
    health.queued()
    now[0] += 59.9
    assert health.status()[0] == 200
    health.queued()  # a later change does not move the oldest one
    now[0] += 0.1
    code, body = health.status()
    assert code == 503, "the oldest change has waited the whole timeout"
    assert body["lastUpdated"] == "2023-11-14T22:15:00.000000Z", "an unhealthy answer names the last sync"
    assert health.status("/livez")[0] == 503
    health.synced()
    assert health.status()[0] == 200 and health.status("/livez")[0] == 200


def test_a_node_being_deleted_fails_healthz_not_livez() -> None:
    health, _ = _health()
    deleting = {"metadata": {"name": "n1", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    tainted = {"metadata": {"name": "n1"},
               "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}
    other_taint = {"metadata": {"name": "n1"}, "spec": {"taints": [{"key": "node.kubernetes.io/unreachable"}]}}
    for obj in (deleting, tainted):
        health.sync_node(parse_node(obj, "n1"))
        code, body = health.status("/healthz")
        assert (code, body["nodeEligible"]) == (503, False), obj
        code, body = health.status("/livez")
        assert code == 200 and "nodeEligible" not in body, "livez is the proxier alone, as kube-proxy"
    health.sync_node(parse_node(other_taint, "n1"))
    assert health.status("/healthz")[0] == 200
    health.sync_node(NodeInfo("n1"))
    assert health.status("/healthz")[0] == 200


def test_served_answers_count_into_kube_proxys_counters() -> None:
    health, now = _health(timeout=1)
    health.serve("127.0.0.1:0")
    assert health.server is not None
    port = health.server.server_address[1]

    def get(path: str) -> Tuple[int, dict]:  # type: ignore[type-arg]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


    try:
        before = (_sample("kubeproxy_proxy_healthz_total", "200"), _sample("kubeproxy_proxy_livez_total", "503"))
        assert get("/healthz")[0] == 200
        health.queued()
        now[0] += 2
        code, body = get("/livez")
        assert code == 503 and set(body) == {"lastUpdated", "currentTime"}
        assert _sample("kubeproxy_proxy_healthz_total", "200") == before[0] + 1
        assert _sample("kubeproxy_proxy_livez_total", "503") == before[1] + 1
    finally:
        health.server.shutdown()
        health.server.server_close()


def _sample(name: str, code: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"code": code}) or 0.0
