"""``netproxy`` — the command line.  This contract is relied on from outside: keep it stable.

    netproxy sync    --source PATH [--backend B] [--iptables-writer W]   sync once, exit 0/1/2
    netproxy run     --source PATH | --kubeconfig PATH                   the long-running proxy
    netproxy plan    --source PATH [--backend B] [--diff]                print the ruleset (or its diff with the kernel)
    netproxy status  [--metrics-address A] [-o json]                    what a running `run` has programmed
    netproxy detect                                                      the version check's choice, what the node holds
    netproxy migrate --to nftables|iptables [--from-kube-proxy] --source PATH   switch the live dataplane
    netproxy cleanup [--backend B|all]                                   remove what netproxy created

Exit codes: 0 all applied; 1 the kernel write failed (previous ruleset kept) or nothing could be
done; 2 some objects were rejected (each named on stderr) and the valid rest was applied.

sync, run, plan and trace take --config FILE, kube-proxy's KubeProxyConfiguration (netproxy/kpconfig.py):
flags given on the command line win over it; a field in it that is wrong or cannot be honoured exits 2,
naming the field, before anything is done.
"""

from __future__ import annotations

import argparse
import gc
import logging
import re
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, List, NoReturn, Optional, Protocol, Sequence, Tuple, Union

from netproxy import ctsysctl, logs, skew
from netproxy import detect as detect_mod
from netproxy.backends import BackendError, create
from netproxy.backends.base import Backend, Packet
from netproxy.config import (
    BACKENDS,
    IPTABLES_WRITERS,
    LOCAL_MODES,
    NFTABLES_WRITERS,
    ProxyConfig,
    check_interface_name,
    parse_cidrs,
)
from netproxy.model import Changes, NodeInfo, Snapshot, ValidationError, forget_parsed_addresses
from netproxy.nodeconfig import (
    PRIMARY,
    ConfigError,
    ensure_localhost_nodeports,
    hostname,
    local_detection,
    needs_node,
    nodeport_cidrs,
    parse_nodeport_addresses,
    start_node,
)
from netproxy.source.files import FileSource, Loaded, SourceError, load
from netproxy.tracker import ChangeTracker

if TYPE_CHECKING:  # the proxier pulls in prometheus_client: only `run` needs it, so import it there
    from netproxy.proxier import Proxier


class Source(Protocol):
    def start(self, tracker: ChangeTracker) -> None: ...

    def stop(self) -> None: ...

log = logging.getLogger("netproxy")

EXIT_OK, EXIT_FAILED, EXIT_REJECTED = 0, 1, 2
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
    p.add_argument("--iptables-writer", default="restore", choices=list(IPTABLES_WRITERS),
                   help="iptables backend: atomic iptables-restore (default) or in-process libiptc")
    p.add_argument("--iptables-flavour", default="auto", choices=["auto", "legacy", "nft"],
                   help="iptables backend: which iptables the node uses (auto: ask `iptables --version`)")
    p.add_argument("--nftables-writer", default="netlink", choices=list(NFTABLES_WRITERS),
                   help="nftables backend: its own netlink batches (default) or libnftables (nft text)")


def _add_common(p: argparse.ArgumentParser, backends: Sequence[str] = BACKENDS) -> None:
    _add_logging(p)
    shown = [b for b in backends if b != "fake"]  # the in-memory test backend: accepted, not advertised

    def backend_name(text: str) -> str:
        if text not in backends:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(shown)})")
        return text

    p.add_argument("--backend", default="auto", type=backend_name, action=_Store, metavar="{" + ",".join(shown) + "}",
                   help="dataplane; auto runs the iptables version check (see `netproxy detect`)")
    _add_writers(p)


def _add_proxy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="kube-proxy's KubeProxyConfiguration (kubeadm's ConfigMap "
                   "config.conf, or the ConfigMap itself); flags given here win over it")
    p.add_argument("--sync-period", type=duration, default=30.0, action=_Store,
                   help="full resync at least this often (30s)")
    p.add_argument("--min-sync-period", type=duration, default=1.0, action=_Store,
                   help="sync at most this often (1s)")
    p.add_argument("--masquerade-all", action=_StoreTrue, help="SNAT all traffic to service addresses")
    p.add_argument("--masquerade-bit", type=int, default=14, action=_Store, help="fwmark bit for traffic to SNAT (14)")
    p.add_argument("--cluster-cidr", type=cidr_list, default=(), action=_Store, help="pod CIDRs, comma-separated")
    p.add_argument("--hostname-override", default="", action=_Store,
                   help="this node's name (default: the host name)")
    p.add_argument("--nodeport-addresses", type=nodeport_addresses, default=(), action=_Store,
                   help="CIDRs of node addresses that accept NodePorts, and the keywords primary (the Node's "
                   "primary IPs), localhost, all; default: all local addresses (nftables: primary)")
    p.add_argument("--iptables-localhost-nodeports", type=flag_bool, default=True, nargs="?", const=True,
                   action=_Store, metavar="BOOL", help="iptables backend: NodePorts answer on 127.0.0.1 too "
                   "(sets route_localnet, as kube-proxy does); default true")
    p.add_argument("--detect-local-mode", choices=list(LOCAL_MODES), default="ClusterCIDR", action=_Store,
                   help="what tells traffic from this node's pods: ClusterCIDR (--cluster-cidr), NodeCIDR "
                   "(the Node's spec.podCIDRs), BridgeInterface, InterfaceNamePrefix")
    p.add_argument("--pod-bridge-interface", type=interface_name, default="", action=_Store,
                   help="BridgeInterface mode: the bridge the pods are on")
    p.add_argument("--pod-interface-name-prefix", type=interface_prefix, default="", action=_Store,
                   help="InterfaceNamePrefix mode: the prefix of the pods' interfaces (e.g. veth)")
    p.add_argument("--service-cluster-ip-range", type=cidr_list, default=(), action=_Store,
                   help="service CIDRs, comma-separated (with the API source's ServiceCIDR objects): traffic "
                        "to an address inside them that no service owns is dropped")
    p.add_argument("--iptables-lock-timeout", type=duration, default=5.0, action=_Store,
                   help="legacy iptables: wait at most this long for the xtables lock (/run/xtables.lock) "
                   "another program holds, then fail the sync naming the holder and retry (5s, kube-proxy's -w 5)")
    _add_conntrack(p)


def _add_conntrack(p: argparse.ArgumentParser) -> None:
    """kube-proxy's --conntrack-* flags: sysctls set at start by sync and run (netproxy/ctsysctl.py).
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


def conntrack_settings(args: argparse.Namespace) -> ctsysctl.ConntrackSettings:
    return ctsysctl.ConntrackSettings(
        max_per_core=getattr(args, "conntrack_max_per_core", None), min=getattr(args, "conntrack_min", None),
        tcp_established_timeout=getattr(args, "conntrack_tcp_timeout_established", None),
        tcp_close_wait_timeout=getattr(args, "conntrack_tcp_timeout_close_wait", None),
        tcp_be_liberal=bool(getattr(args, "conntrack_tcp_be_liberal", False)),
        udp_timeout=getattr(args, "conntrack_udp_timeout", None),
        udp_stream_timeout=getattr(args, "conntrack_udp_timeout_stream", None))


def _kernel(backend: Backend) -> bool:
    """Whether the backend programs this namespace's kernel (the in-memory test backend does not:
    conntrack and sysctls are then left alone)."""
    return bool(backend.name != "fake")


def _set_conntrack_sysctls(args: argparse.Namespace, backend: Backend) -> None:
    """kube-proxy's platformSetup: a setting that cannot be applied stops the start (SysctlError)."""
    if _kernel(backend):
        ctsysctl.apply(conntrack_settings(args))


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; 2 means "some objects rejected, the rest applied" here,
    which would be a lie: nothing was applied, so a usage error exits 1."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_FAILED, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="netproxy", description="Node service proxy: Kubernetes Services "
                                     "to iptables or nftables rules.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("sync", help="load the source, sync once, exit (0 ok, 1 write failed, 2 rejected)")
    p.add_argument("--source", required=True, help="manifest file or directory")
    _add_common(p)
    _add_proxy(p)
    p = sub.add_parser("run", help="the long-running proxy: watch the source, keep the rules in sync")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--source", help="manifest file or directory, watched for changes")
    src.add_argument("--kubeconfig", action=_Store, help="read the Kubernetes API with this kubeconfig")
    p.add_argument("--use-endpoints", action="store_true", help="read v1 Endpoints instead of EndpointSlices")
    p.add_argument("--metrics-bind-address", default="127.0.0.1:10249", action=_Store,
                   help="host:port for /metrics ('' off)")
    p.add_argument("--healthz-bind-address", default="0.0.0.0:10256", action=_Store,
                   help="host:port for /healthz ('' off)")
    _add_common(p)
    _add_proxy(p)
    p = sub.add_parser("plan", help="print the ruleset that sync would write, touching nothing")
    p.add_argument("--source", required=True, help="manifest file or directory")
    p.add_argument("--diff", action="store_true", help="show what a sync would change against the kernel now, "
                   "by service (exit 0 same, 1 differs, 2 bad input or unreadable kernel); writes nothing")
    _add_common(p)
    _add_proxy(p)
    p = sub.add_parser("trace", help="where a packet to a service address would go, and why; touches nothing")
    p.add_argument("--source", required=True, help="manifest file or directory")
    p.add_argument("--to", required=True, metavar="ADDRESS:PORT",
                   help="destination, e.g. 10.96.0.10:53 or [fd00::10]:80")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "udp", "sctp"])
    p.add_argument("--from", dest="source_address", default="203.0.113.1", metavar="ADDRESS",
                   help="the client's address (default: outside the cluster)")
    p.add_argument("--from-node", action="store_true", help="the connection starts on the node itself")
    p.add_argument("--from-interface", default="", type=interface_name, metavar="IFNAME",
                   help="the interface the connection comes in on (--detect-local-mode BridgeInterface, "
                   "InterfaceNamePrefix)")
    p.add_argument("--node-address", action="append", default=[], metavar="ADDRESS",
                   help="this node's addresses (NodePorts, the node's own traffic); repeat")
    p.add_argument("--kernel", action="store_true", help="trace the rules the kernel holds now instead of the "
                   "rendered ones (iptables backend)")
    _add_common(p, ("auto", "nftables", "iptables"))
    _add_proxy(p)
    p = sub.add_parser("status", help="what a running `netproxy run` has programmed, from its /metrics and /healthz")
    p.add_argument("--metrics-address", default="127.0.0.1:10249", help="the run's --metrics-bind-address")
    p.add_argument("--healthz-address", default="127.0.0.1:10256", help="the run's --healthz-bind-address ('' skip)")
    p.add_argument("-o", "--output", default="table", choices=["table", "json"])
    p.add_argument("--kernel", action="store_true", help="also list the service ports -> endpoints the kernel "
                   "holds now (read with iptables-save / nft list; the backend from --backend or the version check)")
    _add_common(p, ("auto", "iptables", "nftables"))
    p = sub.add_parser("detect", help="print the backend the version check picks and the evidence")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="log lines as text or JSON")
    p = sub.add_parser("migrate", help="switch this node's dataplane live: program the new one in full, check it, "
                       "then remove the old one (0 ok, 1 a step failed, 2 rejected objects)")
    p.add_argument("--to", required=True, choices=["nftables", "iptables"], help="the dataplane to switch to")
    p.add_argument("--from-kube-proxy", action="store_true",
                   help="take over from kube-proxy: remove its rules (KUBE-* chains, kube-proxy tables), only those")
    p.add_argument("--source", required=True, help="manifest file or directory")
    _add_logging(p)
    _add_writers(p)
    _add_proxy(p)
    p = sub.add_parser("cleanup", help="remove every rule, chain and table netproxy created, nothing else")
    _add_common(p, BACKENDS + ("all",))
    p.set_defaults(backend="all")
    return parser


def _config(args: argparse.Namespace, backend: str, flavour: str, node: Optional[NodeInfo] = None) -> ProxyConfig:
    return ProxyConfig(
        backend=backend, iptables_writer=args.iptables_writer, iptables_flavour=flavour,
        nftables_writer=args.nftables_writer,
        sync_period=getattr(args, "sync_period", 30.0), min_sync_period=getattr(args, "min_sync_period", 1.0),
        masquerade_all=getattr(args, "masquerade_all", False), masquerade_bit=getattr(args, "masquerade_bit", 14),
        cluster_cidrs=tuple(getattr(args, "cluster_cidr", ())),
        hostname=hostname(args),
        nodeport_addresses=nodeport_cidrs(args, node),
        localhost_nodeports=getattr(args, "iptables_localhost_nodeports", True) is not False,
        service_cidrs=tuple(getattr(args, "service_cluster_ip_range", ())),
        one_shot=getattr(args, "one_shot", False),
        **local_detection(args, node),
        iptables_lock_timeout=getattr(args, "iptables_lock_timeout", 5.0),
    )


def choose_backend(args: argparse.Namespace) -> Tuple[str, str]:
    """(backend, iptables flavour) from the flags, running the version check where they say auto."""
    flavour = args.iptables_flavour
    if args.backend == "auto":
        decision = detect_mod.detect()
        log.info("backend %s: %s", decision.backend, decision.reason)
        backend = decision.backend
        if flavour == "auto":
            flavour = decision.flavour or "legacy"
    else:
        backend = args.backend
    if flavour == "auto":
        # Only the iptables backend cares which iptables the node has; don't probe for the others.
        flavour = detect_mod.iptables_flavour() if backend == "iptables" else "legacy"
    return backend, flavour


def make_backend(args: argparse.Namespace, node: Optional[NodeInfo] = None,
                 read_node: Optional[Callable[[], Optional[NodeInfo]]] = None) -> Tuple[Backend, ProxyConfig]:
    """The backend and its configuration; ``node`` (or ``read_node()``, asked only when the
    configuration needs the Node) gives NodeCIDR's pod CIDRs and ``primary``'s addresses."""
    backend, flavour = choose_backend(args)
    chosen = set(getattr(args, "given", ())) | set(getattr(args, "from_config", ()))
    if backend == "nftables" and hasattr(args, "nodeport_addresses") and "nodeport_addresses" not in chosen:
        args.nodeport_addresses = (PRIMARY,)  # kube-proxy's nftables mode default (its platformApplyDefaults)
    if node is None and read_node is not None and needs_node(args):
        node = read_node()
    config = _config(args, backend, flavour, node)
    return create(backend, config), config


def _report_rejections(errors: Sequence[Exception]) -> None:
    for err in errors:
        print(f"netproxy: rejected {err}", file=sys.stderr)


def _load(args: argparse.Namespace) -> Loaded:
    """One load of --source, for the one-shot commands.  They end after one write, and nothing they
    build forms cycles: the cyclic collector stays off for their whole life."""
    gc.disable()
    return load(args.source, hostname(args))


def _snapshot(loaded: Loaded, config: ProxyConfig) -> Tuple[Snapshot, List[ValidationError]]:
    """The loaded --source as the snapshot a one-shot command syncs, plans or traces."""
    tracker = ChangeTracker(NodeInfo(name=config.hostname), service_cidrs=config.service_cidrs)
    tracker.replace_service_cidrs(loaded.service_cidrs)
    if loaded.node is not None:
        tracker.set_node(loaded.node)
    if config.nodeport_addresses:
        from netproxy.nodeaddr import local_addresses

        tracker.set_node_addresses(local_addresses(config.nodeport_addresses))
    tracker.replace_services(loaded.services)
    tracker.replace_endpoints(loaded.endpoints)
    forget_parsed_addresses()  # no reload follows: the memory goes to the sync instead
    return tracker.take()[0], loaded.errors


def cmd_sync(args: argparse.Namespace) -> int:
    args.one_shot = True
    loaded = _load(args)
    backend, config = make_backend(args, loaded.node)
    snapshot, errors = _snapshot(loaded, config)
    backend.probe()
    ensure_localhost_nodeports(backend.name, config)
    _set_conntrack_sysctls(args, backend)
    skew.settle(backend.name, config)  # rules a newer iptables-nft wrote: refused before any write
    _report_rejections(errors)  # before the write, so that they are named even when it fails
    result = backend.sync(snapshot, Changes(full=True))
    log.info("synced %d service ports with the %s backend", result.services_written, backend.name)
    if _kernel(backend):
        # The reconciler compares the kernel's table with this state, so a one-shot sync cleans the
        # flows an earlier process's rules left stale (no previous snapshot needed).
        from netproxy.conntrack import Reconciler, desired_state

        Reconciler().reconcile(desired_state(snapshot))
    if backend.name in ("iptables", "nftables"):
        from netproxy import migrate

        # The other dataplane's rules (netproxy's or kube-proxy's) go now that the new ruleset is whole.
        migrate.remove_leftovers(backend, config, skip_written=True)
    return EXIT_REJECTED if errors else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        loaded = _load(args)
    except SourceError as err:
        if not args.diff:
            raise
        print(f"netproxy: source: {err}", file=sys.stderr)
        return EXIT_REJECTED  # with --diff, 1 means "differs": bad input is 2, as diff's trouble
    backend, config = make_backend(args, loaded.node)
    snapshot, errors = _snapshot(loaded, config)
    if args.diff:
        return _plan_diff(backend, config, snapshot, errors)
    sys.stdout.write(backend.plan(snapshot))
    _report_rejections(errors)
    return EXIT_REJECTED if errors else EXIT_OK


def _plan_diff(backend: Backend, config: ProxyConfig, snapshot: Snapshot, errors: Sequence[Exception]) -> int:
    """The diff convention: 0 the kernel matches, 1 it differs, 2 trouble (rejected input, or the
    kernel could not be read)."""
    from netproxy import plandiff
    from netproxy.backends import listing

    _report_rejections(errors)
    if errors:
        return EXIT_REJECTED
    try:
        lister = listing(backend.name, config)
        changes = plandiff.diff(lister.kernel(), lister.rendered(backend.plan(snapshot)), snapshot)
    except BackendError as err:
        print(f"netproxy plan --diff: {err}", file=sys.stderr)
        return EXIT_REJECTED
    sys.stdout.write(plandiff.render(changes))
    return EXIT_FAILED if changes else EXIT_OK


def cmd_trace(args: argparse.Namespace) -> int:
    from netproxy.trace import parse_destination, report

    if args.backend == "auto" and not args.kernel:
        args.backend = "nftables"  # a trace reads no kernel: the layout it follows is nftables'
    loaded = _load(args)
    backend, config = make_backend(args, loaded.node)
    tracer = getattr(backend, "trace", None)
    if tracer is None:
        print(f"netproxy trace: the {backend.name} backend has no tracer", file=sys.stderr)
        return EXIT_FAILED
    try:
        address, port = parse_destination(args.to)
    except ValueError as err:
        print(f"netproxy trace: --to: {err}", file=sys.stderr)
        return EXIT_FAILED
    snapshot, errors = _snapshot(loaded, config)
    local = frozenset(args.node_address)
    packet = Packet(args.node_address[0] if args.from_node and local else args.source_address, address, port,
                    args.protocol, hook="output" if args.from_node else "prerouting", local=local,
                    iif="" if args.from_node else args.from_interface)
    if args.kernel:
        from netproxy.backends import listing

        outcomes = listing(backend.name, config).trace(packet)
    else:
        outcomes = tracer(snapshot, packet)
    sys.stdout.write(report(packet, outcomes))
    _report_rejections(errors)
    return EXIT_REJECTED if errors else EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """0 when the proxy answers, has synced and /healthz is 200; 1 otherwise.  With --kernel the
    kernel's service ports are listed even when no proxy answers."""
    from netproxy.status import Status, read, render

    try:
        status, reached = read(args.metrics_address, args.healthz_address), True
    except OSError as err:
        print(f"netproxy status: no netproxy run answers on {args.metrics_address}: {err}", file=sys.stderr)
        if not args.kernel:
            return EXIT_FAILED
        status, reached = Status(), False
    ports = None
    if args.kernel:
        from netproxy.backends import listing

        name, flavour = choose_backend(args)
        ports = listing(name, _config(args, name, flavour)).programmed()
    sys.stdout.write(render(status, args.output, ports=ports))
    healthy = reached and status.health_code in (200, None) and bool(status.last_sync)
    return EXIT_OK if healthy else EXIT_FAILED


def cmd_detect(args: argparse.Namespace) -> int:
    try:
        decision = detect_mod.detect()
    except detect_mod.DetectError as err:
        print(f"backend: none\nreason: {err}")
        return EXIT_FAILED
    print(f"backend: {decision.backend}")
    if decision.flavour:
        print(f"iptables: {decision.flavour}")
    print(f"reason: {decision.reason}")
    for line in decision.evidence:
        print(f"evidence: {line}")
    _print_holdings(decision.backend)
    return EXIT_OK


def _print_holdings(chosen: str) -> None:
    """What the node holds now and what ``netproxy migrate`` would do about it (detect's second half)."""
    from netproxy import holdings, migrate

    held = holdings.survey()
    for ruleset in held.rulesets:
        marks = f", masquerade mark {', '.join(sorted(ruleset.marks))}" if ruleset.marks else ""
        print(f"holds: {ruleset}{marks}")
    if not held.rulesets:
        print("holds: no netproxy or kube-proxy rules")
    for why in held.unread:
        print(f"holds: unreadable: {why}")
    flavour = detect_mod.iptables_flavour() if chosen == "iptables" else ""
    target = holdings.Ruleset("netproxy", chosen, flavour)
    from_kube_proxy = bool(held.find("kube-proxy"))
    command = f"netproxy migrate --to {chosen}" + (" --from-kube-proxy" if from_kube_proxy else "")
    try:
        steps = migrate.plan(held, target, from_kube_proxy).describe()
    except migrate.MigrateError as err:
        print(f"migrate: `{command}` would refuse: {err}")
        return
    print(f"migrate: `{command}` would " + "; ".join(steps))


def cmd_migrate(args: argparse.Namespace) -> int:
    """0 switched; 1 a step failed (named; up to the check the old rules are untouched); 2 switched,
    with some objects rejected (each named)."""
    from netproxy import migrate

    args.backend = args.to  # --to wins over --config's mode
    args.one_shot = True
    loaded = _load(args)
    backend, config = make_backend(args, loaded.node)
    snapshot, errors = _snapshot(loaded, config)
    backend.probe()
    ensure_localhost_nodeports(backend.name, config)
    _report_rejections(errors)
    try:
        report = migrate.migrate(backend, config, snapshot, from_kube_proxy=args.from_kube_proxy)
    except migrate.MigrateError as err:
        print(f"netproxy migrate: {err.step}: {err}", file=sys.stderr)
        return EXIT_FAILED
    for line in report.lines():
        print(f"migrate: {line}")
    return EXIT_REJECTED if errors else EXIT_OK


def cmd_cleanup(args: argparse.Namespace) -> int:
    names: List[str] = ["iptables", "nftables"] if args.backend == "all" else [args.backend]
    status = EXIT_OK
    for name in names:
        if name == "auto":
            name = choose_backend(args)[0]
        flavours = ["legacy", "nft"] if name == "iptables" and args.iptables_flavour == "auto" else [
            args.iptables_flavour if args.iptables_flavour != "auto" else "legacy"]
        for flavour in flavours:
            try:
                backend = create(name, _config(args, name, flavour))
                backend.probe()
            except BackendError as err:
                log.info("cleanup: skipping %s (%s): %s", name, flavour, err)
                continue
            try:
                backend.cleanup()
            except BackendError as err:
                log.error("cleanup of %s failed: %s", name, err)
                status = EXIT_FAILED
    return status


def cmd_run(args: argparse.Namespace) -> int:
    from netproxy import metrics
    from netproxy.proxier import Proxier
    from netproxy.runner import BoundedFrequencyRunner

    source = _make_source(args, hostname(args))
    backend, config = make_backend(args, read_node=lambda: start_node(args, source))
    backend.probe()
    ensure_localhost_nodeports(backend.name, config)
    _set_conntrack_sysctls(args, backend)
    skew.settle(backend.name, config)
    # ETP/ITP Local need the node name from the start
    tracker = ChangeTracker(NodeInfo(name=config.hostname), service_cidrs=config.service_cidrs)
    proxier = Proxier(tracker, backend, config)
    runner = BoundedFrequencyRunner(proxier.sync, config.min_sync_period, config.sync_period,
                                    idle=proxier.check_tampering)
    proxier.retry = runner.retry_after
    proxier.request = runner.request
    tracker.on_change = lambda: _queued(tracker, proxier, runner.request)
    _add_post_sync_steps(proxier, config, args)
    stop = threading.Event()
    failed: List[str] = []
    if config.detect_local_mode == "NodeCIDR":
        def pod_cidrs_kept(prev: Optional[Snapshot], cur: Snapshot) -> None:
            # The rules were written for the pod CIDRs read at start; kube-proxy exits when they
            # change (its NodeManager) so that it starts again with the new ones: so does netproxy.
            if cur.node.pod_cidrs and cur.node.pod_cidrs != config.node_pod_cidrs:
                failed.append(f"the Node's spec.podCIDRs changed from {', '.join(map(str, config.node_pod_cidrs))} "
                              f"to {', '.join(map(str, cur.node.pod_cidrs))}: exiting to start again with them")
                stop.set()
                runner.wake()

        proxier.after_sync.append(pod_cidrs_kept)

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()
        runner.wake()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    metrics.set_families(metrics.families())  # the IPv4 series exist before the first sync
    metrics.serve(args.metrics_bind_address)
    if hasattr(backend, "on_lock_wait"):  # the iptables backend: its waits for the xtables lock
        backend.on_lock_wait = metrics.IPTABLES_LOCK_WAIT.observe
    metrics.BACKEND.labels(backend.name, config.nftables_writer if backend.name == "nftables"
                           else config.iptables_writer if backend.name == "iptables" else "").set(1)
    source.start(tracker)
    watcher = None
    if config.nodeport_addresses:
        from netproxy.nodeaddr import NodeAddressWatcher

        watcher = NodeAddressWatcher(config.nodeport_addresses)
        watcher.start(tracker)
    writer = {"nftables": config.nftables_writer, "iptables": config.iptables_writer}.get(backend.name, "-")
    chosen = ("the version check" if args.backend == "auto"
              else "--config's mode" if "backend" in getattr(args, "from_config", ()) else "--backend")
    log.info("running with the %s backend, writer %s, iptables flavour %s (chosen by %s; seen: %s)", backend.name,
             writer, config.iptables_flavour, chosen, detect_mod.tool_versions(backend.name, config.iptables_flavour))
    try:
        runner.loop(stop)
    finally:
        source.stop()
        if watcher is not None:
            watcher.stop()
    for why in failed:
        log.error("%s", why)
    return EXIT_FAILED if failed else EXIT_OK


def _queued(tracker: ChangeTracker, proxier: Proxier, request: Callable[[], None]) -> None:
    """A change reached the tracker: kube-proxy's queued-change metrics and health, then a sync."""
    from netproxy import metrics

    services, endpoints = tracker.pending_changes()
    for family in metrics.families():
        metrics.LAST_QUEUED.labels(family).set_to_current_time()
    metrics.SERVICE_CHANGES_PENDING.set(services)
    metrics.ENDPOINT_CHANGES_PENDING.set(endpoints)
    seen = proxier.changes_counted
    metrics.SERVICE_CHANGES.inc(tracker.service_changes - seen[0])
    metrics.ENDPOINT_CHANGES.inc(tracker.endpoint_changes - seen[1])
    metrics.REJECTED.inc(tracker.rejected - seen[2])
    proxier.changes_counted = (tracker.service_changes, tracker.endpoint_changes, tracker.rejected)
    if proxier.health is not None:
        proxier.health.queued()
    request()


def _add_post_sync_steps(proxier: Proxier, config: ProxyConfig, args: argparse.Namespace) -> None:
    """What kube-proxy does after writing rules: the conntrack reconciler and the health-check servers."""
    from netproxy.conntrack import Reconciler
    from netproxy.healthcheck import ProxyHealth, ServiceHealthServers

    reconciler = Reconciler(period=config.sync_period)
    services = ServiceHealthServers()
    health = ProxyHealth(2 * config.sync_period)  # kube-proxy's healthz timeout
    health.serve(args.healthz_bind_address)
    proxier.health = health

    if _kernel(proxier.backend):
        proxier.after_sync.append(reconciler.after_sync)
    proxier.after_sync.append(_leftovers_once(proxier))
    proxier.after_sync.append(lambda prev, cur: services.update(cur))
    proxier.after_sync.append(lambda prev, cur: health.synced())
    proxier.after_sync.append(lambda prev, cur: health.sync_node(cur.node))


def _leftovers_once(proxier: Proxier) -> Callable[[Optional[Snapshot], Snapshot], None]:
    """After the first successful sync (a full one: the new ruleset is complete), remove the rules of
    the other dataplane left by an earlier run (netproxy's or kube-proxy's) — ``netproxy migrate``'s
    order, at start-up."""
    done = [False]

    def step(prev: Optional[Snapshot], cur: Snapshot) -> None:
        if done[0] or proxier.backend.name not in ("iptables", "nftables"):
            return
        done[0] = True
        from netproxy import migrate

        migrate.remove_leftovers(proxier.backend, proxier.config)

    return step


def _make_source(args: argparse.Namespace, hostname: str) -> Source:
    """The file source for --source; otherwise the Kubernetes API (--kubeconfig, or in-cluster)."""
    if args.source:
        return FileSource(args.source, node_name=hostname)
    # Imported lazily: the kubernetes client is slow to import and file-source users never need it.
    from netproxy.source import kube

    try:
        client = kube.api_client_from(args.kubeconfig)
    except ValueError as err:
        raise SourceError(f"{err}; pass --source PATH or --kubeconfig PATH") from None
    return kube.KubeSource(client, hostname, use_endpoints=args.use_endpoints)


COMMANDS = {"sync": cmd_sync, "run": cmd_run, "plan": cmd_plan, "trace": cmd_trace, "status": cmd_status,
            "detect": cmd_detect, "migrate": cmd_migrate,
            "cleanup": cmd_cleanup}


def _read_config(args: argparse.Namespace) -> Optional[int]:
    """--config FILE onto the flags not given on the command line; an exit status when it cannot be used
    (1 unreadable, 2 a bad or unsupported value, named), None to go on."""
    from netproxy import kpconfig

    try:
        file_config = kpconfig.read(args.config)
    except OSError as err:
        print(f"netproxy: --config: {err}", file=sys.stderr)
        return EXIT_FAILED
    except kpconfig.ConfigFileError as err:
        print(f"netproxy: --config {err}", file=sys.stderr)
        return EXIT_REJECTED
    warning = file_config.warning()
    if warning:
        log.warning("--config %s: %s", args.config, warning)
    args.from_config = kpconfig.apply(args, file_config, getattr(args, "given", ()))
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level, getattr(args, "log_format", "text"))
    if getattr(args, "config", None):
        status = _read_config(args)
        if status is not None:
            return status
    try:
        return COMMANDS[args.command](args)
    except SourceError as err:
        print(f"netproxy: source: {err}", file=sys.stderr)
    except detect_mod.DetectError as err:
        print(f"netproxy: {err}", file=sys.stderr)
    except BackendError as err:
        print(f"netproxy: {err.kind} error: {err}", file=sys.stderr)
    except ctsysctl.SysctlError as err:
        print(f"netproxy: conntrack: {err}", file=sys.stderr)
    except ConfigError as err:
        print(f"netproxy: {err}", file=sys.stderr)
    except OSError as err:
        if getattr(err, "filename", None) and "/proc/sys/" in str(err.filename):
            print(f"netproxy: cannot set {err.filename}: {err.strerror}", file=sys.stderr)
        else:
            raise
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
