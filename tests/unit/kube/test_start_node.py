"""`run --kubeconfig` in NodeCIDR mode reads its Node at start and waits for its pod CIDRs, as
kube-proxy does — but a Node that gets them a moment later is not waited for in 2-second steps."""

from __future__ import annotations

import argparse
import threading
import time

from kubernetes import client

from netproxy.node.nodeconfig import start_node
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import node


class _Source:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client


def test_a_node_whose_pod_cidrs_come_late_is_read_as_soon_as_they_come(api: ApiServer,
                                                                      api_client: client.ApiClient) -> None:
    args = argparse.Namespace(detect_local_mode="NodeCIDR", hostname_override="node-a", nodeport_addresses=())
    api.create("nodes", node("node-a"))  # registered; the node controller has not given it a pod CIDR yet

    def allocate() -> None:
        time.sleep(0.3)
        api.replace("nodes", {**node("node-a"), "spec": {"podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24"]}})

    threading.Thread(target=allocate, daemon=True).start()
    t0 = time.monotonic()
    info = start_node(args, _Source(api_client))
    took = time.monotonic() - t0
    assert info is not None and [str(c) for c in info.pod_cidrs] == ["10.244.3.0/24"]
    assert 0.3 <= took < 1.9, took  # polled after 0.1, 0.2, 0.4 s...: found by ~0.7 s; 2-s steps took >= 2 s
