"""``netproxy run``: the long-running proxy.  netproxy/wiring.py builds its objects from the one
ProxyConfig; this starts them, runs until a signal (or a reason to start again), and stops them."""

from __future__ import annotations

import argparse
import logging
from typing import Any, List, Tuple

from netproxy import version
from netproxy.cli.args import EXIT_FAILED, EXIT_OK
from netproxy.cli.settings import conntrack_settings, make_backend, set_conntrack_sysctls
from netproxy.cli.signals import on_stop_signals
from netproxy.node import detect as detect_mod
from netproxy.node import skew
from netproxy.node.nodeconfig import ensure_localhost_nodeports, hostname, start_node
from netproxy.observe import zpages
from netproxy.source.base import Source
from netproxy.source.files import FileSource
from netproxy.wiring import build_proxy, writer

log = logging.getLogger("netproxy")


def cmd_run(args: argparse.Namespace) -> int:
    from netproxy import metrics

    if args.init_only:
        return init_only(args)
    # Read before the source is: importing the metadata reader after 10k services are loaded cost
    # 0.13 s in garbage collection passes over them.
    ver = version()
    source = make_source(args, hostname(args))
    backend, config = make_backend(args, read_node=lambda: start_node(args, source),
                                   lock_waits=metrics.IPTABLES_LOCK_WAIT.observe)
    backend.probe()
    ensure_localhost_nodeports(backend.name, config)
    set_conntrack_sysctls(args, backend)
    skew.settle(backend.name, config)
    proxy = build_proxy(config, backend, source)
    proxy.zpages = zpages.pages(config, zpages.conntrack_section(conntrack_settings(args)), args.feature_gates,
                                flag_values(args), ver, kubeconfig=args.kubeconfig or "")

    def _stop(signum: int) -> None:
        log.info("signal %d: stopping", signum)
        proxy.halt()

    on_stop_signals(_stop)
    proxy.start()
    chosen = ("the version check" if args.backend == "auto"
              else "--config's mode" if "backend" in getattr(args, "from_config", ()) else "--backend")
    log.info("netproxy %s running with the %s backend, writer %s, iptables flavour %s (chosen by %s; seen: %s)",
             ver, backend.name,
             writer(config, backend.name), config.iptables_flavour, chosen,
             detect_mod.tool_versions(backend.name, config.iptables_flavour))
    try:
        proxy.runner.loop(proxy.stop)
    finally:
        proxy.close()
    for why in proxy.failures:
        log.error("%s", why)
    return EXIT_FAILED if proxy.failures else EXIT_OK


def init_only(args: argparse.Namespace) -> int:
    """kube-proxy's ``--init-only``: what needs more than NET_ADMIN and NET_RAW, done once by a
    privileged init container — the backend's probe (which loads its kernel modules), route_localnet
    for NodePorts on 127.0.0.1 (iptables), the conntrack sysctls — then exit without reading a source
    or writing a rule.  The same settings in the proxy's own start then find them already made."""
    backend, config = make_backend(args)
    backend.probe()
    ensure_localhost_nodeports(backend.name, config)
    set_conntrack_sysctls(args, backend)
    log.info("netproxy %s: --init-only: the node is set up for the %s backend; exiting without writing rules",
             version(), backend.name)
    return EXIT_OK


INTERNAL = ("command", "given", "from_config")
"""Attributes argparse's namespace carries that are no flag."""


def flag_values(args: argparse.Namespace) -> List[Tuple[str, Any]]:
    """(flag name, effective value) of every flag ``run`` has, for /flagz (--config's values included)."""
    return [(name.replace("_", "-"), value) for name, value in vars(args).items() if name not in INTERNAL]


def make_source(args: argparse.Namespace, hostname: str) -> Source:
    """The file source for --source; otherwise the Kubernetes API (--kubeconfig, or in-cluster)."""
    if args.source:
        return FileSource(args.source, node_name=hostname)
    from netproxy.cli.settings import kube_client
    from netproxy.source import kube

    client = kube_client(args)
    return kube.KubeSource(client, hostname, use_endpoints=args.use_endpoints)
