"""Fault 1 of the fault suite: ``kill -9`` at any moment of a sync.

- A 5,000-service ``netproxy sync`` (2,000 in the quick tier) is killed at eight moments (four in the
  quick tier) spread over its own duration: every table the kernel holds afterwards is the old
  ruleset or the new one, never a mix (iptables: per family and table, since iptables commits table
  by table; nftables: one transaction per sync), and the next ``sync`` converges to exactly the new
  ruleset.
- A ``netproxy run`` killed with ``-9`` and started again keeps established flows on the endpoints
  they had: no flush and no conntrack wipe at start-up (UDP flows from fixed source ports follow
  their conntrack entry, so a wipe would re-balance them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from netproxy_lab.checks import wait_for
from netproxy_lab.combos import Combo
from netproxy_lab.manifests import Manifest, endpoint_slice, port, service
from netproxy_lab.proxy import Proxy
from netproxy_lab.tier import knob
from netproxy_lab.topology import Pod, Sandbox
from tests.faults.figures import figure

# The quick tier runs this fault on the two default node kinds (nftables, iptables-legacy); the
# full tier on every combination (lab/netproxy_lab/tier.py).
pytestmark = [pytest.mark.kernel, pytest.mark.quick_combos("nftables", "iptables-legacy/restore")]

SERVICES = int(knob("NETPROXY_KILL_SERVICES", quick=2000, full=5000))
KILL_POINTS = int(knob("NETPROXY_KILL_POINTS", quick=4, full=8))
Listing = Dict[Tuple[str, str], str]


def _cluster(n: int, pods: Sequence[Pod], new: bool) -> List[Manifest]:
    """``n`` services; the new version moves endpoints of every other service and empties every 50th
    (which changes the filter table too: a service without endpoints is refused there)."""
    out: List[Manifest] = []
    for i in range(n):
        name = f"svc-{i}"
        out.append(service(name, f"10.96.{i // 250}.{i % 250 + 1}", [port(80, 8080)]))
        chosen: Sequence[Pod] = pods[:2]
        if new and i % 2 == 0:
            chosen = pods[1:3]
        if new and i % 50 == 0:
            chosen = ()
        out.append(endpoint_slice(name, list(chosen), [port(8080)]))
    return out


def _write_list(path: str, objects: Sequence[Manifest]) -> None:
    """One JSON ``List`` (streamed by the loader) rather than 10,000 YAML documents."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"apiVersion": "v1", "kind": "List", "items": list(objects)}, f)
    os.replace(tmp, path)


_COUNTERS = re.compile(r"\[\d+:\d+\]")


def _listing(proxy: Proxy) -> Listing:
    """What the kernel holds now, per (family, table), spelled by the kernel's own tools."""
    sb, combo = proxy.sandbox, proxy.combo
    out: Listing = {}
    if combo.backend == "iptables":
        for family, tool in (("4", "iptables"), ("6", "ip6tables")):
            for table in ("nat", "filter"):
                text = sb.exec(sb.node, [f"{tool}-{combo.flavour}-save", "-t", table], check=True).stdout
                lines = [_COUNTERS.sub("", line) for line in text.splitlines() if not line.startswith("#")]
                out[(family, table)] = "\n".join(lines)
    else:
        for family in ("ip", "ip6"):
            text = sb.exec(sb.node, ["nft", "list", "table", family, "netproxy"]).stdout
            out[(family, "netproxy")] = text
    return out


def _settle(sb: Sandbox, timeout: float = 60.0) -> None:
    """Wait until no process is left in the node: a killed sync's ``iptables-restore`` child lives
    on (it commits or fails on its cut input by itself) and must be done before the kernel is read."""
    def empty() -> Optional[str]:
        left = subprocess.run(["ip", "netns", "pids", sb.node], capture_output=True, text=True).stdout.split()
        return None if not left else f"still running in the node: {left}"

    wait_for(empty, timeout=timeout, step=0.05)


def _complete_sync(proxy: Proxy, source: str) -> float:
    t0 = time.monotonic()
    proc = proxy.command("sync", "--source", source, *proxy.base_flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return time.monotonic() - t0


def test_kill_9_during_a_sync_leaves_each_table_old_or_new(proxy: Proxy, sandbox: Sandbox, combo: Combo) -> None:
    pods = sandbox.pods[:3]
    old_path, new_path = (os.path.join(sandbox.workdir, f"{v}.json") for v in ("old", "new"))
    _write_list(old_path, _cluster(SERVICES, pods, new=False))
    _write_list(new_path, _cluster(SERVICES, pods, new=True))
    _complete_sync(proxy, new_path)
    new = _listing(proxy)
    _complete_sync(proxy, old_path)
    old = _listing(proxy)
    changed = [k for k in old if old[k] != new[k]]
    assert changed, "the two versions must differ in the kernel"
    took = _complete_sync(proxy, new_path)  # how long a whole old → new sync takes, process start included
    _complete_sync(proxy, old_path)

    states = {"old": 0, "new": 0}
    mixed: List[str] = []
    current, target = old, new
    paths = {id(old): old_path, id(new): new_path}
    for k in range(1, KILL_POINTS + 1):
        at = took * k / (KILL_POINTS + 1)
        proc = sandbox.start_netproxy(["sync", "--source", paths[id(target)], *proxy.base_flags, *combo.flags],
                                      flavour=combo.path_flavour)
        time.sleep(at)
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.wait()
        _settle(sandbox)
        now = _listing(proxy)
        for key, text in now.items():
            if text == target[key]:
                states["new" if target is new else "old"] += 1
            elif text == current[key]:
                states["old" if target is new else "new"] += 1
            else:
                mixed.append(f"kill at {at:.2f}s: {key} is neither the old nor the new ruleset")
        # The next start converges: a whole sync leaves exactly the target ruleset.
        _complete_sync(proxy, paths[id(target)])
        assert _listing(proxy) == target, f"kill at {at:.2f}s: the next sync did not converge"
        current, target = target, current
    figure(f"kill -9 during a {SERVICES}-service sync [{combo.name}]",
           f"{KILL_POINTS} kills over {took:.2f}s: {len(mixed)} mixed tables; tables old {states['old']}, "
           f"new {states['new']}; every restart converged", "0 mixed states, restart converges")
    assert not mixed, mixed


UDP_IP = "10.96.2.53"
FLOW_PORTS = (41001, 41002, 41003, 41004, 41005, 41006)


def _dns(pods: Sequence[Pod]) -> List[Manifest]:
    return [service("dns", UDP_IP, [port(53, 8080, protocol="UDP")]),
            endpoint_slice("dns", list(pods), [port(8080, protocol="UDP")])]


def _flows(sb: Sandbox) -> Dict[int, str]:
    """The pod answering each fixed-source-port UDP flow (one datagram each)."""
    out = {}
    for p in FLOW_PORTS:
        for _ in range(3):  # a datagram lost on a loaded machine: the same flow again (same conntrack entry)
            res = sb.connect(UDP_IP, 53, proto="udp", count=1, timeout=2.0, bind=f":{p}")
            if res.answered == 1:
                break
        assert res.answered == 1, (p, res.errors)
        out[p] = next(iter(res.counts))
    return out


def test_kill_9_of_run_and_restart_keep_established_flows(proxy: Proxy, sandbox: Sandbox, combo: Combo) -> None:
    pods = sandbox.pods[:3]
    run = proxy.start_run(_dns(pods))
    wait_for(lambda: None if "synced full" in proxy.run_output() else "no sync yet", timeout=60)
    before = _flows(sandbox)
    # (All six on one pod happens (3 * 3^-6); a wipe would still re-balance them: 3^-6 to land there again.)
    run.kill()
    run.wait()
    ruleset = _listing(proxy)
    proxy.start_run(_dns(pods))
    wait_for(lambda: None if proxy.run_output().count("synced full") >= 1 else "no sync yet", timeout=60)
    assert _listing(proxy) == ruleset, "the restart changed a ruleset that was already right"
    after = _flows(sandbox)
    moved = {p: (before[p], after[p]) for p in FLOW_PORTS if before[p] != after[p]}
    figure(f"kill -9 of run, restart [{combo.name}]",
           f"{len(FLOW_PORTS) - len(moved)}/{len(FLOW_PORTS)} established UDP flows kept their endpoint",
           "all kept: no flush, no conntrack wipe at start-up")
    assert not moved, f"flows re-balanced by the restart (conntrack wiped or rules flushed): {moved}"
    assert proxy.stop_runs() == [-9, 0], proxy.run_output()[-3000:]  # the killed run, then the restart
