"""``netproxy status``: what a running ``netproxy run`` has programmed, read from its own endpoints.

It asks the proxy (``/metrics`` and ``/healthz``), not the input: the backend and writer in use, the
service ports of the last sync, when that sync was and how long it took, the health answer and the
objects rejected so far.  ``-o json`` prints the same for scripts.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Status:
    backend: str = ""
    writer: str = ""
    service_ports: Optional[int] = None
    last_sync: Optional[float] = None
    """Unix time of the last successful sync."""
    last_sync_seconds: Optional[float] = None
    syncs: Dict[str, float] = field(default_factory=dict)
    """Syncs so far by result (ok, error)."""
    rejected_objects: Optional[float] = None
    health_code: Optional[int] = None
    health: Optional[Dict[str, object]] = None


def _get(url: str, timeout: float) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - an operator's address
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:  # a 503 from /healthz is an answer, not a failure
        return err.code, err.read().decode()


def _samples(text: str) -> Dict[str, List[Tuple[Dict[str, str], float]]]:
    out: Dict[str, List[Tuple[Dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def read(metrics_address: str, healthz_address: str, timeout: float = 5.0) -> Status:
    """The running proxy's status; OSError (urllib's URLError) when its metrics do not answer."""
    status = Status()
    _, text = _get(f"http://{metrics_address}/metrics", timeout)
    samples = _samples(text)

    def one(name: str) -> Optional[float]:
        """The metric's value; for one labelled by ip_family, the largest (the most recent, for a time)."""
        found = samples.get(name)
        return max(value for _, value in found) if found else None

    for labels, value in samples.get("netproxy_backend_info", []):
        if value:
            status.backend, status.writer = labels.get("backend", ""), labels.get("writer", "")
    ports = one("netproxy_service_ports")
    status.service_ports = int(ports) if ports is not None else None
    last = one("kubeproxy_sync_proxy_rules_last_timestamp_seconds")
    status.last_sync = last or None
    status.last_sync_seconds = one("netproxy_sync_proxy_rules_last_duration_seconds")
    status.syncs = {labels["result"]: value for labels, value in samples.get("netproxy_sync_proxy_rules_total", [])}
    status.rejected_objects = one("netproxy_rejected_objects_total")
    if healthz_address:
        try:
            code, body = _get(f"http://{healthz_address}/healthz", timeout)
            status.health_code, status.health = code, json.loads(body)
        except (OSError, ValueError) as err:
            status.health = {"error": str(err)}
    return status


Programmed = List[Tuple[str, str, Tuple[str, ...]]]
"""(service, "address:port/proto", endpoints or ("reject",)) as the kernel holds them."""


def render(status: Status, output: str = "table", now: Optional[float] = None,
           ports: Optional[Programmed] = None) -> str:
    if output == "json":
        doc: Dict[str, object] = asdict(status)
        if ports is not None:
            doc["kernel"] = [{"service": s, "frontend": f, "endpoints": list(e)} for s, f, e in ports]
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"
    return _table(status, now) + ("" if ports is None else _ports(ports))


def _ports(ports: Programmed) -> str:
    """The kernel's service ports, one per line: SERVICE  FRONTEND  ENDPOINTS."""
    rows = [("SERVICE", "FRONTEND", "ENDPOINTS")] + [(s, f, ", ".join(e) or "-") for s, f, e in ports]
    wide = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n" + "".join(f"{s:<{wide[0]}}  {f:<{wide[1]}}  {e}\n" for s, f, e in rows)


def _table(status: Status, now: Optional[float]) -> str:
    now = time.time() if now is None else now

    def show(value: object) -> str:
        return "-" if value is None or value == "" else str(value)

    if status.last_sync:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(status.last_sync))
        last = f"{stamp} ({now - status.last_sync:.0f}s ago)"
    else:
        last = "never"
    took = f"{status.last_sync_seconds:.3f}s" if status.last_sync_seconds is not None else "-"
    health = "unreachable" if status.health_code is None else \
        ("ok" if status.health_code == 200 else "failing") + f" ({status.health_code})"
    if status.health and status.health.get("nodeEligible") is False:
        health += ", node being deleted"
    rows = [("backend", show(status.backend)), ("writer", show(status.writer)),
            ("service ports", show(status.service_ports)), ("last sync", last), ("last sync took", took),
            ("syncs", ", ".join(f"{k} {v:.0f}" for k, v in sorted(status.syncs.items())) or "-"),
            ("rejected objects", show(None if status.rejected_objects is None else int(status.rejected_objects))),
            ("healthz", health)]
    return "".join(f"{k + ':':<18}{v}\n" for k, v in rows)
