"""What ``netproxy trace`` prints for the iptables backend: each outcome's chain path and share,
from the shared packet (its hook and interface), and the MARK arithmetic the tracer replays.
Written for the mutants of backends/iptables/trace.py that survived the parity traces
(scripts/mutation, docs/testing.md): those check where a packet ends, not the path it is shown."""

from __future__ import annotations

from typing import Dict

import pytest

from netproxy.backends import base
from netproxy.backends.iptables import trace
from netproxy.backends.iptables.trace import Packet, Tracer
from netproxy.core.config import ProxyConfig
from tests.unit.iptables.test_parity_trace import (
    CLIENT,
    CLUSTER_IP,
    LOCAL_EP,
    NODE_IP,
    NODE_PORT,
    POD,
    REMOTE_EP,
    endpoints,
    ruleset,
    service,
    tracer,
)

PATH = ("nat/KUBE-SERVICES", "nat/KUBE-SVC-CDGGSHYLG3RE2FKL", "nat/KUBE-MARK-MASQ", "filter/KUBE-SERVICES",
        "nat/KUBE-POSTROUTING")


@pytest.mark.parametrize("hook, src, first", [("prerouting", CLIENT, "nat/PREROUTING"),
                                              ("output", NODE_IP, "nat/OUTPUT")])
def test_each_outcome_shows_its_chains_from_the_hook_and_its_share(hook: str, src: str, first: str) -> None:
    outcomes = tracer(service()).outcomes(base.Packet(src, CLUSTER_IP, 80, hook=hook))
    assert sorted((o.verdict, o.target, o.masquerade, o.chains, o.share) for o in outcomes) == [
        ("dnat", f"{LOCAL_EP}:8080", True, (first, *PATH), 0.5),
        ("dnat", f"{REMOTE_EP}:8080", True, (first, *PATH), 0.5)]


def test_an_unmasqueraded_outcome_shows_no_postrouting_chain() -> None:
    (o, _) = tracer(service()).outcomes(base.Packet(POD, CLUSTER_IP, 80))
    assert o.masquerade is False and o.chains[-1] == "filter/KUBE-SERVICES"


def test_the_shared_packet_is_read_with_its_hook_and_interface() -> None:
    p = Packet.of(base.Packet("10.0.0.1", "10.96.0.1", 53, proto="udp", hook="output", iif="eth1"))
    assert p == Packet("10.0.0.1", "10.96.0.1", 53, "udp", from_node=True, iif="eth1")
    assert Packet.of(base.Packet("10.0.0.1", "10.96.0.1", 80)).from_node is False


@pytest.mark.parametrize("opts, before, after", [
    ({"--set-xmark": "0x4000/0x4000"}, 0x1, 0x4001),  # --or-mark 0x4000 as iptables-save spells it
    ({"--set-xmark": "0x4000/0x0"}, 0x4001, 0x1),  # --xor-mark 0x4000
    ({"--set-xmark": "0x8000/0xc000"}, 0x4001, 0x8001),  # set the masked bits to the value
    ({"--set-xmark": "0x10"}, 0xFFFF, 0x10),  # no mask: the whole mark
    ({"--or-mark": "0x4000"}, 0x2, 0x4002),
    ({"--xor-mark": "0x4000"}, 0x4002, 0x2),
])
def test_mark_targets_change_the_mark_as_the_kernel_does(opts: Dict[str, str], before: int, after: int) -> None:
    assert trace._mark(before, opts) == after


def test_an_unknown_mark_target_is_refused_by_name() -> None:
    with pytest.raises(AssertionError, match="MARK .*--and-mark"):
        trace._mark(0, {"--and-mark": "0x1"})


@pytest.mark.parametrize("iif, masqueraded", [("veth1a2b", False), ("veth", False), ("vetz0", True), ("eth0", True)])
def test_an_interface_prefix_matches_names_that_start_with_it(iif: str, masqueraded: bool) -> None:
    """--detect-local-mode InterfaceNamePrefix: ``! -i veth+`` masquerades what did not come from a pod."""
    config = ProxyConfig(hostname="node", detect_local_mode="InterfaceNamePrefix", pod_interface_name_prefix="veth")
    t = Tracer(ruleset([service()], endpoints(LOCAL_EP), config=config), local_addresses=(NODE_IP,))
    assert {o.masquerade for o in t.trace(Packet(CLIENT, CLUSTER_IP, 80, iif=iif))} == {masqueraded}


def test_the_health_check_node_port_is_accepted_for_the_load_balancer_and_nothing_else() -> None:
    """externalTrafficPolicy Local: the healthCheckNodePort (TCP, on the node's addresses) is let past
    the node's INPUT policy ("allow"), whether or not an endpoint is local; other ports and UDP are not."""
    svc = service(service_type="LoadBalancer", node_port=NODE_PORT, external_traffic_policy="Local",
                  health_check_node_port=30999)
    for eps in (endpoints(LOCAL_EP), endpoints(REMOTE_EP)):
        t = Tracer(ruleset([svc], eps), local_addresses=(NODE_IP,))
        assert t.trace(Packet(CLIENT, NODE_IP, 30999)) == {base.Outcome("allow", None, False)}
        assert t.trace(Packet(CLIENT, NODE_IP, 30998)) == {base.Outcome("accept", None, False)}
        assert t.trace(Packet(CLIENT, NODE_IP, 30999, proto="udp")) == {base.Outcome("accept", None, False)}
