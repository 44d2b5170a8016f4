"""Measure listing and converting a big cluster through the official client, in a fresh process.

    python -m tests.unit.kube.measure_list --services 10000 --endpoints-per-slice 10 [--mode raw|model]

Starts the API stand-in in a child process (so the figures are the client's alone), lists every
Service and EndpointSlice, converts them and hands them to a ChangeTracker; prints one JSON line:
seconds per collection and the peak RSS growth.  ``raw`` is what the source does (raw JSON,
``_preload_content=False``); ``model`` is the client's default (typed models), turned back into dicts
for the same conversion, which is what using the models would cost us.  ``--url`` measures against a
stand-in that is already running.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any, Callable, Dict, Iterator, Optional

from kubernetes import client

from netproxy.core.tracker import ChangeTracker
from netproxy.source.kube import ServiceHandler, SliceHandler
from netproxy.source.kube_reflector import Reflector, ReflectorSettings
from netproxy_lab.apiserver_process import StandInProcess, generated_cluster


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def model_items(api: client.ApiClient, list_func: Callable[..., Any], kind: str) -> Iterator[Dict[str, Any]]:
    """Pages deserialised into the client's models, then back to API-shaped dicts for convert.py."""
    cont: Optional[str] = None
    while True:
        page = list_func(limit=500, _continue=cont) if cont else list_func(limit=500)
        for item in page.items:
            obj = api.sanitize_for_serialization(item)
            obj["kind"] = kind
            yield obj
        cont = page.metadata._continue
        if not cont:
            return


def measure(url: str, mode: str, page_size: int = 500) -> Dict[str, float]:
    cfg = client.Configuration()
    cfg.host = url
    api = client.ApiClient(cfg)
    core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    tracker = ChangeTracker()
    handlers = {"Service": (core.list_service_for_all_namespaces, ServiceHandler(tracker)),
                "EndpointSlice": (discovery.list_endpoint_slice_for_all_namespaces, SliceHandler(tracker, ("IPv4",)))}
    base = peak_rss_mb()
    out: Dict[str, float] = {}
    for kind, (func, handler) in handlers.items():
        t0 = time.perf_counter()
        if mode == "raw":
            Reflector(kind, func, handler, ReflectorSettings(page_size=page_size)).list_once()
        else:
            handler.replace(model_items(api, func, kind))
        out[f"{kind}_seconds"] = round(time.perf_counter() - t0, 3)
    snap, _ = tracker.take()
    out["services"] = len(snap.services)
    out["endpoints"] = sum(len(v) for v in snap.endpoints.values())
    out["rejected"] = tracker.rejected
    out["peak_rss_growth_mb"] = round(peak_rss_mb() - base, 1)
    out["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints-per-slice", type=int, default=10)
    parser.add_argument("--mode", choices=("raw", "model"), default="raw")
    parser.add_argument("--page-size", type=int, default=500)
    parser.add_argument("--url", help="a running stand-in (otherwise one is started)")
    args = parser.parse_args()
    if args.url:
        result = measure(args.url, args.mode, args.page_size)
    else:
        with StandInProcess(generated_cluster(args.services, args.endpoints_per_slice)) as url:
            result = measure(url, args.mode, args.page_size)
    result["mode"] = args.mode  # type: ignore[assignment]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
