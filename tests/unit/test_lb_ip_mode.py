"""``status.loadBalancer.ingress[].ipMode``: ``VIP`` (the default) is handled on the
node as today; ``Proxy`` gets no rule at all (kube-proxy >= 1.30 skips such ingress IPs), so traffic
to it leaves the node for the load balancer.  Traffic: tests/kernel/test_parity.py; both tracers:
tests/unit/test_service_cidrs.py."""

from __future__ import annotations

import ipaddress
from typing import Any, Dict, List

import pytest

from netproxy.backends.iptables.render import render_service
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Endpoint, NodeInfo, ValidationError
from netproxy.source.convert import parse_service

ip = ipaddress.ip_address


def lb_service(*ingress: Dict[str, Any]) -> Dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]},
            "status": {"loadBalancer": {"ingress": list(ingress)}}}


def test_ip_mode_splits_the_ingress_ips() -> None:
    (port,) = parse_service(lb_service({"ip": "198.51.100.1"}, {"ip": "198.51.100.2", "ipMode": "VIP"},
                                       {"ip": "198.51.100.3", "ipMode": "Proxy"}, {"hostname": "lb.example"}))
    assert port.load_balancer_ips == (ip("198.51.100.1"), ip("198.51.100.2"))
    assert port.proxy_load_balancer_ips == (ip("198.51.100.3"),)
    assert ip("198.51.100.3") not in port.addresses()


def test_a_proxy_ip_gets_no_rule() -> None:
    (port,) = parse_service(lb_service({"ip": "198.51.100.3", "ipMode": "Proxy"}))
    endpoint = Endpoint(ip("10.244.1.10"), 8080, node_name="node-a")
    rules = render_service(port, (endpoint,), NodeInfo("node-a"), 4, ProxyConfig(hostname="node-a"))
    assert rules is not None
    assert "198.51.100.3" not in repr(rules)
    # The cluster IP and the NodePort are still served.
    assert [e.rule[1] for e in rules.dispatch] == ["10.96.0.10/32"] and len(rules.nodeports) == 1


@pytest.mark.parametrize("ingress, field, words", [
    ([{"ip": "198.51.100.3", "ipMode": "Tunnel"}], "status.loadBalancer.ingress[0].ipMode", "'Tunnel' is not one of"),
    ([{"ip": "198.51.100.1"}, {"hostname": "x", "ipMode": "Proxy"}], "status.loadBalancer.ingress[1].ipMode",
     "only allowed with an ip"),
    ([{"ip": "198.51.100.300", "ipMode": "Proxy"}], "status.loadBalancer.ingress[0].ip", "not an IP address"),
    (["198.51.100.1"], "status.loadBalancer.ingress[0]", "must be a mapping"),
])
def test_bad_ingress_is_rejected_naming_the_field(ingress: List[Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_service(lb_service(*ingress))
    assert err.value.field_path == field and words in str(err.value)
    assert str(err.value).startswith("Service shop/web: field ")
