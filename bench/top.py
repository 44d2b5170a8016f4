"""``netproxy top``'s refresh at 100,000 conntrack entries (target: <= 0.5 s of CPU, memory bounded).

Two figures:
1. the fold alone (netproxy/observe/traffic.py's ``fold``, what a refresh runs once the dump is
   counted), in this process: 100,000 synthetic entries (1,000 service ports, 100 flows each over 10
   endpoints; half TCP, half UDP) grouped in memory (untimed), folded twice, the second time
   against the first's ids, as every refresh after the first is;
2. a whole refresh as ``netproxy top`` runs it, in a throwaway ``np-bench-…-top`` namespace (a child
   process, ``python -m bench.top --child``): the same entries created through ctnetlink as DNAT-ed
   flows leave them (the TCP ones ESTABLISHED), then two refreshes of netproxy.cli.top.Sampler (one
   dump of every family and protocol, counted into groups by netproxy/node/ctflows.py as it is read,
   and the fold), the second timed (wall; CPU, and the kernel's part of it: system time) with the
   peak resident set it adds (VmHWM reset just before).  The figures are checked: every entry
   counted, each endpoint its 100 flows... of the right service.

Run alone: ``sudo .venv/bin/python -m bench.top`` (prints JSON); ``python -m bench`` runs it once and
prints it in its report.  The namespace is deleted afterwards, with every entry in it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

from bench.conntrack import _status, main

ENTRIES = 100_000
SERVICES = 1_000
ENDPOINTS = 10
TARGET = 0.5


def _addr(base: str, i: int) -> str:
    return str(ipaddress.ip_address(base) + i)


def cluster(entries: int) -> Tuple[Any, List[Tuple[int, str, str, str, int]]]:
    """The service map of SERVICES ports (every other one UDP) and the flows, as (proto, client,
    service address, endpoint address, client port)."""
    from netproxy.core.model import Endpoint, ServicePort, ServicePortName, Snapshot
    from netproxy.observe import traffic

    services = max(1, entries * SERVICES // ENTRIES)
    per = entries // services
    ports, endpoints, flows = [], {}, []
    for s in range(services):
        proto = "UDP" if s % 2 else "TCP"
        svc = ServicePort(ServicePortName("bench", f"svc-{s}", "p"), proto, 80, 8080,
                          cluster_ips=(ipaddress.ip_address(_addr("10.96.0.1", s)),))
        eps = [_addr("10.244.0.1", s * ENDPOINTS + j) for j in range(ENDPOINTS)]
        ports.append(svc)
        endpoints[svc.name] = tuple(Endpoint(ipaddress.ip_address(a), 8080) for a in eps)
        flows += [(17 if s % 2 else 6, _addr("10.128.0.1", f), _addr("10.96.0.1", s), eps[f % ENDPOINTS], 20000 + s)
                  for f in range(per)]
    return traffic.from_snapshot(Snapshot.build(ports, endpoints)), flows


def aggregation(entries: int = ENTRIES) -> Dict[str, Any]:
    """Figure 1: the pure fold over the grouped entries, twice (the second against the first's ids),
    CPU of the second."""
    from netproxy.observe import traffic

    smap, flows = cluster(entries)

    def packed(a: str, port: int) -> bytes:
        return socket.inet_aton(a) + struct.pack("!H", port)

    entries: List[traffic.Flow] = [(proto, socket.inet_aton(client), packed(svc, 80), packed(ep, 8080), 3, i + 1, 0, 0)
                                   for i, (proto, client, svc, ep, _sport) in enumerate(flows)]
    groups, sums, who = traffic.group(entries, False, 0)
    _, ids = traffic.fold(groups, sums, who, smap, None)
    c0 = time.process_time()
    report, _ = traffic.fold(groups, sums, who, smap, ids, 1.0)
    cpu = time.process_time() - c0
    counted = sum(p.connections for p in report.ports)
    out: Dict[str, Any] = {"entries": len(flows), "cpu_seconds": cpu, "counted": counted}
    if counted != len(flows):
        out["error"] = f"aggregation counted {counted} of {len(flows)} entries"
    return out


def _create(flows: List[Tuple[int, str, str, str, int]]) -> int:
    from netproxy.node import ctnetlink

    a = ctnetlink._attr
    established = ctnetlink._nest(4, ctnetlink._nest(1, a(1, bytes([3]))))  # PROTOINFO { TCP { STATE 3 } }
    requests = []
    for proto, client, svc, ep, sport in flows:
        req = ctnetlink.create_request(socket.AF_INET, proto, (client, sport), (svc, 80), (ep, 8080), timeout=600)
        if proto == 6:
            req = struct.pack("=I", len(req) + len(established)) + req[4:] + established
        requests.append(req)
    with ctnetlink.Ctnetlink() as ct:
        created, _ = ct.batch(requests)
    return created


def child(entries: int = ENTRIES) -> Dict[str, Any]:
    """Figure 2; runs inside the bench namespace only (it fills that namespace's table)."""
    wanted = os.environ.get("NP_BENCH_TOP_NETNS", "")
    here = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True, text=True).stdout.strip()
    if not wanted or here != wanted:
        raise SystemExit("bench.top --child: runs only in the namespace bench.top.measure made "
                         f"(here: {here or 'not a named namespace'})")
    from netproxy.cli.top import Sampler

    smap, flows = cluster(entries)
    created = _create(flows)
    del flows
    sampler = Sampler(smap)
    sampler.refresh()
    rss_before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    t0, c0, k0 = time.perf_counter(), time.process_time(), os.times().system
    report = sampler.refresh()
    seconds, cpu, kernel = time.perf_counter() - t0, time.process_time() - c0, os.times().system - k0
    peak_added = _status("VmHWM") - rss_before
    sampler.close()
    counted = sum(p.connections for p in report.ports)
    established = sum(p.established for p in report.ports)
    out: Dict[str, Any] = {"entries": created, "read": report.entries, "counted": counted, "established": established,
                           "seconds": seconds, "cpu_seconds": cpu, "kernel_seconds": kernel,
                           "peak_added_mib": peak_added / 1024,
                           "rss_before_mib": rss_before / 1024, "loadavg": os.getloadavg()[0]}
    uneven = [p.name for p in report.ports if p.imbalance > 1e-9]
    if counted != created or established != created or uneven:
        out["error"] = (f"counted {counted}, established {established} of {created} entries; "
                        f"{len(uneven)} ports off their equal split")
    return out


def measure(timeout: float = 300.0, entries: int = ENTRIES) -> Dict[str, Any]:
    """Both figures: the aggregation here, the refresh in a namespace of its own, deleted afterwards."""
    from netproxy_lab import netns

    result: Dict[str, Any] = {"aggregation": aggregation(entries)}
    with netns.namespace("top") as ns:
        proc = subprocess.run(netns.exec_args(ns, [sys.executable, "-m", "bench.top", "--child", str(entries)]),
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "NP_BENCH_TOP_NETNS": ns},
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0:
        result["refresh"] = {"error": f"exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    else:
        result["refresh"] = json.loads(proc.stdout)
    errors = [f"{k}: {v['error']}" for k, v in result.items() if "error" in v]
    if errors:
        result["error"] = "; ".join(errors)
    return result


def target(results: Dict[str, Any]) -> Dict[str, Any]:
    """The report's target line (bench/targets.py): a refresh over 100,000 entries in 0.5 s of CPU."""
    cell = (results.get("top") or {}).get("refresh") or {}
    name, goal = "netproxy top, one refresh over 100,000 conntrack entries", f"≤ {TARGET} s CPU"
    if "cpu_seconds" not in cell:
        why = cell.get("error") or (results.get("top") or {}).get("skipped") or "not measured (full runs only)"
        return {"name": name, "target": goal, "met": None, "figure": str(why)[:160]}
    return {"name": name, "target": goal, "met": cell["cpu_seconds"] <= TARGET and not cell.get("error"),
            "figure": f"{cell['cpu_seconds']:.3f} s CPU "
                      f"({cell.get('kernel_seconds', float('nan')):.2f} s the kernel's), {cell['seconds']:.3f} s wall, "
                      f"peak +{cell['peak_added_mib']:.1f} MiB, load {cell['loadavg']:.1f}"}


def markdown(cell: Dict[str, Any]) -> List[str]:
    """The report's section (bench/report.py)."""
    if not cell:
        return []
    lines = [f"### netproxy top (target: one refresh over 100,000 entries <= {TARGET} s CPU)", ""]
    agg, ref = cell.get("aggregation") or {}, cell.get("refresh") or {}
    if "cpu_seconds" not in ref:
        return lines + [f"- not measured: {cell.get('error') or cell.get('skipped')}", ""]
    lines += ["| entries | fold alone (CPU) | refresh: dump counted + fold (CPU) | of it the kernel's | (wall) "
              "| peak memory added |",
              "|---:|---:|---:|---:|---:|---:|",
              f"| {ref['entries']:,} | {agg.get('cpu_seconds', float('nan')):.3f} s | {ref['cpu_seconds']:.3f} s "
              f"| {ref.get('kernel_seconds', float('nan')):.2f} s | {ref['seconds']:.3f} s "
              f"| {ref['peak_added_mib']:.1f} MiB |", ""]
    if cell.get("error"):
        lines += [f"- error: {cell['error']}", ""]
    return lines


if __name__ == "__main__":
    main("top", child, measure, ENTRIES)
