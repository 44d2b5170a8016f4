"""Least privilege (the fault suite's item 8): the API token never reaches netproxy's logs.

`netproxy run --kubeconfig` (fake backend: no kernel) authenticates with a bearer token, inline or
from a tokenFile, against the stand-in, at --log-level debug, through 401s and 500s that make the
source log its failures; the token must appear nowhere in what it printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netproxy import cli
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import endpoint_slice, node, service

TOKEN = "np-test-token-5f1c0ffee-d0d0cafe"


def kubeconfig(path: Path, url: str, inline: bool) -> str:
    user = {"token": TOKEN} if inline else {"tokenFile": "token"}
    if not inline:
        (path.parent / "token").write_text(TOKEN + "\n")
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "c", "cluster": {"server": url}}], "users": [{"name": "u", "user": user}],
           "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path.write_text(json.dumps(doc))
    return str(path)


def watch_requests(api: ApiServer) -> int:
    with api.cond:
        return sum(q.get("watch") in ("true", "1") for _m, _p, q in api.requests)


@pytest.mark.parametrize("inline", [True, False], ids=["inline-token", "token-file"])
def test_the_token_never_reaches_the_logs(api: ApiServer, tmp_path: Path, inline: bool) -> None:
    api.create("services", service("web", "10.96.0.10"))
    api.create("endpointslices", endpoint_slice("web-a", "web", ["10.244.1.10"]))
    api.create("nodes", node("node-a"))
    api.fail_next(401, count=2)  # the source logs a refused list at error level
    api.fail_next(500, count=2)
    config = kubeconfig(tmp_path / "kubeconfig", api.url, inline)
    log = tmp_path / "run.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "netproxy.cli", "run", "--kubeconfig", config, "--backend",
                                 "fake", "--hostname-override", "node-a", "--metrics-bind-address", "",
                                 "--healthz-bind-address", "", "--log-level", "debug"],
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and "synced" not in log.read_text():
            time.sleep(0.2)
        # "synced" is logged once the lists are in: the watches open after them.  Wait for them (a
        # loaded machine opened fewer than three by then), then drop them.
        while time.monotonic() < deadline and watch_requests(api) < 3:
            time.sleep(0.1)
        # Dropped watches, logged as they reconnect: wait until every one was opened again (a fixed
        # sleep could end before the reconnects and their log lines, leaving nothing to look at).
        opened = watch_requests(api)
        dropped = api.drop_watches()
        assert dropped >= 3, "netproxy had not opened its watches"
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and watch_requests(api) < opened + dropped:
            time.sleep(0.1)
        assert watch_requests(api) >= opened + dropped, "the dropped watches were not opened again"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    out = log.read_text()
    assert api.authorizations == [f"Bearer {TOKEN}"], api.authorizations  # the token was used...
    assert "synced" in out, out[-3000:]
    assert "401" in out or "Unauthorized" in out, out[-3000:]  # ...failures were logged...
    assert out.count("watch failed") >= dropped, out[-3000:]  # ...so were the dropped watches...
    assert TOKEN not in out and TOKEN[:16] not in out, "the API token is in netproxy's log"  # ...not the token
    assert "Bearer" not in out


def test_metrics_bind_to_localhost_by_default() -> None:
    args = cli.build_parser().parse_args(["run", "--source", os.devnull])
    assert args.metrics_bind_address.startswith("127.0.0.1:")
