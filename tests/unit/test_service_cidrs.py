"""Service CIDRs: ``--service-cluster-ip-range`` and ``networking.k8s.io/v1``
ServiceCIDR objects → ``Snapshot.service_cidrs`` → a drop for addresses no service owns, on both
backends (the kernel suite's test_parity.py sends the traffic; here the pieces and both tracers)."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

from netproxy import cli
from netproxy.backends.iptables.assemble import SERVICE_CIDR_COMMENT, assemble
from netproxy.backends.iptables.render import render_service
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import NodeInfo, ServicePort, ServicePortName, ValidationError
from netproxy.core.tracker import ChangeTracker
from netproxy.source.convert import parse_service_cidr
from netproxy.source.files import load

net = ipaddress.ip_network


def service_cidr(name: str, *cidrs: Any) -> Dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": name},
            "spec": {"cidrs": list(cidrs)}}


# ---- conversion ------------------------------------------------------------------------------------


def test_service_cidr_object_converts() -> None:
    assert parse_service_cidr(service_cidr("kubernetes", "10.96.0.0/16", "fd00:10:96::/112")) == (
        "kubernetes", (net("10.96.0.0/16"), net("fd00:10:96::/112")))


@pytest.mark.parametrize("cidrs, field, words", [
    (["10.96.0.0/33"], "spec.cidrs[0]", "is not a CIDR"),
    (["10.96.0.0/16", "nonsense"], "spec.cidrs[1]", "'nonsense' is not a CIDR"),
    ([7], "spec.cidrs[0]", "7 is not a CIDR"),
    ([], "spec.cidrs", "must list"),
    (["10.96.0.0/16", "10.97.0.0/16"], "spec.cidrs", "at most one IPv4 and one IPv6"),
])
def test_bad_service_cidr_is_rejected_naming_the_field(cidrs: List[Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_service_cidr(service_cidr("extra", *cidrs))
    assert err.value.kind == "ServiceCIDR" and err.value.ref == "extra" and err.value.field_path == field
    assert words in str(err.value)


def test_flag_cidrs_use_the_models_check() -> None:
    assert parse_cidrs("10.96.0.0/12, fd00::/108") == (net("10.96.0.0/12"), net("fd00::/108"))
    with pytest.raises(ValueError, match="'10.96.0.0/40' is not a CIDR"):
        parse_cidrs("10.96.0.0/12,10.96.0.0/40")
    with pytest.raises(ValueError, match="no %zone"):
        parse_cidrs("fe80::%eth0/64")


# ---- file source and tracker -----------------------------------------------------------------------


def write(tmp_path: Path, *objects: Dict[str, Any]) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text("".join("---\n" + json.dumps(o) + "\n" for o in objects))
    return str(path)


def test_file_source_reads_service_cidrs_and_rejects_bad_ones(tmp_path: Path) -> None:
    loaded = load(write(tmp_path, service_cidr("kubernetes", "10.96.0.0/16"), service_cidr("bad", "x"),
                        service_cidr("kubernetes", "10.97.0.0/16")))
    assert loaded.service_cidrs == {"kubernetes": (net("10.96.0.0/16"),)}
    assert [(e.ref, e.field_path) for e in loaded.errors] == [("bad", "spec.cidrs[0]"),
                                                              ("kubernetes", "metadata.name")]


def test_tracker_joins_the_flag_and_the_objects_and_a_change_is_a_full_sync() -> None:
    t = ChangeTracker(service_cidrs=(net("10.96.0.0/16"),))
    t.services_synced()
    t.endpoints_synced()
    snap, changes = t.take()
    assert snap.service_cidrs == (net("10.96.0.0/16"),)
    t.replace_service_cidrs({"kubernetes": (net("10.96.0.0/16"),), "extra": (net("fd00::/108"), net("10.100.0.0/24"))})
    assert t.pending()
    snap, changes = t.take()
    assert snap.service_cidrs == (net("10.96.0.0/16"), net("10.100.0.0/24"), net("fd00::/108"))
    assert changes.full
    t.update_service_cidr("extra", None)
    snap, changes = t.take()
    assert snap.service_cidrs == (net("10.96.0.0/16"),) and changes.full  # the flag's stays
    t.replace_service_cidrs({"kubernetes": (net("10.96.0.0/16"),)})
    assert not t.pending(), "the same CIDRs again are no change"


# ---- the iptables rules ------------------------------------------------------------------------------


def test_iptables_drops_a_service_cidr_after_the_cluster_ip_refusal() -> None:
    svc = ServicePort(ServicePortName("default", "web", "http"), "TCP", 80, 8080,
                      cluster_ips=(ipaddress.ip_address("10.96.0.10"),))
    rendered = render_service(svc, (), NodeInfo("node-a"), 4, ProxyConfig(hostname="node-a"))
    assert rendered is not None
    ruleset = assemble(4, [rendered], ProxyConfig(hostname="node-a"),
                       service_cidrs=(net("10.96.0.0/16"), net("fd00::/108")))
    rules = ruleset.tables["filter"]["KUBE-SERVICES"]
    refuse = next(i for i, r in enumerate(rules) if "--match-set" in r)
    assert rules[refuse + 1] == ("-d", "10.96.0.0/16", "-m", "addrtype", "!", "--dst-type", "LOCAL",
                                 "-m", "comment", "--comment", SERVICE_CIDR_COMMENT, "-j", "DROP")
    assert not any("fd00::/108" in r for r in rules), "only the family's own CIDRs"
    assert not any(SERVICE_CIDR_COMMENT in r for r in assemble(4, [rendered], ProxyConfig()).tables[
        "filter"]["KUBE-SERVICES"]), "no CIDRs, no drop"


# ---- both tracers, through `netproxy trace` ------------------------------------------------------------

MANIFESTS: List[Dict[str, Any]] = [
    service_cidr("kubernetes", "10.96.0.0/16"),
    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
     "spec": {"clusterIP": "10.96.0.10", "type": "LoadBalancer",
              "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080}]},
     "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.10"},
                                             {"ip": "198.51.100.11", "ipMode": "Proxy"}]}}},
    {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
     "metadata": {"name": "web-a", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
     "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
     "endpoints": [{"addresses": ["10.244.1.10"], "nodeName": "node-a"}]},
]
DNAT, REFUSED, DROPPED, UNTOUCHED = "DNAT to 10.244.1.10:8080", "refused", "dropped", "not a service here"
TRACES = {
    "10.96.0.10:80": DNAT,          # the service
    "10.96.0.10:81": REFUSED,       # its other ports
    "10.96.0.99:80": DROPPED,       # in the CIDR, no service
    "10.97.0.1:80": UNTOUCHED,      # outside the CIDR: not netproxy's
    "198.51.100.10:80": DNAT,       # ipMode VIP (the default)
    "198.51.100.11:80": UNTOUCHED,  # ipMode Proxy: left to the load balancer
}


def _trace(source: str, backend: str, to: str, capsys: pytest.CaptureFixture[str], *extra: str) -> List[str]:
    code = cli.main(["trace", "--source", source, "--backend", backend, "--hostname-override", "node-a",
                     "--iptables-flavour", "legacy", "--to", to, "--from", "10.244.1.2", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    return sorted(re.sub(r"\s+via .*$", "", line).strip() for line in out.splitlines()[1:])


@pytest.mark.parametrize("to", sorted(TRACES))
def test_both_tracers_agree_on_service_cidrs_and_ip_mode(to: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    source = write(tmp_path, *MANIFESTS)
    ipt, nft = _trace(source, "iptables", to, capsys), _trace(source, "nftables", to, capsys)
    assert ipt == nft, f"iptables {ipt} != nftables {nft}"
    assert len(ipt) == 1 and ipt[0].startswith("100.0%  " + TRACES[to]), ipt


def test_the_flag_alone_drops_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write(tmp_path, *MANIFESTS[1:])
    for backend in ("iptables", "nftables"):
        assert UNTOUCHED in _trace(source, backend, "10.96.0.99:80", capsys)[0]
        got = _trace(source, backend, "10.96.0.99:80", capsys, "--service-cluster-ip-range", "10.96.0.0/16")
        assert DROPPED in got[0], (backend, got)


def test_bad_flag_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["trace", "--source", "x", "--to", "10.96.0.1:80", "--service-cluster-ip-range", "10.96.0.0/99"])
    assert exited.value.code == 1  # a usage error: nothing was read or applied
    assert "--service-cluster-ip-range: '10.96.0.0/99' is not a CIDR" in capsys.readouterr().err


def test_bad_service_cidr_object_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write(tmp_path, service_cidr("extra", "10.100.0.0/99"), *MANIFESTS)
    code = cli.main(["trace", "--source", source, "--backend", "nftables", "--hostname-override", "node-a",
                     "--to", "10.96.0.10:80"])
    assert code == 2
    assert "rejected ServiceCIDR extra: field spec.cidrs[0]: '10.100.0.0/99' is not a CIDR" in \
        capsys.readouterr().err
