"""The nftables tracer: packets through the rendered tables by the rules' own kernel expressions."""

from __future__ import annotations

import dataclasses
from typing import Dict, List

from netproxy.backends.nftables import names
from netproxy.backends.nftables.trace import Outcome, Packet, Tracer
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes
from tests.unit.nftables.nft_helpers import backend, eps, snap, svc

NODE = "node-a"
CONFIG = ProxyConfig(hostname=NODE, cluster_cidrs=parse_cidrs("10.244.0.0/16"))


def _targets(outcomes: List[Outcome]) -> Dict[str, float]:
    got: Dict[str, float] = {}
    for o in outcomes:
        key = o.target if o.verdict == "dnat" else o.verdict
        got[str(key)] = got.get(str(key), 0.0) + o.share
    return got


def _tracer(*items, config: ProxyConfig = CONFIG) -> Tracer:  # type: ignore[no-untyped-def]
    b, fake = backend(config)
    b.sync(snap(*items, node=NODE), Changes())
    return Tracer(fake, "ip")


WEB = svc("web", "10.96.0.10", external=["192.0.2.10"])
NODEPORT = dataclasses.replace(svc("np", "10.96.0.11"), node_port=30080, service_type="NodePort")
EMPTY = svc("empty", "10.96.0.12")
LOCAL = dataclasses.replace(svc("local", "10.96.0.13", external=["192.0.2.13"], ext_policy="Local"))


def test_cluster_ip_reaches_each_endpoint_with_equal_odds_masqueraded_only_from_outside_the_cluster() -> None:
    t = _tracer((WEB, eps("10.1.0.1", "10.1.0.2", "10.1.0.3")))
    inside = t.trace(Packet("10.244.1.5", "10.96.0.10", 80))
    assert _targets(inside) == {"10.1.0.1:8080": 1 / 3, "10.1.0.2:8080": 1 / 3, "10.1.0.3:8080": 1 / 3}
    assert not any(o.masquerade for o in inside)
    assert inside[0].chains == (names.NAT_PREROUTING, names.SERVICES, "cluster-tcp-pick-3")
    outside = t.trace(Packet("172.16.0.9", "10.96.0.10", 80))
    assert all(o.masquerade for o in outside) and len(outside) == 3
    external = t.trace(Packet("172.16.0.9", "192.0.2.10", 80))
    assert all(o.masquerade and o.verdict == "dnat" for o in external)


def test_refusals_unknown_ports_and_other_protocols() -> None:
    t = _tracer((WEB, eps("10.1.0.1")), (EMPTY, ()))
    assert _targets(t.trace(Packet("10.244.1.5", "10.96.0.12", 80))) == {"reject": 1.0}
    assert _targets(t.trace(Packet("10.244.1.5", "10.96.0.10", 81))) == {"reject": 1.0}
    assert _targets(t.trace(Packet("10.244.1.5", "10.96.0.10", 80, proto="udp"))) == {"reject": 1.0}
    assert _targets(t.trace(Packet("10.244.1.5", "10.99.0.1", 80))) == {"accept": 1.0}, "not a service"


def test_node_ports_on_node_addresses_only() -> None:
    t = _tracer((NODEPORT, eps("10.1.0.1", "10.1.0.2")))
    local = frozenset({"192.168.1.10"})
    got = t.trace(Packet("172.16.0.9", "192.168.1.10", 30080, local=local))
    assert _targets(got) == {"10.1.0.1:8080": 0.5, "10.1.0.2:8080": 0.5} and all(o.masquerade for o in got)
    assert _targets(t.trace(Packet("172.16.0.9", "192.168.1.99", 30080, local=local))) == {"accept": 1.0}


def test_external_traffic_policy_local_keeps_the_client_and_drops_without_a_local_endpoint() -> None:
    t = _tracer((LOCAL, eps("10.1.0.1", node=NODE) + eps("10.1.0.2", node="node-b")))
    got = t.trace(Packet("172.16.0.9", "192.0.2.13", 80))
    assert _targets(got) == {"10.1.0.1:8080": 1.0} and not got[0].masquerade
    pods = t.trace(Packet("10.244.1.5", "192.0.2.13", 80))  # --cluster-cidr: the exception, every endpoint
    assert _targets(pods) == {"10.1.0.1:8080": 0.5, "10.1.0.2:8080": 0.5}
    t = _tracer((LOCAL, eps("10.1.0.2", node="node-b")))
    assert _targets(t.trace(Packet("172.16.0.9", "192.0.2.13", 80))) == {"drop": 1.0}


def test_a_remembered_client_goes_to_its_endpoint_only() -> None:
    sticky = svc("s", "10.96.0.20", affinity=True)
    b, fake = backend(CONFIG)
    b.sync(snap((sticky, eps("10.1.0.1", "10.1.0.2")), node=NODE), Changes())
    fake.touch("ip", names.affinity_map("tcp"), "10.244.1.5 . 10.96.0.20 . 80", 60, "10.1.0.2 . 8080")
    t = Tracer(fake, "ip")
    assert _targets(t.trace(Packet("10.244.1.5", "10.96.0.20", 80))) == {"10.1.0.2:8080": 1.0}
    assert _targets(t.trace(Packet("10.244.1.6", "10.96.0.20", 80))) == {"10.1.0.1:8080": 0.5, "10.1.0.2:8080": 0.5}


def test_every_rendered_expression_decodes_back_from_its_netlink_form() -> None:
    """``trace --kernel`` reads rules back as the kernel dumps them: each rule's encoded expressions
    (what the netlink writer sends) decode into the very objects the tracer runs on the render."""
    from netproxy.backends.nftables import expr

    config = dataclasses.replace(CONFIG, masquerade_all=True)
    affinity = dataclasses.replace(svc("sticky", "10.96.0.14"), affinity="ClientIP", affinity_timeout=60)
    b, fake = backend(config)
    b.sync(snap((WEB, eps("10.1.0.1", "10.1.0.2")), (NODEPORT, eps("10.1.0.3")), (EMPTY, ()),
                (LOCAL, eps("10.1.0.4")), (affinity, eps("10.1.0.5", "10.1.0.6")), node=NODE), Changes())
    rules = [r for t in fake.tables.values() for chain in t.rules.values() for r in chain]
    kinds = set()
    for rule in rules:
        encoded = b"".join(e.encode() for e in rule.exprs)
        assert expr.decode_rule(encoded) == tuple(rule.exprs), rule.body
        kinds |= {type(e).__name__ for e in rule.exprs}
    assert {"Payload", "Cmp", "Lookup", "Verdict", "Nat", "Numgen", "Dynset", "Reject", "Masquerade"} <= kinds, kinds
