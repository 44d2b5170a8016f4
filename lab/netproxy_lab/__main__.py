"""``python -m netproxy_lab [--pods N]``: hold a sandbox open for manual work (root)."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from typing import List, Optional, Sequence

from netproxy_lab.topology import CLIENT, DEFAULT_PORTS, Sandbox


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m netproxy_lab [--pods N]``: build a sandbox, print it as JSON, hold it until a signal."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m netproxy_lab",
                                     description="hold a netproxy sandbox open for manual work (root)")
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--remote-pods", type=int, default=0, help="how many of the pods are on another node")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stop: List[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    with Sandbox(args.pods, remote_pods=args.remote_pods) as sb:
        info = {"node": sb.node, "client": sb.client, "ext": sb.ext, "node_ips": list(sb.node_ips),
                "pods": [{"name": p.name, "netns": p.netns, "ip": p.ip, "ip6": p.ip6, "node": p.node_name}
                         for p in sb.pods]}
        print(json.dumps(info, indent=1), flush=True)
        print(f"try: ip netns exec {sb.client} {sys.executable} {CLIENT} {sb.pods[0].ip} {DEFAULT_PORTS[0]}"
              " --count 10\nCtrl-C (or SIGTERM) removes everything.", flush=True)
        try:
            while not stop:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
