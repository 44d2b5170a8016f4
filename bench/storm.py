"""``python -m bench.storm`` — the fault suite's soak (update storms, the API going away), part of ``make bench``.

Runs tests/faults/test_storm.py and test_api.py at soak size: 10,000 services, storms of 1,000
changes a second for 60 s from the file and the API source, 10,000 sync cycles for the RSS figure,
and the API down for 60 s.  The tests' FAULT-FIGURE lines are printed and written, with the commit
and the load, to ``<out>/storm.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from typing import List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.storm", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="nftables,iptables-legacy/restore",
                   help="NETPROXY_BACKENDS for the fault suite (default: nftables,iptables-legacy/restore)")
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--seconds", type=float, default=60.0, help="length of each storm")
    p.add_argument("--rate", type=float, default=1000.0, help="changes a second")
    p.add_argument("--cycles", type=int, default=10000, help="sync cycles of the RSS measure")
    p.add_argument("--down", type=float, default=60.0, help="seconds the API is down")
    p.add_argument("--only", default="", help="a pytest -k expression, e.g. 'rss' or 'storm'")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    return p.parse_args(argv)


def commit() -> str:
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ, NETPROXY_BACKENDS=args.backends, NETPROXY_STORM_SERVICES=str(args.services),
               NETPROXY_STORM_SECONDS=str(args.seconds), NETPROXY_STORM_RATE=str(args.rate),
               NETPROXY_STORM_CYCLES=str(args.cycles), NETPROXY_API_DOWN_SECONDS=str(args.down))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join(ROOT, "tests", "faults", "test_storm.py"), os.path.join(ROOT, "tests", "faults", "test_api.py")]
    if args.only:
        cmd += ["-k", args.only]
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"bench.storm: {' '.join(cmd[3:])} with {args.services:,} services, {args.seconds:g} s storms at "
          f"{args.rate:g}/s, {args.cycles:,} cycles, API down {args.down:g} s ({args.backends})", flush=True)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-20000:])
    sys.stderr.write(proc.stderr[-5000:])
    figures: List[str] = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAULT-FIGURE ")]
    figures = list(dict.fromkeys(figures))  # printed live (pytest -s) and in the summary: once each
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "storm.md")
    with open(path, "w") as f:
        f.write(f"# Fault-suite soak ({started:%Y-%m-%d %H:%M} UTC, commit {commit()}, "
                f"load {os.getloadavg()[0]:.1f}, exit {proc.returncode})\n\n")
        f.write(f"`python -m bench.storm --services {args.services} --seconds {args.seconds:g} --rate {args.rate:g} "
                f"--cycles {args.cycles} --down {args.down:g} --backends {args.backends}"
                + (f" --only '{args.only}'" if args.only else "") + "`\n\n")
        f.writelines(f"- {ln[len('FAULT-FIGURE '):]}\n" for ln in figures)
    print(f"results: {path}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
