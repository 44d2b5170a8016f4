"""Endpoint eligibility for kube-proxy parity (docs/parity.md), pure: ``netproxy/core/endpoints.py``.

The kernel suite (tests/kernel/test_parity.py) checks these behaviours through both backends; here
the rules themselves, case by case, and the file source turning the same manifests (EndpointSlice
conditions, zones and hints, ``kind: Node``) into what they rule on.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from netproxy.core.endpoints import cluster_endpoints, external_endpoints, local_endpoints, usable
from netproxy.core.model import Endpoint, NodeInfo, ServicePort
from netproxy.source.files import load
from netproxy_lab.manifests import service_port

HERE, THERE = "node-a", "node-b"
NODE = NodeInfo(name=HERE, zone="zone-a")


def svc(**kw: Any) -> ServicePort:
    return service_port(**kw)


def ep(last: int, *, ready: bool = True, serving: Optional[bool] = None, terminating: bool = False,
       node: Optional[str] = HERE, zone: Optional[str] = None, hints: Tuple[str, ...] = (),
       nodes: Tuple[str, ...] = ()) -> Endpoint:
    return Endpoint(ipaddress.ip_address(f"10.244.1.{last}"), 8080, ready=ready,
                    serving=ready if serving is None else serving, terminating=terminating, node_name=node,
                    zone=zone, zone_hints=hints, node_hints=nodes)


def ips(endpoints: Sequence[Endpoint]) -> set:  # type: ignore[type-arg]
    return {int(str(e.ip).rsplit(".", 1)[1]) for e in endpoints}


# ---- terminating endpoints ---------------------------------------------------------------------


def test_ready_endpoints_win_over_terminating_ones() -> None:
    eps = [ep(10, ready=False, serving=True, terminating=True), ep(11)]
    assert ips(usable(eps)) == {11}
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {11}


def test_serving_terminating_endpoints_used_when_none_is_ready() -> None:
    eps = [ep(10, ready=False, serving=True, terminating=True), ep(11, ready=False, serving=False, terminating=True),
           ep(12, ready=False, serving=False)]
    assert ips(usable(eps)) == {10}
    assert ips(external_endpoints(svc(), eps, NODE)) == {10}


def test_nothing_serving_means_no_endpoints() -> None:
    eps = [ep(10, ready=False, serving=False, terminating=True), ep(11, ready=False)]
    assert usable(eps) == ()
    assert cluster_endpoints(svc(), eps, NODE) == ()


# ---- traffic policies --------------------------------------------------------------------------


def test_etp_local_limits_external_traffic_only() -> None:
    eps = [ep(10), ep(11, node=THERE), ep(12, node=None)]
    policy = svc(external_traffic_policy="Local")
    assert ips(external_endpoints(policy, eps, NODE)) == {10}
    assert ips(cluster_endpoints(policy, eps, NODE)) == {10, 11, 12}


def test_itp_local_limits_cluster_traffic_only() -> None:
    eps = [ep(10), ep(11, node=THERE)]
    policy = svc(internal_traffic_policy="Local")
    assert ips(cluster_endpoints(policy, eps, NODE)) == {10}
    assert ips(external_endpoints(policy, eps, NODE)) == {10, 11}


def test_local_policy_without_local_endpoints_is_empty() -> None:
    eps = [ep(10, node=THERE), ep(11, node=THERE)]
    assert external_endpoints(svc(external_traffic_policy="Local"), eps, NODE) == ()
    assert cluster_endpoints(svc(internal_traffic_policy="Local"), eps, NODE) == ()


def test_local_endpoints_fall_back_to_local_terminating_ones() -> None:
    """Ready remote endpoints do not hide this node's serving-terminating ones (kube-proxy categorises per set)."""
    eps = [ep(10, ready=False, serving=True, terminating=True), ep(11, node=THERE)]
    assert ips(local_endpoints(eps, NODE)) == {10}


def test_no_node_name_means_no_local_endpoints() -> None:
    """A proxy that does not know its node name cannot call any endpoint local."""
    assert local_endpoints([ep(10)], NodeInfo()) == ()


# ---- topology ----------------------------------------------------------------------------------

ZONED = [ep(10, zone="zone-a"), ep(11, zone="zone-b", node=THERE), ep(12, zone="zone-a", node=THERE)]


def test_prefer_close_keeps_cluster_traffic_in_this_zone() -> None:
    assert ips(cluster_endpoints(svc(traffic_distribution="PreferClose"), ZONED, NODE)) == {10, 12}


def test_without_prefer_close_zones_alone_do_nothing() -> None:
    assert ips(cluster_endpoints(svc(), ZONED, NODE)) == {10, 11, 12}


def test_zone_hints_win_over_the_endpoints_own_zone() -> None:
    eps = [ep(10, zone="zone-a", hints=("zone-b",)), ep(11, zone="zone-b", hints=("zone-a",)),
           ep(12, zone="zone-b", hints=("zone-b",))]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {11}


def test_all_endpoints_when_none_is_for_this_zone() -> None:
    eps = [ep(10, zone="zone-b"), ep(11, zone="zone-c")]
    assert ips(cluster_endpoints(svc(traffic_distribution="PreferClose"), eps, NODE)) == {10, 11}


def test_hints_ignored_unless_every_endpoint_has_them() -> None:
    eps = [ep(10, hints=("zone-a",)), ep(11, zone="zone-b")]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {10, 11}


def test_topology_needs_the_nodes_zone() -> None:
    assert ips(cluster_endpoints(svc(traffic_distribution="PreferClose"), ZONED, NodeInfo(name=HERE))) == {
        10, 11, 12}


def test_topology_applies_to_external_traffic_with_etp_cluster() -> None:
    assert ips(external_endpoints(svc(traffic_distribution="PreferClose"), ZONED, NODE)) == {10, 12}


def test_zone_hints_of_not_ready_endpoints_do_not_count() -> None:
    """kube-proxy's topologyModeFromHints looks at ready endpoints only: a not-ready endpoint without
    hints does not switch topology off."""
    eps = [ep(10, hints=("zone-a",)), ep(11, hints=("zone-b",)), ep(12, ready=False, serving=False)]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {10}


def test_no_topology_for_terminating_endpoints() -> None:
    """Without a ready endpoint there is no topology mode: every serving-terminating endpoint,
    whatever its hints (kube-proxy falls back after choosing the mode from ready ones)."""
    eps = [ep(10, ready=False, serving=True, terminating=True, hints=("zone-b",)),
           ep(11, ready=False, serving=True, terminating=True, hints=("zone-a",))]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {10, 11}


# ---- PreferSameNode (hints.forNodes, KEP-3015) ---------------------------------------------------


def test_node_hints_keep_cluster_traffic_on_this_node() -> None:
    eps = [ep(10, nodes=(HERE,), hints=("zone-a",)), ep(11, node=THERE, nodes=(THERE,), hints=("zone-a",)),
           ep(12, node=THERE, nodes=(THERE,), hints=("zone-b",))]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {10}
    assert ips(external_endpoints(svc(), eps, NODE)) == {10}


def test_node_hints_win_over_the_endpoints_own_node() -> None:
    """Hints are what the controller decided: an endpoint elsewhere hinted for this node serves it."""
    eps = [ep(10, nodes=(THERE,)), ep(11, node=THERE, nodes=(HERE, THERE))]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {11}


def test_node_hints_for_other_nodes_only_fall_back_to_the_zone() -> None:
    eps = [ep(10, node=THERE, nodes=(THERE,), hints=("zone-a",)),
           ep(11, node="node-c", nodes=("node-c",), hints=("zone-b",))]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {10}


def test_partial_node_hints_fall_back_to_the_zone() -> None:
    """One ready endpoint without a node hint switches the node level off, not the zone level."""
    eps = [ep(10, nodes=(HERE,), hints=("zone-b",)), ep(11, node=THERE, hints=("zone-a",)),
           ep(12, node=THERE, nodes=(THERE,), hints=("zone-a",))]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {11, 12}


def test_partial_node_and_zone_hints_mean_every_endpoint() -> None:
    eps = [ep(10, nodes=(HERE,)), ep(11, node=THERE, hints=("zone-a",))]
    assert ips(cluster_endpoints(svc(), eps, NODE)) == {10, 11}


def test_node_hints_need_the_nodes_name() -> None:
    eps = [ep(10, nodes=(HERE,)), ep(11, node=THERE, nodes=(THERE,))]
    assert ips(cluster_endpoints(svc(), eps, NodeInfo(zone="zone-a"))) == {10, 11}


def test_node_hints_without_a_zone_label() -> None:
    """The node level needs no zone: kube-proxy checks it first, with the node name alone."""
    eps = [ep(10, nodes=(HERE,)), ep(11, node=THERE, nodes=(THERE,))]
    assert ips(cluster_endpoints(svc(), eps, NodeInfo(name=HERE))) == {10}


SPREAD = [ep(10, zone="zone-a"), ep(11, node=THERE, zone="zone-a"), ep(12, node=THERE, zone="zone-b")]


def test_prefer_same_node_without_hints_means_this_nodes_endpoints() -> None:
    """The file source has no EndpointSlice controller: PreferSameNode hints each endpoint for its
    own node and zone, as the controller's preferCloseHeuristic would."""
    assert ips(cluster_endpoints(svc(traffic_distribution="PreferSameNode"), SPREAD, NODE)) == {10}


def test_prefer_same_node_falls_back_to_the_zone_then_everything() -> None:
    elsewhere = [e for e in SPREAD if e.node_name == THERE]
    assert ips(cluster_endpoints(svc(traffic_distribution="PreferSameNode"), elsewhere, NODE)) == {11}
    far = [ep(12, node=THERE, zone="zone-b"), ep(13, node=THERE, zone="zone-c")]
    assert ips(cluster_endpoints(svc(traffic_distribution="PreferSameNode"), far, NODE)) == {12, 13}


def test_prefer_same_zone_is_prefer_close() -> None:
    for distribution in ("PreferSameZone", "PreferClose"):
        assert ips(cluster_endpoints(svc(traffic_distribution=distribution), SPREAD, NODE)) == {10, 11}


def test_prefer_same_node_with_itp_local_is_local() -> None:
    policy = svc(traffic_distribution="PreferSameNode", internal_traffic_policy="Local")
    assert ips(cluster_endpoints(policy, SPREAD, NODE)) == {10}
    assert cluster_endpoints(policy, SPREAD[1:], NODE) == ()


# ---- the manifests the kernel suite writes mean the above -------------------------------------


def _manifests(tmp_path: Path, *objects: Dict[str, Any]) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text("".join("---\n" + json.dumps(o) + "\n" for o in objects))
    return str(path)


def test_file_source_reads_node_zone_conditions_and_hints(tmp_path: Path) -> None:
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": HERE, "labels": {"topology.kubernetes.io/zone": "zone-a"}}}
    other = {"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": THERE, "labels": {"topology.kubernetes.io/zone": "zone-z"}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
               "spec": {"clusterIP": "10.96.0.10", "trafficDistribution": "PreferClose",
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}}
    eps = [
        {"addresses": ["10.244.1.10"], "nodeName": HERE, "zone": "zone-a",
         "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": ["10.244.1.11"], "nodeName": THERE, "zone": "zone-b",
         "hints": {"forZones": [{"name": "zone-a"}]},
         "conditions": {"ready": True, "serving": True, "terminating": False}},
    ]
    slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
              "metadata": {"name": "web-a", "namespace": "default",
                           "labels": {"kubernetes.io/service-name": "web"}},
              "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
              "endpoints": eps}
    loaded = load(_manifests(tmp_path, other, node, service, slice_), HERE)
    assert loaded.errors == []
    assert loaded.node is not None and (loaded.node.name, loaded.node.zone) == (HERE, "zone-a")
    ((port,),) = loaded.services.values()
    assert port.traffic_distribution == "PreferClose"
    (slice_eps,) = loaded.endpoints.values()
    got = {str(e.ip): (e.ready, e.serving, e.terminating, e.node_name, e.zone, e.zone_hints)
           for e in slice_eps.for_port("http", "TCP")}
    assert got == {"10.244.1.10": (False, True, True, HERE, "zone-a", ()),
                   "10.244.1.11": (True, True, False, THERE, "zone-b", ("zone-a",))}


def test_file_source_ignores_other_nodes(tmp_path: Path) -> None:
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": THERE, "labels": {"topology.kubernetes.io/zone": "zone-z"}}}
    assert load(_manifests(tmp_path, node), HERE).node is None


def test_file_source_reads_node_hints(tmp_path: Path) -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
               "spec": {"clusterIP": "10.96.0.10", "trafficDistribution": "PreferSameNode",
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}}
    slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
              "metadata": {"name": "web-a", "namespace": "default",
                           "labels": {"kubernetes.io/service-name": "web"}},
              "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
              "endpoints": [{"addresses": ["10.244.1.10"], "nodeName": THERE, "zone": "zone-a",
                             "hints": {"forZones": [{"name": "zone-a"}], "forNodes": [{"name": HERE}]}}]}
    loaded = load(_manifests(tmp_path, service, slice_), HERE)
    assert loaded.errors == []
    ((port,),) = loaded.services.values()
    assert port.traffic_distribution == "PreferSameNode"
    ((only,),) = [s.for_port("http", "TCP") for s in loaded.endpoints.values()]
    assert (only.node_hints, only.zone_hints) == ((HERE,), ("zone-a",))


def test_bad_node_hint_is_rejected_naming_the_field(tmp_path: Path) -> None:
    slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
              "metadata": {"name": "web-a", "namespace": "default",
                           "labels": {"kubernetes.io/service-name": "web"}},
              "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
              "endpoints": [{"addresses": ["10.244.1.10"], "hints": {"forNodes": [{"name": "Node_A"}]}},
                            {"addresses": ["10.244.1.11"], "hints": {"forNodes": [{}]}}]}
    (err,) = load(_manifests(tmp_path, slice_), HERE).errors
    assert err.field_path == "endpoints[0].hints.forNodes[0].name" and "Node_A" in str(err)
    slice_["endpoints"] = slice_["endpoints"][1:]  # type: ignore[index]
    (err,) = load(_manifests(tmp_path, slice_), HERE).errors
    assert err.field_path == "endpoints[0].hints.forNodes[0].name" and "required" in str(err)
