"""``make demo``: netproxy on the bundled example cluster, in a throwaway sandbox, with real traffic.

1. builds network namespaces: a client, an off-cluster client (``ext``), the node, and one pod per
   endpoint of ``examples/cluster.yaml`` (at the endpoint's address, answering with its pod name);
2. runs ``netproxy run`` in the node with the backend the version check picks (or ``--backend``);
3. sends traffic to every service address and prints which pods answered, and how often;
4. edits the example (scales one service down, another up), waits for the proxy to pick it up,
   shows the new distribution;
5. ``netproxy migrate``: stops the proxy, puts kube-proxy's rules for the example in the node
   (the benchmark's kube-proxy layout), takes over from them with ``--from-kube-proxy`` and then
   switches to the other dataplane, each time while a client opens connections in a loop, and shows
   that none failed; then tears everything down.

Exit status 1 if any expected traffic went wrong, so the demo doubles as a smoke test.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import yaml

from netproxy.core.model import ServicePort
from netproxy.source.files import flatten, load, read_documents
from netproxy_lab import kubeproxy_layout
from netproxy_lab.topology import Sandbox
from netproxy_lab.traffic import ConnectResult

# The repository's example: this file is lab/netproxy_lab/demo.py, three levels below the checkout.
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "cluster.yaml")
CONNECTIONS = 120
AFFINITY_CONNECTIONS = 40
REFUSED_CONNECTIONS = 5
BOLD, GREEN, RED, DIM, RESET = ("\033[1m", "\033[32m", "\033[31m", "\033[2m", "\033[0m") if sys.stdout.isatty() \
    else ("", "", "", "", "")


@dataclass(frozen=True)
class Probe:
    """One row of the table: traffic to one service address, and what should answer it."""

    service: str
    address: str
    port: int
    proto: str
    origin: str          # "client", "ext" (off-cluster) or "node"
    expected: Tuple[str, ...]
    affinity: bool = False


def pods_of(objects: Sequence[Mapping[str, Any]]) -> Dict[str, str]:
    """endpoint address → pod name (from targetRef), for every EndpointSlice in the example."""
    out: Dict[str, str] = {}
    for obj in objects:
        if obj.get("kind") != "EndpointSlice":
            continue
        for ep in obj.get("endpoints") or []:
            name = (ep.get("targetRef") or {}).get("name") or f"pod-{ep['addresses'][0]}"
            for addr in ep.get("addresses") or []:
                out[addr] = name
    return out


def probes_for(path: str, pod_names: Mapping[str, str]) -> List[Probe]:
    loaded = load(path)
    if loaded.errors:
        raise SystemExit(f"the example has invalid objects: {loaded.errors}")
    from netproxy.core.tracker import ChangeTracker

    tracker = ChangeTracker()
    tracker.replace_services(loaded.services)
    tracker.replace_endpoints(loaded.endpoints)
    snap, _ = tracker.take()
    out: List[Probe] = []
    for name in snap.sorted_names():
        svc: ServicePort = snap.services[name]
        expected = tuple(sorted(pod_names[str(e.ip)] for e in snap.endpoints_of(name) if e.ready))
        rows = [(a, "client") for a in svc.cluster_ips] + [(a, "ext") for a in svc.external_ips]
        rows += [(a, "ext") for a in svc.load_balancer_ips]
        if name.name == "web" and name.port == "http":
            rows.append((svc.cluster_ips[0], "node"))  # the node's own connections (nat OUTPUT)
        for addr, origin in rows:
            if addr.version != 4:
                continue
            out.append(Probe(str(name), str(addr), svc.port, svc.protocol.lower(), origin, expected,
                             svc.client_ip_affinity))
    return out


def run_probe(box: Sandbox, probe: Probe) -> Tuple[ConnectResult, bool, str]:
    """Send the probe's traffic; return the result, whether it is as expected, and a verdict."""
    source = {"client": box.client, "ext": box.ext, "node": box.node}[probe.origin]
    if probe.affinity:
        # Affinity: one client address must stick to one pod; a second address may land elsewhere.
        res = box.connect(probe.address, probe.port, proto=probe.proto, count=AFFINITY_CONNECTIONS,
                          source=source, timeout=1.0)
        ok = len(res.counts) == 1 and set(res.counts) <= set(probe.expected) and res.failed == 0
        return res, ok, "sticks to one pod" if ok else "affinity broken"
    if not probe.expected:
        # A few connections only: the kernel rate-limits the ICMP errors that a reject sends
        # (net.ipv4.icmp_ratelimit), so a burst of 120 would see timeouts after the first few.
        res = box.connect(probe.address, probe.port, proto=probe.proto, count=REFUSED_CONNECTIONS,
                          source=source, timeout=1.0)
        ok = res.answered == 0 and set(res.errors) == {"refused"}
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(res.errors.items())) or "-"
        return res, ok, f"no endpoints: {kinds}" if ok else f"expected refusals, got {kinds}"
    res = box.connect(probe.address, probe.port, proto=probe.proto, count=CONNECTIONS, source=source, timeout=1.0)
    ok = set(res.counts) == set(probe.expected) and res.failed == 0
    return res, ok, "all endpoints, no errors" if ok else "WRONG"


def print_table(title: str, rows: List[Tuple[Probe, ConnectResult, bool, str]]) -> None:
    print(f"\n{BOLD}{title}{RESET}")
    header = f"{'service':<26} {'address':<21} {'from':<6} {'answers by pod':<44} verdict"
    print(header)
    print("-" * len(header))
    for probe, res, ok, verdict in rows:
        answers = ", ".join(f"{pod} {n}" for pod, n in sorted(res.counts.items())) or "-"
        if res.failed:
            answers += f"  ({res.failed} failed)"
        colour = GREEN if ok else RED
        print(f"{probe.service:<26} {probe.address + ':' + str(probe.port) + '/' + probe.proto:<21} "
              f"{probe.origin:<6} {answers:<44} {colour}{verdict}{RESET}")


def wait_until(box: Sandbox, probe: Probe, timeout: float = 20.0) -> bool:
    """Poll until the probe's address answers only from its expected pods (the proxy caught up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = box.connect(probe.address, probe.port, proto=probe.proto, count=30, timeout=0.5,
                          source=box.client)
        if res.counts and set(res.counts) == set(probe.expected) and res.failed == 0:
            return True
        time.sleep(0.2)
    return False


def edited_example(objects: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The example with default/web scaled down to one pod and shop/frontend scaled up to three."""
    out = copy.deepcopy(objects)
    for obj in out:
        if obj.get("kind") != "EndpointSlice":
            continue
        svc = obj["metadata"]["labels"]["kubernetes.io/service-name"]
        if svc == "web":
            obj["endpoints"] = obj["endpoints"][:1]
        elif svc == "frontend":
            obj["endpoints"].append({"addresses": ["10.244.2.43"], "conditions": {"ready": True},
                                     "targetRef": {"kind": "Pod", "name": "frontend-3", "namespace": "shop"}})
    return out


def write_manifest(path: str, objects: List[Dict[str, Any]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}, fh, sort_keys=False)
    os.replace(tmp, path)  # atomic: the proxy never reads half a file


def detect_in(box: Sandbox, backend: str) -> str:
    proc = box.netproxy(["detect"])
    print(f"{BOLD}version check in the node:{RESET}")
    for line in proc.stdout.splitlines():
        print(f"  {line}")
    if backend != "auto":
        print(f"  (overridden: --backend {backend})")
        return backend
    for line in proc.stdout.splitlines():
        if line.startswith("backend: "):
            return str(line.split(": ", 1)[1])
    raise SystemExit(f"netproxy detect failed: {proc.stdout}{proc.stderr}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netproxy_lab.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "iptables", "nftables"])
    parser.add_argument("--source", default=EXAMPLE)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if os.geteuid() != 0:
        print("make demo needs root: it creates network namespaces", file=sys.stderr)
        return 1
    objects = [dict(o) for f in [args.source] for o in flatten(read_documents(f)) if isinstance(o, Mapping)]
    names = pods_of(objects)
    names["10.244.2.43"] = "frontend-3"  # the pod the edit scales frontend up to
    ports = sorted({int(p["port"]) for o in objects if o.get("kind") == "EndpointSlice" for p in o["ports"]})
    box = Sandbox(pods=0, tcp_ports=ports, udp_ports=ports, ipv6=False)
    with box:
        for addr, pod_name in sorted(names.items()):
            box.add_pod(pod_name, ip=addr, start=False)
        for pod in box.pods:
            box.start_server(pod)
        print(f"sandbox {box.id}: node {box.node}, client {box.client}, ext {box.ext}, {len(box.pods)} pods")
        backend = detect_in(box, args.backend)
        status = _demo(box, backend, objects, names)
    left = leftovers(box.id)
    if left:
        print(f"{RED}namespaces left behind: {', '.join(sorted(left))}{RESET}")
        return 1
    print("sandbox removed: no namespace, process or rule of the demo is left")
    return status


def _demo(box: Sandbox, backend: str, objects: List[Dict[str, Any]], names: Dict[str, str]) -> int:
    source = os.path.join(box.workdir, "cluster.yaml")
    write_manifest(source, objects)
    proxy = box.start_netproxy(["run", "--source", source, "--backend", backend, "--min-sync-period", "200ms",
                                "--metrics-bind-address", "", "--healthz-bind-address", "",
                                "--hostname-override", "np-node"])
    failures = 0
    probes = probes_for(source, names)
    if not wait_until(box, probes[0]):
        print(f"{RED}netproxy did not program {probes[0].service} within 20 s{RESET}")
        _show_log(box)
        return 1
    rows = [(p, *run_probe(box, p)) for p in probes]
    failures += sum(1 for r in rows if not r[2])
    print_table(f"traffic with the {backend} backend ({CONNECTIONS} connections per row)", rows)

    print(f"\n{BOLD}editing the cluster:{RESET} default/web 3 → 1 endpoint, shop/frontend 2 → 3 endpoints")
    write_manifest(source, edited_example(objects))
    start = time.monotonic()
    after = probes_for(source, names)
    changed = [p for p in after if p.service.startswith(("default/web:http", "shop/frontend"))]
    caught_up = all(wait_until(box, p) for p in changed if p.origin == "client")
    print(f"proxy picked up the edit in {time.monotonic() - start:.2f} s" if caught_up
          else f"{RED}proxy did not pick up the edit{RESET}")
    failures += 0 if caught_up else 1
    rows = [(p, *run_probe(box, p)) for p in changed]
    failures += sum(1 for r in rows if not r[2])
    print_table("after the edit", rows)
    if proxy.poll() is not None:
        print(f"{RED}netproxy exited with {proxy.returncode}{RESET}")
        failures += 1
    proxy.terminate()
    proxy.wait(timeout=10)
    failures += _migrate_demo(box, backend, source, names)
    if failures:
        _show_log(box)
    print(f"\n{GREEN if not failures else RED}{'demo passed' if not failures else f'{failures} checks failed'}"
          f"{RESET}; tearing the sandbox down")
    return 1 if failures else 0


LOOP = 1500


def _kube_proxy_rules(box: Sandbox, source: str) -> str:
    """kube-proxy's iptables (legacy) or nftables rules for the example, from the lab's copy of its
    layout (the benchmark's reference too); the mode written."""
    docs = [o for o in flatten(read_documents(source)) if isinstance(o, Mapping)]  # rejected ones are left out
    objects = [dict(o) for o in docs if o.get("kind") in ("Service", "EndpointSlice")
               and o.get("spec", {}).get("clusterIP", "") != "None"]
    svcs = kubeproxy_layout.services(objects)
    box.reset_netfilter()
    if shutil.which("iptables-legacy-restore"):
        for payload in (kubeproxy_layout.iptables_full(svcs), kubeproxy_layout.iptables_node_chains()):
            box.exec(box.node, ["iptables-legacy-restore", "--noflush"], input=payload, check=True)
        return "iptables"
    box.exec(box.node, ["nft", "-f", "-"], input=kubeproxy_layout.nft_full(svcs), check=True)
    return "nftables"


def _switch(box: Sandbox, probe: Probe, args: List[str]) -> int:
    """``netproxy migrate ARGS`` while the client opens ``LOOP`` connections to ``probe``; failures."""
    loop = box.start_connect(probe.address, probe.port, count=LOOP, interval=0.002, timeout=2.0)
    time.sleep(0.5)
    proc = box.netproxy(["migrate", *args, "--hostname-override", "np-node"])
    res = loop.result()
    shown = args[:args.index("--source")] if "--source" in args else args
    print(f"  $ netproxy migrate {' '.join(shown)} --source cluster.yaml")
    for line in (proc.stdout + proc.stderr).splitlines():
        print(f"    {line}")
    ok = proc.returncode == 0 and res.failed == 0 and res.answered == LOOP
    print(f"  {GREEN if ok else RED}{res.answered} of {LOOP} connections to {probe.service} "
          f"({probe.address}:{probe.port}) opened across the switch answered, {res.failed} failed{RESET}")
    return 0 if ok else 1


def _migrate_demo(box: Sandbox, backend: str, source: str, names: Dict[str, str]) -> int:
    probes = probes_for(source, names)
    loop_probe = next(p for p in probes if p.origin == "client" and p.proto == "tcp")
    mode = _kube_proxy_rules(box, source)
    failures = 0
    print(f"\n{BOLD}taking over from kube-proxy:{RESET} the node now holds kube-proxy's {mode} rules "
          "(ClusterIPs of the example)")
    for line in box.netproxy(["detect"]).stdout.splitlines():
        if line.startswith(("holds:", "migrate:")):
            print(f"  {line}")
    failures += _switch(box, loop_probe, ["--to", backend, "--from-kube-proxy", "--source", source])
    other = "iptables" if backend == "nftables" else "nftables"
    print(f"\n{BOLD}switching dataplanes live:{RESET} {backend} → {other}")
    failures += _switch(box, loop_probe, ["--to", other, "--source", source])
    rows = [(p, *run_probe(box, p)) for p in probes]
    failures += sum(1 for r in rows if not r[2])
    print_table(f"traffic with the {other} backend, after the switch", rows)
    return failures


def _show_log(box: Sandbox) -> None:
    for name in sorted(os.listdir(box.workdir)):
        if name.endswith(".log"):
            with open(os.path.join(box.workdir, name), encoding="utf-8", errors="replace") as fh:
                print(f"{DIM}--- {name}\n{fh.read()[-4000:]}{RESET}")


def leftovers(sandbox_id: str) -> Set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line and line.split()[0].endswith(f"-{sandbox_id}")}


if __name__ == "__main__":
    sys.exit(main())
