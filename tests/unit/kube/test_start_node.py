"""`run --kubeconfig` in NodeCIDR mode reads its Node at start and waits for its pod CIDRs, as
kube-proxy does — but a Node that gets them a moment later is not waited for in 2-second steps."""

from __future__ import annotations

import argparse
import types

import pytest
from kubernetes import client

from netproxy.node import nodeconfig
from netproxy.node.nodeconfig import start_node
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import node


class _Source:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client


def test_a_node_whose_pod_cidrs_come_late_is_read_as_soon_as_they_come(api: ApiServer, api_client: client.ApiClient,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On start_node's own clock, not the machine's: its waits advance a fake clock, and the node
    controller allocates the pod CIDR when that clock passes 0.3 s.  Polled after 0.1, 0.2, 0.4 s...,
    the CIDR is found at 0.7 s; waits in 2-second steps would find it at 2 s.  (Measured with the real
    clock, a loaded machine made a correct 0.7 s take longer than the bound.)"""
    args = argparse.Namespace(detect_local_mode="NodeCIDR", hostname_override="node-a", nodeport_addresses=())
    api.create("nodes", node("node-a"))  # registered; the node controller has not given it a pod CIDR yet
    now = [0.0]

    def sleep(seconds: float) -> None:
        before, now[0] = now[0], now[0] + seconds
        if before < 0.3 <= now[0]:  # the node controller's allocation, done before the next read
            api.replace("nodes", {**node("node-a"), "spec": {"podCIDR": "10.244.3.0/24",
                                                             "podCIDRs": ["10.244.3.0/24"]}})

    monkeypatch.setattr(nodeconfig, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    info = start_node(args, _Source(api_client))
    assert info is not None and [str(c) for c in info.pod_cidrs] == ["10.244.3.0/24"]
    assert 0.3 <= now[0] <= 0.8, now[0]  # found at the first read after 0.3 s (0.7 s); 2-s steps: 2 s
