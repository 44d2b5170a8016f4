"""The one-shot commands read the cluster from the API as `run` does: `plan --kubeconfig` prints what
`plan --source` prints for the same objects (kube-proxy's informer filter included), `sync --kubeconfig`
writes it, and an API that cannot be listed is named, with exit 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from netproxy import cli
from netproxy_lab.apiserver import ApiServer
from netproxy_lab.apiserver_process import write_kubeconfig
from tests.unit.kube.kube_helpers import endpoint_slice, node, service

FAKE = ["--backend", "fake", "--iptables-flavour", "legacy", "--hostname-override", "node-a"]


def _cluster(api: ApiServer) -> List[Dict[str, Any]]:
    """Objects in the stand-in; the same objects, with their kinds, as a manifest list."""
    objects = [("services", service("web", "10.96.0.10")),
               ("endpointslices", endpoint_slice("web-a", "web", ["10.1.0.1", "10.1.0.2"])),
               ("services", service("db", "10.96.0.11", port=5432)),
               ("endpointslices", endpoint_slice("db-a", "db", ["10.1.0.3"], port=5432)),
               # Another proxy's service: neither path programs it.
               ("services", {**service("mesh", "10.96.0.12"),
                             "metadata": {"name": "mesh", "namespace": "default",
                                          "labels": {"service.kubernetes.io/service-proxy-name": "other"}}}),
               ("nodes", node("node-a", zone="z1"))]
    kinds = {"services": "Service", "endpointslices": "EndpointSlice", "nodes": "Node"}
    out = []
    for plural, obj in objects:
        api.create(plural, json.loads(json.dumps(obj)))
        out.append({"kind": kinds[plural], **obj})
    return out


def test_plan_from_the_api_is_the_plan_of_the_same_manifests(api: ApiServer, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    manifests = tmp_path / "cluster.json"
    manifests.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": _cluster(api)}))
    kubeconfig = write_kubeconfig(str(tmp_path / "kubeconfig"), api.url)
    assert cli.main(["plan", "--source", str(manifests), *FAKE]) == 0
    from_file = capsys.readouterr().out
    assert cli.main(["plan", "--kubeconfig", kubeconfig, *FAKE]) == 0
    from_api = capsys.readouterr().out
    assert "web" in from_api and "db" in from_api and "mesh" not in from_api
    assert from_api == from_file
    # The lists carried kube-proxy's informer selector, as run's do.
    selectors = {q.get("labelSelector") for _, path, q in api.requests if path.endswith("/services")}
    assert selectors == {"!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"}


def test_sync_from_the_api_writes_and_a_missing_servicecidr_api_is_not_an_error(
        api: ApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _cluster(api)
    api.store.unserved["servicecidrs"] = 404  # an older server
    kubeconfig = write_kubeconfig(str(tmp_path / "kubeconfig"), api.url)
    assert cli.main(["sync", "--kubeconfig", kubeconfig, *FAKE]) == 0
    assert cli.main(["trace", "--kubeconfig", kubeconfig, "--to", "10.96.0.10:80", "--backend", "nftables",
                     "--hostname-override", "node-a"]) == 0
    assert "10.1.0.1" in capsys.readouterr().out


def test_an_api_that_cannot_be_listed_is_named_and_exits_1(api: ApiServer, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _cluster(api)
    api.store.unserved["endpointslices"] = 403  # RBAC without endpointslices: nothing can be programmed
    kubeconfig = write_kubeconfig(str(tmp_path / "kubeconfig"), api.url)
    assert cli.main(["plan", "--kubeconfig", kubeconfig, *FAKE]) == 1
    err = capsys.readouterr().err
    assert "listing EndpointSlice failed" in err and "403" in err
