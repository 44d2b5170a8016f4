"""The commands that look and change nothing: status (what a running proxy has programmed) and
detect (the version check's choice and what the node holds)."""

from __future__ import annotations

import argparse
import sys

from netproxy.cli.args import EXIT_FAILED, EXIT_OK
from netproxy.cli.settings import choose_backend, proxy_config
from netproxy.node import detect as detect_mod


def cmd_status(args: argparse.Namespace) -> int:
    """0 when the proxy answers, has synced and /healthz is 200; 1 otherwise.  With --kernel the
    kernel's service ports are listed even when no proxy answers."""
    from netproxy.observe.status import Status, read, render

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
        ports = listing(name, proxy_config(args, name, flavour)).programmed()
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
    # A node fact of the nftables backend, printed whichever backend won: what `--backend nftables` renders.
    affinity = detect_mod.ipv6_affinity_layout()
    print(f"ipv6 affinity: {affinity.layout} ({affinity.reason})")
    _print_holdings(decision.backend)
    return EXIT_OK


def _print_holdings(chosen: str) -> None:
    """What the node holds now and what ``netproxy migrate`` would do about it (detect's second half)."""
    from netproxy.migration import holdings, migrate

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
