"""What a service port with one endpoint costs in the kernel's objects, against two.

kube-proxy 1.37 (kubernetes #140723) takes no random choice for one endpoint, and neither does
netproxy: on nftables no ``numgen`` and its map keyed without an index, on iptables no ``-m statistic``
rule.  This counts the objects each backend renders (``plan``: nothing is written, no kernel needed)
for N ClusterIP services of one endpoint each and of two each, gen.py's addresses, one TCP port:

- nftables: rules, chains, sets and maps, elements (the services' and endpoints' entries), rules
  that draw a ``numgen`` number and maps keyed by one;
- iptables (legacy, IPv4): rules, chains and ``-m statistic`` rules.

``python -m bench`` measures it at its largest size up to 10,000 (the smoke run at 100) and prints it
as the "single-endpoint services" table and one line per backend.
"""

from __future__ import annotations

import ipaddress
import re
import time
from typing import Any, Dict, List

from bench import gen

Counts = Dict[str, int]
BACKENDS = ("nftables", "iptables")
COLUMNS = {"nftables": ("rules", "chains", "maps and sets", "elements", "numgen rules", "numgen maps"),
           "iptables": ("rules", "chains", "statistic rules")}
_ELEMENTS = re.compile(r"^add element \S+ \S+ \S+ \{ (.*) \}$")


def snapshot(n: int, endpoints: int) -> Any:
    """N services ``bench/svc-<i>`` with ``endpoints`` ready endpoints each (the model's objects)."""
    from netproxy.core.model import Endpoint, Snapshot
    from netproxy_lab.manifests import service_port

    ports = [service_port(gen.service_name(i), gen.NAMESPACE, "p", cluster_ip=gen.cluster_ip(i),
                          port=gen.PORT, target_port=gen.TARGET_PORT) for i in range(n)]
    eps = {p.name: tuple(Endpoint(ipaddress.ip_address(gen.endpoint_ip(i, j)), gen.TARGET_PORT)
                         for j in range(endpoints)) for i, p in enumerate(ports)}
    return Snapshot.build(ports, eps)


def plan(backend: str, n: int, endpoints: int) -> str:
    from netproxy.core.config import ProxyConfig
    from netproxy.wiring import new_backend

    config = ProxyConfig(hostname=gen.LOCAL_NODE, iptables_flavour="legacy", one_shot=True)
    text: str = new_backend(backend, config).plan(snapshot(n, endpoints))
    return text


def count_nft(text: str) -> Counts:
    """Objects in an nft script of ``add`` commands (elements: one per key in each ``add element``;
    comments are sanitised to have no comma, so a ", " always separates two elements)."""
    out = dict.fromkeys(COLUMNS["nftables"], 0)
    for line in text.splitlines():
        if line.startswith("add rule "):
            out["rules"] += 1
            out["numgen rules"] += "numgen" in line
        elif line.startswith("add chain "):
            out["chains"] += 1
        elif line.startswith(("add map ", "add set ")):
            out["maps and sets"] += 1
            out["numgen maps"] += "numgen" in line
        else:
            m = _ELEMENTS.match(line)
            if m:
                out["elements"] += m.group(1).count(", ") + 1
    return out


def count_iptables(text: str) -> Counts:
    """Rules and chains in iptables-restore input (the jumps from the built-in chains included)."""
    out = dict.fromkeys(COLUMNS["iptables"], 0)
    for line in text.splitlines():
        if line.startswith(("-A ", "-I ")):
            out["rules"] += 1
            out["statistic rules"] += "-m statistic" in line
        elif line.startswith(":"):
            out["chains"] += 1
    return out


def measure(n: int) -> Dict[str, Any]:
    """``{"n": N, "seconds": render time, "<backend>": {"1": counts, "2": counts}}``."""
    t0 = time.monotonic()
    out: Dict[str, Any] = {"n": n}
    for backend in BACKENDS:
        count = count_nft if backend == "nftables" else count_iptables
        out[backend] = {str(k): count(plan(backend, n, k)) for k in (1, 2)}
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def lines(cell: Dict[str, Any]) -> List[str]:
    """One line per backend: each count for one endpoint per service, against two."""
    out = []
    for backend in BACKENDS:
        one, two = cell[backend]["1"], cell[backend]["2"]
        parts = ", ".join(f"{k} {one[k]:,} / {two[k]:,}" for k in COLUMNS[backend])
        out.append(f"single-endpoint services, {backend}, N = {cell['n']:,} (1 endpoint / 2 endpoints each): {parts}")
    return out


def markdown(cell: Dict[str, Any]) -> List[str]:
    if not cell:
        return []
    if "error" in cell:
        return ["### Single-endpoint services", "", f"not measured: {cell['error']}", ""]
    out = ["### Single-endpoint services", "",
           f"Objects rendered (`plan`, no kernel) for N = {cell['n']:,} ClusterIP services of one TCP port, with "
           "one endpoint each against two each: one endpoint takes no random choice (kube-proxy 1.37, "
           "kubernetes #140723) — no `numgen` rule or map on nftables, no `-m statistic` rule on iptables.", ""]
    for backend in BACKENDS:
        cols = COLUMNS[backend]
        out.append(f"| {backend} | " + " | ".join(cols) + " |")
        out.append("|---|" + "---|" * len(cols))
        for k in ("1", "2"):
            out.append(f"| {k} endpoint{'s' if k != '1' else ''} each | "
                       + " | ".join(f"{cell[backend][k][c]:,}" for c in cols) + " |")
        out.append("")
    return out + lines(cell) + [""]
