"""The commands that load --source once, act, and end: sync, plan, trace, migrate — and cleanup."""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import sys
from typing import Callable, FrozenSet, List, Optional, Sequence, Tuple

from netproxy.backends.base import Backend, BackendError, Packet
from netproxy.cli.args import EXIT_FAILED, EXIT_OK, EXIT_REJECTED
from netproxy.cli.settings import choose_backend, kube_client, make_backend, proxy_config, set_conntrack_sysctls
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, IPAddress, NodeInfo, Snapshot, ValidationError, forget_parsed_addresses
from netproxy.core.tracker import ChangeTracker
from netproxy.node import skew
from netproxy.node.nodeconfig import ensure_localhost_nodeports, hostname
from netproxy.source.files import Loaded, SourceError, load
from netproxy.wiring import is_kernel, new_backend

log = logging.getLogger("netproxy")


def _report_rejections(errors: Sequence[Exception]) -> None:
    for err in errors:
        print(f"netproxy: rejected {err}", file=sys.stderr)


def _load(args: argparse.Namespace) -> Loaded:
    """One load of --source (or one list of the API), for the one-shot commands.  They end after one
    write, and nothing they build forms cycles: the cyclic collector stays off for their whole life."""
    gc.disable()
    if args.source:
        return load(args.source, hostname(args), remember_addresses=False)
    if getattr(args, "kernel", False) and not args.kubeconfig:
        return Loaded()  # trace --kernel: the rules are the kernel's, no cluster needed
    from netproxy.source import kube

    return kube.load_once(kube_client(args), hostname(args), use_endpoints=args.use_endpoints)


Addresses = Callable[[], Sequence[IPAddress]]


def snapshot_of(loaded: Loaded, config: ProxyConfig,
                node_addresses: Optional[Addresses] = None) -> Tuple[Snapshot, List[ValidationError]]:
    """The loaded --source as the snapshot a one-shot command syncs, plans or traces.
    ``node_addresses``: the node's addresses inside ``--nodeport-addresses`` (default: this node's
    own, read from the kernel; the conformance suite gives a table's node's)."""
    tracker = ChangeTracker(NodeInfo(name=config.hostname), service_cidrs=config.service_cidrs,
                            external_ips=config.gate("AllowServiceExternalIPs"))
    tracker.replace_service_cidrs(loaded.service_cidrs)
    if loaded.node is not None:
        tracker.set_node(loaded.node)
    if config.nodeport_addresses:
        if node_addresses is None:
            from netproxy.node.nodeaddr import local_addresses

            tracker.set_node_addresses(local_addresses(config.nodeport_addresses))
        else:
            tracker.set_node_addresses(tuple(node_addresses()))
    tracker.replace_services(loaded.services)
    tracker.replace_endpoints(loaded.endpoints)
    forget_parsed_addresses()  # no reload follows: the memory goes to the sync instead
    return tracker.take()[0], loaded.errors


def _ready_to_write(args: argparse.Namespace) -> Tuple[Backend, ProxyConfig, Snapshot, List[ValidationError]]:
    """What a command that writes once needs: the backend (probed: its tools answer) and its
    configuration, the snapshot of --source and the objects it rejected; route_localnet set if asked."""
    args.one_shot = True
    loaded = _load(args)
    backend, config = make_backend(args, loaded.node)
    snapshot, errors = snapshot_of(loaded, config)
    backend.probe()
    ensure_localhost_nodeports(backend.name, config)
    return backend, config, snapshot, errors


def cmd_sync(args: argparse.Namespace) -> int:
    backend, config, snapshot, errors = _ready_to_write(args)
    set_conntrack_sysctls(args, backend)
    skew.settle(backend.name, config)  # rules a newer iptables-nft wrote: refused before any write
    _report_rejections(errors)  # before the write, so that they are named even when it fails
    result = backend.sync(snapshot, Changes(full=True))
    log.info("synced %d service ports with the %s backend", result.services_written, backend.name)
    if is_kernel(backend):
        # The reconciler compares the kernel's table with this state, so a one-shot sync cleans the
        # flows an earlier process's rules left stale (no previous snapshot needed).
        from netproxy.node.conntrack import Reconciler, desired_state

        Reconciler(metrics=False).reconcile(desired_state(snapshot))
    if backend.name in ("iptables", "nftables"):
        from netproxy.migration import migrate

        # The other dataplane's rules (netproxy's or kube-proxy's) go now that the new ruleset is whole.
        migrate.remove_leftovers(backend, config, skip_written=True)
    _keep_until_exit(args, backend, snapshot)
    return EXIT_REJECTED if errors else EXIT_OK


def _keep_until_exit(args: argparse.Namespace, *objects: object) -> None:
    """Hold the sync's last objects (the snapshot, the backend's record and transaction) on ``args``,
    which :func:`netproxy.cli.main` keeps until the program leaves by ``os._exit``: freed as this
    function's caller returned, their half-million objects cost 0.04 s each (snapshot; record) at
    10k x 10, about ten times that at 100k, for nothing.  Called from Python, they go with ``args``."""
    args.kept_until_exit = objects


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        loaded = _load(args)
    except SourceError as err:
        if not args.diff:
            raise
        print(f"netproxy: source: {err}", file=sys.stderr)
        return EXIT_REJECTED  # with --diff, 1 means "differs": bad input is 2, as diff's trouble
    backend, config = make_backend(args, loaded.node)
    snapshot, errors = snapshot_of(loaded, config)
    if args.diff:
        return _plan_diff(backend, config, snapshot, errors)
    sys.stdout.write(backend.plan(snapshot))
    _report_rejections(errors)
    return EXIT_REJECTED if errors else EXIT_OK


def _plan_diff(backend: Backend, config: ProxyConfig, snapshot: Snapshot, errors: Sequence[Exception]) -> int:
    """The diff convention: 0 the kernel matches, 1 it differs, 2 trouble (rejected input, or the
    kernel could not be read)."""
    from netproxy.backends import listing
    from netproxy.cli import plandiff

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


OUTSIDE_CLIENT = "203.0.113.1"
"""``trace``'s client when ``--from`` is not given: an address outside the cluster (TEST-NET-3)."""


def _trace_source(args: argparse.Namespace, destination: str, local: FrozenSet[str]) -> str:
    """The traced packet's source: ``--from``; else, from the node, a node address of the destination's
    family (the first ``--node-address``, or the lowest of the node's own); else an outside client."""
    if args.source_address:
        return str(args.source_address)
    if not args.from_node:
        return OUTSIDE_CLIENT
    family = ":" in destination
    named = [a for a in args.node_address if (":" in a) == family]
    own = sorted((a for a in local if (":" in a) == family and not ipaddress.ip_address(a).is_loopback),
                 key=ipaddress.ip_address)
    return (named or own or [OUTSIDE_CLIENT])[0]


def cmd_trace(args: argparse.Namespace) -> int:
    from netproxy.cli.trace import parse_destination, report

    loaded = _load(args)
    # auto: the backend this node's version check picks, as `sync` and `run` would (it reads the
    # node's iptables version, nothing else); said on stderr, since the answer follows its layout.
    backend, config = make_backend(args, loaded.node)
    if args.backend == "auto":
        print(f"netproxy trace: --backend auto: tracing the {backend.name} rules (this node's choice)", file=sys.stderr)
    tracer = getattr(backend, "trace", None)
    if tracer is None:
        print(f"netproxy trace: the {backend.name} backend has no tracer", file=sys.stderr)
        return EXIT_FAILED
    try:
        address, port = parse_destination(args.to)
    except ValueError as err:
        print(f"netproxy trace: --to: {err}", file=sys.stderr)
        return EXIT_FAILED
    snapshot, errors = snapshot_of(loaded, config)
    local = frozenset(args.node_address)
    if args.kernel and not local:
        # The kernel's rules are this node's: so are its addresses, unless the caller names others.
        from netproxy.node.nodeaddr import local_addresses

        local = frozenset(str(a) for a in local_addresses((ipaddress.ip_network("0.0.0.0/0"),
                                                           ipaddress.ip_network("::/0"))))
    packet = Packet(_trace_source(args, address, local), address, port,
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


def cmd_migrate(args: argparse.Namespace) -> int:
    """0 switched; 1 a step failed (named; up to the check the old rules are untouched); 2 switched,
    with some objects rejected (each named)."""
    from netproxy.migration import migrate

    args.backend = args.to  # --to wins over --config's mode
    backend, config, snapshot, errors = _ready_to_write(args)
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
                backend = new_backend(name, proxy_config(args, name, flavour))
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
