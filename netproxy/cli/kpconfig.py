"""kube-proxy's own configuration file, for ``--config FILE``.

The file is a ``KubeProxyConfiguration`` (``kubeproxy.config.k8s.io/v1alpha1``), as kubeadm writes it
into the ``kube-proxy`` ConfigMap (key ``config.conf``).  The whole ConfigMap, and a multi-document
file holding one ``KubeProxyConfiguration`` (kubeadm's init configuration), are accepted too.

kubeadm writes every field, most of them at their zero value ("", ``0s``, ``null``, ``false``), and
kube-proxy reads a zero value as "use the default": so does this module.  Fields netproxy has a flag
for become that flag's value (``FileConfig.values``, keyed by the argparse destination); the command
line wins over the file (``apply``).  A field set to something netproxy does not do is listed in
``not_applied``, a field kube-proxy does not know in ``unknown``: the CLI names both in one warning.
A setting that would change traffic in a way netproxy cannot honour (``mode: ipvs``,
``detectLocalMode: BridgeInterface`` without ``detectLocal.bridgeInterface``, ...) and a value of
the wrong type raise ``FieldError``.

kube-proxy's v1alpha1 keeps ``masqueradeBit``, ``masqueradeAll``, ``syncPeriod`` and ``minSyncPeriod``
per mode: ``nftables.*`` in nftables mode, ``iptables.*`` otherwise (mode "" is iptables for
kube-proxy).  The same section is read here; the other one is ignored, as kube-proxy does.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import yaml

from netproxy.core import features
from netproxy.core.config import ProxyConfig, check_interface_name, parse_cidrs
from netproxy.core.model import FieldError
from netproxy.node.nodeconfig import parse_nodeport_addresses

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
CONFIGMAP_KEY = "config.conf"
MODES = {"": "auto", "iptables": "iptables", "nftables": "nftables"}
HEALTHZ_PORT, METRICS_PORT = (int(a.rpartition(":")[2]) for a in (ProxyConfig.healthz_bind_address,
                                                                   ProxyConfig.metrics_bind_address))
"""The ports a bare bind address gets: the default addresses' (kube-proxy's 10256 and 10249)."""

# kube-proxy's v1alpha1 fields (k8s.io/kube-proxy/config/v1alpha1/types.go, 1.33 to the newest), by section.
_TOP = {
    "apiVersion", "kind", "featureGates", "clientConnection", "logging", "hostnameOverride", "bindAddress",
    "healthzBindAddress", "metricsBindAddress", "bindAddressHardFail", "enableProfiling",
    "showHiddenMetricsForVersion", "mode", "iptables", "ipvs", "nftables", "winkernel", "detectLocalMode",
    "detectLocal", "clusterCIDR", "nodePortAddresses", "oomScoreAdj", "conntrack", "configSyncPeriod",
    "portRange", "windowsRunAsService",
}
_SECTIONS = {
    "clientConnection": {"kubeconfig", "acceptContentTypes", "contentType", "qps", "burst"},
    "iptables": {"masqueradeBit", "masqueradeAll", "localhostNodePorts", "snatNodeInternalIP", "syncPeriod",
                 "minSyncPeriod"},
    "ipvs": {"syncPeriod", "minSyncPeriod", "scheduler", "excludeCIDRs", "strictARP", "tcpTimeout",
             "tcpFinTimeout", "udpTimeout"},
    "nftables": {"masqueradeBit", "masqueradeAll", "syncPeriod", "minSyncPeriod"},
    "winkernel": {"networkName", "sourceVip", "enableDSR", "rootHnsEndpointName", "forwardHealthCheckVip"},
    "detectLocal": {"bridgeInterface", "interfaceNamePrefix"},
    "conntrack": {"maxPerCore", "min", "tcpEstablishedTimeout", "tcpCloseWaitTimeout", "tcpBeLiberal",
                  "udpTimeout", "udpStreamTimeout"},
}
_NOT_APPLIED = ("logging", "bindAddressHardFail", "enableProfiling", "showHiddenMetricsForVersion", "oomScoreAdj",
                "configSyncPeriod")

_GO_DURATION = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigFileError(ValueError):
    """The file cannot be used; names the file and, where there is one, the field."""

    def __init__(self, path: str, message: str, field_path: str = "") -> None:
        self.path = path
        self.field_path = field_path
        self.message = message
        where = f"field {field_path}: " if field_path else ""
        super().__init__(f"{path}: {where}{message}")


@dataclass(frozen=True)
class FileConfig:
    values: Dict[str, Any]
    """Flag values from the file, keyed by argparse destination (``sync_period``, ``backend``, ...)."""
    not_applied: Tuple[str, ...] = ()
    """Fields kube-proxy knows, set in the file, that netproxy does not apply."""
    unknown: Tuple[str, ...] = ()
    """Fields kube-proxy does not know either."""

    def warning(self) -> Optional[str]:
        """The one warning line naming every field that is not applied, or None."""
        parts = []
        if self.not_applied:
            parts.append("not applied: " + ", ".join(self.not_applied))
        if self.unknown:
            parts.append("unknown fields: " + ", ".join(self.unknown))
        return "; ".join(parts) or None


def go_duration(text: str) -> float:
    """Seconds in a Go duration ("30s", "1m0s", "500ms", "2h22m", "0"); ValueError otherwise."""
    s = text.strip()
    sign = -1.0 if s.startswith("-") else 1.0
    s = s.lstrip("+-")
    if s == "0":
        return 0.0
    total, pos = 0.0, 0
    for m in _GO_DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _GO_UNITS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise ValueError(f"{text!r} is not a duration (e.g. 30s, 1m0s, 500ms)")
    return sign * total


def read(path: str) -> FileConfig:
    """Load and check the file at ``path``; OSError if unreadable, ConfigFileError if unusable."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return parse(_document(text))
    except yaml.YAMLError as err:
        raise ConfigFileError(path, f"not YAML: {err}") from None
    except FieldError as err:
        raise ConfigFileError(path, err.message, err.field_path) from None


def _document(text: str) -> Any:
    """The KubeProxyConfiguration in ``text``: the only document, the one of its kind among
    several, or the ``config.conf`` of a ConfigMap."""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    kinds = [d for d in docs if isinstance(d, dict) and d.get("kind") in (KIND, "ConfigMap")]
    if len(docs) > 1:
        if len(kinds) != 1:
            raise FieldError("kind", f"{len(docs)} documents and {len(kinds)} of them a {KIND} or ConfigMap: "
                             "expected exactly one")
        docs = kinds
    if not docs:
        raise FieldError("kind", f"the file is empty: expected a {KIND}")
    doc = docs[0]
    if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
        data = doc.get("data")
        inner = data.get(CONFIGMAP_KEY) if isinstance(data, dict) else None
        if not isinstance(inner, str):
            raise FieldError(f"data.{CONFIGMAP_KEY}", f"the ConfigMap has no {CONFIGMAP_KEY} string "
                             "(kubeadm's kube-proxy ConfigMap has)")
        doc = yaml.safe_load(inner)
    return doc


# -- the fields read as they are ---------------------------------------------------------------------
# Each row: the field (in the document, or in the per-mode section), the flag's destination, and how
# its value is read (a reader returns None for "unset": the flag's default applies).
Reader = Callable[[Mapping[str, Any], str, str], Any]


def _cidrs(doc: Mapping[str, Any], key: str, where: str) -> Any:
    text = _string(doc, key, where)
    try:
        return parse_cidrs(text) if text else None
    except ValueError as err:
        raise FieldError(where + key, str(err)) from None


def _text(doc: Mapping[str, Any], key: str, where: str) -> Optional[str]:
    return _string(doc, key, where).strip() or None


def _address(port: int) -> Reader:
    def read(doc: Mapping[str, Any], key: str, where: str) -> Optional[str]:
        text = _string(doc, key, where)
        return _with_port(text, port) if text else None
    return read


def _bit(doc: Mapping[str, Any], key: str, where: str) -> Optional[int]:
    bit = doc.get(key)
    if bit is None:
        return None
    if isinstance(bit, bool) or not isinstance(bit, int):
        raise FieldError(where + key, f"{bit!r} is not an integer")
    if not 0 <= bit <= 31:
        raise FieldError(where + key, f"{bit} is out of range (0-31)")
    return bit


def _true_only(doc: Mapping[str, Any], key: str, where: str) -> Optional[bool]:
    return _flag(doc, key, where) or None  # false is the default: nothing to apply


def _period(doc: Mapping[str, Any], key: str, where: str) -> Optional[float]:
    return _duration(doc, key, where) or None  # 0s is kube-proxy's "unset": the default (30s, 1s) applies


def _read_fields(doc: Mapping[str, Any], rows: Tuple[Tuple[str, str, Reader], ...], where: str = "") -> Dict[str, Any]:
    values = {}
    for key, dest, reader in rows:
        value = reader(doc, key, where)
        if value is not None:
            values[dest] = value
    return values


def parse(doc: Any) -> FileConfig:
    """A KubeProxyConfiguration (already YAML-decoded) as netproxy's flag values; FieldError when
    a value has the wrong type or asks for something netproxy cannot do."""
    _check_header(doc)
    unknown: List[str] = [k for k in map(str, doc) if k not in _TOP]
    sections = {name: _section(doc, name) for name in _SECTIONS}
    for name, known in _SECTIONS.items():
        unknown += [f"{name}.{k}" for k in map(str, sections[name]) if k not in known]

    mode = _string(doc, "mode")
    if mode not in MODES:
        raise FieldError("mode", f"{mode!r} is not supported: netproxy has the iptables and nftables "
                         "backends (\"\" picks one as --backend auto does)")
    values: Dict[str, Any] = {"backend": MODES[mode]} if mode else {}
    values.update(_detect_local(doc, sections["detectLocal"]))
    values.update(_read_fields(doc, _TOP_FIELDS))
    nodeports = _nodeport_addresses(doc.get("nodePortAddresses"))
    if nodeports is not None:
        values["nodeport_addresses"] = nodeports
    values.update(_read_fields(sections["clientConnection"], _CLIENT_FIELDS, "clientConnection."))
    values.update(_mode_section(mode, sections))
    values.update(_conntrack(sections["conntrack"]))
    gates, not_applied = _feature_gates(doc)
    values.update(gates)
    return FileConfig(values, tuple(sorted(not_applied + _not_applied(doc, sections))), tuple(sorted(unknown)))


def _check_header(doc: Any) -> None:
    if not isinstance(doc, dict):
        raise FieldError("kind", f"expected a {KIND} mapping, not {type(doc).__name__}")
    if doc.get("apiVersion") != API_VERSION:
        raise FieldError("apiVersion", f"{doc.get('apiVersion')!r}: expected {API_VERSION}")
    if doc.get("kind") != KIND:
        raise FieldError("kind", f"{doc.get('kind')!r}: expected {KIND}")


def _mode_section(mode: str, sections: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """The per-mode section kube-proxy reads: nftables' in nftables mode, iptables' otherwise."""
    used = "nftables" if mode == "nftables" else "iptables"
    sec, where = sections[used], f"{used}."
    values = _read_fields(sec, _MODE_FIELDS, where)
    if (values.get("min_sync_period", ProxyConfig.min_sync_period)
            > values.get("sync_period", ProxyConfig.sync_period)):
        raise FieldError(f"{used}.syncPeriod", f"must be greater than or equal to {used}.minSyncPeriod")
    if used == "iptables":
        if _flag(sec, "snatNodeInternalIP", where) is True:
            raise FieldError("iptables.snatNodeInternalIP", "true is not supported: netproxy masquerades to "
                             "the egress interface's address")
        values.update(_read_fields(sec, _IPTABLES_FIELDS, where))
    return values


def _feature_gates(doc: Mapping[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """The gates netproxy has are applied (a bad value is an error); others are named as not applied
    rather than refused: a kubeadm ConfigMap carries the cluster's gates, which kube-proxy's binary
    knows all of (every Kubernetes gate), and refusing them would stop a node kube-proxy runs on.
    The --feature-gates flag, which a person types for this proxy, refuses an unknown one."""
    gates = doc.get("featureGates") or {}
    if not isinstance(gates, dict):
        raise FieldError("featureGates", f"expected a mapping of gate names to true/false, not {type(gates).__name__}")
    ours = {g: v for g, v in gates.items() if g in features.GATES}
    not_applied = [f"featureGates.{g}" for g in gates if g not in features.GATES]
    if not ours:
        return {}, not_applied
    try:
        return {"feature_gates": features.checked(ours)}, not_applied
    except features.GateError as err:
        raise FieldError("featureGates", str(err)) from None


def _not_applied(doc: Mapping[str, Any], sections: Mapping[str, Mapping[str, Any]]) -> List[str]:
    """What kube-proxy would apply in this mode and netproxy does not.  Sections kube-proxy itself
    ignores here (the other mode's, ipvs, winkernel, detectLocal outside its modes, portRange) are not."""
    out = [f"clientConnection.{sub}" for sub in ("acceptContentTypes", "contentType", "qps", "burst")
           if not _is_zero(sections["clientConnection"].get(sub))]
    if _string(doc, "bindAddress") not in ("", "0.0.0.0", "::"):
        out.append("bindAddress")
    return out + [k for k in _NOT_APPLIED if not _is_zero(doc.get(k))]


_CONNTRACK_COUNTS = {"maxPerCore": "conntrack_max_per_core", "min": "conntrack_min"}
_CONNTRACK_DURATIONS = {"tcpEstablishedTimeout": "conntrack_tcp_timeout_established",
                        "tcpCloseWaitTimeout": "conntrack_tcp_timeout_close_wait",
                        "udpTimeout": "conntrack_udp_timeout", "udpStreamTimeout": "conntrack_udp_timeout_stream"}


def _conntrack(sec: Mapping[str, Any]) -> Dict[str, Any]:
    """The ``conntrack`` section as the --conntrack-* flags (sysctls set at start, netproxy/node/ctsysctl.py).
    null/0 is kube-proxy's "unset"; netproxy then keeps the kernel's value (kube-proxy's defaults are
    not applied: docs/parity.md)."""
    out: Dict[str, Any] = {}
    for key, dest in _CONNTRACK_COUNTS.items():
        value = sec.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FieldError(f"conntrack.{key}", f"{value!r} is not a whole number >= 0")
        if key == "maxPerCore" or value:
            out[dest] = value  # maxPerCore: 0 is meaningful: "leave nf_conntrack_max alone"
    for key, dest in _CONNTRACK_DURATIONS.items():
        seconds = _duration(sec, key, "conntrack.")
        if seconds:
            out[dest] = seconds
    if _flag(sec, "tcpBeLiberal", "conntrack.") is True:
        out["conntrack_tcp_be_liberal"] = True
    return out


def apply(args: Any, config: FileConfig, given: Iterable[str]) -> Set[str]:
    """Copy the file's values onto the parsed flags, except where a flag was given (the command line
    wins, as with kube-proxy) or the command has no such flag; returns the destinations set."""
    explicit = set(given)
    done = set()
    for dest, value in config.values.items():
        if dest in explicit or not hasattr(args, dest):
            continue
        if dest == "kubeconfig" and getattr(args, "source", None):
            continue  # --source: no API to read
        setattr(args, dest, value)
        done.add(dest)
    return done


def _section(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = doc.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FieldError(name, f"expected a mapping, not {type(value).__name__}")
    return value


def _string(doc: Mapping[str, Any], key: str, prefix: str = "") -> str:
    value = doc.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(prefix + key, f"{value!r} is not a string")
    return value


def _flag(doc: Mapping[str, Any], key: str, prefix: str) -> Optional[bool]:
    value = doc.get(key)
    if value is not None and not isinstance(value, bool):
        raise FieldError(prefix + key, f"{value!r} is not true or false")
    return value


def _duration(doc: Mapping[str, Any], key: str, prefix: str) -> float:
    text = _string(doc, key, prefix)
    if not text:
        return 0.0
    try:
        seconds = go_duration(text)
    except ValueError as err:
        raise FieldError(prefix + key, str(err)) from None
    if seconds < 0:
        raise FieldError(prefix + key, f"{text!r} is negative")
    return seconds


def _detect_local(doc: Mapping[str, Any], section: Mapping[str, Any]) -> Dict[str, Any]:
    """``detectLocalMode`` and the ``detectLocal`` field its mode needs, as flag values; kube-proxy's
    validation: the interface modes need their (non-empty) interface field."""
    mode = _string(doc, "detectLocalMode")
    if mode in ("", "ClusterCIDR"):
        return {"detect_local_mode": "ClusterCIDR"} if mode else {}
    if mode == "NodeCIDR":
        return {"detect_local_mode": mode}
    fields = {"BridgeInterface": ("bridgeInterface", "pod_bridge_interface", False),
              "InterfaceNamePrefix": ("interfaceNamePrefix", "pod_interface_name_prefix", True)}
    if mode not in fields:
        raise FieldError("detectLocalMode", f"{mode!r} is not one of ClusterCIDR, NodeCIDR, BridgeInterface, "
                         "InterfaceNamePrefix")
    key, dest, prefix = fields[mode]
    name = _string(section, key, "detectLocal.")
    if not name:
        raise FieldError(f"detectLocal.{key}", f"must be set with detectLocalMode {mode}")
    try:
        check_interface_name(name, "", prefix)
    except ValueError as err:
        raise FieldError(f"detectLocal.{key}", str(err).lstrip(": ")) from None
    return {"detect_local_mode": mode, dest: name}


def _nodeport_addresses(value: Any) -> Optional[Tuple[Any, ...]]:
    """CIDRs and kube-proxy's keywords ("primary", "localhost"; "all": () every local address);
    None when unset."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FieldError("nodePortAddresses", f"{value!r} is not a list of CIDRs")
    if not value:
        return None
    if "all" in value:
        return ()
    try:
        return parse_nodeport_addresses(value)
    except ValueError as err:
        raise FieldError("nodePortAddresses", str(err)) from None


def _with_port(address: str, port: int) -> str:
    """kube-proxy appends the default port to a bare IP ("0.0.0.0" -> "0.0.0.0:10256")."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _is_zero(value: Any) -> bool:
    """kube-proxy's "unset": null, "", 0, false, a zero duration, or a mapping/list of those."""
    if value is None or value is False or value == 0 or value == "":
        return True
    if isinstance(value, dict):
        return all(_is_zero(v) for v in value.values())
    if isinstance(value, list):
        return not value
    if isinstance(value, str):
        try:
            return go_duration(value) == 0 if value.strip() else True
        except ValueError:
            return value.strip() in ("0",)
    return False


# The tables parse() reads by (after the readers they name).
_TOP_FIELDS: Tuple[Tuple[str, str, Reader], ...] = (
    ("clusterCIDR", "cluster_cidr", _cidrs),
    ("hostnameOverride", "hostname_override", _text),
    ("healthzBindAddress", "healthz_bind_address", _address(HEALTHZ_PORT)),
    ("metricsBindAddress", "metrics_bind_address", _address(METRICS_PORT)),
)
_MODE_FIELDS: Tuple[Tuple[str, str, Reader], ...] = (
    ("masqueradeBit", "masquerade_bit", _bit),
    ("masqueradeAll", "masquerade_all", _true_only),
    ("syncPeriod", "sync_period", _period),
    ("minSyncPeriod", "min_sync_period", _period),
)
_CLIENT_FIELDS: Tuple[Tuple[str, str, Reader], ...] = (
    ("kubeconfig", "kubeconfig", _text),
)
_IPTABLES_FIELDS: Tuple[Tuple[str, str, Reader], ...] = (
    ("localhostNodePorts", "iptables_localhost_nodeports", _flag),  # null is kube-proxy's default, true
)
