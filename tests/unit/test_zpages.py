"""kube-proxy's z-pages beside /metrics: /configz (the effective KubeProxyConfiguration), /statusz,
/flagz and /proxyMode — from a real ``netproxy run`` (the in-memory backend: no kernel needed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Iterator, Tuple

import pytest

from netproxy import version
from netproxy.observe.zpages import go_duration
from netproxy_lab.cleanup import stop_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Tuple[str, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("zpages") / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "netproxy", "run", "--backend", "fake", "--source",
             os.path.join(REPO, "examples", "cluster.yaml"), "--hostname-override", "node-a",
             "--metrics-bind-address", f"127.0.0.1:{port}", "--healthz-bind-address", "",
             "--sync-period", "45s", "--conntrack-udp-timeout", "47s", "--masquerade-all"],
            stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _get(base + "/metrics")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(log.read_text()) from None
                time.sleep(0.1)
        yield base
    finally:
        stop_process(proc)


def test_configz_is_the_effective_kube_proxy_configuration(running: str) -> None:
    ctype, body = _get(running + "/configz")
    assert ctype == "application/json"
    doc: Any = json.loads(body)["kubeproxy.config.k8s.io"]
    assert (doc["apiVersion"], doc["kind"]) == ("kubeproxy.config.k8s.io/v1alpha1", "KubeProxyConfiguration")
    assert doc["mode"] == "fake" and doc["hostnameOverride"] == "node-a"
    assert doc["iptables"]["syncPeriod"] == doc["nftables"]["syncPeriod"] == "45s"
    assert doc["iptables"]["minSyncPeriod"] == "1s" and doc["iptables"]["masqueradeAll"] is True
    assert doc["conntrack"]["udpTimeout"] == "47s" and doc["conntrack"]["maxPerCore"] is None
    assert doc["metricsBindAddress"].startswith("127.0.0.1:")


def test_statusz_flagz_and_proxy_mode_in_kube_proxys_formats(running: str) -> None:
    ctype, status = _get(running + "/statusz")
    assert ctype.startswith("text/plain")
    lines = status.splitlines()
    assert lines[0].startswith("kube-proxy statusz") and lines[1].startswith("Warning: This endpoint is not meant")
    assert f"Binary version: {version()}" in lines and any(line.startswith("Up: 0 hr") for line in lines)
    assert "configz:/configz" in lines and "metrics:/metrics" in lines
    _, flags = _get(running + "/flagz")
    assert "sync-period=45.0" in flags.splitlines() and "masquerade-all=true" in flags.splitlines()
    assert "hostname-override=node-a" in flags.splitlines()
    assert _get(running + "/proxyMode")[1] == "fake"
    _, metrics = _get(running + "/metrics")  # /metrics is still prometheus_client's
    assert "kubeproxy_sync_proxy_rules_duration_seconds" in metrics


def test_go_durations() -> None:
    assert [go_duration(s) for s in (30, 1, 0.5, 90, 3600, 7200.5, 0)] == \
        ["30s", "1s", "500ms", "1m30s", "1h0m0s", "2h0m0.5s", "0s"]
