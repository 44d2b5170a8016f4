"""``netproxy top``: where each service port's connections go, live or once, from conntrack.

The names come from the cluster (``--source``/``--kubeconfig``: endpoint states, and the expected
share from the same endpoint selection the backends use) or, with neither, from netproxy's rules in
the kernel (``status --kernel``'s listing).  Each refresh is one ctnetlink dump of every family and
protocol, counted into groups as it is read (netproxy/node/ctflows.py) and folded into figures by
netproxy/observe/traffic.py; the only history kept is the previous refresh's entry ids.  The live
view is netproxy/cli/toptui.py.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from typing import List, Optional, Set, Tuple

from netproxy.cli.args import EXIT_FAILED, EXIT_OK, EXIT_REJECTED
from netproxy.node import ctflows
from netproxy.node.ctnetlink import Ctnetlink
from netproxy.observe import toptable, traffic

log = logging.getLogger("netproxy")


class Sampler:
    """Refreshes: one dump of every family and protocol, folded with the previous refresh's ids."""

    def __init__(self, smap: traffic.ServiceMap, clients: int = 0, always: Tuple[str, ...] = ()) -> None:
        self.smap, self.clients, self.always = smap, clients, always
        self._ct = Ctnetlink()
        self._previous: Optional[Set[int]] = None
        self._at = 0.0

    def close(self) -> None:
        self._ct.close()

    def refresh(self) -> traffic.Report:
        now = time.monotonic()
        interval = now - self._at if self._previous is not None else None
        accounting = ctflows.accounting()
        # The cyclic collector paused for the refresh: reading 100,000 entries allocates a tuple each
        # (none kept, no cycle made), which set it off about 85 times a refresh, a full collection
        # every other refresh (bench/README.md, "netproxy top", has what pausing it saves).
        collecting = gc.isenabled()
        gc.disable()
        try:
            groups, sums, who = ctflows.count(self._ct, accounting, self.clients > 0)
            report, self._previous = traffic.fold(groups, sums, who, self.smap, self._previous, interval,
                                                  accounting, self.clients, self.always)
        finally:
            if collecting:
                gc.enable()
        self._at = now
        if self.always:  # --service: that service's ports only
            report.ports = [p for p in report.ports if p.name in self.always]
        return report


def service_map(args: argparse.Namespace) -> Tuple[traffic.ServiceMap, List[Exception]]:
    """From the cluster when a source is named, else from the kernel's rules; (map, rejected objects)."""
    if args.source or args.kubeconfig:
        from netproxy.cli.oneshot import _load, snapshot_of
        from netproxy.cli.settings import proxy_config

        loaded = _load(args)
        gc.enable()  # _load turns the collector off for one-shot commands; the live view runs on
        config = proxy_config(args, "nftables" if args.backend == "auto" else args.backend, "legacy", loaded.node)
        snapshot, errors = snapshot_of(loaded, config)
        return traffic.from_snapshot(snapshot), list(errors)
    from netproxy.backends import listing
    from netproxy.cli.settings import choose_backend, proxy_config

    name, flavour = choose_backend(args)
    return traffic.from_programmed(listing(name, proxy_config(args, name, flavour)).programmed()), []


def _wanted(smap: traffic.ServiceMap, service: str) -> Tuple[str, ...]:
    """The port names of ``--service NS/NAME`` (every port of it)."""
    return tuple(p.name for p in smap.ports if p.name == service or p.name.startswith(service + ":"))


def cmd_top(args: argparse.Namespace) -> int:
    """0 shown; 1 conntrack or the rules unreadable, or no terminal for the live view; 2 some objects
    of the source rejected (named), the figures shown with the rest."""
    if not args.once and not (sys.stdout.isatty() and sys.stdin.isatty()):
        print("netproxy top: the live view needs a terminal; use --once for a script", file=sys.stderr)
        return EXIT_FAILED
    smap, errors = service_map(args)
    for err in errors:
        print(f"netproxy: rejected {err}", file=sys.stderr)
    always: Tuple[str, ...] = ()
    if args.service:
        always = _wanted(smap, args.service)
        if not always:
            print(f"netproxy top: --service {args.service}: no such service port here", file=sys.stderr)
            return EXIT_FAILED
    try:
        sampler = Sampler(smap, args.clients, always)
    except OSError as err:
        print(f"netproxy top: cannot open ctnetlink: {err}", file=sys.stderr)
        return EXIT_FAILED
    try:
        if args.once:
            _once(sampler, args)
        else:
            from netproxy.cli import toptui

            toptui.run(sampler.refresh, args.interval, args.sort, args.filter)
    except OSError as err:
        print(f"netproxy top: conntrack: {err}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        sampler.close()
    return EXIT_REJECTED if errors else EXIT_OK


def _once(sampler: Sampler, args: argparse.Namespace) -> None:
    """Two refreshes ``--interval`` apart (the rates need both), the second printed."""
    first = sampler.refresh()
    # On stderr: a script (or a test) that starts traffic after it knows the window has begun.
    log.info("first refresh: %d conntrack entries; the figures in %gs", first.entries, args.interval)
    time.sleep(args.interval)
    report = sampler.refresh()
    ports = traffic.arrange(report.ports, args.sort, args.filter)
    out = toptable.as_json(report, ports) if args.output == "json" else toptable.table(report, ports)
    sys.stdout.write(out)
