"""``python -m bench.relay`` — NodePorts on localhost in nftables mode: what the userspace relay costs.

Part of ``make bench``.

    python -m bench.relay [--seconds 5] [--out bench/results]

One sandbox; ``netproxy run`` (nftables) with ``--nodeport-addresses primary,localhost`` and one
NodePort service on the sandbox's pods.  From the node namespace, one connection at a time for
``--seconds`` each way: connect, read the pod's one-line answer to its end — straight to a pod
(``pod:8080``, the floor), through the relay (``127.0.0.1:<nodePort>``), and through the kernel's
DNAT on the node's own address (``<node address>:<nodePort>``, what iptables and nftables rules
cost).  Prints connections per second and the median and p99 time of a whole exchange for each, and
the relay's added latency; written to ``bench/results/relay.md`` with the commit.

    python -m bench.relay measure ADDR PORT SECONDS    # the measuring loop (inside the node namespace)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from netproxy_lab import netns
from netproxy_lab.combos import COMBOS
from netproxy_lab.manifests import endpoint_slice, port, service, write_manifests
from netproxy_lab.topology import NODE_EXT4, NODE_NAME, Sandbox

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NODE_PORT = 30080


def measure(address: str, port_number: int, seconds: float) -> Dict[str, Any]:
    """Sequential exchanges (connect, read to EOF) for ``seconds``: rate, p50, p99, failures."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    times: List[float] = []
    failures = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(2.0)
                s.connect((address, port_number))
                while s.recv(4096):
                    pass
            times.append(time.monotonic() - t0)
        except OSError:
            failures += 1
    times.sort()
    n = len(times)
    return {"exchanges": n, "failures": failures, "rate": n / seconds,
            "p50_us": times[n // 2] * 1e6 if n else None, "p99_us": times[int(n * 0.99)] * 1e6 if n else None}


def _in_node(sandbox: Sandbox, address: str, port_number: int, seconds: float) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = netns.run_in_timeout(sandbox.node, [sys.executable, "-m", "bench.relay", "measure", address,
                                               str(port_number), str(seconds)], seconds + 60, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr or b"").decode(errors="replace")[-300:]}
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


def commit() -> str:
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["measure"]:
        print(json.dumps(measure(args[1], int(args[2]), float(args[3]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    opts = p.parse_args(args)
    netns.remove_stale()
    combo = COMBOS["nftables"]
    results: Dict[str, Any] = {"commit": commit(), "seconds": opts.seconds}
    with Sandbox(pods=3, udp_ports=()) as sb:
        pods = sb.pods
        source = os.path.join(sb.workdir, "relay.yaml")
        write_manifests(source, [
            service("web", "10.96.0.10", [port(80, 8080, name="http", node_port=NODE_PORT)], type="NodePort"),
            endpoint_slice("web", pods, [port(8080, name="http")]),
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME},
             "status": {"addresses": [{"type": "InternalIP", "address": NODE_EXT4}]}}])
        run = sb.start_netproxy(["run", "--source", source, *combo.flags, "--hostname-override", NODE_NAME,
                                 "--nodeport-addresses", "primary,localhost", "--metrics-bind-address", ""])
        try:
            ready = _in_node(sb, "127.0.0.1", NODE_PORT, 0.2)
            deadline = time.monotonic() + 30
            while not ready.get("exchanges") and time.monotonic() < deadline:
                time.sleep(0.3)
                ready = _in_node(sb, "127.0.0.1", NODE_PORT, 0.2)
            for name, (address, port_number) in {"direct to a pod": (pods[0].ip, 8080),
                                                 "the relay (127.0.0.1:NodePort)": ("127.0.0.1", NODE_PORT),
                                                 "the rules (node address:NodePort)": (NODE_EXT4, NODE_PORT)}.items():
                results[name] = _in_node(sb, address, port_number, opts.seconds)
                print(f"bench.relay: {name}: {json.dumps(results[name])}", flush=True)
        finally:
            netns.stop(run)
    direct, relay = results["direct to a pod"], results["the relay (127.0.0.1:NodePort)"]
    lines = [f"# NodePorts on localhost through the relay (`python -m bench.relay`, commit {results['commit']})", "",
             "One connection at a time from the node namespace, connect then read the pod's answer, "
             f"{opts.seconds:g} s each.", "",
             "| path | exchanges/s | p50 | p99 | failures |", "|---|---|---|---|---|"]
    for name in ("direct to a pod", "the relay (127.0.0.1:NodePort)", "the rules (node address:NodePort)"):
        r = results[name]
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | |")
            continue
        lines.append(f"| {name} | {r['rate']:.0f} | {r['p50_us']:.0f} µs | {r['p99_us']:.0f} µs | {r['failures']} |")
    if direct.get("p50_us") and relay.get("p50_us"):
        lines += ["", f"The relay adds {relay['p50_us'] - direct['p50_us']:.0f} µs to the median exchange "
                      f"({relay['rate'] / direct['rate']:.2f}× the direct rate)."]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "relay.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
