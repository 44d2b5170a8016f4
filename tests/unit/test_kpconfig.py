"""--config FILE: kube-proxy's KubeProxyConfiguration onto netproxy's flags (netproxy/cli/kpconfig.py).

The file as kubeadm writes it (every field, mostly zero values) must load without a warning; set
fields map onto the flags netproxy has; flags on the command line win; fields netproxy does not apply
are named in one warning; values of the wrong type, or asking for what netproxy cannot do, exit 2
naming the field."""

from __future__ import annotations

import argparse
import copy
import ipaddress
import logging
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import yaml

import netproxy.backends as backends
from netproxy import cli
from netproxy.backends.fake import FakeBackend
from netproxy.cli import kpconfig
from netproxy.core.config import ProxyConfig
from netproxy.core.model import FieldError
from netproxy.node import detect as detect_mod

# What `kubeadm init` (1.33) writes into the kube-proxy ConfigMap's config.conf, with clusterCIDR set.
KUBEADM = yaml.safe_load("""
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
""")


def kubeadm(**changes: Any) -> Dict[str, Any]:
    """kubeadm's file with ``changes``; a dotted key ("iptables__masqueradeBit") sets a nested field."""
    doc = copy.deepcopy(KUBEADM)
    for key, value in changes.items():
        *parents, leaf = key.split("__")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return doc


def write(tmp_path: Path, doc: Any, name: str = "config.conf") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


# -- durations ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("30s", 30.0), ("1m0s", 60.0), ("500ms", 0.5), ("2h22m", 8520.0),
                                           ("1m30s", 90.0), ("0", 0.0), ("0s", 0.0), ("1.5s", 1.5),
                                           ("100us", 0.0001), ("1h0m0s", 3600.0)])
def test_go_durations(text: str, seconds: float) -> None:
    assert kpconfig.go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "30", "s", "1d", "ten", "1m 30s", "1s2"])
def test_bad_go_durations(text: str) -> None:
    with pytest.raises(ValueError):
        kpconfig.go_duration(text)


# -- the mapping --------------------------------------------------------------------------------------

def test_kubeadms_file_loads_with_nothing_to_warn_about() -> None:
    config = kpconfig.parse(KUBEADM)
    assert config.values == {"cluster_cidr": (ipaddress.ip_network("10.244.0.0/16"),),
                             "kubeconfig": "/var/lib/kube-proxy/kubeconfig.conf"}
    assert (config.not_applied, config.unknown, config.warning()) == ((), (), None)


def test_iptables_mode_fields_map_onto_the_flags() -> None:
    values = kpconfig.parse(kubeadm(
        mode="iptables", clusterCIDR="10.244.0.0/16,fd00:244::/56", nodePortAddresses=["192.168.0.0/24"],
        iptables__masqueradeBit=10, iptables__masqueradeAll=True, iptables__syncPeriod="1m0s",
        iptables__minSyncPeriod="500ms", metricsBindAddress="0.0.0.0:10249", healthzBindAddress="127.0.0.1:10256",
        hostnameOverride="node-b")).values
    assert values["backend"] == "iptables"
    assert [str(c) for c in values["cluster_cidr"]] == ["10.244.0.0/16", "fd00:244::/56"]
    assert [str(c) for c in values["nodeport_addresses"]] == ["192.168.0.0/24"]
    assert (values["masquerade_bit"], values["masquerade_all"]) == (10, True)
    assert (values["sync_period"], values["min_sync_period"]) == (60.0, 0.5)
    assert (values["metrics_bind_address"], values["healthz_bind_address"]) == ("0.0.0.0:10249", "127.0.0.1:10256")
    assert values["hostname_override"] == "node-b"


def test_nftables_mode_reads_the_nftables_section_and_ignores_the_iptables_one() -> None:
    config = kpconfig.parse(kubeadm(mode="nftables", nftables__masqueradeBit=3, nftables__masqueradeAll=True,
                                    nftables__syncPeriod="45s", iptables__masqueradeBit=20,
                                    iptables__syncPeriod="10s"))
    assert config.values["backend"] == "nftables"
    assert (config.values["masquerade_bit"], config.values["masquerade_all"]) == (3, True)
    assert config.values["sync_period"] == 45.0
    assert config.warning() is None  # kube-proxy ignores the other mode's section too


def test_empty_mode_is_auto_and_reads_the_iptables_section() -> None:
    config = kpconfig.parse(kubeadm(iptables__masqueradeBit=5, nftables__masqueradeBit=6))
    assert "backend" not in config.values  # --backend's default, auto, stays
    assert config.values["masquerade_bit"] == 5
    assert config.warning() is None


def test_zero_values_are_kube_proxys_unset_and_leave_the_defaults() -> None:
    values = kpconfig.parse(kubeadm(iptables__syncPeriod="0s", iptables__minSyncPeriod="0",
                                    iptables__masqueradeAll=False)).values
    assert not {"sync_period", "min_sync_period", "masquerade_all", "masquerade_bit"} & set(values)


def test_bare_bind_addresses_get_kube_proxys_ports() -> None:
    values = kpconfig.parse(kubeadm(healthzBindAddress="0.0.0.0", metricsBindAddress="::1")).values
    assert (values["healthz_bind_address"], values["metrics_bind_address"]) == ("0.0.0.0:10256", "[::1]:10249")


def test_nodeport_addresses_all_means_every_local_address() -> None:
    assert kpconfig.parse(kubeadm(nodePortAddresses=["all"])).values["nodeport_addresses"] == ()


# -- what is not applied, and what is refused ---------------------------------------------------------

@pytest.mark.parametrize("changes, values", [
    ({"detectLocalMode": "ClusterCIDR"}, {"detect_local_mode": "ClusterCIDR"}),
    ({"detectLocalMode": "NodeCIDR"}, {"detect_local_mode": "NodeCIDR"}),
    ({"detectLocalMode": "BridgeInterface", "detectLocal__bridgeInterface": "cbr0"},
     {"detect_local_mode": "BridgeInterface", "pod_bridge_interface": "cbr0"}),
    ({"detectLocalMode": "InterfaceNamePrefix", "detectLocal__interfaceNamePrefix": "veth"},
     {"detect_local_mode": "InterfaceNamePrefix", "pod_interface_name_prefix": "veth"}),
    ({"nodePortAddresses": ["primary"]}, {"nodeport_addresses": ("primary",)}),
    ({"nodePortAddresses": ["primary", "localhost", "10.0.0.0/8"]},
     {"nodeport_addresses": ("primary", "localhost", ipaddress.ip_network("10.0.0.0/8"))}),
    ({"iptables__localhostNodePorts": True}, {"iptables_localhost_nodeports": True}),
    ({"iptables__localhostNodePorts": False}, {"iptables_localhost_nodeports": False}),
])
def test_detect_local_mode_nodeport_addresses_and_localhost_nodeports_map_onto_flags(
        changes: Dict[str, Any], values: Dict[str, Any]) -> None:
    got = kpconfig.parse(kubeadm(**changes)).values
    assert {k: got[k] for k in values} == values


def test_localhost_nodeports_null_is_kube_proxys_default_and_sets_nothing() -> None:
    assert "iptables_localhost_nodeports" not in kpconfig.parse(kubeadm()).values


def test_unsupported_and_unknown_fields_are_named_in_one_line() -> None:
    # ipvs.* and detectLocal.* are set too: kube-proxy ignores them in iptables mode, and so does netproxy.
    config = kpconfig.parse(kubeadm(oomScoreAdj=-999, featureGates={"SomeGate": True}, ipvs__scheduler="rr",
                                    iptables__localhostNodePorts=False, bindAddress="192.168.0.5",
                                    detectLocal__bridgeInterface="cbr0", udpIdleTimeout="250ms",
                                    iptables__typo=1))
    assert config.not_applied == ("bindAddress", "featureGates.SomeGate", "oomScoreAdj")
    assert config.values["iptables_localhost_nodeports"] is False
    assert config.unknown == ("iptables.typo", "udpIdleTimeout")
    warning = config.warning()
    assert warning is not None and "\n" not in warning
    assert warning.startswith("not applied: bindAddress, featureGates.SomeGate")
    assert warning.endswith("unknown fields: iptables.typo, udpIdleTimeout")


@pytest.mark.parametrize("changes, field, words", [
    ({"mode": "ipvs"}, "mode", "'ipvs' is not supported"),
    ({"mode": "kernelspace"}, "mode", "not supported"),
    ({"mode": 3}, "mode", "not a string"),
    ({"detectLocalMode": "LocalCIDR"}, "detectLocalMode", "'LocalCIDR' is not one of ClusterCIDR, NodeCIDR"),
    ({"detectLocalMode": "InterfaceNamePrefix"}, "detectLocal.interfaceNamePrefix",
     "must be set with detectLocalMode InterfaceNamePrefix"),
    ({"detectLocalMode": "BridgeInterface", "detectLocal__bridgeInterface": "br 0"}, "detectLocal.bridgeInterface",
     "is not an interface name"),
    ({"detectLocalMode": "BridgeInterface", "detectLocal__bridgeInterface": "a-very-long-bridge"},
     "detectLocal.bridgeInterface", "longer than 15 characters"),
    ({"detectLocalMode": "InterfaceNamePrefix", "detectLocal__interfaceNamePrefix": "veth+"},
     "detectLocal.interfaceNamePrefix", "is not an interface name"),
    ({"iptables__masqueradeBit": "x"}, "iptables.masqueradeBit", "not an integer"),
    ({"iptables__masqueradeBit": 40}, "iptables.masqueradeBit", "out of range (0-31)"),
    ({"iptables__masqueradeBit": True}, "iptables.masqueradeBit", "not an integer"),
    ({"mode": "nftables", "nftables__masqueradeBit": -1}, "nftables.masqueradeBit", "out of range"),
    ({"iptables__masqueradeAll": "yes please"}, "iptables.masqueradeAll", "not true or false"),
    ({"iptables__syncPeriod": "30 seconds"}, "iptables.syncPeriod", "not a duration"),
    ({"iptables__syncPeriod": 30}, "iptables.syncPeriod", "not a string"),
    ({"iptables__minSyncPeriod": "-1s"}, "iptables.minSyncPeriod", "negative"),
    ({"iptables__syncPeriod": "1s", "iptables__minSyncPeriod": "5s"}, "iptables.syncPeriod",
     "greater than or equal to iptables.minSyncPeriod"),
    ({"iptables__snatNodeInternalIP": True}, "iptables.snatNodeInternalIP", "not supported"),
    ({"clusterCIDR": "10.244.0.0/16,nope"}, "clusterCIDR", "'nope' is not a CIDR"),
    ({"nodePortAddresses": "10.0.0.0/8"}, "nodePortAddresses", "not a list"),
    ({"nodePortAddresses": ["primary", "nope"]}, "nodePortAddresses", "'nope' is not a CIDR"),
    ({"iptables": "on"}, "iptables", "expected a mapping"),
    ({"featureGates": ["A"]}, "featureGates", "expected a mapping"),
    ({"apiVersion": "kubeproxy.config.k8s.io/v1beta1"}, "apiVersion", "expected kubeproxy.config.k8s.io/v1alpha1"),
    ({"kind": "KubeletConfiguration"}, "kind", "expected KubeProxyConfiguration"),
])
def test_bad_or_unsupported_values_name_the_field(changes: Dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(FieldError) as info:
        kpconfig.parse(kubeadm(**changes))
    assert info.value.field_path == field
    assert words in info.value.message


# -- the file's forms ---------------------------------------------------------------------------------

def test_the_kube_proxy_configmap_itself(tmp_path: Path) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
          "data": {"config.conf": yaml.safe_dump(kubeadm(mode="nftables")),
                   "kubeconfig.conf": "apiVersion: v1\nkind: Config\n"}}
    config = kpconfig.read(write(tmp_path, cm, "cm.yaml"))
    assert config.values["backend"] == "nftables"


def test_a_configmap_without_config_conf_names_the_key(tmp_path: Path) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kube-proxy"}, "data": {"other": "x"}}
    with pytest.raises(kpconfig.ConfigFileError) as info:
        kpconfig.read(write(tmp_path, cm))
    assert info.value.field_path == "data.config.conf"


def test_kubeadms_multi_document_init_configuration(tmp_path: Path) -> None:
    docs = [{"apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "ClusterConfiguration"},
            kubeadm(mode="iptables", iptables__masqueradeBit=12)]
    config = kpconfig.read(write(tmp_path, yaml.safe_dump_all(docs)))
    assert (config.values["backend"], config.values["masquerade_bit"]) == ("iptables", 12)


def test_not_yaml_and_empty_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(kpconfig.ConfigFileError, match="not YAML"):
        kpconfig.read(write(tmp_path, "mode: [iptables\n"))
    with pytest.raises(kpconfig.ConfigFileError, match="empty"):
        kpconfig.read(write(tmp_path, "# nothing\n", "empty.conf"))


# -- the command line ---------------------------------------------------------------------------------

@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[str, ProxyConfig]]:
    """Every backend the CLI asks for, by name; each is a fake, so nothing touches the kernel."""
    made: List[Tuple[str, ProxyConfig]] = []

    def create(name: str, config: ProxyConfig) -> FakeBackend:
        made.append((name, config))
        return FakeBackend(config)

    monkeypatch.setattr(backends, "create", create)
    monkeypatch.setattr(detect_mod, "detect", lambda: pytest.fail("the version check ran"))
    monkeypatch.setattr(detect_mod, "iptables_flavour", lambda: "legacy")
    return made


@pytest.fixture
def source() -> str:
    return str(Path(__file__).parents[2] / "examples" / "cluster.yaml")


def test_plan_uses_the_files_values(created: List[Tuple[str, ProxyConfig]], tmp_path: Path, source: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, kubeadm(mode="nftables", hostnameOverride="node-b", nodePortAddresses=["10.0.0.0/8"],
                                   nftables__masqueradeBit=7, nftables__masqueradeAll=True,
                                   nftables__syncPeriod="2m", nftables__minSyncPeriod="250ms"))
    assert cli.main(["plan", "--source", source, "--config", path]) == 0
    ((name, config),) = created
    assert name == "nftables"
    assert (config.masquerade_bit, config.masquerade_all, config.sync_period, config.min_sync_period) == (
        7, True, 120.0, 0.25)
    assert [str(c) for c in config.cluster_cidrs] == ["10.244.0.0/16"]
    assert [str(c) for c in config.nodeport_addresses] == ["10.0.0.0/8"]
    assert config.hostname == "node-b"
    assert "not applied" not in capsys.readouterr().err


def test_flags_on_the_command_line_win_over_the_file(created: List[Tuple[str, ProxyConfig]], tmp_path: Path,
                                                     source: str) -> None:
    path = write(tmp_path, kubeadm(mode="nftables", clusterCIDR="10.244.0.0/16", hostnameOverride="node-b",
                                   nftables__masqueradeBit=7, nftables__syncPeriod="2m"))
    assert cli.main(["plan", "--source", source, "--config", path, "--backend", "fake", "--masquerade-bit", "14",
                     "--sync-period", "30s", "--cluster-cidr", "10.1.0.0/16", "--hostname-override", "node-c"]) == 0
    ((name, config),) = created
    assert name == "fake"  # --backend, though the file says nftables
    assert (config.masquerade_bit, config.sync_period) == (14, 30.0)  # given, though equal to the defaults
    assert [str(c) for c in config.cluster_cidrs] == ["10.1.0.0/16"]
    assert config.hostname == "node-c"


def test_masquerade_all_from_the_file_or_the_flag(created: List[Tuple[str, ProxyConfig]], tmp_path: Path,
                                                  source: str) -> None:
    off = write(tmp_path, kubeadm(iptables__masqueradeAll=False), "off.conf")
    on = write(tmp_path, kubeadm(iptables__masqueradeAll=True), "on.conf")
    assert cli.main(["plan", "--source", source, "--config", off, "--backend", "fake", "--masquerade-all"]) == 0
    assert cli.main(["plan", "--source", source, "--config", on, "--backend", "fake"]) == 0
    assert [c.masquerade_all for _, c in created] == [True, True]


def test_run_takes_the_bind_addresses_and_the_kubeconfig(tmp_path: Path) -> None:
    path = write(tmp_path, kubeadm(metricsBindAddress="0.0.0.0:10249", healthzBindAddress="0.0.0.0"))

    def parsed(*argv: str) -> argparse.Namespace:
        args = cli.build_parser().parse_args(["run", "--config", path, *argv])
        assert cli._read_config(args) is None
        return args

    args = parsed()
    assert (args.metrics_bind_address, args.healthz_bind_address) == ("0.0.0.0:10249", "0.0.0.0:10256")
    assert args.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    args = parsed("--metrics-bind-address", "127.0.0.1:9999", "--kubeconfig", "/etc/kc")
    assert (args.metrics_bind_address, args.kubeconfig) == ("127.0.0.1:9999", "/etc/kc")
    args = parsed("--source", "cluster.yaml")
    assert (args.source, args.kubeconfig) == ("cluster.yaml", None)  # a file source reads no API


def test_sync_names_fields_not_applied_in_one_warning(created: List[Tuple[str, ProxyConfig]], tmp_path: Path,
                                                      source: str, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, kubeadm(enableProfiling=True, oomScoreAdj=-999, extraThing=1))
    with caplog.at_level(logging.WARNING, logger="netproxy"):
        assert cli.main(["sync", "--source", source, "--config", path, "--backend", "fake"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"--config {path}: not applied: enableProfiling, oomScoreAdj; "
                        "unknown fields: extraThing"]
    assert len(created) == 1  # and the sync went on


@pytest.mark.parametrize("command", ["sync", "plan"])
@pytest.mark.parametrize("changes, field", [({"mode": "ipvs"}, "mode"),
                                            ({"iptables__masqueradeBit": 40}, "iptables.masqueradeBit"),
                                            ({"iptables__masqueradeBit": "x"}, "iptables.masqueradeBit"),
                                            ({"detectLocalMode": "BridgeInterface"}, "detectLocal.bridgeInterface")])
def test_a_bad_value_exits_2_naming_the_field_and_touches_nothing(
        command: str, changes: Dict[str, Any], field: str, created: List[Tuple[str, ProxyConfig]],
        tmp_path: Path, source: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, kubeadm(**changes))
    assert cli.main([command, "--source", source, "--config", path, "--backend", "fake"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"netproxy: --config {path}: field {field}: ")
    assert created == []


def test_an_unreadable_file_exits_1(created: List[Tuple[str, ProxyConfig]], tmp_path: Path, source: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sync", "--source", source, "--config", str(tmp_path / "missing.conf"),
                     "--backend", "fake"]) == 1
    assert "missing.conf" in capsys.readouterr().err
    assert created == []


def test_the_sample_in_deploy_loads_cleanly() -> None:
    sample = Path(__file__).parents[2] / "deploy" / "kube-proxy-config.conf"
    config = kpconfig.read(str(sample))
    assert config.warning() is None
    assert [str(c) for c in config.values["cluster_cidr"]] == ["10.244.0.0/16", "fd00:10:244::/56"]
    assert (config.values["masquerade_bit"], config.values["sync_period"]) == (14, 30.0)


def test_the_kubeadm_daemonset_reads_config_conf_from_kube_proxys_configmap() -> None:
    (ds,) = [d for d in yaml.safe_load_all((Path(__file__).parents[2] / "deploy" / "daemonset-kubeadm.yaml")
                                           .read_text()) if d and d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = cli.build_parser().parse_args(container["args"])  # real flags, and --config among them
    (mount,) = [m for m in container["volumeMounts"] if args.config.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "kube-proxy"
    assert args.config == mount["mountPath"] + "/config.conf"
    # kubeadm's config.conf names kubeconfig.conf beside it: the whole ConfigMap is mounted there.
    assert KUBEADM["clientConnection"]["kubeconfig"] == mount["mountPath"] + "/kubeconfig.conf"
    assert "items" not in volume["configMap"]
    assert container["livenessProbe"]["httpGet"]["port"] == kpconfig.HEALTHZ_PORT  # kubeadm's "" healthz


# -- the kubeconfig the file names: kubeadm's kubeconfig.conf reads a rotating token file ----------------

def test_a_kubeconfig_token_file_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from netproxy.source import kube

    (tmp_path / "token").write_text("first\n")
    kubeconfig = tmp_path / "kubeconfig.conf"
    kubeconfig.write_text(yaml.safe_dump({  # kubeadm's kube-proxy kubeconfig.conf, with a relative path
        "apiVersion": "v1", "kind": "Config", "current-context": "default",
        "clusters": [{"name": "default", "cluster": {"server": "https://cp.example:6443"}}],
        "contexts": [{"name": "default", "context": {"cluster": "default", "user": "default"}}],
        "users": [{"name": "default", "user": {"tokenFile": "token"}}]}))
    assert kube.kubeconfig_token_file(str(kubeconfig)) == str(tmp_path / "token")
    api = kube.api_client_from(str(kubeconfig))
    assert api.configuration.get_api_key_with_prefix("BearerToken") == "Bearer first"
    (tmp_path / "token").write_text("second\n")  # the kubelet rotated it
    assert api.configuration.get_api_key_with_prefix("BearerToken") == "Bearer first"  # within the minute
    monkeypatch.setattr(kube, "TOKEN_REREAD_SECONDS", 0.0)
    assert api.configuration.get_api_key_with_prefix("BearerToken") == "Bearer second"
    api.close()


def test_an_inline_token_is_not_a_token_file(tmp_path: Path) -> None:
    from netproxy.source import kube

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"user": "u"}}],
        "users": [{"name": "u", "user": {"token": "abc", "tokenFile": "/t"}}]}))
    assert kube.kubeconfig_token_file(str(kubeconfig)) is None


# -- conntrack (sysctls set at start: netproxy/node/ctsysctl.py) -------------------------------------------

def test_conntrack_section_becomes_the_conntrack_flags() -> None:
    values = kpconfig.parse(kubeadm(conntrack__maxPerCore=65536, conntrack__min=131072,
                                    conntrack__tcpEstablishedTimeout="24h0m0s", conntrack__tcpCloseWaitTimeout="1h0m0s",
                                    conntrack__tcpBeLiberal=True, conntrack__udpTimeout="30s",
                                    conntrack__udpStreamTimeout="2m0s")).values
    assert {k: v for k, v in values.items() if k.startswith("conntrack_")} == {
        "conntrack_max_per_core": 65536, "conntrack_min": 131072, "conntrack_tcp_timeout_established": 86400.0,
        "conntrack_tcp_timeout_close_wait": 3600.0, "conntrack_tcp_be_liberal": True, "conntrack_udp_timeout": 30.0,
        "conntrack_udp_timeout_stream": 120.0}


def test_kubeadms_null_conntrack_fields_leave_the_kernel_alone_and_max_per_core_zero_is_kept() -> None:
    assert not [k for k in kpconfig.parse(kubeadm()).values if k.startswith("conntrack_")]
    assert kpconfig.parse(kubeadm(conntrack__maxPerCore=0)).values["conntrack_max_per_core"] == 0


@pytest.mark.parametrize("changes, field", [({"conntrack__maxPerCore": "lots"}, "conntrack.maxPerCore"),
                                            ({"conntrack__min": -1}, "conntrack.min"),
                                            ({"conntrack__udpTimeout": "soon"}, "conntrack.udpTimeout"),
                                            ({"conntrack__tcpBeLiberal": "yes"}, "conntrack.tcpBeLiberal")])
def test_bad_conntrack_values_are_named(changes: Dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as err:
        kpconfig.parse(kubeadm(**changes))
    assert err.value.field_path == field


def test_conntrack_flags_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, kubeadm(conntrack__udpTimeout="30s", conntrack__maxPerCore=65536))
    args = cli.build_parser().parse_args(["run", "--source", "x.yaml", "--config", path,
                                          "--conntrack-udp-timeout", "10s"])
    kpconfig.apply(args, kpconfig.read(path), args.given)
    assert (args.conntrack_udp_timeout, args.conntrack_max_per_core) == (10.0, 65536)
