"""Runs an NftablesBackend inside a network namespace for tests/kernel/test_nftables_*.py.

libnftables talks to the network namespace of the process that calls it, so the tests start this
module with ``ip netns exec <ns> python -m tests.kernel.nft_driver`` (from the repository root) and
talk to it over stdin/stdout, one JSON request and one JSON reply per line.  One process per test
keeps the backend's own record across syncs, which is what the incremental path needs.

Request: {"op": "sync"|"plan"|"cleanup"|"scenario", "full": bool, "changed": [names], "services": [svc...]}
with svc = {"name", "ip", "port", "proto", "eps": [ip...], "affinity": seconds or 0, "external": [ip...]}.
{"op": "scenario", "config": name, "step": i} applies step i of nft_scenarios.steps() (step 0 starts a
new backend with nft_scenarios.CONFIGS[name]).
Reply: {"ok": true, "result": ...} or {"ok": false, "error": str, "line": str or null}.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import sys
from typing import Any, Dict, List

from netproxy.backends.base import SyncError
from netproxy.backends.nftables import NftablesBackend
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Endpoint, ServicePort, ServicePortName, Snapshot


def _snapshot(services: List[Dict[str, Any]]) -> Snapshot:
    ports, eps = [], {}
    for s in services:
        name = ServicePortName("default", s["name"], "p")
        ports.append(ServicePort(
            name, s.get("proto", "TCP"), int(s.get("port", 80)), 8080,
            cluster_ips=(ipaddress.ip_address(s["ip"]),),
            external_ips=tuple(ipaddress.ip_address(a) for a in s.get("external", ())),
            affinity="ClientIP" if s.get("affinity") else "None",
            affinity_timeout=int(s.get("affinity") or 10800)))
        eps[name] = tuple(Endpoint(ipaddress.ip_address(a), 8080) for a in s.get("eps", ()))
    return Snapshot.build(ports, eps)


def main() -> None:
    writer = os.environ.get("NETPROXY_NFT_WRITER", "netlink")
    backend = NftablesBackend(ProxyConfig(hostname="node", nftables_writer=writer))
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "sync":
                changed = frozenset(ServicePortName("default", n, "p") for n in req.get("changed", ()))
                res = backend.sync(_snapshot(req["services"]), Changes(req.get("full", True), changed))
                reply: Dict[str, Any] = {"ok": True, "result": {"full": res.full, "written": res.services_written}}
            elif req["op"] == "scenario":  # nft_scenarios.py: the two writers' comparison
                from tests.kernel import nft_scenarios

                if req["step"] == 0:
                    backend = NftablesBackend(dataclasses.replace(nft_scenarios.CONFIGS[req["config"]],
                                                                  nftables_writer=writer))
                snapshot, changes = nft_scenarios.steps()[req["step"]]
                res = backend.sync(snapshot, changes)
                reply = {"ok": True, "result": {"full": res.full, "written": res.services_written}}
            elif req["op"] == "plan":
                reply = {"ok": True, "result": backend.plan(_snapshot(req["services"]))}
            elif req["op"] == "cleanup":
                backend.cleanup()
                reply = {"ok": True, "result": None}
            else:
                reply = {"ok": False, "error": f"unknown op {req['op']!r}", "line": None}
        except SyncError as err:
            reply = {"ok": False, "error": str(err), "line": err.line}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
