"""``netproxy``'s command line: the sub-commands, their flags and the flags' value types.

The proxy's defaults are ProxyConfig's (netproxy/core/config.py): a flag's default is read from there, so
that the flag, a --config file's missing field and a ProxyConfig built in code all mean the same."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Dict, NoReturn, Optional, Sequence, Tuple, Union

from netproxy import version
from netproxy.core import features
from netproxy.core.config import (
    BACKENDS,
    IPTABLES_WRITERS,
    LOCAL_MODES,
    NFTABLES_WRITERS,
    ProxyConfig,
    check_interface_name,
    parse_cidrs,
)
from netproxy.node.nodeconfig import parse_nodeport_addresses

EXIT_OK, EXIT_FAILED, EXIT_REJECTED = 0, 1, 2
"""0 all applied; 1 the kernel write failed or nothing could be done; 2 some objects rejected, the rest applied."""
D = ProxyConfig  # the defaults (class attributes of the dataclass)
_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration(text: str) -> float:
    """A kube-proxy style duration ("30s", "1m", "500ms") or plain seconds, for flags."""
    m = _DURATION.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 30s, 1m, 500ms)")
    return float(m.group("n")) * _UNITS[m.group("unit")]


def cidr_list(text: str) -> Tuple[object, ...]:
    try:
        return parse_cidrs(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def nodeport_addresses(text: str) -> Tuple[object, ...]:
    """CIDRs and kube-proxy's keywords (``primary``, ``localhost``, ``all``), comma-separated, in
    any combination (kube-proxy 1.37; before it ``primary`` only alone, which this accepts too)."""
    try:
        return parse_nodeport_addresses(text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def flag_bool(text: str) -> bool:
    """A Go-style boolean flag value (``--iptables-localhost-nodeports=false``)."""
    value = text.strip().lower()
    if value in ("true", "1", "t", "yes"):
        return True
    if value in ("false", "0", "f", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def interface_name(text: str) -> str:
    if not text:
        return ""  # unset (argparse runs a string default through this too)
    try:
        return check_interface_name(text, "interface")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def interface_prefix(text: str) -> str:
    if not text:
        return ""  # unset (argparse runs a string default through this too)
    try:
        return check_interface_name(text, "interface prefix", prefix=True)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _note_given(namespace: argparse.Namespace, dest: str) -> None:
    given = set(getattr(namespace, "given", ()))
    given.add(dest)
    namespace.given = given


class _Store(argparse._StoreAction):
    """``store`` that notes the flag as given on the command line: a --config file does not override it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Union[str, Sequence[Any], None], option_string: Optional[str] = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


class _StoreTrue(argparse._StoreTrueAction):
    """``store_true`` that notes the flag as given (see _Store)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Union[str, Sequence[Any], None], option_string: Optional[str] = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="log lines as text or JSON")


def _add_writers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iptables-writer", default=D.iptables_writer, choices=list(IPTABLES_WRITERS),
                   help="iptables backend: atomic iptables-restore (default) or in-process libiptc")
    p.add_argument("--iptables-flavour", default="auto", choices=["auto", "legacy", "nft"],
                   help="iptables backend: which iptables the node uses (auto: ask `iptables --version`)")
    p.add_argument("--nftables-writer", default=D.nftables_writer, choices=list(NFTABLES_WRITERS),
                   help="nftables backend: its own netlink batches (default) or libnftables (nft text)")


def _add_common(p: argparse.ArgumentParser, backends: Sequence[str] = BACKENDS) -> None:
    _add_logging(p)
    shown = [b for b in backends if b != "fake"]  # the in-memory test backend: accepted, not advertised

    def backend_name(text: str) -> str:
        if text not in backends:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(shown)})")
        return text

    p.add_argument("--backend", default=D.backend, type=backend_name, action=_Store,
                   metavar="{" + ",".join(shown) + "}",
                   help="dataplane; auto runs the iptables version check (see `netproxy detect`)")
    _add_writers(p)


def _add_proxy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="kube-proxy's KubeProxyConfiguration (kubeadm's ConfigMap "
                   "config.conf, or the ConfigMap itself); flags given here win over it")
    p.add_argument("--sync-period", type=duration, default=D.sync_period, action=_Store,
                   help=f"full resync at least this often ({D.sync_period:g}s)")
    p.add_argument("--min-sync-period", type=duration, default=D.min_sync_period, action=_Store,
                   help=f"sync at most this often ({D.min_sync_period:g}s)")
    p.add_argument("--masquerade-all", action=_StoreTrue, help="SNAT all traffic to service addresses")
    p.add_argument("--masquerade-bit", type=int, default=D.masquerade_bit, action=_Store,
                   help=f"fwmark bit for traffic to SNAT ({D.masquerade_bit})")
    p.add_argument("--cluster-cidr", type=cidr_list, default=D.cluster_cidrs, action=_Store,
                   help="pod CIDRs, comma-separated")
    p.add_argument("--hostname-override", default="", action=_Store,
                   help="this node's name (default: the host name)")
    p.add_argument("--nodeport-addresses", type=nodeport_addresses, default=D.nodeport_addresses, action=_Store,
                   help="CIDRs of node addresses that accept NodePorts, and the keywords primary (the Node's "
                   "primary IPs), localhost, all; default: all local addresses (nftables: primary)")
    p.add_argument("--iptables-localhost-nodeports", type=flag_bool, default=D.localhost_nodeports, nargs="?",
                   const=True, action=_Store, metavar="BOOL",
                   help="iptables backend: NodePorts answer on 127.0.0.1 too (sets route_localnet, as kube-proxy "
                   f"does); default {str(D.localhost_nodeports).lower()}")
    p.add_argument("--detect-local-mode", choices=list(LOCAL_MODES), default=D.detect_local_mode, action=_Store,
                   help="what tells traffic from this node's pods: ClusterCIDR (--cluster-cidr), NodeCIDR "
                   "(the Node's spec.podCIDRs), BridgeInterface, InterfaceNamePrefix")
    p.add_argument("--pod-bridge-interface", type=interface_name, default=D.pod_bridge_interface, action=_Store,
                   help="BridgeInterface mode: the bridge the pods are on")
    p.add_argument("--pod-interface-name-prefix", type=interface_prefix,
                   default=D.pod_interface_name_prefix, action=_Store,
                   help="InterfaceNamePrefix mode: the prefix of the pods' interfaces (e.g. veth)")
    p.add_argument("--service-cluster-ip-range", type=cidr_list, default=D.service_cidrs, action=_Store,
                   help="service CIDRs, comma-separated (with the API source's ServiceCIDR objects): traffic "
                        "to an address inside them that no service owns is dropped")
    p.add_argument("--iptables-lock-timeout", type=duration, default=D.iptables_lock_timeout, action=_Store,
                   help="legacy iptables: wait at most this long for the xtables lock (/run/xtables.lock) "
                   "another program holds, then fail the sync naming the holder and retry "
                   f"({D.iptables_lock_timeout:g}s, kube-proxy's -w 5)")
    p.add_argument("--feature-gates", type=feature_gates, default={}, action=_Store, metavar="Name=BOOL,...",
                   help="kube-proxy's feature gates netproxy has: " + ", ".join(sorted(features.GATES)) +
                   " (an unknown gate is an error)")
    _add_conntrack(p)


def feature_gates(text: str) -> Dict[str, bool]:
    try:
        return features.parse(text)
    except features.GateError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_conntrack(p: argparse.ArgumentParser) -> None:
    """kube-proxy's --conntrack-* flags: sysctls set at start by sync and run (netproxy/node/ctsysctl.py).
    Unset (the default) leaves the kernel's value, where kube-proxy would apply its own defaults."""
    g = p.add_argument_group("conntrack (set at start by sync and run; unset: the kernel's value is kept)")
    g.add_argument("--conntrack-max-per-core", type=_count, default=None, action=_Store, metavar="N",
                   help="nf_conntrack_max = N x CPUs (at least --conntrack-min, at most 1048576); 0 leaves it")
    g.add_argument("--conntrack-min", type=_count, default=None, action=_Store, metavar="N",
                   help="the least nf_conntrack_max that --conntrack-max-per-core sets")
    g.add_argument("--conntrack-tcp-timeout-established", type=duration, default=None, action=_Store,
                   metavar="DURATION", help="nf_conntrack_tcp_timeout_established (e.g. 24h)")
    g.add_argument("--conntrack-tcp-timeout-close-wait", type=duration, default=None, action=_Store,
                   metavar="DURATION", help="nf_conntrack_tcp_timeout_close_wait (e.g. 1h)")
    g.add_argument("--conntrack-tcp-be-liberal", action=_StoreTrue,
                   help="nf_conntrack_tcp_be_liberal = 1 (accept out-of-window TCP packets)")
    g.add_argument("--conntrack-udp-timeout", type=duration, default=None, action=_Store, metavar="DURATION",
                   help="nf_conntrack_udp_timeout")
    g.add_argument("--conntrack-udp-timeout-stream", type=duration, default=None, action=_Store,
                   metavar="DURATION", help="nf_conntrack_udp_timeout_stream")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _add_source(p: argparse.ArgumentParser, file_help: str = "manifest file or directory",
                verb: str = "list", neither: str = "in a pod without either flag: its service account") -> None:
    """Where the cluster comes from, the same for every command that reads it: manifests, or the API
    (a kubeconfig, or the pod's service account when neither flag is given inside a cluster)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--source", help=file_help)
    src.add_argument("--kubeconfig", action=_Store,
                     help=f"{verb} the Kubernetes API with this kubeconfig ({neither})")
    p.add_argument("--use-endpoints", action="store_true", help="read v1 Endpoints instead of EndpointSlices")


def interval(text: str) -> float:
    value = duration(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"{text!r} is shorter than 100ms")
    return value


def service_name(text: str) -> str:
    """``--service NS/NAME``: a namespace and a name (checked as the source checks them, loosely)."""
    if text and not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAMESPACE/NAME")
    return text


def _add_top(sub: Any) -> None:
    p = sub.add_parser("top", help="where each service port's connections go, live, from conntrack")
    _add_source(p, "manifest file or directory", neither="neither flag: the names of netproxy's rules in the kernel")
    p.add_argument("--interval", type=interval, default=1.0, metavar="DURATION", help="refresh period (default 1s)")
    p.add_argument("--once", action="store_true", help="print the figures of one interval and exit")
    p.add_argument("-o", "--output", default="table", choices=["table", "json"], help="with --once")
    p.add_argument("--service", type=service_name, default="", metavar="NS/NAME", help="this service's ports only")
    p.add_argument("--sort", default="connections", choices=["connections", "imbalance", "name"])
    p.add_argument("--filter", default="", metavar="TEXT", help="ports whose namespace/name:port contains TEXT")
    p.add_argument("--clients", type=_count, nargs="?", const=5, default=0, metavar="N",
                   help="the N (default 5) client addresses with the most connections to each endpoint")
    p.add_argument("--hostname-override", default="", help="this node's name (topology, Local traffic policies)")
    _add_common(p, ("auto", "iptables", "nftables"))


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; 2 means "some objects rejected, the rest applied" here,
    which would be a lie: nothing was applied, so a usage error exits 1."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_FAILED, f"{self.prog}: error: {message}\n")


class _Version(argparse.Action):
    """argparse's ``version`` action wants the text when the parser is built; reading the installed
    version costs an import every command would pay, so it is read only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        sys.stdout.write(f"netproxy {version()}\n")  # stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="netproxy", description="Node service proxy: Kubernetes Services "
                                     "to iptables or nftables rules.")
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("sync", help="load the source, sync once, exit (0 ok, 1 write failed, 2 rejected)")
    _add_source(p)
    _add_common(p)
    _add_proxy(p)
    p = sub.add_parser("run", help="the long-running proxy: watch the source, keep the rules in sync")
    _add_source(p, "manifest file or directory, watched for changes", "watch")
    p.add_argument("--init-only", action="store_true",
                   help="kube-proxy's flag: the set-up that needs full privileges (conntrack sysctls, "
                        "route_localnet, the backend's kernel modules), then exit 0 without a source or a rule "
                        "written; the proxy then runs with NET_ADMIN and NET_RAW only (deploy/daemonset.yaml)")
    p.add_argument("--metrics-bind-address", default=D.metrics_bind_address, action=_Store,
                   help="host:port for /metrics ('' off)")
    p.add_argument("--healthz-bind-address", default=D.healthz_bind_address, action=_Store,
                   help="host:port for /healthz ('' off)")
    _add_common(p)
    _add_proxy(p)
    p = sub.add_parser("plan", help="print the ruleset that sync would write, touching nothing")
    _add_source(p)
    p.add_argument("--diff", action="store_true", help="show what a sync would change against the kernel now, "
                   "by service (exit 0 same, 1 differs, 2 bad input or unreadable kernel); writes nothing")
    _add_common(p)
    _add_proxy(p)
    p = sub.add_parser("trace", help="where a packet to a service address would go, and why; touches nothing")
    _add_source(p, "manifest file or directory (none with --kernel: the kernel's rules are traced)")
    p.add_argument("--to", required=True, metavar="ADDRESS:PORT",
                   help="destination, e.g. 10.96.0.10:53 or [fd00::10]:80")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "udp", "sctp"])
    p.add_argument("--from", dest="source_address", default=None, metavar="ADDRESS",
                   help="the client's address (default: 203.0.113.1, outside the cluster; with --from-node "
                   "the first --node-address of the destination's family): with --from-node, the address "
                   "the node sends from, e.g. a load-balancer IP the node holds")
    p.add_argument("--from-node", action="store_true", help="the connection starts on the node itself")
    p.add_argument("--from-interface", default="", type=interface_name, metavar="IFNAME",
                   help="the interface the connection comes in on (--detect-local-mode BridgeInterface, "
                   "InterfaceNamePrefix)")
    p.add_argument("--node-address", action="append", default=[], metavar="ADDRESS",
                   help="this node's addresses (NodePorts, the node's own traffic); repeat")
    p.add_argument("--kernel", action="store_true", help="trace the rules the kernel holds now instead of the "
                   "rendered ones (either backend; --node-address defaults to this node's addresses)")
    _add_common(p, ("auto", "nftables", "iptables"))
    _add_proxy(p)
    p = sub.add_parser("status", help="what a running `netproxy run` has programmed, from its /metrics and /healthz")
    p.add_argument("--metrics-address", default=D.metrics_bind_address, help="the run's --metrics-bind-address")
    p.add_argument("--healthz-address", default="127.0.0.1:" + D.healthz_bind_address.rpartition(":")[2],
                   help="the run's --healthz-bind-address ('' skip)")
    p.add_argument("-o", "--output", default="table", choices=["table", "json"])
    p.add_argument("--kernel", action="store_true", help="also list the service ports -> endpoints the kernel "
                   "holds now (read with iptables-save / nft list; the backend from --backend or the version check)")
    _add_common(p, ("auto", "iptables", "nftables"))
    _add_top(sub)
    p = sub.add_parser("detect", help="print the backend the version check picks and the evidence")
    _add_logging(p)
    p = sub.add_parser("migrate", help="switch this node's dataplane live: program the new one in full, check it, "
                       "then remove the old one (0 ok, 1 a step failed, 2 rejected objects)")
    p.add_argument("--to", required=True, choices=["nftables", "iptables"], help="the dataplane to switch to")
    p.add_argument("--from-kube-proxy", action="store_true",
                   help="take over from kube-proxy: remove its rules (KUBE-* chains, kube-proxy tables), only those")
    _add_source(p)
    _add_logging(p)
    _add_writers(p)
    _add_proxy(p)
    p = sub.add_parser("cleanup", help="remove every rule, chain and table netproxy created, nothing else")
    _add_common(p, BACKENDS + ("all",))
    p.set_defaults(backend="all")
    return parser
