"""Per-port values kept from the changed ports (core/perport.py) equal the same values computed
from every port, through random sequences of real tracker changes."""

from __future__ import annotations

import dataclasses
import ipaddress
import random
from typing import Dict, FrozenSet, Optional, Tuple

import pytest

from netproxy.core.endpoints import no_local_endpoints, no_local_kinds
from netproxy.core.model import Endpoint, EndpointSet, NodeInfo, ServicePort, ServicePortName, SlicePort, Snapshot
from netproxy.core.perport import PerPort, Tally
from netproxy.core.tracker import ChangeTracker
from netproxy.node.localports import PortTargets, merged, port_targets, targets
from netproxy_lab.manifests import service_port

NODES = ("node-a", "node-b")


def _service(rng: random.Random, i: int) -> Tuple[ServicePort, ...]:
    v6 = rng.random() < 0.3
    port = service_port(f"s{i}", port_name="", cluster_ip=f"fd00::{i + 1:x}" if v6 else f"10.96.0.{i + 1}",
                        protocol=rng.choice(("TCP", "UDP")), node_port=30000 + i if rng.random() < 0.5 else 0)
    return (dataclasses.replace(port, internal_traffic_policy=rng.choice(("Cluster", "Local")),
                                external_traffic_policy=rng.choice(("Cluster", "Local"))),)


def _slice(rng: random.Random, i: int, v6: bool) -> EndpointSet:
    eps = tuple(Endpoint(ipaddress.ip_address(f"fd00:1::{i}:{j + 1:x}" if v6 else f"10.244.{i}.{j + 1}"), 0,
                         ready=rng.random() < 0.8, node_name=rng.choice(NODES))
                for j in range(rng.randrange(0, 4)))
    return EndpointSet("default", f"s{i}", (SlicePort("", "TCP", 8080),), eps)


def _full(snapshot: Snapshot) -> Dict[object, object]:
    """Every port's value, computed from all of them (what the kept values must equal)."""
    out: Dict[object, object] = {}
    for name, svc in snapshot.services.items():
        value = no_local_kinds(svc, snapshot.endpoints_of(name), snapshot.node)
        if value is not None:
            out[name] = value
    return out


@pytest.mark.parametrize("seed", range(8))
def test_values_kept_from_changes_equal_values_from_every_port(seed: int) -> None:
    rng = random.Random(seed)
    tracker = ChangeTracker(NodeInfo(name="node-a"))
    ports: PerPort[Tuple[Tuple[int, str], ...]] = PerPort(no_local_kinds)
    tally: Tally[Tuple[int, str]] = Tally(no_local_kinds)
    relay: PerPort[PortTargets] = PerPort(lambda svc, eps, node: port_targets(svc, eps, node, (4, 6)))
    v6: Dict[int, bool] = {}
    partial = 0
    for step in range(60):
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(12)
            roll = rng.random()
            if roll < 0.35:
                ports_of = _service(rng, i)
                v6[i] = ports_of[0].cluster_ips[0].version == 6
                tracker.update_service("default", f"s{i}", ports_of)
            elif roll < 0.45:
                tracker.update_service("default", f"s{i}", None)
            elif roll < 0.9:
                tracker.update_endpoints("default", f"s{i}-a", _slice(rng, i, v6.get(i, False)))
            elif roll < 0.95:
                tracker.update_endpoints("default", f"s{i}-a", None)
            else:  # the node moves: every port's locality may change (the tracker says full)
                tracker.set_node(NodeInfo(name=rng.choice(NODES)))
        snapshot, changes = tracker.take()
        changed: Optional[FrozenSet[ServicePortName]] = None if changes.full or step % 17 == 0 else changes.services
        partial += changed is not None
        ports.update(snapshot, changed)
        counts = tally.update(snapshot, changed)
        relay.update(snapshot, changed)
        assert ports.values == _full(snapshot), f"seed {seed}, step {step}"
        assert counts == no_local_endpoints(snapshot), f"seed {seed}, step {step}"
        assert merged(relay.values.values()) == targets(snapshot, (4, 6)), f"seed {seed}, step {step}"
    assert partial > 30  # most steps were kept from the changes, not recomputed


def test_a_changed_node_recomputes_every_port_even_when_told_only_some_changed() -> None:
    calls = []

    def derive(svc: ServicePort, eps: Tuple[Endpoint, ...], node: NodeInfo) -> Optional[str]:
        calls.append(svc.name)
        return node.name

    tracker = ChangeTracker(NodeInfo(name="node-a"))
    for i in range(3):
        port = service_port(f"s{i}", port_name="", cluster_ip=f"10.96.0.{i + 1}")
        tracker.update_service("default", f"s{i}", (port,))
    kept: PerPort[str] = PerPort(derive)
    snapshot, _ = tracker.take()
    kept.update(snapshot, frozenset())  # nothing derived yet: every port, whatever it is told
    assert len(calls) == 3 and set(kept.values.values()) == {"node-a"}
    kept.update(snapshot, frozenset())
    assert len(calls) == 3  # told nothing changed, same node: nothing asked again
    moved = dataclasses.replace(snapshot, node=NodeInfo(name="node-b"))
    diff = kept.update(moved, frozenset())
    assert len(calls) == 6 and set(kept.values.values()) == {"node-b"} and len(diff) == 3
