"""--detect-local-mode, --nodeport-addresses primary and --iptables-localhost-nodeports: the flags,
what they become in ProxyConfig, what is refused (before any backend exists), and the rules each
backend renders for them (one rule per mode in shared chains, none per service)."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from netproxy import backends, cli
from netproxy.backends.fake import FakeBackend
from netproxy.backends.iptables.assemble import LOCALNET_COMMENT, assemble
from netproxy.backends.iptables.render import render_service
from netproxy.backends.nftables import layout
from netproxy.backends.nftables import stmt as st
from netproxy.core.config import ProxyConfig, check_interface_name
from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from netproxy.node import detect as detect_mod
from netproxy.node import sysctl
from netproxy.source.convert import parse_node

net = ipaddress.ip_network
NODE = "node-a"


def node_manifest(pod_cidrs: Optional[List[str]] = None, addresses: Optional[List[Dict[str, str]]] = None) -> Dict[
        str, Any]:
    obj: Dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}, "spec": {}, "status": {}}
    if pod_cidrs is not None:
        obj["spec"]["podCIDRs"] = pod_cidrs
    if addresses is not None:
        obj["status"]["addresses"] = addresses
    return obj


SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
           "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}


def source(tmp_path: Path, *objects: Dict[str, Any]) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text("".join("---\n" + json.dumps(o) + "\n" for o in (SERVICE, *objects)))
    return str(path)


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[str, ProxyConfig]]:
    made: List[Tuple[str, ProxyConfig]] = []

    def create(name: str, config: ProxyConfig) -> FakeBackend:
        made.append((name, config))
        return FakeBackend(config)

    monkeypatch.setattr(backends, "create", create)
    monkeypatch.setattr(detect_mod, "iptables_flavour", lambda: "legacy")
    return made


def plan(path: str, *flags: str, backend: str = "iptables") -> int:
    return cli.main(["plan", "--source", path, "--backend", backend, "--hostname-override", NODE, *flags])


# ---- the flags -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, mode, cidrs, interface", [
    ([], "ClusterCIDR", [], None),
    (["--cluster-cidr", "10.244.0.0/16"], "ClusterCIDR", ["10.244.0.0/16"], None),
    (["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0", "--cluster-cidr", "10.244.0.0/16"],
     "BridgeInterface", [], ("cbr0", False)),
    (["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"],
     "InterfaceNamePrefix", [], ("veth", True)),
])
def test_detect_local_mode_flags(flags: List[str], mode: str, cidrs: List[str], interface: Any,
                                 created: List[Tuple[str, ProxyConfig]], tmp_path: Path) -> None:
    assert plan(source(tmp_path), *flags) == 0
    config = created[-1][1]
    assert config.detect_local_mode == mode
    assert [str(c) for c in config.local_cidrs] == cidrs
    assert config.local_interface == interface


def test_node_cidr_takes_the_nodes_pod_cidrs(created: List[Tuple[str, ProxyConfig]], tmp_path: Path) -> None:
    path = source(tmp_path, node_manifest(["10.244.1.0/24", "fd00:10:244:1::/64"]))
    assert plan(path, "--detect-local-mode", "NodeCIDR", "--cluster-cidr", "10.244.0.0/16") == 0
    config = created[-1][1]
    assert [str(c) for c in config.local_cidrs] == ["10.244.1.0/24", "fd00:10:244:1::/64"]


@pytest.mark.parametrize("flags, objects, words", [
    (["--detect-local-mode", "NodeCIDR"], [], "the Node 'node-a' has no valid spec.podCIDRs"),
    (["--detect-local-mode", "NodeCIDR"], [node_manifest()], "the Node 'node-a' has no valid spec.podCIDRs"),
    (["--detect-local-mode", "BridgeInterface"], [], "BridgeInterface needs --pod-bridge-interface"),
    (["--detect-local-mode", "InterfaceNamePrefix", "--pod-bridge-interface", "cbr0"], [],
     "InterfaceNamePrefix needs --pod-interface-name-prefix"),
])
def test_a_mode_without_what_it_needs_exits_1_naming_it_before_any_backend(
        flags: List[str], objects: List[Dict[str, Any]], words: str, created: List[Tuple[str, ProxyConfig]],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan(source(tmp_path, *objects), *flags) == 1
    assert words in capsys.readouterr().err
    assert created == []


@pytest.mark.parametrize("flag, value, words", [
    ("--pod-bridge-interface", "br 0", "is not an interface name"),
    ("--pod-bridge-interface", "a-very-long-bridge", "longer than 15"),
    ("--pod-interface-name-prefix", "veth+", "is not an interface name"),
    ("--pod-interface-name-prefix", "fifteen-chars-x", "longer than 14"),  # iptables writes "<prefix>+"
    ("--pod-bridge-interface", 'br"0', "is not an interface name"),
    ("--nodeport-addresses", "primary,10.0.0.0/33", "'10.0.0.0/33' is not a CIDR"),
    ("--nodeport-addresses", "primary,lo", "'lo' is not a CIDR"),
    ("--iptables-localhost-nodeports", "maybe", "is not true or false"),
    ("--detect-local-mode", "LocalCIDR", "invalid choice"),
])
def test_bad_values_are_usage_errors(flag: str, value: str, words: str, created: List[Tuple[str, ProxyConfig]],
                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        plan(source(tmp_path), f"{flag}={value}")
    assert exit_.value.code == 1
    assert words in capsys.readouterr().err
    assert created == []


def test_interface_names() -> None:
    assert check_interface_name("cbr0", "x") == "cbr0"
    assert check_interface_name("a" * 15, "x") == "a" * 15
    for bad in ("", ".", "..", "a/b", "a:b", "tab\tx", "é"):
        with pytest.raises(ValueError):
            check_interface_name(bad, "x")


def test_nodeport_addresses_primary_is_the_nodes_primary_ips(created: List[Tuple[str, ProxyConfig]],
                                                              tmp_path: Path) -> None:
    addresses = [{"type": "Hostname", "address": NODE}, {"type": "ExternalIP", "address": "203.0.113.5"},
                 {"type": "InternalIP", "address": "192.168.1.10"}, {"type": "InternalIP", "address": "192.168.1.11"},
                 {"type": "InternalIP", "address": "fd00::10"}]
    assert plan(source(tmp_path, node_manifest(addresses=addresses)), "--nodeport-addresses", "primary") == 0
    assert [str(c) for c in created[-1][1].nodeport_addresses] == ["192.168.1.10/32", "fd00::10/128"]


@pytest.mark.parametrize("value, node_ips, cidrs", [
    ("primary,localhost", ["192.168.1.10"], ["192.168.1.10/32", "127.0.0.0/8", "::1/128"]),
    ("localhost", [], ["127.0.0.0/8", "::1/128"]),
    ("primary,localhost", [], ["127.0.0.0/8", "::1/128"]),
    ("10.0.0.0/8,primary", ["192.168.1.10"], ["10.0.0.0/8", "192.168.1.10/32"]),
    ("all,10.0.0.0/8", [], []),
    ("primary", [], []),
])
def test_nodeport_address_keywords_combine_as_in_kube_proxy_1_37(
        value: str, node_ips: List[str], cidrs: List[str], created: List[Tuple[str, ProxyConfig]],
        tmp_path: Path) -> None:
    node = node_manifest(addresses=[{"type": "InternalIP", "address": a} for a in node_ips])
    assert plan(source(tmp_path, node), f"--nodeport-addresses={value}") == 0
    assert [str(c) for c in created[-1][1].nodeport_addresses] == cidrs


def test_primary_without_node_ips_is_every_local_address(created: List[Tuple[str, ProxyConfig]],
                                                         tmp_path: Path) -> None:
    assert plan(source(tmp_path), "--nodeport-addresses", "primary") == 0
    assert created[-1][1].nodeport_addresses == ()


def test_nftables_defaults_to_primary_and_an_explicit_value_wins(created: List[Tuple[str, ProxyConfig]],
                                                                 tmp_path: Path) -> None:
    path = source(tmp_path, node_manifest(addresses=[{"type": "InternalIP", "address": "192.168.1.10"}]))
    assert plan(path, backend="nftables") == 0
    assert [str(c) for c in created[-1][1].nodeport_addresses] == ["192.168.1.10/32"]
    assert plan(path, "--nodeport-addresses", "10.0.0.0/8", backend="nftables") == 0
    assert [str(c) for c in created[-1][1].nodeport_addresses] == ["10.0.0.0/8"]
    assert plan(path) == 0  # iptables mode: every local address, as kube-proxy
    assert created[-1][1].nodeport_addresses == ()


@pytest.mark.parametrize("flags, expected", [([], True), (["--iptables-localhost-nodeports"], True),
                                             (["--iptables-localhost-nodeports=false"], False),
                                             (["--iptables-localhost-nodeports", "true"], True)])
def test_localhost_nodeports_flag(flags: List[str], expected: bool, created: List[Tuple[str, ProxyConfig]],
                                  tmp_path: Path) -> None:
    assert plan(source(tmp_path), *flags) == 0
    assert created[-1][1].localhost_nodeports is expected


def test_node_fields_are_validated() -> None:
    info = parse_node(node_manifest(["10.244.1.0/24"], [{"type": "InternalIP", "address": "192.168.1.10"}]), NODE)
    assert [str(c) for c in info.pod_cidrs] == ["10.244.1.0/24"] and [str(a) for a in info.ips] == ["192.168.1.10"]
    single = node_manifest()
    single["spec"]["podCIDR"] = "10.244.2.0/24"
    assert [str(c) for c in parse_node(single, NODE).pod_cidrs] == ["10.244.2.0/24"]
    for bad, field in ((node_manifest(["10.244.1.0/33"]), "spec.podCIDRs[0]"),
                       (node_manifest(addresses=[{"type": "InternalIP", "address": "nope"}]),
                        "status.addresses[0].address")):
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_node(bad, NODE)


# ---- route_localnet --------------------------------------------------------------------------------

def test_sysctl_ensure_writes_only_when_different(tmp_path: Path) -> None:
    path = tmp_path / sysctl.ROUTE_LOCALNET
    path.parent.mkdir(parents=True)
    path.write_text("0\n")
    assert sysctl.ensure(sysctl.ROUTE_LOCALNET, 1, root=str(tmp_path)) is True
    assert path.read_text() == "1\n"
    assert sysctl.ensure(sysctl.ROUTE_LOCALNET, 1, root=str(tmp_path)) is False


@pytest.mark.parametrize("config, serves", [
    (ProxyConfig(hostname=NODE), True),
    (ProxyConfig(hostname=NODE, localhost_nodeports=False), False),
    (ProxyConfig(hostname=NODE, nodeport_addresses=(net("192.168.0.0/16"),)), False),
    (ProxyConfig(hostname=NODE, nodeport_addresses=(net("127.0.0.0/8"), net("192.168.0.0/16"))), True),
    (ProxyConfig(hostname=NODE, nodeport_addresses=(net("::1/128"),)), False),
])
def test_which_configurations_serve_localhost(config: ProxyConfig, serves: bool) -> None:
    assert config.route_localnet_nodeports is serves


# ---- rules: one per mode, in shared places ---------------------------------------------------------

SVC = ServicePort(ServicePortName("default", "web", "http"), "TCP", 80, 8080,
                  (ipaddress.ip_address("10.96.0.10"),), node_port=30080, external_traffic_policy="Local")


def _ipt_rules(config: ProxyConfig) -> List[Tuple[str, ...]]:
    eps = (Endpoint(ipaddress.ip_address("10.244.1.5"), 8080, node_name=NODE),)
    rendered = render_service(SVC, eps, NodeInfo(NODE), 4, config)
    assert rendered is not None
    out = assemble(4, [rendered], config, NodeInfo(NODE))
    return [r for chains in out.tables.values() for rules in chains.values() for r in rules]


def test_iptables_interface_modes_write_kube_proxys_matches() -> None:
    bridge = ProxyConfig(hostname=NODE, detect_local_mode="BridgeInterface", pod_bridge_interface="cbr0",
                         cluster_cidrs=(net("10.244.0.0/16"),))
    rules = _ipt_rules(bridge)
    assert any(r[-5:] == ("!", "-i", "cbr0", "-j", "KUBE-MARK-MASQ") for r in rules)
    assert not any("10.244.0.0/16" in r for r in rules)  # the cluster CIDR is not the detector here
    prefix = ProxyConfig(hostname=NODE, detect_local_mode="InterfaceNamePrefix", pod_interface_name_prefix="veth")
    assert any(r[-5:] == ("!", "-i", "veth+", "-j", "KUBE-MARK-MASQ") for r in _ipt_rules(prefix))


def test_iptables_localnet_guard_only_with_localhost_nodeports() -> None:
    def guards(config: ProxyConfig) -> int:
        return sum(LOCALNET_COMMENT in r for r in _ipt_rules(config))

    assert guards(ProxyConfig(hostname=NODE)) == 1
    assert guards(ProxyConfig(hostname=NODE, localhost_nodeports=False)) == 0


def test_nftables_interface_modes_match_as_nft_writes_them() -> None:
    assert st.iifname("cbr0").text == 'iifname "cbr0"'
    assert st.iifname("veth", prefix=True, invert=True).text == 'iifname != "veth*"'
    # nft --debug=netlink: an exact name compares all 16 bytes, a prefix only its own.
    assert [e.debug() for e in st.iifname("br0").exprs] == [
        "[ meta load iifname => reg 1 ]", "[ cmp eq reg 1 0x00307262 0x00000000 0x00000000 0x00000000 ]"]
    assert [e.debug() for e in st.iifname("veth", prefix=True, invert=True).exprs] == [
        "[ meta load iifname => reg 1 ]", "[ cmp neq reg 1 0x68746576 ]"]
    config = ProxyConfig(hostname=NODE, detect_local_mode="InterfaceNamePrefix", pod_interface_name_prefix="veth",
                         cluster_cidrs=(net("10.244.0.0/16"),))
    masq = layout.masquerade_rule("c", layout.CLUSTER, "ip", config)
    assert masq is not None and 'iifname != "veth*"' in masq.body and "cluster-cidrs" not in masq.body
    exempt = layout.exemption_rules("c", "ip", config, st.jump("x"))
    assert 'iifname "veth*"' in exempt[0].body


def _many(n: int) -> List[ServicePort]:
    return [ServicePort(ServicePortName("default", f"s{i}", "http"), "TCP", 80, 8080,
                        (ipaddress.ip_address(f"10.96.{i // 250}.{i % 250 + 1}"),), node_port=30000 + i,
                        external_traffic_policy="Local" if i % 2 else "Cluster") for i in range(n)]


@pytest.mark.parametrize("family", [4, 6])
def test_no_mode_adds_rules_per_service(family: int) -> None:
    """10k-service scale: an interface mode writes the same number of rules as a single cluster CIDR
    (it replaces the CIDR match), and the localnet guard is one rule for the whole table."""
    services = _many(200)
    eps = (Endpoint(ipaddress.ip_address("10.244.1.5" if family == 4 else "fd00:10:244:1::5"), 8080, node_name=NODE),)
    if family == 6:
        services = [ServicePort(s.name, s.protocol, s.port, s.target_port,
                                (ipaddress.ip_address(f"fd00:96::{i + 1:x}"),), node_port=s.node_port,
                                external_traffic_policy=s.external_traffic_policy) for i, s in enumerate(services)]
    cidr = "10.244.0.0/16" if family == 4 else "fd00:10:244::/48"

    def count(config: ProxyConfig) -> int:
        rendered = [render_service(s, eps, NodeInfo(NODE), family, config) for s in services]
        out = assemble(family, [r for r in rendered if r is not None], config, NodeInfo(NODE))
        return sum(len(rules) for chains in out.tables.values() for rules in chains.values())

    base = count(ProxyConfig(hostname=NODE, cluster_cidrs=(net(cidr),), localhost_nodeports=False))
    for mode, extra in (("BridgeInterface", {"pod_bridge_interface": "cbr0"}),
                        ("InterfaceNamePrefix", {"pod_interface_name_prefix": "veth"})):
        config = ProxyConfig(hostname=NODE, detect_local_mode=mode, localhost_nodeports=False, **extra)
        assert count(config) == base, mode
    guarded = count(ProxyConfig(hostname=NODE, cluster_cidrs=(net(cidr),)))
    assert guarded == base + (1 if family == 4 else 0)
