"""The conntrack reconciler and the conntrack sysctls (``--conntrack-*``, or ``conntrack.*`` in ``--config``),
with real traffic, on every backend/writer.

A UDP client sends from one fixed source port every 100 ms, so all its packets are one conntrack
flow; every pod answers with its name, so the answer sequence shows which endpoint the flow is on.
The endpoint a flow leaves keeps running and answering: a flow that stays on it after the change is
the stale entry, not a dead pod.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from typing import Any, Iterator, List, Optional, Sequence

import pytest

from netproxy_lab.checks import DROPPED, NOT_SERVED_TIMEOUT, TIME_SCALE, assert_not_served, wait_for
from netproxy_lab.manifests import Manifest, endpoint_slice, port, service, write_manifests
from netproxy_lab.proxy import Proxy
from netproxy_lab.pytest_plugin import require
from netproxy_lab.topology import NODE_EXT4, Pod, Sandbox
from netproxy_lab.traffic import PendingConnect

pytestmark = pytest.mark.kernel
log = logging.getLogger(__name__)

UDP_IP, UDP_IP6, TCP_IP = "10.96.2.53", "fd00:10:96::2:53", "10.96.2.80"
NODE_PORT = 30553
INTERVAL = 0.1
# Packets per flow: long enough to outlast a `netproxy sync` process on a busy machine (an
# iptables-legacy sync there took over 3 s); stretched like every wait (NETPROXY_TEST_TIME_SCALE).
FLOW = int(80 * TIME_SCALE)
UDP_PORTS = [port(8080, name="dns", protocol="UDP")]


@pytest.fixture(scope="module")
def sandbox(kernel_env: None, combo: Any) -> Iterator[Sandbox]:
    with Sandbox(pods=3, tcp_ports=(8080,), udp_ports=(8080,)) as sb:
        yield sb


def dns(pods: Sequence[Pod]) -> List[Manifest]:
    return [service("dns", UDP_IP, [port(53, 8080, name="dns", protocol="UDP")]),
            endpoint_slice("dns", pods, UDP_PORTS)]


def dns_everywhere(pods: Sequence[Pod]) -> List[Manifest]:
    """A dual-stack NodePort UDP service: every kind of front end the reconciler matches."""
    svc = service("dns", UDP_IP, [{**port(53, 8080, name="dns", protocol="UDP"), "nodePort": NODE_PORT}],
                  type="NodePort", clusterIPs=[UDP_IP, UDP_IP6], ipFamilies=["IPv4", "IPv6"],
                  ipFamilyPolicy="RequireDualStack")
    return [svc, endpoint_slice("dns", pods, UDP_PORTS, suffix="v4"),
            endpoint_slice("dns", pods, UDP_PORTS, suffix="v6", address_type="IPv6")]


def web(pods: Sequence[Pod]) -> List[Manifest]:
    return [service("web", TCP_IP, [port(80, 8080, name="http")]),
            endpoint_slice("web", pods, [port(8080, name="http")])]


def sync(proxy: Proxy, objects: Sequence[Manifest], *extra: str, expect: int = 0) -> Any:
    write_manifests(proxy.source, objects)
    proc = proxy.command("sync", "--source", proxy.source, *proxy.base_flags, *extra)
    assert proc.returncode == expect, f"sync exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def require_conntrack_tool() -> None:
    """The flows' entries are read with conntrack-tools' ``conntrack``: without it a test cannot wait
    for a flow's first packet nor check its entry, so it skips — and fails under CI=true — instead
    of sleeping and leaving the entry checks out."""
    require(shutil.which("conntrack") is not None, "the conntrack tool (conntrack-tools) is not installed")


def udp_entries(sb: Sandbox) -> str:
    """Both families' UDP entries in the node (``conntrack -L`` alone lists IPv4 only)."""
    require_conntrack_tool()
    return "".join(str(sb.exec(sb.node, ["conntrack", "-L", "-p", "udp", "-f", f]).stdout) for f in ("ipv4", "ipv6"))


def answered_on(pending: PendingConnect, pod: Pod, times: int = 3) -> None:
    """Until a flow started with ``progress=True`` has been answered ``times`` more times by ``pod``
    (what assert_moved needs before a change; a fixed sleep gave a loaded machine fewer)."""
    left = [times]

    def counted(who: str) -> bool:
        left[0] -= who == pod.name
        return left[0] <= 0

    pending.wait_outcome(counted, timeout=60)


def answered_by(proxy: Proxy, sb: Sandbox, pod: Pod) -> None:
    def check() -> Optional[str]:
        res = sb.connect(UDP_IP, 53, proto="udp", count=1, timeout=0.3)
        return None if res.counts == {pod.name: 1} else f"{res.counts} {res.errors}"

    wait_for(check, timeout=15)


KINDS = {"deleted-flow": (DROPPED,), "no-rules": (DROPPED,)}
"""How an unserved datagram ends here: to a cluster IP no rule takes, dropped with no ICMP error
(seen on every combination, 2026-12-06); an answer, however slow, fails the check."""

LOST_AT_SWITCH = 2
"""Datagrams a flow may lose at the moment it moves, and only then: a reply the old endpoint sent
just before the sync deleted the flow's conntrack entry comes back un-NATed and the client's
connected socket drops it (kube-proxy's reconciler has the same window).  A loss anywhere else, or
more than these, fails the test."""
REPLY_TIMEOUT = 1.5
"""Seconds a datagram's answer may take: on a loaded machine the pod server can answer later than
a few hundred ms; a late answer is not a lost one (the client waits for each before the next)."""


def assert_moved(seq: Sequence[str], old: Pod, new: Pod) -> int:
    """The flow was on ``old``, then on ``new`` for good; the index of its first answer from ``new``."""
    assert set(seq[:3]) == {old.name}, f"the flow was not on {old.name} before the change: {seq}"
    last_old = max(i for i, who in enumerate(seq) if who == old.name)
    assert last_old < len(seq) - 5, f"still answered by the removed endpoint {old.name} at the end: {seq}"
    first_new = next((i for i in range(last_old + 1, len(seq)) if seq[i] == new.name), None)
    assert first_new is not None, f"the flow never reached {new.name}: {seq}"
    after = [who for who in seq[first_new:] if not who.startswith("!")]
    assert set(after) == {new.name}, f"the flow did not settle on {new.name}: {seq}"
    return first_new


def assert_moved_losing_nothing_else(seq: Sequence[str], old: Pod, new: Pod) -> None:
    """:func:`assert_moved`, and no datagram lost outside the switch (at most ``LOST_AT_SWITCH`` in it)."""
    first_new = assert_moved(seq, old, new)
    last_old = max(i for i, who in enumerate(seq) if who == old.name)
    lost = [i for i, who in enumerate(seq) if who.startswith("!")]
    outside = [i for i in lost if not last_old < i < first_new]
    assert not outside and len(lost) <= LOST_AT_SWITCH, \
        f"the flow lost datagrams {lost} (switch between {last_old} and {first_new}): {seq}"


def test_a_new_sync_process_moves_a_udp_flow_off_a_removed_endpoint(proxy: Proxy, sandbox: Sandbox) -> None:
    """The endpoint is removed by a *new* `netproxy sync`: the snapshot-diff cleaner had no previous
    state in that process, and the flow stayed on the removed endpoint."""
    old, new = sandbox.pods[0], sandbox.pods[1]
    sync(proxy, dns([old]))
    answered_by(proxy, sandbox, old)
    pending = sandbox.start_connect(UDP_IP, 53, proto="udp", count=FLOW, interval=INTERVAL,
                                     timeout=REPLY_TIMEOUT, bind=":41053", progress=True)
    answered_on(pending, old)
    sync(proxy, dns([new]))
    assert_moved_losing_nothing_else(pending.result().sequence, old, new)


def test_a_new_sync_process_ends_the_udp_flow_of_a_deleted_service(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy 1.38 clears the UDP flows of a deleted service.  A one-shot `sync` that follows
    the deletion has no memory of the service; the flow's own original destination, an address of
    the service CIDRs that no service owns now, says it was one.  Without that, the flow's conntrack
    entry keeps DNAT-ing it to the deleted service's endpoint for as long as it keeps sending."""
    pod = sandbox.pods[0]
    cidr = ["--service-cluster-ip-range", "10.96.0.0/16"]
    sync(proxy, [*dns([pod]), *web(sandbox.pods[1:2])], *cidr)
    answered_by(proxy, sandbox, pod)
    before = sandbox.connect(UDP_IP, 53, proto="udp", count=5, interval=INTERVAL, timeout=REPLY_TIMEOUT,
                             bind=":41055", concurrency=1)
    assert before.counts == {pod.name: 5}, before.counts
    sync(proxy, web(sandbox.pods[1:2]), *cidr)  # dns deleted
    after = sandbox.connect(UDP_IP, 53, proto="udp", count=3, interval=INTERVAL, timeout=NOT_SERVED_TIMEOUT,
                            bind=":41055", concurrency=1)
    assert_not_served(after, 3, KINDS["deleted-flow"], "the deleted service's flow")
    entries = udp_entries(sandbox)
    assert not [ln for ln in entries.splitlines() if f"dst={UDP_IP} " in ln and f"src={pod.ip} " in ln], entries


@pytest.mark.parametrize("front", ["cluster-ip-v6", "node-port"])
def test_a_new_sync_process_moves_flows_to_every_kind_of_front_end(proxy: Proxy, sandbox: Sandbox, front: str) -> None:
    """The same through an IPv6 cluster IP (the other family's dump and deletes) and through a
    NodePort reached from outside the cluster (matched on the port alone)."""
    old, new = sandbox.pods[0], sandbox.pods[1]
    address, dport, source, sport = ((UDP_IP6, 53, None, 41063) if front == "cluster-ip-v6"
                                     else (NODE_EXT4, NODE_PORT, sandbox.ext, 41064))
    sync(proxy, dns_everywhere([old]))
    wait_for(lambda: None if sandbox.connect(address, dport, proto="udp", count=1, timeout=0.3,
                                             source=source).counts == {old.name: 1} else "not on the old endpoint yet",
             timeout=15)
    pending = sandbox.start_connect(address, dport, proto="udp", count=FLOW, interval=INTERVAL, timeout=REPLY_TIMEOUT,
                                    bind=f":{sport}", source=source, progress=True)
    answered_on(pending, old)
    sync(proxy, dns_everywhere([new]))
    assert_moved_losing_nothing_else(pending.result().sequence, old, new)


METRICS = "127.0.0.1:10349"


def metrics(sb: Sandbox) -> str:
    """The running `netproxy run`'s /metrics, fetched inside the node namespace."""
    fetch = ("import urllib.request; "
             f"print(urllib.request.urlopen('http://{METRICS}/metrics', timeout=5).read().decode())")
    return str(sb.exec(sb.node, [sys.executable, "-c", fetch], check=True).stdout)


def sample(text: str, name: str, **labels: str) -> Optional[float]:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def test_the_first_sync_after_a_restart_cleans_stale_flows(proxy: Proxy, sandbox: Sandbox) -> None:
    """`netproxy run` stops; the endpoint goes away while none runs; the next `run`'s first sync
    moves the flow."""
    old, new = sandbox.pods[0], sandbox.pods[1]
    proxy.start_run(dns([old]))
    answered_by(proxy, sandbox, old)
    pending = sandbox.start_connect(UDP_IP, 53, proto="udp", count=FLOW + 20, interval=INTERVAL,
                                    timeout=REPLY_TIMEOUT, bind=":41054", progress=True)
    answered_on(pending, old)
    proxy.stop_runs()  # the rules stay: the flow goes on to `old`
    answered_on(pending, old, times=1)
    proxy.start_run(dns([new]), "--metrics-bind-address", METRICS)
    res = pending.result()
    log_text = proxy.run_output()
    assert_moved_losing_nothing_else(res.sequence, old, new)
    assert "conntrack reconciler: deleted" in log_text, log_text[-2000:]
    # kube-proxy's two metrics, served by the run that deleted the flow.
    served = metrics(sandbox)
    for name in ("kubeproxy_conntrack_reconciler_deleted_entries_total",
                 "kubeproxy_conntrack_reconciler_sync_duration_seconds_count"):
        value = sample(served, name, ip_family="IPv4")
        assert value is not None and value >= 1, f"{name} = {value}:\n{served[-2000:]}"


def test_scale_to_zero_then_one_does_not_blackhole(proxy: Proxy, sandbox: Sandbox) -> None:
    """kubernetes #139628: at 0 endpoints the flow must leave the endpoint that went away (its
    packets then meet the reject), and at 1 endpoint again it must reach the new one."""
    old, new = sandbox.pods[0], sandbox.pods[1]
    sync(proxy, dns([old]))
    answered_by(proxy, sandbox, old)
    # Conditions, not sleeps: the flow answered by the old endpoint before the scale to zero, at least
    # one datagram of it unanswered at zero endpoints before the scale to one.  Each answer may take
    # REPLY_TIMEOUT (a slow answer is not a miss).
    pending = sandbox.start_connect(UDP_IP, 53, proto="udp", count=FLOW + 20, interval=INTERVAL,
                                    timeout=REPLY_TIMEOUT, bind=":41055", progress=True)
    pending.wait_outcome(lambda who: who == old.name, timeout=30)
    sync(proxy, dns([]))
    pending.wait_outcome(lambda who: who.startswith("!"), timeout=30)
    sync(proxy, dns([new]))
    seq = pending.result().sequence
    first_miss = next((i for i, who in enumerate(seq) if who.startswith("!")), None)
    assert first_miss is not None, f"never unanswered at 0 endpoints: the flow stayed on {old.name}: {seq}"
    assert old.name not in seq[first_miss:], f"{old.name} still answered after the service had no endpoint: {seq}"
    assert_moved(seq, old, new)


def test_tcp_flows_are_left_alone_as_kube_proxy_leaves_them(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy's reconciler reads UDP only: a TCP connection to a removed endpoint ends on its own
    (reset or timeout), and deleting its entry would only cut it sooner.  The entry of a finished
    connection (TIME_WAIT) to the removed endpoint is still there after the sync."""
    require(shutil.which("conntrack") is not None, "the conntrack tool reads the table in this test")
    old, new = sandbox.pods[0], sandbox.pods[1]
    sync(proxy, web([old]) + dns([old]))
    res = sandbox.connect(TCP_IP, 80, count=1)
    assert res.counts == {old.name: 1}, res

    def tcp_to(pod: Pod) -> bool:
        listed = sandbox.exec(sandbox.node, ["conntrack", "-L", "-p", "tcp", "-d", TCP_IP]).stdout
        return f"src={pod.ip} " in listed

    assert tcp_to(old)
    sync(proxy, web([new]) + dns([new]))
    assert tcp_to(old), "the TCP entry to the removed endpoint was deleted: kube-proxy leaves TCP alone"


# ---- sysctls ------------------------------------------------------------------------------------

SYSCTL = "/proc/sys/net/netfilter/"


def read_sysctl(sb: Sandbox, ns: Optional[str], name: str) -> int:
    if ns is None:  # the host's: read only, to show it did not change
        with open(SYSCTL + name) as f:
            return int(f.read())
    return int(sb.exec(ns, ["cat", SYSCTL + name], check=True).stdout)


def test_conntrack_timeouts_are_set_in_the_node_namespace_only(proxy: Proxy, sandbox: Sandbox) -> None:
    names = ("nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream", "nf_conntrack_tcp_timeout_established",
             "nf_conntrack_tcp_timeout_close_wait", "nf_conntrack_tcp_be_liberal")
    host_before = {n: read_sysctl(sandbox, None, n) for n in names}
    proc = sync(proxy, dns([sandbox.pods[0]]), "--conntrack-udp-timeout", "47s", "--conntrack-udp-timeout-stream",
                "3m", "--conntrack-tcp-timeout-established", "2h", "--conntrack-tcp-timeout-close-wait", "15m",
                "--conntrack-tcp-be-liberal")
    got = {n: read_sysctl(sandbox, sandbox.node, n) for n in names}
    assert got == {"nf_conntrack_udp_timeout": 47, "nf_conntrack_udp_timeout_stream": 180,
                   "nf_conntrack_tcp_timeout_established": 7200, "nf_conntrack_tcp_timeout_close_wait": 900,
                   "nf_conntrack_tcp_be_liberal": 1}
    assert "setting nf_conntrack_udp_timeout to 47" in proc.stderr + proc.stdout
    assert {n: read_sysctl(sandbox, None, n) for n in names} == host_before
    # The same again: already in place, nothing written.
    proc = sync(proxy, dns([sandbox.pods[0]]), "--conntrack-udp-timeout", "47s")
    assert "nf_conntrack_udp_timeout is already 47" in proc.stderr + proc.stdout


def test_a_max_the_namespace_cannot_set_stops_the_start_naming_it(proxy: Proxy, sandbox: Sandbox) -> None:
    """nf_conntrack_max is read-only outside the initial namespace: kube-proxy fails to start, and so
    does netproxy, before writing any rule; maxPerCore 0 (kind's setting) leaves it."""
    current = read_sysctl(sandbox, sandbox.node, "nf_conntrack_max")
    proc = sync(proxy, dns([sandbox.pods[0]]), "--conntrack-max-per-core", "1", "--conntrack-min", str(current + 1),
                expect=1)
    assert "nf_conntrack_max" in proc.stderr and "conntrack.maxPerCore" in proc.stderr, proc.stderr
    assert read_sysctl(sandbox, None, "nf_conntrack_max") == current
    assert_not_served(sandbox.connect(UDP_IP, 53, proto="udp", count=1, timeout=NOT_SERVED_TIMEOUT), 1,
                      KINDS["no-rules"], "nothing was written")
    sync(proxy, dns([sandbox.pods[0]]), "--conntrack-max-per-core", "0")
    answered_by(proxy, sandbox, sandbox.pods[0])


def test_init_only_sets_the_node_up_and_writes_no_rule(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy's --init-only, the privileged half of the split DaemonSet: the sysctls are set in
    the node's namespace, the process exits 0 without a source, nothing is programmed; the proxy's
    own start afterwards finds the settings made."""
    write_manifests(proxy.source, dns([sandbox.pods[0]]))  # there, but --init-only must not read it
    proc = proxy.command("run", "--init-only", *proxy.base_flags, "--conntrack-udp-timeout", "53s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_sysctl(sandbox, sandbox.node, "nf_conntrack_udp_timeout") == 53
    assert "--init-only" in proc.stderr + proc.stdout
    held = json.loads(proxy.command("status", "--kernel", "-o", "json").stdout)["kernel"]
    assert held == [], f"--init-only wrote rules: {held}"
    assert_not_served(sandbox.connect(UDP_IP, 53, proto="udp", count=1, timeout=NOT_SERVED_TIMEOUT), 1,
                      KINDS["no-rules"], "--init-only wrote nothing")
    proc = sync(proxy, dns([sandbox.pods[0]]), "--conntrack-udp-timeout", "53s")
    assert "nf_conntrack_udp_timeout is already 53" in proc.stderr + proc.stdout
