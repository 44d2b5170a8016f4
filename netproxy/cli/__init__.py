"""``netproxy`` — the command line.  This contract is relied on from outside: keep it stable.

    netproxy sync    --source PATH [--backend B] [--iptables-writer W]   sync once, exit 0/1/2
    netproxy run     --source PATH | --kubeconfig PATH                   the long-running proxy
    netproxy plan    --source PATH [--backend B] [--diff]                print the ruleset (or its diff with the kernel)
    netproxy trace   --source PATH --to ADDRESS:PORT [--kernel]          where a packet to a service would go, and why
    netproxy status  [--metrics-address A] [-o json]                    what a running `run` has programmed
    netproxy detect                                                      the version check's choice, what the node holds
    netproxy top     [--source PATH] [--once -o table|json] [--service NS/NAME]   where each service's connections go
    netproxy migrate --to nftables|iptables [--from-kube-proxy] --source PATH   switch the live dataplane
    netproxy cleanup [--backend B|all]                                   remove what netproxy created

Exit codes: 0 all applied; 1 the kernel write failed (previous ruleset kept) or nothing could be
done; 2 some objects were rejected (each named on stderr) and the valid rest was applied.

sync, run, plan, trace and migrate take --config FILE, kube-proxy's KubeProxyConfiguration
(netproxy/cli/kpconfig.py): flags given on the command line win over it; a field in it that is wrong or
cannot be honoured exits 2, naming the field, before anything is done.  A setting neither gives keeps
ProxyConfig's default (netproxy/core/config.py), the one place defaults are written.

This module parses and dispatches, and turns errors into exit codes; the flags are in args.py,
the commands in oneshot.py (sync, plan, trace, migrate, cleanup), observe.py (status,
detect), top.py (top, its live view in toptui.py) and run.py (run); netproxy/wiring.py builds the objects they use.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Optional, Sequence

from netproxy.backends.base import BackendError
from netproxy.cli.args import EXIT_FAILED, EXIT_OK, EXIT_REJECTED, build_parser
from netproxy.cli.oneshot import cmd_cleanup, cmd_migrate, cmd_plan, cmd_sync, cmd_trace
from netproxy.node import ctsysctl
from netproxy.node import detect as detect_mod
from netproxy.node.nodeconfig import ConfigError
from netproxy.observe import logs
from netproxy.source.files import SourceError

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_REJECTED", "build_parser", "main"]

log = logging.getLogger("netproxy")



def cmd_run(args: argparse.Namespace) -> int:
    # run, status and detect import their servers and clients (http.server, wsgiref, email...:
    # 50 ms) only when asked: a one-shot sync pays none of it.
    from netproxy.cli.run import cmd_run as run

    return run(args)


def cmd_status(args: argparse.Namespace) -> int:
    from netproxy.cli.observe import cmd_status as status

    return status(args)


def cmd_top(args: argparse.Namespace) -> int:
    from netproxy.cli.top import cmd_top as top

    return top(args)


def cmd_detect(args: argparse.Namespace) -> int:
    from netproxy.cli.observe import cmd_detect as detect

    return detect(args)


COMMANDS = {"sync": cmd_sync, "run": cmd_run, "plan": cmd_plan, "trace": cmd_trace, "status": cmd_status,
            "detect": cmd_detect, "migrate": cmd_migrate, "top": cmd_top,
            "cleanup": cmd_cleanup}


def _read_config(args: argparse.Namespace) -> Optional[int]:
    """--config FILE onto the flags not given on the command line; an exit status when it cannot be used
    (1 unreadable, 2 a bad or unsupported value, named), None to go on."""
    from netproxy.cli import kpconfig

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


ENDS_AT_ONCE = frozenset({"sync", "plan", "trace", "migrate", "cleanup", "status", "detect", "top"})
"""The commands that act once and end: run as the program, they leave without Python's teardown."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    code = _main(args)
    if argv is None and args.command in ENDS_AT_ONCE:
        _leave(code)
    return code


def _leave(code: int) -> None:
    """End the process now, as a C tool would: the interpreter's teardown freed the half-million
    objects of a 10k-service sync one by one (0.15-0.5 s of ``netproxy sync``'s 3-4 s, measured in
    a throwaway namespace), for nothing.  Nothing these commands leave needs it: every file and
    child process is closed by its ``with``; logging and the standard streams are flushed here.
    Only as the program (``argv`` None): called from Python, :func:`main` returns."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (| head): what was read is all
            stream.flush()
    os._exit(code)


def _main(args: argparse.Namespace) -> int:
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
