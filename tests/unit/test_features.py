"""kube-proxy's feature gates: --feature-gates and the config file's featureGates, named as kube-proxy
names them; an unknown gate is an error naming it; AllowServiceExternalIPs=false drops externalIPs."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from typing import Any

import pytest

from netproxy.cli import kpconfig
from netproxy.core import features
from netproxy.core.model import FieldError, NodeInfo
from netproxy.core.tracker import ChangeTracker
from netproxy_lab.manifests import service_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_reads_kube_proxys_syntax() -> None:
    assert features.parse("AllowServiceExternalIPs=false, LoadBalancerIPMode=true") == {
        "AllowServiceExternalIPs": False, "LoadBalancerIPMode": True}
    assert features.parse("") == {}
    assert dict(features.effective({"AllowServiceExternalIPs": False}))["AllowServiceExternalIPs"] is False
    assert features.enabled(features.effective({}), "AllowServiceExternalIPs") is True


@pytest.mark.parametrize("text, message", [
    ("NoSuchGate=true", "unrecognized feature gate: NoSuchGate"),
    ("AllowServiceExternalIPs", "missing bool value for 'AllowServiceExternalIPs'"),
    ("AllowServiceExternalIPs=yes", "invalid value of AllowServiceExternalIPs='yes'"),
    ("TopologyAwareHints=false", "TopologyAwareHints=false is not supported: netproxy always has it"),
])
def test_a_bad_gate_is_an_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(features.GateError, match=message):
        features.parse(text)


def config(**extra: Any) -> Any:
    return {"apiVersion": kpconfig.API_VERSION, "kind": kpconfig.KIND, **extra}


def test_the_config_files_feature_gates_are_applied_not_ignored() -> None:
    parsed = kpconfig.parse(config(featureGates={"AllowServiceExternalIPs": False}))
    assert parsed.values["feature_gates"] == {"AllowServiceExternalIPs": False}
    assert not any(f.startswith("featureGates") for f in parsed.not_applied)
    # A gate of the cluster's that netproxy has no behaviour for is named, not refused (a kubeadm
    # ConfigMap carries every gate of the cluster); a gate netproxy has with a bad value is refused.
    other = kpconfig.parse(config(featureGates={"InPlacePodVerticalScaling": True, "AllowServiceExternalIPs": True}))
    assert other.not_applied == ("featureGates.InPlacePodVerticalScaling",)
    assert other.values["feature_gates"] == {"AllowServiceExternalIPs": True}
    with pytest.raises(FieldError, match="featureGates.*AllowServiceExternalIPs: 'no' is not true or false"):
        kpconfig.parse(config(featureGates={"AllowServiceExternalIPs": "no"}))


def test_the_cli_refuses_an_unknown_gate_naming_it(tmp_path: Any) -> None:
    proc = subprocess.run([sys.executable, "-m", "netproxy", "plan", "--backend", "nftables", "--source",
                           os.path.join(REPO, "examples", "cluster.yaml"), "--feature-gates", "Bogus=true"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "unrecognized feature gate: Bogus" in proc.stderr, proc.stderr


def test_allow_service_external_ips_false_drops_them_as_services_enter() -> None:
    port = service_port("web", external_ips=(ipaddress.ip_address("203.0.113.10"),))
    for allowed, want in ((True, (ipaddress.ip_address("203.0.113.10"),)), (False, ())):
        tracker = ChangeTracker(NodeInfo(name="n"), external_ips=allowed)
        tracker.replace_services({("default", "web"): (port,)})
        tracker.services_synced()
        tracker.endpoints_synced()
        (got,) = tracker.take()[0].services.values()
        assert got.external_ips == want and got.cluster_ips == port.cluster_ips


def test_plan_leaves_external_ips_out_with_the_gate_off(tmp_path: Any) -> None:
    source = tmp_path / "c.yaml"
    source.write_text("""apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {clusterIP: 10.96.0.10, externalIPs: [203.0.113.10], ports: [{name: http, port: 80, targetPort: 8080}]}
""")

    def plan(*extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "netproxy", "plan", "--backend", "nftables", "--source",
                               str(source), *extra], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "203.0.113.10" in plan()
    off = plan("--feature-gates", "AllowServiceExternalIPs=false")
    assert "203.0.113.10" not in off and "10.96.0.10" in off
