"""The iptables backend's two writers in a real kernel (root, inside namespaces these tests create).

- Equivalence: over a matrix of snapshots, the restore writer and the libiptc writer leave
  byte-identical ``iptables-legacy-save`` output (the generated-by header and counters aside).
- Cleanup removes netproxy's chains and the chains of kube-proxy's old userspace mode, and nothing else.
- A refused restore keeps the previous rules, and the error names the failing payload line.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Dict, Iterator, List

import pytest

from netproxy_lab.pytest_plugin import require

pytestmark = pytest.mark.kernel

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable


def snapshot_steps() -> List[object]:
    """The matrix: each step is a whole snapshot, applied in order (so later steps are updates)."""
    from netproxy.core.model import Endpoint, ServicePort, ServicePortName, Snapshot

    ip = ipaddress.ip_address

    def port(ns: str, name: str, pname: str, cip: str, number: int, **kw: object) -> ServicePort:
        return ServicePort(ServicePortName(ns, name, pname), str(kw.pop("protocol", "TCP")), number, number,
                           (ip(cip),), **kw)  # type: ignore[arg-type]

    def eps(prefix: str, n: int, number: int = 8080) -> List[Endpoint]:
        return [Endpoint(ip(f"{prefix}.{i + 1}"), number) for i in range(n)]

    web = port("default", "web", "http", "10.96.0.10", 80)
    multi = [port("default", "multi", "http", "10.96.0.11", 80), port("default", "multi", "dns", "10.96.0.11", 53,
                                                                         protocol="UDP")]
    sticky = port("default", "sticky", "", "10.96.0.12", 443, affinity="ClientIP", affinity_timeout=60,
                  external_ips=(ip("203.0.113.10"),), load_balancer_ips=(ip("198.51.100.10"),))
    dual = port("default", "v6", "", "fd00::10", 80)
    fifty = [port(f"ns{i % 5}", f"svc-{i}", "", f"10.97.{i // 200}.{i % 200 + 1}", 80) for i in range(50)]
    empty = port("default", "empty", "", "10.96.0.13", 80)
    steps = [Snapshot.build([])]
    steps.append(Snapshot.build([web], {web.name: eps("10.1.0", 3)}))
    steps.append(Snapshot.build([web] + multi, {web.name: eps("10.1.0", 3), multi[0].name: eps("10.1.1", 2),
                                                multi[1].name: eps("10.1.1", 2, 53)}))
    steps.append(Snapshot.build([web, sticky, dual, empty], {web.name: eps("10.1.0", 3),
                                                             sticky.name: eps("10.1.2", 4),
                                                             dual.name: [Endpoint(ip("fd01::1"), 80)]}))
    big = {s.name: eps(f"10.2.{i}", (i % 7) + 1) for i, s in enumerate(fifty)}
    steps.append(Snapshot.build(fifty + [web, sticky], {**big, web.name: eps("10.1.0", 3),
                                                        sticky.name: eps("10.1.2", 4)}))
    moved = dict(big)
    moved[fifty[7].name] = eps("10.3.7", 5)  # an endpoint change
    del moved[fifty[9].name]  # endpoints gone: reject
    steps.append(Snapshot.build(fifty[:40] + [web], {**moved, web.name: eps("10.1.0", 2)}))  # 10 services deleted
    # 120 NodePorts (TCP and UDP), half of them without endpoints: both KUBE-NODEPORTS and
    # KUBE-EXTERNAL-SERVICES become protocol / port-range trees (``--dport LO:HI`` rules, a libiptc shape
    # of their own); then one NodePort moves, as a partial sync.
    nodeports = [port("np", f"np-{i}", "", f"10.98.0.{i + 1}", 80, node_port=30000 + 22 * i,
                      protocol="UDP" if i % 3 == 0 else "TCP") for i in range(120)]
    np_eps = {s.name: eps(f"10.4.{i}", 1) for i, s in enumerate(nodeports) if i % 2 == 0}
    steps.append(Snapshot.build(nodeports, np_eps))
    nodeports[8] = dataclasses.replace(nodeports[8], node_port=32700)
    steps.append(Snapshot.build(nodeports, np_eps))
    steps.append(parity_snapshot())
    steps.append(Snapshot.build([]))
    return steps


def parity_snapshot() -> object:
    """Every rule shape docs/parity.md adds: NodePorts, Local policies (with and without local
    endpoints), source ranges, no endpoints with external addresses, IPv6 NodePorts."""
    from netproxy.core.model import Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot

    ip, net = ipaddress.ip_address, ipaddress.ip_network
    local = [Endpoint(ip("10.244.1.5"), 8080, node_name="node"), Endpoint(ip("10.244.2.5"), 8080, node_name="x")]
    remote = local[1:]

    def port(name: str, cip: str, **kw: object) -> ServicePort:
        return ServicePort(ServicePortName("parity", name, ""), "TCP", 80, 8080, (ip(cip),), **kw)  # type: ignore[arg-type]

    svcs = [
        port("np", "10.96.1.1", node_port=30001, service_type="NodePort"),
        port("etp", "10.96.1.2", node_port=30002, external_ips=(ip("203.0.113.2"),), external_traffic_policy="Local",
             affinity="ClientIP", affinity_timeout=30),
        port("etp-none", "10.96.1.3", node_port=30003, external_traffic_policy="Local"),
        port("itp", "10.96.1.4", internal_traffic_policy="Local"),
        port("itp-none", "10.96.1.5", internal_traffic_policy="Local"),
        port("fw", "10.96.1.6", load_balancer_ips=(ip("198.51.100.6"),), source_ranges=(net("172.16.0.0/24"),),
             node_port=30006),
        port("gone", "10.96.1.7", node_port=30007, external_ips=(ip("203.0.113.7"),)),
        ServicePort(ServicePortName("parity", "v6", ""), "UDP", 53, 53, (ip("fd00::53"),), node_port=30053),
    ]
    eps = {s.name: local for s in svcs[:6]}
    eps[svcs[2].name] = remote
    eps[svcs[4].name] = remote
    eps[svcs[7].name] = [Endpoint(ip("fd01::5"), 53, node_name="node")]
    return Snapshot.build(svcs, eps, NodeInfo(name="node"))


def run_steps(writer: str, out: str) -> None:
    """Runs inside the namespace (see :func:`apply_matrix`): every step as a full sync, then as a
    partial one from the previous step, saving the tables after each."""
    from netproxy.backends import create
    from netproxy.core.config import ProxyConfig
    from netproxy.core.model import Changes

    results: Dict[str, str] = {}
    backend = create("iptables", ProxyConfig(iptables_writer=writer, iptables_flavour="legacy", hostname="node",
                                             cluster_cidrs=(ipaddress.ip_network("10.244.0.0/16"),)))
    for i, snap in enumerate(snapshot_steps()):
        backend.sync(snap, Changes(full=(i % 2 == 0), services=frozenset(snap.services)))  # type: ignore[attr-defined]
        results[str(i)] = saved_tables()
    with open(out, "w") as fh:
        json.dump(results, fh)


def saved_tables() -> str:
    text = ""
    for tool in ("iptables-legacy-save", "ip6tables-legacy-save"):
        for table in ("nat", "filter"):
            text += subprocess.run([tool, "-t", table], capture_output=True, text=True, check=True).stdout
    return normalise(text)


def normalise(text: str) -> str:
    """Drop the generated-by/completed comments and chain counters (the writers differ only there)."""
    lines = [re.sub(r"\[\d+:\d+\]$", "[0:0]", line) for line in text.splitlines() if not line.startswith("#")]
    return "\n".join(lines) + "\n"


@pytest.fixture()
def netns(kernel_env: None) -> Iterator[str]:
    require(shutil.which("iptables-legacy-restore") is not None, "iptables-legacy is not installed")
    name = f"np-iptw-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_ns(ns: str, *cmd: str, input: str = "", check: bool = True) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], input=input, capture_output=True, text=True,
                          check=check)


def python_in_ns(ns: str, code: str, check: bool = True) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return in_ns(ns, PY, "-c", f"import sys; sys.path.insert(0, {HERE!r}); " + code, check=check)


def test_restore_and_libiptc_writers_leave_identical_tables(kernel_env: None, tmp_path: object) -> None:
    require(shutil.which("iptables-legacy-restore") is not None, "iptables-legacy is not installed")
    try:
        import iptc  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        require(False, f"python-iptables is not usable: {exc}")
    results: Dict[str, Dict[str, str]] = {}
    for writer in ("restore", "libiptc"):
        ns = f"np-iptw-{os.getpid()}-{writer}"
        out = os.path.join(str(tmp_path), f"{writer}.json")
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            proc = python_in_ns(ns, f"from test_iptables_writers import run_steps; run_steps({writer!r}, {out!r})",
                                check=False)
            assert proc.returncode == 0, proc.stderr
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)
        with open(out) as fh:
            results[writer] = json.load(fh)
    assert len(results["restore"]) == len(snapshot_steps())
    for step, text in results["restore"].items():
        assert results["libiptc"][step] == text, f"step {step} differs"
    # The matrix is not vacuous: the busy step has many service chains, the last is empty again.
    assert results["restore"]["4"].count(":KUBE-SVC-") >= 50
    last = len(snapshot_steps()) - 1
    assert ":KUBE-SVC-" not in results["restore"][str(last)]
    parity = results["restore"][str(last - 1)]
    trees = results["restore"]["7"]
    assert trees.count(":KUBE-NPS-") >= 2 * 3 and "--dport 32700 " in trees
    port_range = r"-A KUBE-NPS-\S+ -p tcp -m comment --comment \"nodeports in tcp/\d+:\d+\" -m tcp --dport \d+:\d+ "
    assert re.search(port_range, trees), "no port-range jump"
    for shape in (":KUBE-SVL-", ":KUBE-FW-", "-A KUBE-NODEPORTS", "--random-fully",
                  "--match-set NETPROXY-HAIRPIN-4 src,dst,dst", "-j SET --add-set NETPROXY-AFFINITY-4-",
                  "-A KUBE-EXTERNAL-SERVICES", "--src-type LOCAL", "--ctstate DNAT", "icmp6-port-unreachable"):
        assert shape in parity, shape


USERSPACE_LEFTOVERS = """*nat
:KUBE-PORTALS-CONTAINER - [0:0]
:KUBE-PORTALS-HOST - [0:0]
:KUBE-NODEPORT-CONTAINER - [0:0]
:KUBE-NODEPORT-HOST - [0:0]
:KUBE-SVC-LEFTOVER - [0:0]
:OPERATOR - [0:0]
:KUBE-FIREWALL - [0:0]
-A PREROUTING -m comment --comment "handle ClusterIPs; NOTE: before the NodePort rules" -j KUBE-PORTALS-CONTAINER
-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment "handle service NodePorts" -j KUBE-NODEPORT-CONTAINER
-A OUTPUT -m comment --comment "handle ClusterIPs" -j KUBE-PORTALS-HOST
-A OUTPUT -m addrtype --dst-type LOCAL -j KUBE-NODEPORT-HOST
-A PREROUTING -j OPERATOR
-A OPERATOR -d 192.0.2.1/32 -m comment --comment "-j KUBE-SERVICES" -j RETURN
-A KUBE-PORTALS-HOST -d 10.0.0.1/32 -p tcp -m tcp --dport 80 -j DNAT --to-destination 127.0.0.1:1234
COMMIT
"""


def test_cleanup_removes_ours_and_the_userspace_modes_chains_only(netns: str) -> None:
    in_ns(netns, "iptables-legacy-restore", "--noflush", input=USERSPACE_LEFTOVERS)
    code = ("from test_iptables_writers import snapshot_steps; from netproxy.backends import create; "
            "from netproxy.core.config import ProxyConfig; from netproxy.core.model import Changes; "
            "b = create('iptables', ProxyConfig()); b.sync(snapshot_steps()[3], Changes(full=True)); b.cleanup()")
    python_in_ns(netns, code)
    nat = in_ns(netns, "iptables-legacy-save", "-t", "nat").stdout
    assert "KUBE-PORTALS" not in nat and "KUBE-NODEPORT-" not in nat and "KUBE-SVC-" not in nat
    assert "KUBE-SERVICES" not in nat.replace('"-j KUBE-SERVICES"', "")
    # Other programs' chains and rules stay, including kubelet's KUBE-FIREWALL.
    assert ":OPERATOR" in nat and "-A PREROUTING -j OPERATOR" in nat and ":KUBE-FIREWALL" in nat
    assert '-A OPERATOR -d 192.0.2.1/32 -m comment --comment "-j KUBE-SERVICES" -j RETURN' in nat
    assert "KUBE-" not in in_ns(netns, "iptables-legacy-save", "-t", "filter").stdout


@pytest.mark.parametrize("writer", ["restore", "libiptc"])
def test_refused_write_keeps_old_rules_and_names_the_line(netns: str, writer: str) -> None:
    # A foreign rule that jumps to a stale KUBE-SVC- chain: deleting that chain must fail.
    code = ("from test_iptables_writers import snapshot_steps; from netproxy.backends import create; "
            "from netproxy.core.config import ProxyConfig; from netproxy.core.model import Changes; "
            f"b = create('iptables', ProxyConfig(iptables_writer={writer!r})); "
            "b.sync(snapshot_steps()[2], Changes(full=True))")
    python_in_ns(netns, code)
    in_ns(netns, "iptables-legacy-restore", "--noflush",
          input="*nat\n:KUBE-SVC-STALE - [0:0]\n:OPERATOR - [0:0]\n-A OPERATOR -j KUBE-SVC-STALE\nCOMMIT\n")
    before = in_ns(netns, "iptables-legacy-save", "-t", "nat").stdout
    code = ("from test_iptables_writers import snapshot_steps; from netproxy.backends import create; "
            "from netproxy.backends.base import SyncError; "
            "from netproxy.core.config import ProxyConfig; from netproxy.core.model import Changes; "
            f"b = create('iptables', ProxyConfig(iptables_writer={writer!r}))\n"
            "try:\n    b.sync(snapshot_steps()[4], Changes(full=True))\n"
            "except SyncError as e:\n    print('LINE', e.line)\nelse:\n    print('NO ERROR')")
    out = python_in_ns(netns, code).stdout
    assert "LINE -X KUBE-SVC-STALE" in out, out
    after = in_ns(netns, "iptables-legacy-save", "-t", "nat").stdout
    assert normalise(after) == normalise(before)


def _skip_then_repair(netns: str, writer: str, flavour: str) -> None:
    """A full sync with nothing changed writes nothing while the tables are as netproxy left them
    (traffic moving the counters included); a rule changed by someone else, even to one of the same
    size, is noticed and written back."""
    save, tool = f"iptables-{flavour}-save", f"iptables-{flavour}"
    in_ns(netns, "ip", "addr", "add", "10.9.9.9/8", "dev", "lo")
    code = ("from test_iptables_writers import snapshot_steps; from netproxy.backends import create; "
            "from netproxy.core.config import ProxyConfig; from netproxy.core.model import Changes; "
            "import socket, subprocess, sys\n"
            f"b = create('iptables', ProxyConfig(iptables_writer={writer!r}, iptables_flavour={flavour!r}))\n"
            "snap = snapshot_steps()[4]\n"
            "print('FIRST', b.sync(snap, Changes(full=True)).bytes_written)\n"
            "for _ in range(5):\n"
            "    s = socket.socket(); s.settimeout(0.05)\n"
            "    try: s.connect(('10.96.0.10', 80))\n"
            "    except OSError: pass\n"
            "    s.close()\n"
            "print('AGAIN', b.sync(snap, Changes(full=True)).bytes_written)\n"
            "sys.stdout.flush(); input()\n"  # the test tampers with a rule here
            "print('AFTER', b.sync(snap, Changes(full=True)).bytes_written)\n"
            "print('THEN', b.sync(snap, Changes(full=True)).bytes_written)\n")
    argv = ["ip", "netns", "exec", netns, PY, "-c", f"import sys; sys.path.insert(0, {HERE!r}); " + code]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    first, again = proc.stdout.readline(), proc.stdout.readline()
    assert first.startswith("FIRST ") and int(first.split()[1]) > 0, (first, again)
    assert again.strip() == "AGAIN 0", again
    good = in_ns(netns, save, "-t", "nat").stdout
    assert re.search(r"^\[[1-9]\d*:\d+\] -A OUTPUT", in_ns(netns, save, "-c", "-t", "nat").stdout,
                     re.M), "no traffic went through the rules: the counters test would be vacuous"
    rule = next(ln for ln in good.splitlines() if ln.startswith("-A KUBE-SVC-") and "--to-destination" in ln)
    chain = rule.split()[1]
    tampered = re.sub(r"--to-destination (\d+\.\d+\.\d+)\.\d+:", r"--to-destination \1.99:", rule)
    assert tampered != rule
    in_ns(netns, tool, "-t", "nat", "-R", chain, "1", *shlex.split(tampered)[2:])
    assert in_ns(netns, save, "-t", "nat").stdout != good
    out, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0, err
    after, then = out.splitlines()
    assert after.startswith("AFTER ") and int(after.split()[1]) > 0, out
    assert then == "THEN 0", out
    assert normalise(in_ns(netns, save, "-t", "nat").stdout) == normalise(good)


@pytest.mark.parametrize("writer", ["restore", "libiptc"])
def test_periodic_full_sync_skips_untouched_tables_and_repairs_touched_ones(netns: str, writer: str) -> None:
    """Legacy tables: the evidence is a fingerprint of the kernel's table blob (kernel/stamp.py)."""
    _skip_then_repair(netns, writer, "legacy")


def test_iptables_nft_periodic_full_sync_skips_by_the_generation_and_repairs_touched_ones(netns: str) -> None:
    """iptables-nft: the evidence is the nf_tables generation read after netproxy's last write (traffic
    moving the counters is no commit; the replaced rule is one)."""
    _skip_then_repair(netns, "restore", "nft")
