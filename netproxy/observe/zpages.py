"""kube-proxy's z-pages on the metrics address: ``/statusz``, ``/flagz``, ``/configz`` and
``/proxyMode``, in kube-proxy's formats, beside ``/metrics``.

- ``/configz``: the effective configuration as kube-proxy's ``KubeProxyConfiguration`` (JSON under
  ``kubeproxy.config.k8s.io``, as its configz handler nests it), built from the one ProxyConfig: what
  the proxy runs with, whether a flag, ``--config`` or a default set it;
- ``/statusz`` and ``/flagz``: plain text for people (component-base's zpages: a title, the warning
  that the format is not for machines, then start time, uptime and versions, or ``flag=value`` lines);
- ``/proxyMode``: the backend's name, as kube-proxy answers ``iptables`` or ``nftables``.

Pure functions of their inputs; :func:`serve` puts them on one HTTP server with prometheus_client's
``/metrics``.
"""

from __future__ import annotations

import json
import logging
import platform
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from netproxy.core.config import ProxyConfig

log = logging.getLogger(__name__)

WARNING = ("Warning: This endpoint is not meant to be machine parseable, has no formatting compatibility "
           "guarantees and is for debugging purposes only.")
ENDPOINTS = (("configz", "/configz"), ("flagz", "/flagz"), ("healthz", "/healthz"), ("livez", "/livez"),
             ("metrics", "/metrics"), ("proxyMode", "/proxyMode"))


def go_duration(seconds: float) -> str:
    """``30.0`` → ``"30s"``, ``0.5`` → ``"500ms"``, ``3600`` → ``"1h0m0s"``, as Go prints a Duration."""
    if seconds < 1 and seconds != 0:
        return f"{seconds * 1000:g}ms"
    whole = int(seconds)
    frac = seconds - whole
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    sec = f"{s + frac:g}s"
    if h:
        return f"{h}h{m}m{sec}"
    if m:
        return f"{m}m{sec}"
    return sec


CONNTRACK_FIELDS = (("max_per_core", "maxPerCore", None), ("min", "min", None),
                    ("tcp_established_timeout", "tcpEstablishedTimeout", go_duration),
                    ("tcp_close_wait_timeout", "tcpCloseWaitTimeout", go_duration),
                    ("tcp_be_liberal", "tcpBeLiberal", None), ("udp_timeout", "udpTimeout", go_duration),
                    ("udp_stream_timeout", "udpStreamTimeout", go_duration))
"""ctsysctl.ConntrackSettings' fields → KubeProxyConntrackConfiguration's, and how a value is shown."""


def conntrack_section(settings: Any) -> Dict[str, Any]:
    """The ``conntrack`` section from ctsysctl.ConntrackSettings: null where netproxy leaves the
    kernel's value alone (kube-proxy would print its own default there)."""
    out: Dict[str, Any] = {}
    for attr, key, shown in CONNTRACK_FIELDS:
        value = getattr(settings, attr)
        out[key] = shown(value) if shown is not None and value is not None else value
    return out


def configz(config: ProxyConfig, conntrack: Mapping[str, Any], feature_gates: Mapping[str, bool],
            kubeconfig: str = "") -> Dict[str, Any]:
    """The effective KubeProxyConfiguration (k8s.io/kube-proxy/config/v1alpha1), as /configz nests it."""
    periods = {"masqueradeBit": config.masquerade_bit, "masqueradeAll": config.masquerade_all,
               "syncPeriod": go_duration(config.sync_period), "minSyncPeriod": go_duration(config.min_sync_period)}
    doc: Dict[str, Any] = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "featureGates": dict(feature_gates),
        "clientConnection": {"kubeconfig": kubeconfig},
        "hostnameOverride": config.hostname,
        "healthzBindAddress": config.healthz_bind_address,
        "metricsBindAddress": config.metrics_bind_address,
        "mode": config.backend,
        "iptables": {**periods, "localhostNodePorts": config.localhost_nodeports},
        "nftables": dict(periods),
        "detectLocalMode": config.detect_local_mode,
        "detectLocal": {"bridgeInterface": config.pod_bridge_interface,
                        "interfaceNamePrefix": config.pod_interface_name_prefix},
        "clusterCIDR": ",".join(str(c) for c in config.cluster_cidrs),
        "nodePortAddresses": [str(c) for c in config.nodeport_addresses],
        "conntrack": dict(conntrack),
        "configSyncPeriod": go_duration(config.sync_period),
    }
    return {"kubeproxy.config.k8s.io": doc}


def _header(title: str) -> List[str]:
    return [title, WARNING, ""]


def statusz(started: float, now: float, version: str) -> str:
    up = int(now - started)
    lines = _header("kube-proxy statusz (netproxy)") + [
        f"Started: {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime(started))}",
        f"Up: {up // 3600} hr {up // 60 % 60:02d} min {up % 60:02d} sec",
        f"Python version: {platform.python_version()}",
        f"Binary version: {version}",
        "",
        "List of useful endpoints",
        "--------------",
        *(f"{name}:{path}" for name, path in ENDPOINTS),
    ]
    return "\n".join(lines) + "\n"


def flagz(flags: Iterable[Tuple[str, Any]]) -> str:
    """``name=value`` per flag, sorted, as component-base prints a command's flag set."""
    def shown(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value)
        return "" if value is None else str(value)

    return "\n".join(_header("kube-proxy flags (netproxy)") +
                     [f"{name}={shown(value)}" for name, value in sorted(flags)]) + "\n"


Page = Callable[[], Tuple[str, bytes]]
"""A page: (content type, body), computed when asked."""


def pages(config: ProxyConfig, conntrack: Mapping[str, Any], feature_gates: Mapping[str, bool],
          flags: Sequence[Tuple[str, Any]], version: str, kubeconfig: str = "",
          started: Optional[float] = None, clock: Callable[[], float] = time.time) -> Dict[str, Page]:
    start = clock() if started is None else started
    text = "text/plain; charset=utf-8"
    return {
        "/configz": lambda: ("application/json", json.dumps(configz(config, conntrack, feature_gates,
                                                                     kubeconfig)).encode()),
        "/statusz": lambda: (text, statusz(start, clock(), version).encode()),
        "/flagz": lambda: (text, flagz(flags).encode()),
        "/proxyMode": lambda: (text, config.backend.encode()),
    }


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("metrics server: " + fmt, *args)


def app(zpages: Mapping[str, Page]) -> Callable[..., Any]:
    """One WSGI app: the z-pages by path, everything else prometheus_client's /metrics."""
    from prometheus_client import make_wsgi_app

    metrics = make_wsgi_app()

    def route(environ: Dict[str, Any], start_response: Callable[..., Any]) -> Any:
        page = zpages.get(environ.get("PATH_INFO", ""))
        if page is None:
            return metrics(environ, start_response)
        ctype, body = page()
        start_response("200 OK", [("Content-Type", ctype), ("Content-Length", str(len(body))),
                                  ("X-Content-Type-Options", "nosniff")])
        return [body]

    return route


def serve(address: str, zpages: Mapping[str, Page]) -> Optional[WSGIServer]:
    """/metrics and the z-pages on ``host:port``; a port already taken is logged, not fatal."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        host = host.strip("[]") or "0.0.0.0"
        server = make_server(host, int(port), app(zpages), server_class=_Server6 if ":" in host else _Server,
                             handler_class=_Quiet)
    except (OSError, ValueError) as err:
        log.warning("metrics not served on %s: %s", address, err)
        return None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
