"""kube-proxy parity (docs/parity.md): one test body per behaviour, on every backend/writer.

Each test syncs (or runs) real netproxy in the sandbox's node and sends real traffic from the
in-cluster client (10.244.1.2), the off-cluster ``ext`` namespace (192.0.2.100, reaching the node
on 192.0.2.1), the node itself or a pod.  Pods answer with their name *and* the source address they
saw, so masquerade (a node address) and source preservation (the client's own address) are
asserted, not assumed.

Pods 0-2 are on this node (:data:`NODE_NAME`), pods 3-4 on another (:data:`REMOTE_NODE_NAME`).

Outcomes are told apart: *refused* (an ICMP error or a reset, at once), *dropped* (every attempt
times out) and *answered*.  The kernel rate-limits ICMP errors per destination (a burst of about
six, then one a second), so every refusal check sends two or three connections, each from a
source address of its own (:meth:`Sandbox.client_addresses`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pytest

from netproxy_lab.checks import (
    DROPPED,
    NOT_SERVED_TIMEOUT,
    TIME_SCALE,
    assert_not_served,
    assert_only_and_all,
    wait_for,
)
from netproxy_lab.manifests import Manifest, endpoint_slice, port, service, write_manifests
from netproxy_lab.proxy import Proxy
from netproxy_lab.refuse import WritesRefused
from netproxy_lab.topology import CLIENT4, CLIENT6, EXT4, GATEWAY4, NODE_EXT4, NODE_NAME, REMOTE_NODE_NAME, Pod, Sandbox
from netproxy_lab.traffic import ConnectResult
from tests.kernel import kernel_services, traced
from tests.kernel.test_conntrack import (
    REPLY_TIMEOUT,
    answered_on,
    assert_moved_losing_nothing_else,
    require_conntrack_tool,
)

pytestmark = pytest.mark.kernel
log = logging.getLogger(__name__)

SVC_IP = "10.96.1.10"
SVC_IP6 = "fd00:10:96::10"
UDP_IP = "10.96.1.53"
EXTERNAL_IP = "203.0.113.10"
LB_IP = "198.51.100.10"
NODE_PORT = 30080
UDP_NODE_PORT = 30053
HC_PORT = 30999
ZONE_LABEL = "topology.kubernetes.io/zone"
KINDS: Dict[str, Tuple[str, ...]] = {
    # A NodePort on an address it is not served on reaches the node's own closed port: its reset.
    "localhost-nodeport": ("rst",),
    "localhost-off": ("rst",),
    "unlisted-nodeport": ("rst",),
    # An external IP no rule takes (AllowServiceExternalIPs=false): routed nowhere, dropped.
    "external-gate-off": ("timeout",),
}
"""How each kind of unserved connection ends (seen on every combination, 2026-12-06), besides
:data:`REJECTED` and a silent drop (:func:`assert_dropped`)."""
NODE_ADDRESSES = {NODE_EXT4, GATEWAY4}
"""What a masqueraded connection's source is: one of the node's own IPv4 addresses."""


@pytest.fixture(scope="module")
def sandbox(kernel_env: None, combo: Any) -> Any:
    """Five pods: 0-2 on this node, 3-4 labelled as on another node (traffic-policy tests)."""
    with Sandbox(pods=5, remote_pods=2, tcp_ports=(8080,), udp_ports=(8080,)) as sb:
        yield sb


@pytest.fixture(autouse=True)
def trace_equals_traffic(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Trace equals traffic: each batch of connections below is traced with ``netproxy trace --kernel`` in the
    node, and the trace must predict what the batch saw (tests/kernel/traced.py)."""
    before = traced.traced_count()
    yield from traced.install(request, monkeypatch)
    log.info("%d batches traced", traced.traced_count() - before)


# ---- manifests ---------------------------------------------------------------------------------


def local(sb: Sandbox) -> List[Pod]:
    return [p for p in sb.pods if p.node_name == NODE_NAME]


def remote(sb: Sandbox) -> List[Pod]:
    return [p for p in sb.pods if p.node_name != NODE_NAME]


ABSENT = "absent"
"""A condition the endpoint's controller left out (the API reads absent ready/serving as true)."""


def ep(pod: Pod, *, ready: bool = True, serving: Union[bool, str, None] = None, terminating: bool = False,
       zone: Optional[str] = None, hints: Sequence[str] = (), nodes: Sequence[str] = (),
       ipv6: bool = False) -> Manifest:
    """One EndpointSlice endpoint for ``pod`` with explicit conditions, zone, zone hints and node hints.

    ``serving``: None → the same as ``ready``; :data:`ABSENT` → no ``serving`` field at all."""
    conditions: Manifest = {"ready": ready, "serving": ready if serving is None else serving,
                            "terminating": terminating}
    if serving == ABSENT:
        del conditions["serving"]
    out: Manifest = {"addresses": [pod.ip6 if ipv6 else pod.ip], "nodeName": pod.node_name,
                     "conditions": conditions,
                     "targetRef": {"kind": "Pod", "name": pod.name, "namespace": "default"}}
    if zone:
        out["zone"] = zone
    if hints or nodes:
        out["hints"] = {}
    if hints:
        out["hints"]["forZones"] = [{"name": z} for z in hints]
    if nodes:
        out["hints"]["forNodes"] = [{"name": n} for n in nodes]
    return out


def http_port(node_port: int = 0) -> Manifest:
    return port(80, 8080, name="http", node_port=node_port)


def web(pods: Sequence[Pod], *, node_port: int = 0, name: str = "web", cluster_ip: str = SVC_IP,
        **spec: Any) -> List[Manifest]:
    """``default/<name>``: TCP 80 → the pods' 8080 (and ``node_port`` when given)."""
    if node_port and "type" not in spec:
        spec["type"] = "NodePort"
    return [service(name, cluster_ip, [http_port(node_port)], **spec),
            endpoint_slice(name, [ep(p) for p in pods], [port(8080, name="http")])]


def node_object(zone: str) -> Manifest:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME, "labels": {ZONE_LABEL: zone}}}


# ---- outcomes ----------------------------------------------------------------------------------


def sources_of(res: ConnectResult) -> set:  # type: ignore[type-arg]
    return set(res.source_addresses())


def assert_masqueraded(res: ConnectResult, client: str) -> None:
    seen = sources_of(res)
    assert seen and seen <= NODE_ADDRESSES, \
        f"pods saw sources {res.sources}: expected only node addresses {sorted(NODE_ADDRESSES)}, not {client}"


def assert_preserved(res: ConnectResult, client: str) -> None:
    assert sources_of(res) == {client}, f"pods saw sources {res.sources}: expected the client's own {client}"


REJECTED = ("icmp port-unreachable", "icmp6 port-unreachable")
"""How kube-proxy's REJECT (iptables ``-j REJECT``, nftables ``reject``) refuses: an ICMP port
unreachable, whatever the protocol; a TCP reset would be a pod's or the node's own socket."""


def assert_dropped(res: ConnectResult, total: int) -> None:
    """Not answered and not refused: every attempt timed out (a DROP, not a REJECT).  Sent with
    :data:`DROP_TIMEOUT`, well above an answer's time, so that a slow answer still counts as one."""
    assert_not_served(res, total, (DROPPED,), "expected a silent drop")


def assert_refused(res: ConnectResult, total: int, timeout: float) -> None:
    """Refused at once by a REJECT rule (ICMP port-unreachable), not reset, not left to time out."""
    assert_not_served(res, total, REJECTED, "expected a REJECT")
    assert res.elapsed < timeout, f"took {res.elapsed:.2f}s: not refused at once"


class Addresses:
    """Fresh client source addresses, one per refusal check (ICMP errors are rate-limited per peer)."""

    next_index = 0

    @classmethod
    def take(cls, sb: Sandbox) -> str:
        cls.next_index += 1
        return sb.client_addresses(cls.next_index)[-1]


def refused_check(sb: Sandbox, address: str, port_number: int, *, proto: str = "tcp", count: int = 2,
                  source: Optional[str] = None) -> None:
    timeout = 2.0
    sources = [] if source is not None else [Addresses.take(sb)]
    res = sb.connect(address, port_number, proto=proto, count=count, timeout=timeout, source=source,
                     sources=sources)
    assert_refused(res, count, timeout)


DROP_TIMEOUT = NOT_SERVED_TIMEOUT
"""Seconds an attempt may take before it counts as dropped: answers in the sandbox take milliseconds,
but on a loaded machine a one-thread pod can take hundreds, and a slow answer must fail a "dropped"
check, not pass it."""


def dropped_check(sb: Sandbox, address: str, port_number: int, *, source: Optional[str] = None,
                  count: int = 2, proto: str = "tcp") -> None:
    res = sb.connect(address, port_number, proto=proto, count=count, timeout=DROP_TIMEOUT, source=source)
    assert_dropped(res, count)


Call = Tuple[str, int, Dict[str, Any]]


ANSWER_TIMEOUT = 5.0
"""Seconds one connection of a burst may take when it is expected to be answered: a burst of 90
connections, 32 at a time, to the pods' one-thread servers can take over a second per connection
on a loaded machine, and a late answer is not a refusal.  Batches that expect a drop pass their
own short ``timeout`` (DROP_TIMEOUT)."""


def connect_all(sb: Sandbox, *calls: Call) -> List[ConnectResult]:
    """Several client batches at once (each is a process start: overlapping them keeps the suite fast)."""
    pending = [sb.start_connect(address, port_number, **{"timeout": ANSWER_TIMEOUT, **kwargs})
               for address, port_number, kwargs in calls]
    return [p.result() for p in pending]


HTTP_GET = """
import json, sys, urllib.error, urllib.request
headers = {}
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        code, body, headers = r.status, r.read().decode(), dict(r.headers)
except urllib.error.HTTPError as e:
    code, body, headers = e.code, e.read().decode(), dict(e.headers)
except OSError as e:
    code, body = 0, repr(e)
print(json.dumps({"code": code, "body": body, "headers": headers}))
"""


def http_get(sb: Sandbox, ns: str, url: str) -> Tuple[int, str]:
    code, body, _ = http_get_headers(sb, ns, url)
    return code, body


def http_get_headers(sb: Sandbox, ns: str, url: str) -> Tuple[int, str, Dict[str, str]]:
    proc = sb.exec(ns, [sys.executable, "-c", HTTP_GET, url], check=True, timeout=10)
    out = json.loads(proc.stdout)
    return int(out["code"]), str(out["body"]), {k.lower(): str(v) for k, v in out["headers"].items()}


def alive(proxy: Proxy) -> None:
    if proxy.running() is False:
        raise AssertionError(f"netproxy run exited:\n{proxy.run_output()[-3000:]}")


def run_wait(proxy: Proxy, check: Callable[[], Optional[str]], timeout: float, step: float = 0.2) -> float:
    """:func:`wait_for` on a ``netproxy run``; a failure shows the end of its log.  Batches sent while
    waiting are not traced (wait_for): the change waited for may reach the kernel between one and its trace."""
    try:
        return wait_for(check, timeout=timeout, step=step)
    except AssertionError as err:
        raise AssertionError(f"{err}\n--- netproxy run log ---\n{proxy.run_output()[-3000:]}") from None


# ---- NodePort ----------------------------------------------------------------------------------


def test_nodeport_on_node_addresses_from_outside_and_from_the_node(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = local(sandbox)
    objects = [
        service("np", SVC_IP, [http_port(NODE_PORT),
                               {**port(53, 8080, name="dns", protocol="UDP"), "nodePort": UDP_NODE_PORT}],
                type="NodePort"),
        endpoint_slice("np", [ep(p) for p in pods], [port(8080, name="http"), port(8080, name="dns", protocol="UDP")]),
        *web(pods, name="lb", cluster_ip="10.96.1.11", node_port=NODE_PORT + 1, type="LoadBalancer"),
    ]
    proxy.sync(objects)
    ext, node = {"source": sandbox.ext}, {"source": sandbox.node}
    results = connect_all(
        sandbox,
        (NODE_EXT4, NODE_PORT, {"count": 90, **ext}),
        (NODE_EXT4, UDP_NODE_PORT, {"proto": "udp", "count": 90, **ext}),
        (NODE_EXT4, NODE_PORT + 1, {"count": 90, **ext}),  # a LoadBalancer's NodePort
        (GATEWAY4, NODE_PORT, {"count": 90}),  # every local address: the client's side of the node too
        (NODE_EXT4, NODE_PORT, {"count": 90, **node}),  # from the node itself (nat OUTPUT)
        (GATEWAY4, NODE_PORT, {"count": 90, **node}),
    )
    for res in results:
        assert_only_and_all(res, pods, total=90)
    # 127.0.0.1: kube-proxy's iptables mode answers (--iptables-localhost-nodeports, default true),
    # its nftables mode does not (test_parity_node.py has both sides and the flag).
    served = proxy.combo.backend == "iptables"
    res = sandbox.connect("127.0.0.1", NODE_PORT, count=30 if served else 2, source=sandbox.node,
                          timeout=ANSWER_TIMEOUT if served else NOT_SERVED_TIMEOUT)
    if served:
        assert_only_and_all(res, pods, total=30)
    else:
        assert_not_served(res, 2, KINDS["localhost-nodeport"], f"127.0.0.1:{NODE_PORT} on nftables")


def test_many_nodeports_through_the_nodeport_tree(proxy: Proxy, sandbox: Sandbox) -> None:
    """More NodePorts than one chain holds (iptables: LEAF_SIZE 32, then a protocol / port-range tree
    under KUBE-NODEPORTS and KUBE-EXTERNAL-SERVICES): each port still reaches its own endpoint, over
    TCP and UDP, low and high in the range, and an endpoint-less one is still refused."""
    pods = local(sandbox)
    served = 40  # 20 TCP + 20 UDP, nodePorts 30100..32479
    objects: List[Manifest] = []
    for i in range(served):
        proto = "TCP" if i % 2 == 0 else "UDP"
        name = f"many-{i}"
        objects += [service(name, f"10.96.3.{i + 1}", [{**port(80, 8080, name="p", protocol=proto),
                                                         "nodePort": 30100 + 61 * i}], type="NodePort"),
                    endpoint_slice(name, [ep(pods[i % len(pods)])], [port(8080, name="p", protocol=proto)])]
    for j in range(34):  # > 32 endpoint-less NodePorts: filter's per-NodePort rejects are a tree too
        name = f"none-{j}"
        objects += [service(name, f"10.96.4.{j + 1}", [http_port(30101 + 61 * j)], type="NodePort"),
                    endpoint_slice(name, [], [port(8080, name="http")])]
    proxy.sync(objects)
    picks = (0, 1, 17, 22, 38, 39)
    ext, node = {"source": sandbox.ext}, {"source": sandbox.node}
    calls: List[Call] = [(NODE_EXT4, 30100 + 61 * i, {"proto": "tcp" if i % 2 == 0 else "udp", "count": 6, **ext})
                         for i in picks]
    calls += [(GATEWAY4, 30100 + 61 * i, {"proto": "tcp" if i % 2 == 0 else "udp", "count": 6, **node})
              for i in picks[:2]]
    for (_, number, _), res in zip(calls, connect_all(sandbox, *calls)):
        i = (number - 30100) // 61
        assert_only_and_all(res, [pods[i % len(pods)]], total=6)
    refused_check(sandbox, NODE_EXT4, 30101 + 61 * 20, source=sandbox.ext)


def test_nodeport_addresses(proxy: Proxy, sandbox: Sandbox) -> None:
    """netproxy run --nodeport-addresses: NodePorts only on listed node addresses, following address changes."""
    pods = local(sandbox)
    added = "192.0.2.5"
    proxy.start_run(web(pods, node_port=NODE_PORT), "--nodeport-addresses", "192.0.2.0/24")

    def answers(address: str, source: str) -> Optional[str]:
        alive(proxy)
        res = sandbox.connect(address, NODE_PORT, count=5, timeout=0.5, source=source)
        return None if res.answered == 5 else f"{address}:{NODE_PORT} answered {res.counts}, errors {res.errors}"

    run_wait(proxy, lambda: answers(NODE_EXT4, sandbox.ext), timeout=15)
    assert answers(NODE_EXT4, sandbox.node) is None
    # 10.244.1.1 is the node's too, but outside --nodeport-addresses.
    for source in (sandbox.client, sandbox.node):
        res = sandbox.connect(GATEWAY4, NODE_PORT, count=2, timeout=NOT_SERVED_TIMEOUT, source=source)
        assert_not_served(res, 2, KINDS["unlisted-nodeport"], f"{GATEWAY4}:{NODE_PORT} (not listed) from {source}")
    assert_only_and_all(sandbox.connect(SVC_IP, 80, count=90), pods, total=90)  # the ClusterIP is unaffected
    assert answers(added, sandbox.ext) is not None, f"{added} is not a node address yet, and answered"
    sandbox.exec(sandbox.node, ["ip", "addr", "add", f"{added}/32", "dev", "ext0"], check=True)
    try:
        took = run_wait(proxy, lambda: answers(added, sandbox.ext), timeout=8)
        log.info("%s: a new node address took NodePorts after %.2fs", proxy.combo.name, took)
    finally:
        sandbox.exec(sandbox.node, ["ip", "addr", "del", f"{added}/32", "dev", "ext0"])


# ---- masquerade --------------------------------------------------------------------------------


def test_masquerade_external_traffic_with_etp_cluster(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = local(sandbox) + remote(sandbox)
    proxy.sync(web(pods, node_port=NODE_PORT, type="LoadBalancer", externalIPs=[EXTERNAL_IP],
                   load_balancer_ips=[LB_IP]))
    targets = ((NODE_EXT4, NODE_PORT), (EXTERNAL_IP, 80), (LB_IP, 80))
    results = connect_all(sandbox, *((a, p, {"count": 150, "source": sandbox.ext}) for a, p in targets))
    for res in results:
        assert_only_and_all(res, pods, total=150)
        assert_masqueraded(res, EXT4)


def test_masquerade_all(proxy: Proxy, sandbox: Sandbox) -> None:
    """--masquerade-all SNATs in-cluster ClusterIP traffic too; --masquerade-bit moves the mark."""
    pods = local(sandbox)
    proxy.base_flags = [*proxy.base_flags, "--masquerade-all", "--masquerade-bit", "5"]
    proxy.sync(web(pods))
    res = sandbox.connect(SVC_IP, 80, count=90)
    assert_only_and_all(res, pods, total=90)
    assert_masqueraded(res, CLIENT4)
    rules = proxy.ruleset()
    assert re.search(r"\b0x0*20\b", rules), "--masquerade-bit 5: no 0x20 mark in the ruleset"
    assert not re.search(r"\b0x0*4000\b", rules), "--masquerade-bit 5: the default bit 0x4000 is still used"


def test_masquerade_cluster_traffic_from_outside_cluster_cidr(proxy: Proxy, sandbox: Sandbox) -> None:
    """--cluster-cidr (two CIDRs): ClusterIP traffic from outside all of them is SNATed, from inside not."""
    pods = local(sandbox)
    proxy.base_flags = [*proxy.base_flags, "--cluster-cidr", "10.250.0.0/16,10.244.0.0/16"]
    proxy.sync(web(pods))
    inside, outside = connect_all(sandbox, (SVC_IP, 80, {"count": 90}),
                                  (SVC_IP, 80, {"count": 90, "source": sandbox.ext}))
    assert_only_and_all(inside, pods, total=90)
    assert_preserved(inside, CLIENT4)
    assert_only_and_all(outside, pods, total=90)
    assert_masqueraded(outside, EXT4)


def test_no_masquerade_for_in_cluster_clusterip_traffic(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = local(sandbox)[:2]
    other = sandbox.pods[3]  # a pod that is not an endpoint, as a client
    proxy.sync(web(pods))
    from_client, from_pod = connect_all(sandbox, (SVC_IP, 80, {"count": 30}),
                                        (SVC_IP, 80, {"count": 30, "source": other.netns}))
    assert_only_and_all(from_client, pods, total=30)
    assert_preserved(from_client, CLIENT4)
    assert_only_and_all(from_pod, pods, total=30)
    assert_preserved(from_pod, other.ip)


# ---- externalTrafficPolicy: Local ---------------------------------------------------------------


def test_etp_local(proxy: Proxy, sandbox: Sandbox) -> None:
    """Only local endpoints, client address kept; none local → dropped, except from the node or the cluster."""
    here, there = local(sandbox)[:2], remote(sandbox)
    proxy.base_flags = [*proxy.base_flags, "--cluster-cidr", "10.244.0.0/16"]
    proxy.sync([
        *web([*here, *there], node_port=NODE_PORT, type="LoadBalancer", externalTrafficPolicy="Local",
             load_balancer_ips=[LB_IP]),
        *web(there, name="far", cluster_ip="10.96.1.11", node_port=NODE_PORT + 1, externalTrafficPolicy="Local"),
    ])
    ext = {"source": sandbox.ext}
    results = connect_all(
        sandbox,
        (NODE_EXT4, NODE_PORT, {"count": 60, **ext}),
        (LB_IP, 80, {"count": 60, **ext}),
        (SVC_IP, 80, {"count": 150}),  # cluster traffic is not restricted
        # No local endpoint: from the node itself and from inside --cluster-cidr it is cluster traffic.
        (NODE_EXT4, NODE_PORT + 1, {"count": 30, "source": sandbox.node}),
        (GATEWAY4, NODE_PORT + 1, {"count": 30}),
        (NODE_EXT4, NODE_PORT + 1, {"count": 2, "timeout": DROP_TIMEOUT, **ext}),
    )
    for res in results[:2]:
        assert_only_and_all(res, here, total=60, at_least=10)
        assert_preserved(res, EXT4)
    assert_only_and_all(results[2], [*here, *there], total=150)
    assert_only_and_all(results[3], there, total=30)
    assert_only_and_all(results[4], there, total=30)
    assert_dropped(results[5], 2)


@pytest.mark.untraced  # its only traffic is HTTP to the health check port, inside wait loops
def test_health_check_node_port(proxy: Proxy, sandbox: Sandbox) -> None:
    """netproxy run: healthCheckNodePort answers 200 with the local count, 503 with none; /healthz 200."""
    here, there = local(sandbox)[:2], remote(sandbox)[:1]
    spec: Dict[str, Any] = {"node_port": NODE_PORT, "type": "LoadBalancer", "externalTrafficPolicy": "Local",
                            "healthCheckNodePort": HC_PORT}
    proxy.start_run(web([*here, *there], **spec), "--healthz-bind-address", "0.0.0.0:10256")
    url = f"http://{NODE_EXT4}:{HC_PORT}/"

    def status(code: int, count: int) -> Optional[str]:
        alive(proxy)
        got, body = http_get(sandbox, sandbox.ext, url)
        if got != code:
            return f"{url}: HTTP {got} {body!r}, want {code}"
        try:
            local_count = json.loads(body).get("localEndpoints")
        except ValueError:
            return f"{url}: not JSON: {body!r}"
        return None if local_count == count else f"{url}: localEndpoints {local_count}, want {count} ({body})"

    run_wait(proxy, lambda: status(200, 2), timeout=15, step=0.3)
    code, body = http_get(sandbox, sandbox.ext, f"http://{NODE_EXT4}:10256/healthz")
    assert code == 200, f"/healthz: {code} {body}"
    write_manifests(proxy.source, web(there, **spec))
    took = run_wait(proxy, lambda: status(503, 0), timeout=8, step=0.3)
    log.info("%s: health check turned 503 after %.2fs", proxy.combo.name, took)


@pytest.mark.untraced  # its only traffic is HTTP to the health check port, inside wait loops
def test_health_check_node_port_passes_a_dropping_input_policy(proxy: Proxy, sandbox: Sandbox) -> None:
    """A node whose firewall drops what it does not allow (INPUT policy DROP, established traffic
    accepted) still answers its load balancer's health checks: the iptables backend accepts the
    healthCheckNodePort in filter, as kube-proxy's iptables mode does; /healthz (not a NodePort) stays
    dropped.  nftables: kube-proxy's nftables mode writes no such accept and neither does netproxy — an
    accept in one nftables table cannot override another table's drop — so there the operator's
    firewall decides (docs/parity.md)."""
    here = local(sandbox)[:1]
    spec: Dict[str, Any] = {"node_port": NODE_PORT, "type": "LoadBalancer", "externalTrafficPolicy": "Local",
                            "healthCheckNodePort": HC_PORT}
    if proxy.combo.backend == "iptables":
        tool = f"iptables-{proxy.combo.flavour}"
        policy = [[tool, "-w", "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                  [tool, "-w", "-P", "INPUT", "DROP"]]
        undo = [[tool, "-w", "-P", "INPUT", "ACCEPT"],
                [tool, "-w", "-D", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]]
    else:
        policy = [["nft", "add table inet operator-fw; add chain inet operator-fw input { type filter hook input "
                   "priority 0; policy drop; ct state established,related accept; }"]]
        undo = [["nft", "delete table inet operator-fw"]]
    proxy.start_run(web(here, **spec), "--healthz-bind-address", "0.0.0.0:10256")
    url, healthz = f"http://{NODE_EXT4}:{HC_PORT}/", f"http://{NODE_EXT4}:10256/healthz"

    def answers(u: str) -> Callable[[], Optional[str]]:
        def check() -> Optional[str]:
            alive(proxy)
            code, body = http_get(sandbox, sandbox.ext, u)
            return None if code == 200 else f"{u}: HTTP {code} {body[:200]}"
        return check

    run_wait(proxy, answers(url), timeout=15, step=0.3)  # before the firewall: served
    for argv in policy:
        sandbox.exec(sandbox.node, argv, check=True)
    try:
        code, body = http_get(sandbox, sandbox.ext, healthz)
        assert code == 0 and "timed out" in body, f"{healthz} passed the dropping policy: {code} {body[:200]}"
        code, body = http_get(sandbox, sandbox.ext, url)
        if proxy.combo.backend == "iptables":
            assert code == 200, f"{url}: HTTP {code} {body[:200]} through INPUT policy DROP"
        else:
            assert code == 0 and "timed out" in body, f"{url}: the operator's nftables drop did not apply: {code}"
    finally:
        for argv in undo:
            sandbox.exec(sandbox.node, argv)


def test_health_check_node_port_turns_503_while_the_proxy_cannot_write(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy's service health server: 200 only while the service has local endpoints *and* the
    proxy is healthy; a proxy whose writes are refused (the kernel refuses them, or another writer
    holds the xtables lock) with a change waiting past 2 x --sync-period answers 503 with
    ``serviceProxyHealthy: false`` — so a cloud load balancer stops sending to this node — and 200
    again once its writes go through.  ``X-Load-Balancing-Endpoint-Weight`` is the local count."""
    here, there = local(sandbox)[:2], remote(sandbox)[:1]
    spec: Dict[str, Any] = {"node_port": NODE_PORT, "type": "LoadBalancer", "externalTrafficPolicy": "Local",
                            "healthCheckNodePort": HC_PORT}
    refused = WritesRefused(sandbox, proxy.combo, proxy.workdir)
    proxy.start_run(web([*here, *there], **spec), "--healthz-bind-address", "0.0.0.0:10256",
                    "--sync-period", "2s", "--min-sync-period", "200ms", env=refused.env)
    url = f"http://{NODE_EXT4}:{HC_PORT}/"

    def answer(code: int, count: int, healthy: bool) -> Callable[[], Optional[str]]:
        def check() -> Optional[str]:
            alive(proxy)
            got, body, headers = http_get_headers(sandbox, sandbox.ext, url)
            try:
                doc = json.loads(body)
            except ValueError:
                return f"{url}: HTTP {got}, not JSON: {body!r}"
            want = {"service": {"namespace": "default", "name": "web"}, "localEndpoints": count,
                    "serviceProxyHealthy": healthy}
            weight = headers.get("x-load-balancing-endpoint-weight")
            if got != code or doc != want or weight != str(count):
                return f"{url}: HTTP {got} {doc} weight {weight}; want {code} {want} weight {count}"
            return None
        return check

    run_wait(proxy, answer(200, 2, True), timeout=15, step=0.3)
    with refused:
        write_manifests(proxy.source, web([here[0], *there], **spec))  # a change that cannot be written
        # The local count is what was last programmed (kube-proxy updates it after a write that
        # went through); health turns once the change has waited 2 x 2 s.
        took = run_wait(proxy, answer(503, 2, False), timeout=15, step=0.3)
        code, body = http_get(sandbox, sandbox.ext, f"http://{NODE_EXT4}:10256/healthz")
        assert code == 503, f"/healthz while writes are refused: {code} {body}"
    log.info("%s: health check 503 after %.2fs of refused writes", proxy.combo.name, took)
    run_wait(proxy, answer(200, 1, True), timeout=20, step=0.3)
    assert_only_and_all(sandbox.connect(SVC_IP, 80, count=30), [here[0], *there], total=30)


# ---- internalTrafficPolicy: Local ---------------------------------------------------------------


def test_itp_local(proxy: Proxy, sandbox: Sandbox) -> None:
    here, there = local(sandbox)[:1], remote(sandbox)
    proxy.sync([*web([*here, *there], node_port=NODE_PORT, internalTrafficPolicy="Local"),
                *web(there, name="far", cluster_ip="10.96.1.11", internalTrafficPolicy="Local")])
    cluster, external, none_local = connect_all(
        sandbox,
        (SVC_IP, 80, {"count": 30}),
        (NODE_EXT4, NODE_PORT, {"count": 150, "source": sandbox.ext}),  # external traffic: not restricted
        ("10.96.1.11", 80, {"count": 2, "timeout": DROP_TIMEOUT}),
    )
    assert_only_and_all(cluster, here, total=30)
    assert_only_and_all(external, [*here, *there], total=150)
    assert_dropped(none_local, 2)


# ---- feature gates -----------------------------------------------------------------------------


def test_allow_service_external_ips_false_serves_everything_but_external_ips(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy 1.36's AllowServiceExternalIPs=false: a service's spec.externalIPs get no rules (the
    address is not this proxy's to answer), its ClusterIP and load-balancer IP are served as ever."""
    pods = local(sandbox)
    write_manifests(proxy.source, web(pods, type="LoadBalancer", externalIPs=[EXTERNAL_IP],
                                      load_balancer_ips=[LB_IP]))
    proc = proxy.command("sync", "--source", proxy.source, *proxy.base_flags,
                         "--feature-gates", "AllowServiceExternalIPs=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cluster_ip, lb_ip, external = connect_all(
        sandbox, (SVC_IP, 80, {"count": 30}), (LB_IP, 80, {"count": 30, "source": sandbox.ext}),
        (EXTERNAL_IP, 80, {"count": 2, "timeout": DROP_TIMEOUT, "source": sandbox.ext}))
    assert_only_and_all(cluster_ip, pods, total=30)
    assert_only_and_all(lb_ip, pods, total=30)
    assert_not_served(external, 2, KINDS["external-gate-off"], "the external IP with the gate off")
    # The same objects with the gate at its default: the external IP answers.
    proxy.sync(web(pods, type="LoadBalancer", externalIPs=[EXTERNAL_IP], load_balancer_ips=[LB_IP]))
    assert_only_and_all(sandbox.connect(EXTERNAL_IP, 80, count=30, source=sandbox.ext, timeout=ANSWER_TIMEOUT),
                        pods, total=30)


# ---- loadBalancerSourceRanges ------------------------------------------------------------------


def test_load_balancer_source_ranges(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = local(sandbox)
    proxy.sync(web(pods, node_port=NODE_PORT, load_balancer_ips=[LB_IP],
                   loadBalancerSourceRanges=[f"{EXT4}/32"]))
    allowed, denied, cluster_ip, node_port = connect_all(
        sandbox,
        (LB_IP, 80, {"count": 90, "source": sandbox.ext}),
        (LB_IP, 80, {"count": 2, "timeout": DROP_TIMEOUT}),  # the client is outside the ranges
        (SVC_IP, 80, {"count": 90}),  # ClusterIP and NodePort are not restricted
        (GATEWAY4, NODE_PORT, {"count": 90}),
    )
    assert_only_and_all(allowed, pods, total=90)
    assert_dropped(denied, 2)
    assert_only_and_all(cluster_ip, pods, total=90)
    assert_only_and_all(node_port, pods, total=90)


def test_load_balancer_source_ranges_admit_the_node_holding_the_lb_ip(proxy: Proxy, sandbox: Sandbox) -> None:
    """A node that holds its load balancer's IP (MetalLB L2, keepalived) connects to it *from* it: with a
    source range covering the node's IP, kube-proxy lets the LB IP in as a source too ("same node to LB,
    implicitly allowed"); a client outside the ranges is still dropped, and without a range covering
    the node the LB IP as a source is dropped as any other."""
    pods = local(sandbox)
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME},
            "status": {"addresses": [{"type": "InternalIP", "address": NODE_EXT4}]}}
    sandbox.exec(sandbox.node, ["ip", "addr", "add", f"{LB_IP}/32", "dev", "lo"], check=True)
    try:
        proxy.sync([node, *web(pods, load_balancer_ips=[LB_IP], loadBalancerSourceRanges=[f"{NODE_EXT4}/32"])])
        from_lb, outside = connect_all(
            sandbox,
            (LB_IP, 80, {"count": 30, "source": sandbox.node, "sources": [LB_IP]}),
            (LB_IP, 80, {"count": 2, "timeout": DROP_TIMEOUT}),  # the in-cluster client: outside the ranges
        )
        assert_only_and_all(from_lb, pods, total=30)
        assert_masqueraded(from_lb, LB_IP)
        assert_dropped(outside, 2)
        # A range that does not cover the node: the LB IP is a source like any other, outside it.
        proxy.sync([node, *web(pods, load_balancer_ips=[LB_IP], loadBalancerSourceRanges=[f"{EXT4}/32"])])
        assert_dropped(sandbox.connect(LB_IP, 80, count=2, source=sandbox.node, sources=[LB_IP],
                                       timeout=DROP_TIMEOUT), 2)
    finally:
        sandbox.exec(sandbox.node, ["ip", "addr", "del", f"{LB_IP}/32", "dev", "lo"])


# ---- refusals ----------------------------------------------------------------------------------


def test_no_endpoints_refused(proxy: Proxy, sandbox: Sandbox) -> None:
    objects = [
        service("empty", SVC_IP, [http_port(NODE_PORT), port(53, 8080, name="dns", protocol="UDP")],
                type="NodePort"),
        endpoint_slice("empty", [], [port(8080, name="http"), port(8080, name="dns", protocol="UDP")]),
    ]
    proxy.sync(objects)
    refused_check(sandbox, SVC_IP, 80)
    refused_check(sandbox, SVC_IP, 53, proto="udp")
    refused_check(sandbox, SVC_IP, 80, source=sandbox.node)
    refused_check(sandbox, NODE_EXT4, NODE_PORT, source=sandbox.ext)


def test_unknown_port_on_active_clusterip_refused(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = local(sandbox)
    proxy.sync(web(pods))
    assert_only_and_all(sandbox.connect(SVC_IP, 80, count=90), pods, total=90)
    refused_check(sandbox, SVC_IP, 81)
    refused_check(sandbox, SVC_IP, 80, proto="udp")


# ---- endpoint eligibility (netproxy/core/endpoints.py, through both backends) -----------------------


def test_terminating_endpoints_only_without_ready_ones(proxy: Proxy, sandbox: Sandbox) -> None:
    p0, p1, p2 = local(sandbox)
    http = [port(8080, name="http")]
    # p1's controller sets no `serving`: absent reads as true (kube-proxy, the API), so it is a
    # serving-and-terminating fallback like p0.
    terminating = [ep(p0, ready=False, serving=True, terminating=True),
                   ep(p1, ready=False, serving=ABSENT, terminating=True)]
    gone = [ep(p, ready=False, serving=False, terminating=True) for p in (p0, p1, p2)]
    proxy.sync([
        service("mixed", SVC_IP, [http_port()]), endpoint_slice("mixed", [*terminating, ep(p2)], http),
        # No ready endpoint: the serving-and-terminating ones (not the non-serving one).
        service("draining", "10.96.1.11", [http_port()]), endpoint_slice("draining", [*terminating, gone[2]], http),
        # Nothing serving at all: no endpoints.
        service("gone", "10.96.1.12", [http_port()]), endpoint_slice("gone", gone, http),
    ])
    mixed, draining = connect_all(sandbox, (SVC_IP, 80, {"count": 30}), ("10.96.1.11", 80, {"count": 60}))
    assert_only_and_all(mixed, [p2], total=30)
    assert_only_and_all(draining, [p0, p1], total=60)
    refused_check(sandbox, "10.96.1.12", 80)


TOPOLOGY = [
    # (cluster IP, spec, [(pod index, zone, hints)], pods that must answer); this node is in zone-a
    ("10.96.1.20", {"trafficDistribution": "PreferClose"},
     [(0, "zone-a", ()), (1, "zone-b", ()), (2, "zone-a", ())], [0, 2]),
    ("10.96.1.21", {}, [(0, "zone-a", ("zone-b",)), (1, "zone-b", ("zone-a",)), (2, "zone-b", ("zone-b",))], [1]),
    ("10.96.1.22", {"trafficDistribution": "PreferClose"},  # none in this zone: all
     [(0, "zone-b", ()), (1, "zone-c", ()), (2, "zone-b", ())], [0, 1, 2]),
]


def test_topology_prefers_this_nodes_zone(proxy: Proxy, sandbox: Sandbox) -> None:
    """A `kind: Node` object puts this node in zone-a: PreferClose and zone hints keep cluster traffic to
    endpoints for zone-a, and use all endpoints when none is for zone-a."""
    pods = sandbox.pods
    objects = [node_object("zone-a")]
    for k, (ip, spec, layout, _) in enumerate(TOPOLOGY):
        objects += [service(f"topo{k}", ip, [http_port()], **spec),
                    endpoint_slice(f"topo{k}", [ep(pods[i], zone=z, hints=h) for i, z, h in layout],
                             [port(8080, name="http")])]
    proxy.sync(objects)
    results = connect_all(sandbox, *((ip, 80, {"count": 90}) for ip, _, _, _ in TOPOLOGY))
    for (ip, spec, layout, want), res in zip(TOPOLOGY, results):
        try:
            assert_only_and_all(res, [pods[i] for i in want], total=90)
        except AssertionError as err:
            raise AssertionError(f"{ip} {spec} endpoints {layout}: {err}") from None


SAME_NODE = [
    # (cluster IP, spec, [(pod index, zone, zone hints, node hints)], pods that must answer); pods 0-2
    # are on this node (zone-a), 3-4 on REMOTE_NODE_NAME.  A negative index: that pod, not ready.
    # PreferSameNode without the controller's hints: this node's endpoint only...
    ("10.96.1.23", {"trafficDistribution": "PreferSameNode"},
     [(0, "zone-a", (), ()), (3, "zone-a", (), ()), (4, "zone-b", (), ())], [0]),
    # ... none on this node: the zone's; none in the zone either: all.
    ("10.96.1.24", {"trafficDistribution": "PreferSameNode"}, [(3, "zone-a", (), ()), (4, "zone-b", (), ())], [3]),
    ("10.96.1.25", {"trafficDistribution": "PreferSameNode"}, [(3, "zone-b", (), ()), (4, "zone-c", (), ())],
     [3, 4]),
    # The controller's hints win over where the endpoints are: 3 and 4 are hinted for this node.
    ("10.96.1.26", {}, [(0, "zone-a", ("zone-a",), (REMOTE_NODE_NAME,)), (3, "zone-a", ("zone-a",), (NODE_NAME,)),
                        (4, "zone-b", ("zone-b",), (NODE_NAME,))], [3, 4]),
    # Partial node hints (pod 3 has none): the node level is off, the zone hints decide.
    ("10.96.1.27", {}, [(0, "zone-a", ("zone-b",), (NODE_NAME,)), (3, "zone-a", ("zone-a",), ()),
                        (4, "zone-b", ("zone-a",), (REMOTE_NODE_NAME,))], [3, 4]),
    # A not-ready endpoint's missing hints do not count (kube-proxy looks at ready ones only).
    ("10.96.1.28", {}, [(0, "zone-a", ("zone-a",), (NODE_NAME,)), (3, "zone-a", ("zone-a",), (REMOTE_NODE_NAME,)),
                        (-1, "zone-a", (), ())], [0]),
]


def test_topology_prefers_this_node(proxy: Proxy, sandbox: Sandbox) -> None:
    """trafficDistribution PreferSameNode and hints.forNodes (kube-proxy 1.33+, KEP-3015): cluster
    traffic stays on this node's endpoints, then the zone's, then goes anywhere; partial node hints
    fall back to the zone hints (kube-proxy's topologyModeFromHints)."""
    pods = sandbox.pods
    objects = [node_object("zone-a")]
    for k, (ip, spec, layout, _) in enumerate(SAME_NODE):
        endpoints = [ep(pods[abs(i)], ready=i >= 0, zone=z, hints=h, nodes=n) for i, z, h, n in layout]
        objects += [service(f"samenode{k}", ip, [http_port()], **spec),
                    endpoint_slice(f"samenode{k}", endpoints, [port(8080, name="http")])]
    proxy.sync(objects)
    results = connect_all(sandbox, *((ip, 80, {"count": 60}) for ip, _, _, _ in SAME_NODE))
    for (ip, spec, layout, want), res in zip(SAME_NODE, results):
        try:
            assert_only_and_all(res, [pods[i] for i in want], total=60)
        except AssertionError as err:
            raise AssertionError(f"{ip} {spec} endpoints {layout}: {err}") from None


# ---- service CIDRs -----------------------------------------------------------------------------

SERVICE_CIDR = "10.96.0.0/16"
UNOWNED = "10.96.200.200"
"""Inside SERVICE_CIDR, owned by no service."""
OUTSIDE = "10.97.0.1"
"""Outside SERVICE_CIDR."""


def service_cidr(name: str, *cidrs: str) -> Manifest:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": name},
            "spec": {"cidrs": list(cidrs)}}


@contextlib.contextmanager
def beyond_the_node(sb: Sandbox, name: str, *addresses: str) -> Iterator[Pod]:
    """A server in ``ext`` (past the node's default route) holding ``addresses``: traffic the node
    leaves alone reaches it and is answered by ``name``; traffic the node drops or DNATs does not."""
    server = Pod(name=name, netns=sb.ext, ip=addresses[0], ip6="", node_name="")
    for a in addresses:
        sb.exec(sb.ext, ["ip", "addr", "add", f"{a}/32", "dev", "lo"], check=True)
    try:
        sb.start_server(server)
        yield server
    finally:
        sb.stop_server(server)
        for a in addresses:
            sb.exec(sb.ext, ["ip", "addr", "del", f"{a}/32", "dev", "lo"])


def test_service_cidr_drops_unowned_addresses(proxy: Proxy, sandbox: Sandbox) -> None:
    """ServiceCIDR objects (kube-proxy 1.30+ nftables mode, default from 1.33) and
    --service-cluster-ip-range: an address inside a service CIDR that no service owns is dropped,
    from pods and from the node; owned addresses work as before (other ports refused); addresses
    outside go on untouched (here to a server beyond the node).  Then `run`: removing the
    ServiceCIDR object lifts the drop (the incremental path)."""
    pods = local(sandbox)
    with beyond_the_node(sandbox, "beyond", UNOWNED, OUTSIDE) as beyond:
        proxy.sync([service_cidr("kubernetes", SERVICE_CIDR), *web(pods)])
        owned, unowned, from_node, outside = connect_all(
            sandbox, (SVC_IP, 80, {"count": 60}), (UNOWNED, 8080, {"count": 2, "timeout": DROP_TIMEOUT}),
            (UNOWNED, 8080, {"count": 2, "timeout": DROP_TIMEOUT, "source": sandbox.node}),
            (OUTSIDE, 8080, {"count": 10}))
        assert_only_and_all(owned, pods, total=60)
        assert_dropped(unowned, 2)
        assert_dropped(from_node, 2)
        assert_only_and_all(outside, [beyond], total=10)
        refused_check(sandbox, SVC_IP, 81)  # an owned address's other port: refused, not dropped

        # The flag alone, another range: the object's range is no longer netproxy's.
        write_manifests(proxy.source, web(pods))
        synced = proxy.command("sync", "--source", proxy.source, *proxy.base_flags,
                               "--service-cluster-ip-range", "10.97.0.0/16")
        assert synced.returncode == 0, synced.stderr
        dropped_check(sandbox, OUTSIDE, 8080)
        assert_only_and_all(sandbox.connect(UNOWNED, 8080, count=10), [beyond], total=10)
        assert_only_and_all(sandbox.connect(SVC_IP, 80, count=30), pods, total=30)

        # A running proxy follows the objects: there, then deleted.
        proxy.reset()
        proxy.start_run([*web(pods), service_cidr("kubernetes", SERVICE_CIDR)])

        def synced_run() -> Optional[str]:
            alive(proxy)
            res = sandbox.connect(SVC_IP, 80, count=1, timeout=DROP_TIMEOUT)
            return None if res.answered == 1 else f"{SVC_IP}: {res.counts} {res.errors}"

        run_wait(proxy, synced_run, timeout=15)  # one snapshot: the service and the CIDR together
        dropped_check(sandbox, UNOWNED, 8080)
        write_manifests(proxy.source, web(pods))

        def lifted() -> Optional[str]:
            alive(proxy)
            res = sandbox.connect(UNOWNED, 8080, count=1, timeout=DROP_TIMEOUT)
            return None if res.counts == {beyond.name: 1} else f"{UNOWNED}: {res.counts} {res.errors}"

        run_wait(proxy, lifted, timeout=15)
        assert_only_and_all(sandbox.connect(SVC_IP, 80, count=30), pods, total=30)


# ---- loadBalancer ipMode -----------------------------------------------------------------------

LB_VIP = "198.51.100.30"
LB_PROXIED = "198.51.100.31"


def test_load_balancer_ip_mode_proxy(proxy: Proxy, sandbox: Sandbox) -> None:
    """ingress ipMode Proxy (kube-proxy 1.30+): no rule for that IP on the node, so traffic to it
    from pods and from the node goes out to the load balancer (here a server in ext holding the IP);
    ipMode VIP (the default) is still DNAT-ed on the node to the endpoints."""
    pods = local(sandbox)
    with beyond_the_node(sandbox, "load-balancer", LB_PROXIED) as lb:
        svc = service("lbmode", SVC_IP, [port(8080, 8080, name="http")], type="LoadBalancer")
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_VIP, "ipMode": "VIP"},
                                                      {"ip": LB_PROXIED, "ipMode": "Proxy"}]}}
        endpoints = endpoint_slice("lbmode", [ep(p) for p in pods], [port(8080, name="http")])
        proxy.sync([svc, endpoints])
        vip, proxied, proxied_from_node = connect_all(
            sandbox, (LB_VIP, 8080, {"count": 60}), (LB_PROXIED, 8080, {"count": 20}),
            (LB_PROXIED, 8080, {"count": 20, "source": sandbox.node}))
        assert_only_and_all(vip, pods, total=60)
        assert_only_and_all(proxied, [lb], total=20)
        assert_preserved(proxied, CLIENT4)  # not DNAT-ed, not masqueraded: untouched by the node
        assert_only_and_all(proxied_from_node, [lb], total=20)
        # The same IP as VIP: the node takes it over again.
        svc["status"]["loadBalancer"]["ingress"][1]["ipMode"] = "VIP"
        proxy.sync([svc, endpoints])
        assert_only_and_all(sandbox.connect(LB_PROXIED, 8080, count=60), pods, total=60)


# ---- dual-stack --------------------------------------------------------------------------------


def test_dual_stack_service(proxy: Proxy, sandbox: Sandbox) -> None:
    pods = local(sandbox)
    http = [port(8080, name="http")]
    proxy.sync([
        service("web", SVC_IP, [http_port()], clusterIPs=[SVC_IP, SVC_IP6], ipFamilies=["IPv4", "IPv6"],
                ipFamilyPolicy="RequireDualStack"),
        endpoint_slice("web", [ep(p) for p in pods], http, suffix="v4"),
        endpoint_slice("web", [ep(p, ipv6=True) for p in pods], http, suffix="v6", address_type="IPv6"),
    ])
    v4, v6 = connect_all(sandbox, (SVC_IP, 80, {"count": 90}), (SVC_IP6, 80, {"count": 90}))
    assert_only_and_all(v4, pods, total=90)
    assert_preserved(v4, CLIENT4)  # reached over IPv4: a v4 endpoint
    assert_only_and_all(v6, pods, total=90)
    assert_preserved(v6, CLIENT6)  # reached over IPv6: a v6 endpoint


# ---- UDP conntrack (netproxy run) --------------------------------------------------------------

UDP_INTERVAL = 0.1
FRESH_IP = "10.96.1.54"


def dns(pods: Sequence[Pod], name: str = "dns", cluster_ip: str = UDP_IP) -> List[Manifest]:
    return [service(name, cluster_ip, [port(53, 8080, name="dns", protocol="UDP")]),
            endpoint_slice(name, [ep(p) for p in pods], [port(8080, name="dns", protocol="UDP")])]


def flows_started(sb: Sandbox, ports: Sequence[int]) -> None:
    """Until the node's conntrack table holds a UDP flow from each of ``ports`` (the clients are
    separate processes: their first packet comes a process start after the call)."""
    require_conntrack_tool()

    def seen() -> Optional[str]:
        listed = sb.exec(sb.node, ["conntrack", "-L", "-p", "udp"]).stdout
        missing = [p for p in ports if f"sport={p} " not in listed]
        return f"no conntrack entry from UDP ports {missing} yet" if missing else None

    wait_for(seen, timeout=30, step=0.05)


@pytest.mark.untraced  # fixed source ports and wait loops only: conntrack, not the rules alone, decides those
def test_udp_conntrack(proxy: Proxy, sandbox: Sandbox) -> None:
    """Two fixed-source-port UDP clients sending every 100 ms, through one edit of the source:
    - one whose endpoint is deleted is answered by the new endpoint within about a sync;
    - one to a service that did not exist (going nowhere) is answered once it appears with an endpoint."""
    old, new, fresh = local(sandbox)
    proxy.start_run(dns([old]))

    def answered_by_old() -> Optional[str]:
        alive(proxy)
        res = sandbox.connect(UDP_IP, 53, proto="udp", count=1, timeout=0.3)
        return None if res.counts == {old.name: 1} else f"{res.counts} {res.errors}"

    run_wait(proxy, answered_by_old, timeout=15)
    # Each answer may take REPLY_TIMEOUT on a loaded machine; the flows run until well past the edit.
    count, fresh_timeout = 60, 1.0
    moving = sandbox.start_connect(UDP_IP, 53, proto="udp", count=count, interval=UDP_INTERVAL,
                                   timeout=REPLY_TIMEOUT, bind=":40053", progress=True)
    reviving = sandbox.start_connect(FRESH_IP, 53, proto="udp", count=count // 2, interval=UDP_INTERVAL,
                                     timeout=fresh_timeout, bind=":40054")
    # Both flows under way, the moving one answered three times by the old endpoint: then the edit.
    answered_on(moving, old)
    flows_started(sandbox, (40054,))
    edited = time.time()  # the client stamps each attempt's start with the same clock
    write_manifests(proxy.source, dns([new]) + dns([fresh], name="dns2", cluster_ip=FRESH_IP))
    moved, revived = moving.result(), reviving.result()

    seq = moved.sequence
    before = [who for who, at in zip(seq, moved.starts) if at < edited]
    assert before and set(before) == {old.name}, f"the flow was not on {old.name} before the edit: {seq}"
    # At most LOST_AT_SWITCH datagrams lost, only between the last answer from the old endpoint and
    # the first from the new one (a reply in flight when the entry went: test_conntrack.py).
    assert_moved_losing_nothing_else(seq, old, new)
    first_new = seq.index(new.name)
    moved_after = moved.starts[first_new] - edited
    log.info("%s: UDP flow moved %.2fs after the edit", proxy.combo.name, moved_after)
    assert moved_after < 2.5 * TIME_SCALE, f"the flow moved {moved_after:.1f}s after its endpoint was deleted: {seq}"

    seq = revived.sequence
    assert seq[0].startswith("!"), f"answered before the service existed: {seq}"
    answered = [i for i, who in enumerate(seq) if not who.startswith("!")]
    assert answered, f"never answered after the service got its endpoint: {revived.errors}: {seq}"
    assert set(seq[answered[0]:]) == {fresh.name}, f"not steadily answered once it started: {seq}"
    # By the clock: the first answered datagram left this long after the edit (it left at most one
    # attempt, fresh_timeout + UDP_INTERVAL, after the rules were in).
    waited = revived.starts[answered[0]] - edited
    log.info("%s: new UDP service answered %.2fs after the edit", proxy.combo.name, waited)
    assert waited < 2.5 * TIME_SCALE + fresh_timeout + UDP_INTERVAL, \
        f"answers started {waited:.1f}s after the service got its endpoint: {seq}"


# ---- hairpin -----------------------------------------------------------------------------------


def test_hairpin(proxy: Proxy, sandbox: Sandbox) -> None:
    """A pod reaching its own service, DNAT-ed back to itself, gets an answer (masqueraded)."""
    pod = local(sandbox)[0]
    proxy.sync(web([pod]))
    res = sandbox.connect(SVC_IP, 80, count=10, source=pod.netns)
    assert_only_and_all(res, [pod], total=10)
    assert_masqueraded(res, pod.ip)


# ---- the node's own tools read back what netproxy wrote ----------------------------------------


def _dump_and_reload(proxy: Proxy, sandbox: Sandbox) -> None:
    """What an operator does to back up and restore a node's ruleset, with the node's own tools:
    ``nft list table`` then ``nft -f`` (the tables deleted between), or ``iptables-save |
    iptables-restore`` (v4 and v6)."""
    node = sandbox.node
    if proxy.combo.backend == "nftables":
        tables = sandbox.exec(node, ["nft", "list", "tables"], check=True).stdout.splitlines()
        listed = {fam: sandbox.exec(node, ["nft", "list", "table", fam, "netproxy"], check=True).stdout
                  for fam in ("ip", "ip6") if f"table {fam} netproxy" in tables}
        assert listed, f"no netproxy table to list: {tables}"
        for fam in listed:
            sandbox.exec(node, ["nft", "delete", "table", fam, "netproxy"], check=True)
        for fam, text in listed.items():
            path = os.path.join(proxy.workdir, f"netproxy-{fam}.nft")
            with open(path, "w") as f:
                f.write(text)
            loaded = sandbox.exec(node, ["nft", "-f", path])
            assert loaded.returncode == 0, f"nft -f of `nft list table {fam} netproxy`: {loaded.stderr}"
        return
    flavour = proxy.combo.flavour
    for tool in ("iptables", "ip6tables"):
        saved = sandbox.exec(node, [f"{tool}-{flavour}-save"], check=True).stdout
        restored = sandbox.exec(node, [f"{tool}-{flavour}-restore"], input=saved)
        assert restored.returncode == 0, f"{tool}-{flavour}-restore of its own save: {restored.stderr}"


def test_the_nodes_own_tools_reload_what_netproxy_wrote(proxy: Proxy, sandbox: Sandbox) -> None:
    """kube-proxy 1.36+'s rulesets re-load with the node's own nft and iptables-restore, and so do
    netproxy's, written over netlink or by the tools: a dual-stack NodePort service with ClientIP
    affinity (its remembered clients included) listed or saved, removed, loaded again; afterwards the
    node's own listing, parsed without netproxy's code (tests/kernel/kernel_services.py), sends both
    cluster IPs to exactly the input's endpoints, as it did before the reload, netproxy's plan agrees
    (`plan --diff` exits 0), and every client keeps its endpoint."""
    pods = local(sandbox)
    sticky = {"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}}}
    http = [port(8080, name="http")]
    objects = [
        service("web", SVC_IP, [http_port(NODE_PORT)], type="NodePort", clusterIPs=[SVC_IP, SVC_IP6],
                ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack", **sticky),
        endpoint_slice("web", [ep(p) for p in pods], http, suffix="v4"),
        endpoint_slice("web", [ep(p, ipv6=True) for p in pods], http, suffix="v6", address_type="IPv6"),
    ]
    proxy.sync(objects)
    want = kernel_services.expected(objects)
    assert len(want) == 2 and all(len(e) == len(pods) for e in want.values()), want
    clients = sandbox.client_addresses(8)

    def landed() -> Tuple[Dict[str, set], set]:  # type: ignore[type-arg]
        # One connection at a time: a client's second SYN must not overtake its first, which records it.
        v4 = sandbox.connect(SVC_IP, 80, count=len(clients) * 2, sources=clients, concurrency=1,
                             timeout=ANSWER_TIMEOUT)
        v6 = sandbox.connect(SVC_IP6, 80, count=4, concurrency=1, timeout=ANSWER_TIMEOUT)
        assert not v4.errors and not v6.errors, (v4.errors, v6.errors)
        chosen: Dict[str, set] = {}  # type: ignore[type-arg]
        for i, answer in enumerate(v4.sequence):
            chosen.setdefault(clients[i % len(clients)], set()).add(answer)
        return chosen, set(v6.sequence)

    before, before6 = landed()
    assert all(len(p) == 1 for p in before.values()) and len(before6) == 1, (before, before6)
    problem = kernel_services.differences(kernel_services.kernel_services(sandbox, proxy.combo), want)
    assert problem is None, f"before the reload, the kernel is not what the input says:\n{problem}"
    _dump_and_reload(proxy, sandbox)
    problem = kernel_services.differences(kernel_services.kernel_services(sandbox, proxy.combo), want)
    assert problem is None, f"after the reload, the kernel is not what the input says:\n{problem}"
    diff = proxy.command("plan", "--diff", "--source", proxy.source, *proxy.base_flags)
    assert diff.returncode == 0, f"the kernel differs from the plan after the reload:\n{diff.stdout}{diff.stderr}"
    after, after6 = landed()
    assert after == before and after6 == before6, f"affinity lost in the reload: {before} {before6} -> {after} {after6}"
