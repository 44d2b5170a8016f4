"""Fault 3 (tests/faults/README.md): another program writing iptables at the same time.

- A foreign writer (``foreign_writer.py``: ``iptables -w -A``/``-D`` and ``iptables-restore -w
  --noflush`` in a loop, in the node) runs during N one-shot netproxy syncs that alternate between
  two rulesets.  After every sync: netproxy's rules are exactly the ones that sync wrote, and every
  foreign rule and chain added so far is still there; the foreign writer never finds its own rule
  gone.  Legacy tables are replaced whole on every write, so this holds only if both of netproxy's
  writers take the xtables lock around their read-modify-commit, as iptables does.
- The lock held 3 s by another process while ``netproxy run`` has a change to write: netproxy
  waits (``netproxy_iptables_lock_wait_seconds``), writes right after, and counts no failure.
- The lock held longer than ``--iptables-lock-timeout``: the sync fails with an error naming the
  lock and its holder, having written nothing.

Only the iptables backend writes iptables; iptables-nft takes no lock (nf_tables commits are per
rule), so there the held lock must simply not stop netproxy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import pytest

from netproxy_lab.checks import wait_for
from netproxy_lab.combos import Combo, selected
from netproxy_lab.manifests import endpoint_slice, port, service, write_manifests
from netproxy_lab.proxy import Proxy
from netproxy_lab.pytest_plugin import driven, require_combo
from netproxy_lab.tier import knob
from netproxy_lab.topology import Pod, Sandbox
from tests.faults.figures import figure
from tests.kernel.test_parity import http_get

# The xtables lock is one file for the whole machine (not per namespace): while these tests hold it,
# every legacy iptables write of a test running beside them would wait. They run alone.
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

HERE = os.path.dirname(os.path.abspath(__file__))
LOCK = "/run/xtables.lock"
METRICS = "127.0.0.1:10249"
SYNC_BUDGET = knob("NETPROXY_FOREIGN_SECONDS", quick=15, full=120)
"""Seconds of netproxy syncs under the foreign writer per combination (quick tier 15 s, full 120 s)."""
SYNCS = int(os.environ.get("NETPROXY_FOREIGN_SYNCS", "0") or "0")
"""A fixed number of syncs instead (the target's 1,000: ``NETPROXY_FOREIGN_SYNCS=1000``, ~20 min a writer)."""
HOLD = 3.0
_COUNTERS = re.compile(r"\[\d+:\d+\]")
IPTABLES_COMBOS = [c for c in selected() if c.backend == "iptables"]


@pytest.fixture(scope="module", params=IPTABLES_COMBOS, ids=[c.name for c in IPTABLES_COMBOS])
def ipt(request: pytest.FixtureRequest, kernel_env: None) -> Combo:
    return require_combo(request.param)


@pytest.fixture(scope="module")
def ipt_sandbox(kernel_env: None, ipt: Combo) -> Iterator[Sandbox]:
    with Sandbox(pods=2) as sb:
        yield sb


@pytest.fixture()
def iproxy(ipt_sandbox: Sandbox, ipt: Combo, tmp_path: Any) -> Iterator[Proxy]:
    yield from driven(ipt_sandbox, ipt, str(tmp_path))


def _cluster(pods: Sequence[Pod], services: int, variant: int) -> List[Dict[str, Any]]:
    """``services`` services; ``variant`` 0/1 differ in every service's endpoints (so consecutive
    syncs rewrite every chain)."""
    out: List[Dict[str, Any]] = []
    for i in range(services):
        name = f"svc-{i}"
        out.append(service(name, f"10.97.{i // 250}.{i % 250 + 1}", [port(80, 8080, name="http")]))
        chosen = list(pods) if variant == 0 else list(pods[:1])
        out.append(endpoint_slice(name, chosen, [port(8080, name="http")]))
    return out


def _save(sb: Sandbox, flavour: str) -> Tuple[Set[str], str]:
    """(netproxy's lines, the whole v4 save) — netproxy's lines are those naming a KUBE- chain, but its
    stamp's (mangle ``KUBE-NP-STAMP``): that names the tables' fingerprint (the foreign rules in them
    included) or the generation, and is left stale, as it should be, when the foreign writer's commits
    come between netproxy's write and its stamp (backends/iptables/README.md, "Restart by adoption")."""
    text = sb.exec(sb.node, [f"iptables-{flavour}-save"], check=True).stdout
    ours = {_COUNTERS.sub("", ln).strip() for ln in text.splitlines()
            if "KUBE-" in ln and "KUBE-NP-STAMP" not in ln and not ln.startswith("#")}
    return ours, text


def _foreign_log(path: str) -> Tuple[List[str], List[str], List[str], int]:
    """(kept rule comments, chains, lost rules, ops) the foreign writer has logged so far."""
    kept, chains, lost, ops = [], [], [], 0
    with open(path) as f:
        for line in f.read().splitlines():
            word, _, rest = line.partition(" ")
            if word == "keep":
                kept.append(rest.split()[1])
            elif word == "chain":
                chains.append(rest)
            elif word == "lost":
                lost.append(rest)
            elif word == "ops":
                ops = int(rest)
    return kept, chains, lost, ops


def test_no_rule_is_lost_with_a_foreign_writer_during_syncs(iproxy: Proxy, ipt_sandbox: Sandbox,
                                                            ipt: Combo) -> None:
    sb = ipt_sandbox
    pods = sb.pods[:2]
    sets = [_cluster(pods, 60, v) for v in (0, 1)]
    expected: List[Set[str]] = []
    for objects in sets:  # each ruleset as netproxy alone writes it, to compare with under contention
        iproxy.sync(objects)
        expected.append(_save(sb, ipt.flavour)[0])
    assert expected[0] != expected[1]
    log_path = os.path.join(iproxy.workdir, "foreign.log")
    writer = sb.popen(sb.node, [sys.executable, os.path.join(HERE, "foreign_writer.py"), ipt.flavour, log_path],
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    syncs = 0
    try:
        wait_for(lambda: None if os.path.exists(log_path) and _foreign_log(log_path)[3] > 0 else "not started", 10)
        t0 = time.monotonic()
        while (syncs < SYNCS) if SYNCS else (time.monotonic() - t0 < SYNC_BUDGET):
            variant = syncs % 2
            iproxy.sync(sets[variant])
            syncs += 1
            kept, chains, lost, _ = _foreign_log(log_path)  # read before the save: all of it must be there
            ours, text = _save(sb, ipt.flavour)
            assert writer.poll() is None, f"the foreign writer failed: {writer.stderr.read() if writer.stderr else ''}"
            assert ours == expected[variant], (
                f"sync {syncs}: netproxy's rules differ from what it wrote "
                f"(missing {sorted(expected[variant] - ours)[:5]}, extra {sorted(ours - expected[variant])[:5]})")
            gone = [c for c in kept if f'"{c}"' not in text and f" {c} " not in text]
            gone += [c for c in chains if f":{c} " not in text]
            assert not gone, f"sync {syncs}: foreign rules/chains lost: {gone[:10]}"
            assert not lost, f"sync {syncs}: the foreign writer found its rules gone: {lost[:10]}"
    finally:
        writer.kill()
        writer.wait()
    kept, chains, lost, ops = _foreign_log(log_path)
    figure(f"foreign writer during {syncs} syncs [{ipt.name}]",
           f"{ops} foreign iptables writes, {len(kept) + len(chains)} foreign rules/chains kept; lost: "
           f"{len(lost)} foreign, 0 netproxy", "0 rules lost, theirs or ours")
    assert syncs >= 5, f"only {syncs} syncs in {SYNC_BUDGET} s"
    assert ops >= syncs, f"the foreign writer ran only {ops} writes during {syncs} syncs"


_HOLDER = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _hold_lock(seconds: float) -> subprocess.Popen:  # type: ignore[type-arg]
    """Another process holding the host's xtables lock for ``seconds`` (the file is shared by every
    namespace; held only this long, never deleted)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, LOCK, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "held", line
    return proc


def _metric(sb: Sandbox, name: str, labels: str = "") -> float:
    code, body = http_get(sb, sb.node, f"http://{METRICS}/metrics")
    assert code == 200, body
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_held_lock_is_waited_for_then_the_sync_goes_through(iproxy: Proxy, ipt_sandbox: Sandbox,
                                                              ipt: Combo) -> None:
    sb = ipt_sandbox
    pods = sb.pods[:2]
    one = [service("web", "10.96.0.10", [port(80, 8080, name="http")]),
           endpoint_slice("web", pods[:1], [port(8080, name="http")])]
    two = one[:1] + [endpoint_slice("web", pods, [port(8080, name="http")])]
    iproxy.start_run(one, "--metrics-bind-address", METRICS, "--healthz-bind-address", "",
                     "--min-sync-period", "0s")

    def synced() -> Optional[str]:
        if iproxy.running() is False:
            raise AssertionError(iproxy.run_output()[-3000:])
        try:
            return None if _metric(sb, "netproxy_sync_proxy_rules_total", '{result="ok"}') >= 1 else "not synced"
        except Exception as err:  # noqa: BLE001 - not listening yet
            return str(err)

    wait_for(synced, 30)  # the first sync may itself wait for a lock other programs on the machine hold
    endpoint = pods[1].ip
    waited_before = _metric(sb, "netproxy_iptables_lock_wait_seconds_sum")
    holder = _hold_lock(HOLD)
    held_at = time.monotonic()
    try:
        write_manifests(iproxy.source, two)
        wait_for(lambda: None if endpoint in _save(sb, ipt.flavour)[1] else "not written", HOLD + 10, step=0.05)
        after = time.monotonic() - held_at
    finally:
        holder.wait()
    waited = _metric(sb, "netproxy_iptables_lock_wait_seconds_sum") - waited_before
    failures = _metric(sb, "netproxy_sync_proxy_rules_total", '{result="error"}') + \
        _metric(sb, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total")
    result = sb.connect("10.96.0.10", 80, count=20)
    assert not result.errors and sorted(result.counts) == sorted(p.name for p in pods), result
    if ipt.flavour == "legacy":
        figure(f"xtables lock held {HOLD:.0f} s by another program [{ipt.name}]",
               f"waited {waited:.2f} s, change in the kernel {after:.2f} s after the lock was taken, "
               f"{failures:.0f} failures", "waited, synced after, 0 failures")
        assert waited >= HOLD - 1.0, f"netproxy waited only {waited:.2f} s for a lock held {HOLD} s"
        assert after >= HOLD - 0.5, f"the change was written {after:.2f} s into a {HOLD} s hold"
    else:  # iptables-nft takes no lock: the write must simply not be held up, nor fail
        figure(f"xtables lock held {HOLD:.0f} s by another program [{ipt.name}]",
               f"not waited (iptables-nft takes no lock): change in the kernel after {after:.2f} s, "
               f"{failures:.0f} failures", "not blocked, 0 failures")
        assert after < HOLD, f"iptables-nft write held up {after:.2f} s by the xtables lock"
    assert failures == 0, iproxy.run_output()[-3000:]


def test_a_lock_held_past_the_timeout_fails_naming_the_holder(iproxy: Proxy, ipt_sandbox: Sandbox,
                                                              ipt: Combo) -> None:
    """Legacy: the sync fails, names the lock and its holder, writes nothing.  iptables-nft takes no
    lock, so there the same sync must go through while the lock is held."""
    sb = ipt_sandbox
    objects = [service("web", "10.96.0.10", [port(80, 8080, name="http")]),
               endpoint_slice("web", sb.pods[:1], [port(8080, name="http")])]
    write_manifests(iproxy.source, objects)
    holder = _hold_lock(HOLD)
    try:
        t0 = time.monotonic()
        proc = iproxy.command("sync", "--source", iproxy.source, *iproxy.base_flags, "--iptables-lock-timeout", "1s")
        took = time.monotonic() - t0
        still_held = holder.poll() is None
    finally:
        holder.wait()
    written = "KUBE-SERVICES" in _save(sb, ipt.flavour)[1]
    if ipt.flavour != "legacy":
        assert proc.returncode == 0 and written, (proc.returncode, proc.stderr[-2000:])
        assert still_held, f"the sync took {took:.2f} s: longer than the lock was held"
        figure(f"xtables lock held past --iptables-lock-timeout=1s [{ipt.name}]",
               f"not waited (iptables-nft takes no lock): synced in {took:.2f} s while it was held",
               "not blocked")
        return
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert LOCK in proc.stderr and f"pid {holder.pid}" in proc.stderr, proc.stderr[-2000:]
    assert "--iptables-lock-timeout=1s" in proc.stderr, proc.stderr[-2000:]
    assert not written, "a write went through without the lock"
    figure(f"xtables lock held past --iptables-lock-timeout=1s [{ipt.name}]",
           f"sync failed after {took:.2f} s naming {LOCK} and pid {holder.pid}", "a clear error, nothing written")


def test_sigterm_while_a_sync_waits_for_the_lock_stops_at_once(iproxy: Proxy, tmp_path: Any) -> None:
    """SIGTERM while a sync waits for a lock another program holds: ``run`` exits 0 within 3 s, not
    when the lock is free or ``--iptables-lock-timeout`` (60 s here) ran out, and its stamp at exit
    does not wait a second time.  Found by stressing ``run``'s stop beside another legacy writer: the
    stop took the lock timeout (> 10 s).  A private lock file (``XTABLES_LOCKFILE``): no write of a
    test beside this one waits on it.  iptables-nft takes no lock: there the stop is simply quick."""
    lock = str(tmp_path / "xtables.lock")
    pods = iproxy.sandbox.pods[:2]
    one = [service("web", "10.96.0.10", [port(80, 8080, name="http")]),
           endpoint_slice("web", pods[:1], [port(8080, name="http")])]
    two = one[:1] + [endpoint_slice("web", pods, [port(8080, name="http")])]
    run = iproxy.start_run(one, "--iptables-lock-timeout", "60s", "--min-sync-period", "0s",
                           env={"XTABLES_LOCKFILE": lock})
    wait_for(lambda: None if "synced " in iproxy.run_output() else "not synced", 30)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, lock, "120"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        write_manifests(iproxy.source, two)
        wait_for(lambda: None if "changed, reloading" in iproxy.run_output() else "change not seen", 15)
        time.sleep(1.0)  # the sync is under way: on legacy, waiting for the lock
        assert run.poll() is None, iproxy.run_output()[-3000:]
        begun = time.monotonic()
        run.terminate()
        try:
            code = run.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - begun
    finally:
        holder.kill()
        holder.wait()
    assert code == 0 and took < 3.0, f"exit {code} {took:.1f} s after SIGTERM\n{iproxy.run_output()[-3000:]}"
