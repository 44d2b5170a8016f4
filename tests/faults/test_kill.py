"""Fault 1 of the fault suite: ``kill -9`` at any moment of a sync.

- A 5,000-service ``netproxy sync`` (2,000 in the quick tier) is killed at eight moments (four in the
  quick tier) spread over its kernel write, each proven by the sync's log to have landed after the
  write began and before it returned: every table the kernel holds afterwards is the old
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
_STAMP = re.compile(r'\n\s*elements = \{ 1 comment "netproxy [^"]*" \}')


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
            # Without the table stamp: it names the generation of the last commit, which two
            # histories that end with the same objects do not share, and the test deletes it to
            # make a sync rewrite rather than adopt (backends/nftables/stamp.py).
            out[(family, "netproxy")] = _STAMP.sub("", text)
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


# The backends log these at debug level right before and right after each kernel write (one per
# family for iptables, one transaction for nftables): a killed sync's log says whether the kill landed
# after a write had begun and before the last one returned.
WRITING, WRITTEN = "writing the kernel:", "written the kernel:"


class Sync:
    """A ``netproxy sync --log-level debug`` in the node, its log read as it is written."""

    def __init__(self, proxy: Proxy, source: str, log_path: str) -> None:
        sb, combo = proxy.sandbox, proxy.combo
        self.log_path = log_path
        self.proc = sb.start_netproxy(["sync", "--source", source, "--log-level", "debug", *proxy.base_flags,
                                       *combo.flags], flavour=combo.path_flavour, log_path=log_path)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for_line(self, text: str, count: int = 1, timeout: float = 300.0) -> bool:
        """Poll the log (every millisecond: the write lasts tens of milliseconds) until ``text`` is
        in it ``count`` times; False if the process exited first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log().count(text) >= count:
                return True
            if self.proc.poll() is not None:
                return self.log().count(text) >= count
            time.sleep(0.001)
        raise AssertionError(f"no {text!r} in the sync's log after {timeout}s:\n{self.log()[-3000:]}")


def _write_window(proxy: Proxy, source: str, log_path: str) -> Tuple[float, int]:
    """A whole sync to ``source``: (seconds from its first kernel write's start to its last write's
    return, as this test's polling sees them; how many writes it made)."""
    sync = Sync(proxy, source, log_path)
    assert sync.wait_for_line(WRITING), sync.log()[-3000:]
    t0 = end = time.monotonic()
    seen = 0
    while sync.proc.poll() is None:
        returned = sync.log().count(WRITTEN)
        if returned > seen:
            seen, end = returned, time.monotonic()
        time.sleep(0.001)
    if sync.log().count(WRITTEN) > seen:
        end = time.monotonic()
    window = end - t0
    assert sync.proc.wait() == 0, sync.log()[-3000:]
    writes = sync.log().count(WRITTEN)
    assert writes >= 1 and writes == sync.log().count(WRITING), sync.log()[-3000:]
    return window, writes


def test_kill_9_during_a_sync_leaves_each_table_old_or_new(proxy: Proxy, sandbox: Sandbox, combo: Combo) -> None:
    """Every kill is timed from the sync's first kernel write (its log says when that began) and must
    land before the last write returned (its log says that too): a kill during start-up or after the
    write would make "0 mixed tables" trivially true.  A kill that came too late is repeated earlier."""
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
    logs = iter(os.path.join(sandbox.workdir, f"sync-{i}.log") for i in range(10_000))
    # How long the kernel writes of a whole old → new sync take, and how many there are.
    window, writes = _write_window(proxy, new_path, next(logs))
    _complete_sync(proxy, old_path)

    states = {"old": 0, "new": 0}
    mixed: List[str] = []
    landed: List[str] = []
    current, target = old, new
    paths = {id(old): old_path, id(new): new_path}
    for k in range(1, KILL_POINTS + 1):
        at = window * k / (KILL_POINTS + 1)
        for _attempt in range(8):
            if combo.backend == "nftables" and k % 2 == 0:
                # A new nftables process adopts the tables it finds (one transaction of the changed
                # services); without their stamp it rewrites them (one transaction of everything):
                # every other kill lands in each kind of write.
                sandbox.exec(sandbox.node, ["nft", "delete", "element", "ip", "netproxy", "stamp", "{ 1 }"],
                             check=True)
            elif k % 2 == 0:  # the same on iptables: its stamp chain flushed, both families rewritten
                for tool in ("iptables", "ip6tables"):
                    sandbox.exec(sandbox.node, [f"{tool}-{combo.flavour}", "-t", "mangle", "-F", "KUBE-NP-STAMP"],
                                 check=True)
            sync = Sync(proxy, paths[id(target)], next(logs))
            began = sync.wait_for_line(WRITING)
            assert began, f"the sync exited before writing:\n{sync.log()[-3000:]}"
            time.sleep(at)
            sync.proc.kill()  # SIGKILL: no handler, no cleanup
            code = sync.proc.wait()
            text = sync.log()
            if combo.backend == "nftables":
                kind = "the full rewrite" if k % 2 == 0 else "adoption"
                assert f"{WRITING} {kind}" in text, f"kill {k}: not {kind}:\n{text[-3000:]}"
            else:
                kind = "not adopted, rewriting them all" if k % 2 == 0 else "IPv4 tables adopted"
                assert kind in text, f"kill {k}: not {kind}:\n{text[-3000:]}"
            _settle(sandbox)
            now = _listing(proxy)
            for key, listed in now.items():
                if listed == target[key]:
                    states["new" if target is new else "old"] += 1
                elif listed == current[key]:
                    states["old" if target is new else "new"] += 1
                else:
                    mixed.append(f"kill {at * 1000:.0f} ms into the write: {key} is neither the old nor the new")
            # The next start converges: a whole sync leaves exactly the target ruleset.
            _complete_sync(proxy, paths[id(target)])
            assert _listing(proxy) == target, f"kill {at * 1000:.0f} ms into the write: the next sync did not converge"
            current, target = target, current
            if code == -9 and text.count(WRITTEN) < writes:
                landed.append(f"{at * 1000:.0f} ms")
                break
            at /= 2  # the write was over (a faster run than the measured one): again, earlier
    figure(f"kill -9 during a {SERVICES}-service sync [{combo.name}]",
           f"{len(landed)}/{KILL_POINTS} kills inside a {window * 1000:.0f} ms write ({', '.join(landed)} after it "
           f"began): {len(mixed)} mixed tables; tables old {states['old']}, new {states['new']}; every restart "
           "converged (adoption and full rewrite in turn)",
           "0 mixed states, restart converges")
    assert not mixed, mixed
    assert len(landed) == KILL_POINTS, f"only {landed} of {KILL_POINTS} kills landed while the kernel was written"


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
