"""``netproxy top`` against real traffic: a client in its own namespace connects to services that the
node's rules (nftables, iptables-legacy) DNAT to pod namespaces, and ``top --once -o json`` in the
node's namespace must see what the client sent, per endpoint, from the node's conntrack table.

- rates: a client opens connections one at a time at a known rate inside ``top``'s window (it starts
  when top logs its first refresh and ends before the second); each endpoint's new connections and
  rate must be within 10 % of what the client's answers say it sent there (the pods answer with
  their names), and its connection count likewise; the same over IPv6, and with the names read from
  the kernel's rules (no --source);
- affinity: a ClientIP service's connections from one client all on one endpoint, the client
  listed as that endpoint's top client;
- draining: a long-lived connection to an endpoint that turns terminating shows it ``draining`` (one
  established connection), and ``gone`` once the endpoint has left the state.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

from netproxy_lab.checks import TIME_SCALE, wait_for
from netproxy_lab.manifests import Manifest, endpoint_slice, port, service
from netproxy_lab.proxy import Proxy
from netproxy_lab.pytest_plugin import require, require_sctp
from netproxy_lab.topology import NODE_NAME, Pod, Sandbox, kernel_has_sctp, netproxy_command

pytestmark = [pytest.mark.kernel, pytest.mark.quick_combos("nftables", "iptables-legacy/restore")]

WEB_IP, WEB_IP6, STICKY_IP, DRAIN_IP = "10.96.4.80", "fd00:10:96::4:80", "10.96.4.81", "10.96.4.82"
DGRAM_IP = "10.96.4.83"
HOLD = 9090
RATE, COUNT = 20.0, 60
"""The client's known rate (connections a second, one at a time) and how many it opens: 3 s."""
WINDOW = 10.0 * TIME_SCALE
"""top's window: the client's 3 s, plus top's own start before its first refresh and a loaded
machine's slower client (6 s was too short beside a full test run: top's second refresh came before
the client's last connections)."""


@pytest.fixture(scope="module")
def sandbox(kernel_env: None, combo: Any) -> Iterator[Sandbox]:
    sctp = (8080,) if kernel_has_sctp() is None else ()
    with Sandbox(pods=3, tcp_ports=(8080,), udp_ports=(8080,), hold_ports=(HOLD,), sctp_ports=sctp) as sb:
        yield sb


def web(pods: Sequence[Pod]) -> List[Manifest]:
    svc = service("web", WEB_IP, [port(80, 8080, name="http")], clusterIPs=[WEB_IP, WEB_IP6],
                  ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack")
    ports = [{"port": 8080, "name": "http", "protocol": "TCP"}]
    return [svc, endpoint_slice("web", pods, ports, suffix="v4"),
            endpoint_slice("web", pods, ports, suffix="v6", address_type="IPv6")]


def top_args(proxy: Proxy, *extra: str, source: bool = True) -> List[str]:
    return ["top", "--once", "-o", "json", "--hostname-override", NODE_NAME,
            *(["--source", proxy.source] if source else []), *extra, *proxy.combo.flags]


def top(proxy: Proxy, *extra: str, source: bool = True) -> Dict[str, Any]:
    proc = proxy.sandbox.netproxy(top_args(proxy, "--interval", "200ms", *extra, source=source),
                                  flavour=proxy.combo.path_flavour)
    assert proc.returncode == 0, f"top exited {proc.returncode}: {proc.stderr[-2000:]}"
    doc: Dict[str, Any] = json.loads(proc.stdout)
    return doc


def endpoints(doc: Dict[str, Any], name: str) -> Dict[str, Dict[str, Any]]:
    port_doc = next((p for p in doc["ports"] if p["name"] == name), None)
    assert port_doc is not None, f"{name} not in top's report: {[p['name'] for p in doc['ports']]}"
    return {e["address"].rsplit(":", 1)[0].strip("[]"): e for e in port_doc["endpoints"]}


def answering(sb: Sandbox, address: str) -> None:
    wait_for(lambda: None if sb.connect(address, 80, count=1, timeout=0.5).answered == 1 else "no answer yet",
             timeout=15)


def within(got: float, want: float, share: float = 0.10) -> bool:
    return abs(got - want) <= share * want


def test_each_endpoints_count_and_rate_are_what_the_client_sent(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = sandbox.pods[:3]
    proxy.sync(web(pods))
    answering(sandbox, WEB_IP)
    before = {ip: e["connections"] for ip, e in endpoints(top(proxy), "default/web:http").items()}
    argv = [*netproxy_command(), *top_args(proxy, "--interval", f"{WINDOW}s")]
    opened = time.monotonic()  # top's window starts after this, at its first refresh
    proc = sandbox.popen(sandbox.node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=sandbox._np_env(proxy.combo.path_flavour, None))
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], 30 * TIME_SCALE)
    line = proc.stderr.readline().decode() if ready else ""
    assert "first refresh" in line, f"top did not start its window: {line!r}"
    start = time.monotonic()
    sent = sandbox.connect(WEB_IP, 80, count=COUNT, interval=1 / RATE, timeout=2.0, concurrency=1)
    took = time.monotonic() - start
    assert sent.answered == COUNT, sent.errors
    # Counted from before top started, so certainly past its first refresh: every connection fell
    # inside the window (else the counts below would judge a window that missed some).
    assert time.monotonic() - opened < WINDOW, \
        f"top's start and the client took {time.monotonic() - opened:.1f}s, longer than top's {WINDOW:.0f}s window"
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    doc = json.loads(out)
    assert within(doc["interval"], WINDOW), doc["interval"]
    seen = endpoints(doc, "default/web:http")
    for pod in pods:
        fig, n = seen[pod.ip], sent.counts.get(pod.name, 0)
        assert fig["state"] == "ready"
        assert within(fig["new"], n), f"{pod.name}: top saw {fig['new']} new, the client sent {n}"
        assert within(fig["rate"], n / doc["interval"]), f"{pod.name}: {fig['rate']}/s, sent {n / doc['interval']}/s"
        assert within(fig["connections"] - before.get(pod.ip, 0), n), (fig, n, before)
    total = next(p for p in doc["ports"] if p["name"] == "default/web:http")
    assert within(total["rate"] * doc["interval"], COUNT), total
    # The client paced its connections (no burst); a loaded machine may slow it, which changes what
    # it sent, not what top must show (the rates above are judged against what it did send).
    assert took >= 0.9 * (COUNT - 1) / RATE, f"{COUNT} connections in {took:.1f}s: not paced at {RATE}/s"

    # IPv6: the other family's entries, in the same dump.
    v6 = sandbox.connect(WEB_IP6, 80, count=30, timeout=2.0)
    assert v6.answered == 30, v6.errors
    seen6 = endpoints(top(proxy), "default/web:http")
    for pod in pods:
        assert within(seen6[pod.ip6]["connections"], v6.counts.get(pod.name, 0)), (seen6, v6.counts)

    # The names from the kernel's rules: the same figures, every endpoint "routed".
    kernel = endpoints(top(proxy, source=False), "default/web:http")
    for pod in pods:
        assert kernel[pod.ip]["state"] == "routed"
        assert kernel[pod.ip]["connections"] == seen[pod.ip]["connections"], (kernel, seen)


def test_an_affinity_service_puts_a_clients_connections_on_one_endpoint(proxy: Proxy, sandbox: Sandbox) -> None:
    svc = service("sticky", STICKY_IP, [port(80, 8080, name="http")], sessionAffinity="ClientIP")
    proxy.sync([svc, endpoint_slice("sticky", sandbox.pods[:3], [{"port": 8080, "name": "http", "protocol": "TCP"}])])
    answering(sandbox, STICKY_IP)
    sent = sandbox.connect(STICKY_IP, 80, count=30, timeout=2.0)
    assert sent.answered == 30 and len(sent.counts) == 1, sent.counts
    (chosen,) = [p for p in sandbox.pods if p.name in sent.counts]
    doc = top(proxy, "--service", "default/sticky", "--clients", "2")
    assert [p["name"] for p in doc["ports"]] == ["default/sticky:http"]
    seen = endpoints(doc, "default/sticky:http")
    assert seen[chosen.ip]["connections"] >= 30 and seen[chosen.ip]["share"] == 1.0, seen
    assert seen[chosen.ip]["clients"] == [[sandbox.client_ip, seen[chosen.ip]["connections"]]], seen[chosen.ip]
    assert all(e["connections"] == 0 for ip, e in seen.items() if ip != chosen.ip), seen
    assert doc["ports"][0]["imbalance"] == pytest.approx(2 / 3, abs=0.01)


@pytest.mark.parametrize("protocol", ["UDP", "SCTP"])
def test_udp_and_sctp_flows_are_counted_per_endpoint(proxy: Proxy, sandbox: Sandbox, protocol: str) -> None:
    """The other two protocols of the dump: UDP flows (each established by being there) and SCTP
    associations, each endpoint's count what the client's answers say it sent there."""
    if protocol == "SCTP":
        # Where the host has no SCTP, the guests test SCTP through the proxy and the unit tests top's
        # reading of SCTP entries (tests/unit/test_top.py, from kernel messages).
        require_sctp("top's SCTP counts by traffic")
    proto = protocol.lower()
    proxy.sync([service("dgram", DGRAM_IP, [port(53, 8080, name=proto, protocol=protocol)]),
                endpoint_slice("dgram", sandbox.pods[:3], [{"port": 8080, "name": proto, "protocol": protocol}])])
    sent = sandbox.connect(DGRAM_IP, 53, proto=proto, count=30, timeout=5.0, concurrency=8)
    assert sent.answered == 30, sent.errors
    seen = endpoints(top(proxy, "--service", "default/dgram"), f"default/dgram:{proto}")
    for pod in sandbox.pods[:3]:
        assert seen[pod.ip]["connections"] == sent.counts.get(pod.name, 0), (seen, sent.counts)
    if protocol == "UDP":
        assert all(e["established"] == e["connections"] for e in seen.values()), seen


def _drain(pods: Sequence[Pod], terminating: Sequence[Pod]) -> List[Manifest]:
    eps: List[Any] = [p if p not in terminating else
                      {"addresses": [p.ip], "nodeName": p.node_name,
                       "conditions": {"ready": False, "serving": True, "terminating": True}} for p in pods]
    return [service("drain", DRAIN_IP, [port(90, HOLD, name="hold")]),
            endpoint_slice("drain", eps, [{"port": HOLD, "name": "hold", "protocol": "TCP"}])]


def test_a_terminating_endpoint_holding_a_connection_shows_draining_then_gone(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = sandbox.pods[:2]
    proxy.sync(_drain(pods, []))
    session = sandbox.open_session(DRAIN_IP, 90)  # the one-shot sync has written the rules: no wait
    try:
        who = session.exchange("ping").split()[0]
        (held,) = [p for p in pods if p.name == who]
        proxy.sync(_drain(pods, [held]))
        seen = endpoints(top(proxy, "--service", "default/drain"), "default/drain:hold")
        assert seen[held.ip]["state"] == "draining", seen
        assert seen[held.ip]["established"] == 1 and seen[held.ip]["expected"] == 0.0, seen
        assert session.exchange("still there").split()[0] == who  # the connection kept its endpoint
        # From the kernel's rules alone: they reach the one ready endpoint; the rules cannot tell
        # a terminating endpoint from one that left, so the held connection's is "gone".
        (ready,) = [p for p in pods if p is not held]
        kernel = endpoints(top(proxy, "--service", "default/drain", source=False), "default/drain:hold")
        assert kernel[ready.ip]["state"] == "routed" and kernel[ready.ip]["expected"] == 1.0, kernel
        assert kernel[held.ip]["state"] == "gone" and kernel[held.ip]["established"] == 1, kernel
        proxy.sync(_drain([p for p in pods if p is not held], []))
        seen = endpoints(top(proxy, "--service", "default/drain"), "default/drain:hold")
        assert seen[held.ip]["state"] == "gone" and seen[held.ip]["established"] == 1, seen
    finally:
        session.close()


# ---- the live view, in a real terminal ----------------------------------------------------------


class Tmux:
    """A tmux server of this test's own (its own socket), one 80x24 window running ``argv``."""

    def __init__(self, name: str, argv: Sequence[str]) -> None:
        self.socket = name
        self._tmux("new-session", "-d", "-x", "80", "-y", "24", "-s", "top", " ".join(argv))
        self._tmux("set-option", "-t", "top", "remain-on-exit", "on")
        self.pid, self.path = self._tmux("display-message", "-p", "-t", "top", "#{pid} #{socket_path}").split()

    def _tmux(self, *args: str) -> str:
        proc = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10)
        assert proc.returncode == 0, f"tmux {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def dead(self) -> Optional[int]:
        """The exit status of the window's program once it ended, else None.  tmux 3.3 marks the pane
        dead when its terminal closes and may leave the program unreaped for a while, without a
        status: then it is read from the zombie's /proc/PID/stat (exit_code, Linux 3.5+)."""
        dead, status, sig, pid = self._tmux("display-message", "-p", "-t", "top",
                                            "#{pane_dead}:#{pane_dead_status}:#{pane_dead_signal}:#{pane_pid}"
                                            ).strip().split(":")
        assert not sig, f"top ended by signal {sig}:\n{self.screen()}"
        if dead != "1":
            return None
        if status:
            return int(status)
        try:
            with open(f"/proc/{pid}/stat") as f:
                return os.WEXITSTATUS(int(f.read().rsplit(")", 1)[1].split()[-1]))
        except FileNotFoundError:
            return None  # reaped meanwhile: the status comes with the next look

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(self.pid), signal.SIGKILL)  # the server, by the pid it reported
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a killed server leaves its socket behind


def shows(term: Tmux, *wanted: str, absent: Sequence[str] = ()) -> None:
    def check() -> Optional[str]:
        text = term.screen()
        missing = [w for w in wanted if w not in text] + [a for a in absent if a in text]
        return None if not missing else f"{missing} on the screen:\n{text}"

    wait_for(check, timeout=15)


def order(text: str, *names: str) -> List[int]:
    lines = text.splitlines()
    return [next(i for i, line in enumerate(lines) if line.startswith(n)) for n in names]


def test_the_live_view_in_a_terminal_sorts_filters_and_quits(proxy: Proxy, sandbox: Sandbox, tmp_path: Any) -> None:
    require(shutil.which("tmux") is not None, "tmux is not installed (scripts/setup-system.sh installs it)")
    sticky = service("sticky", STICKY_IP, [port(80, 8080, name="http")], sessionAffinity="ClientIP")
    proxy.sync([*web(sandbox.pods[:3]), sticky,
                endpoint_slice("sticky", sandbox.pods[:3], [{"port": 8080, "name": "http", "protocol": "TCP"}])])
    answering(sandbox, WEB_IP)
    assert sandbox.connect(WEB_IP, 80, count=45, timeout=2.0).answered == 45
    assert sandbox.connect(STICKY_IP, 80, count=12, timeout=2.0).answered == 12
    argv = ["ip", "netns", "exec", sandbox.node, *netproxy_command(), "top", "--source", proxy.source,
            "--hostname-override", NODE_NAME, "--interval", "500ms", *proxy.combo.flags]
    term = Tmux(f"np-top-{sandbox.id}", argv)
    try:
        shows(term, "netproxy top", "sort: connections", "SERVICE PORT / ENDPOINT", "BYTES", "default/web:http",
              "default/sticky:http", "nf_conntrack_acct")
        text = term.screen()
        (tmp_path / "screen.txt").write_text(text)
        assert all(len(line) <= 80 for line in text.splitlines())
        web_at, sticky_at = order(text, "default/web:http", "default/sticky:http")
        assert web_at < sticky_at, text  # more connections first
        term.keys("n")
        shows(term, "sort: name")
        web_at, sticky_at = order(term.screen(), "default/web:http", "default/sticky:http")
        assert sticky_at < web_at
        term.keys("i")  # the affinity service, all on one endpoint, is the most imbalanced
        shows(term, "sort: imbalance")
        web_at, sticky_at = order(term.screen(), "default/web:http", "default/sticky:http")
        assert sticky_at < web_at
        term.keys("/", "w", "e", "b", "Enter")
        shows(term, "filter: web", "default/web:http", absent=["default/sticky:http"])
        term.keys("Escape")
        shows(term, "no filter", "default/sticky:http")
        term.keys("q")
        wait_for(lambda: None if term.dead() is not None else f"still running:\n{term.screen()}", timeout=10)
        assert term.dead() == 0
        assert "SERVICE PORT" not in term.screen()  # the alternate screen is gone: the shell's is back
    finally:
        term.close()
    term = Tmux(f"np-top-{sandbox.id}-2", argv)  # Ctrl-C quits as q does: no traceback, status 0
    try:
        shows(term, "default/web:http")
        term.keys("C-c")
        wait_for(lambda: None if term.dead() is not None else f"still running:\n{term.screen()}", timeout=10)
        assert term.dead() == 0 and "Traceback" not in term.screen(), term.screen()
    finally:
        term.close()
