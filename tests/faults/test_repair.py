"""Fault 2 (tests/faults/README.md): rules flushed or edited behind netproxy's back.

A running ``netproxy run`` (default ``--sync-period`` 30 s, so a periodic sync cannot be what
repairs) has its rules flushed, its table deleted, one of its chains emptied, or everything wiped
as a firewalld reload does.  Each fault must be noticed and repaired within 2 s: real connections
to the service work again and the kernel holds exactly the ruleset it held before the fault; the
repair is counted in ``netproxy_sync_proxy_rules_repairs_total{reason}`` on ``/metrics``.
"""

from __future__ import annotations

import re
import time
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from netproxy_lab.checks import TIME_SCALE, wait_for
from netproxy_lab.combos import Combo
from netproxy_lab.manifests import endpoint_slice, port, service
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import Sandbox
from tests.faults.figures import figure
from tests.kernel.test_parity import http_get

# Its figure is a time (repaired within 2 s): measured alone, not beside other tests' load.
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

WEB_IP = "10.96.0.10"
METRICS = "127.0.0.1:10249"
REPAIR_TARGET = 2.0
"""Seconds from the fault to a repaired kernel and working traffic (the target this fault is judged by)."""
_COUNTERS = re.compile(r"\[\d+:\d+\]")


def _faults(combo: Combo) -> List[Tuple[str, str]]:
    """(name, shell command run in the node) for the faults that concern this combination."""
    if combo.backend == "nftables":
        return [
            ("nft delete table ip netproxy", "nft delete table ip netproxy"),
            ("nft flush table ip netproxy", "nft flush table ip netproxy"),
            ("one chain emptied (nft flush chain ip netproxy services)", "nft flush chain ip netproxy services"),
            ("firewalld-like reload (nft flush ruleset)", "nft flush ruleset"),
        ]
    ipt = f"iptables-{combo.flavour}"
    faults = [
        ("iptables -F", f"{ipt} -F"),
        ("iptables -t nat -F", f"{ipt} -t nat -F"),
        ("one chain emptied (iptables -t nat -F KUBE-SERVICES)", f"{ipt} -t nat -F KUBE-SERVICES"),
        # What firewalld's reload does to iptables: its own ruleset restored without --noflush, which
        # empties every table it names and deletes every chain in them (one table at a time).
        ("firewalld-like reload (iptables-restore of empty tables)",
         " && ".join(f"printf '*nat\\nCOMMIT\\n*filter\\nCOMMIT\\n*mangle\\nCOMMIT\\n' | {tool}-restore -w"
                     for tool in (ipt, f"ip6tables-{combo.flavour}"))),
    ]
    if combo.flavour == "nft":
        faults.append(("nft delete table ip nat", "nft delete table ip nat"))
    return faults


def _ours(proxy: Proxy) -> str:
    """netproxy's part of the kernel, as an operator reads it: every line of iptables-save that
    names one of its chains (counters dropped), or its nftables tables."""
    sb, combo = proxy.sandbox, proxy.combo
    if combo.backend == "nftables":
        parts = [sb.exec(sb.node, ["nft", "list", "table", fam, "netproxy"]).stdout for fam in ("ip", "ip6")]
        # The table stamp names the generation of the last commit: a repair's is a new one.
        return re.sub(r"\bgen:[0-9]+", "gen:*", "".join(parts))
    lines: List[str] = []
    for tool in (f"iptables-{combo.flavour}-save", f"ip6tables-{combo.flavour}-save"):
        out = sb.exec(sb.node, [tool], check=True).stdout
        lines += [_COUNTERS.sub("", ln).strip() for ln in out.splitlines() if "KUBE-" in ln and not ln.startswith("#")]
    # iptables-nft: the stamp (mangle KUBE-NP-STAMP) names the generation of the last commit, as above.
    return re.sub(r"\bv:gen:[0-9]+", "v:gen:*", "\n".join(lines))


def _repairs(sb: Sandbox) -> Dict[str, float]:
    code, body = http_get(sb, sb.node, f"http://{METRICS}/metrics")
    assert code == 200, body
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^netproxy_sync_proxy_rules_repairs_total\{reason="([^"]+)"\} (\S+)$', body, re.M)}


def _traffic_ok(sb: Sandbox, pods: Sequence[object]) -> Optional[str]:
    result = sb.connect(WEB_IP, 80, count=4, timeout=0.3)
    if result.errors or result.answered != 4:
        return f"connections failed: {result.errors}, answered {result.counts}"
    return None


def test_flushes_and_edits_behind_its_back_are_repaired_within_2s(proxy: Proxy, sandbox: Sandbox,
                                                                     combo: Combo) -> None:
    pods = sandbox.pods[:2]
    objects = [service("web", WEB_IP, [port(80, 8080, name="http")]),
               endpoint_slice("web", pods, [port(8080, name="http")])]
    proxy.start_run(objects, "--metrics-bind-address", METRICS, "--healthz-bind-address", "",
                    "--sync-period", "30s")

    def started() -> Optional[str]:
        if proxy.running() is False:
            raise AssertionError(proxy.run_output()[-3000:])
        return _traffic_ok(sandbox, pods) or (None if "KUBE-SVC" in _ours(proxy) or "netproxy" in _ours(proxy)
                                              else "no rules yet")

    wait_for(started, 15)
    time.sleep(1.0)  # past the first syncs: what the kernel holds now is the reference
    reference = _ours(proxy)
    assert reference, "netproxy's rules are not in the kernel"
    results: List[Tuple[str, float]] = []
    for name, command in _faults(combo):
        before = sum(_repairs(sandbox).values())
        t0 = time.monotonic()
        sandbox.exec(sandbox.node, ["sh", "-c", command], check=True)

        def repaired() -> Optional[str]:
            if proxy.running() is False:
                raise AssertionError(proxy.run_output()[-3000:])
            now = _ours(proxy)
            if now != reference:
                return f"kernel differs from the reference:\n{now[:1500]}"
            return _traffic_ok(sandbox, pods)

        try:
            wait_for(repaired, 10, step=0.05)
        except AssertionError as err:  # the run's own account of what it saw and did
            raise AssertionError(f"{name}: {err}\n--- netproxy run's log ---\n{proxy.run_output()[-5000:]}") from None
        took = time.monotonic() - t0
        counted = sum(_repairs(sandbox).values()) - before
        results.append((name, took))
        figure(f"repair after '{name}' [{combo.name}]", f"{took:.2f} s to repaired (traffic + full ruleset)",
               f"<= {REPAIR_TARGET:.0f} s")
        # The counter proves the fault was seen as one (a read of the kernel right after the fault
        # could race a repair that starts within the same half second).
        assert counted >= 1, f"{name}: netproxy_sync_proxy_rules_repairs_total did not move: no repair"
        assert took <= REPAIR_TARGET * TIME_SCALE, f"{name}: repaired after {took:.2f} s (target {REPAIR_TARGET} s)"
    assert proxy.running(), proxy.run_output()[-3000:]
    reasons = _repairs(sandbox)
    worst = max(results, key=lambda r: r[1])
    figure(f"repair, worst of {len(results)} faults [{combo.name}]", f"{worst[1]:.2f} s ({worst[0]}); "
           f"repairs by reason {reasons}", f"<= {REPAIR_TARGET:.0f} s")
