"""``netproxy migrate`` on a live node: no connection dropped, none refused, nothing foreign touched.

Each test builds the old ruleset in the sandbox's node (netproxy's iptables or nftables rules, or
kube-proxy's as the benchmark's kube-proxy layout writes them), opens long-lived connections through
it (TCP connections the pods keep open, and UDP flows from fixed source ports) to a ClusterIP, a
NodePort and an externalTrafficPolicy Local NodePort, starts a client opening new connections one
after another, and runs ``netproxy migrate`` in the middle of that loop.  Then:

- every long-lived connection and flow still exchanges data both ways, with the same pod, which
  sees the same source address and port as before (the conntrack NAT binding kept, not redone);
- the loop (2,400 connections across the switch) has no failure;
- new connections are DNAT-ed by the new ruleset: the new iptables ruleset's DNAT rule counters
  grow by exactly the connections sent after the switch; a new nftables ruleset's rules carry no
  counters, so the kernel's nftables trace names the rule that DNAT-ed each of them (a rule of
  ``table ip netproxy``), and the old ruleset is gone from every table;
- another program's iptables chains and rules and its nft table are byte-identical before and after.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import pytest

from netproxy_lab import kubeproxy_layout
from netproxy_lab.combos import has_iptables
from netproxy_lab.manifests import Manifest, endpoint_slice, port, service, write_manifests
from netproxy_lab.pytest_plugin import require
from netproxy_lab.topology import EXT4, NODE_EXT4, NODE_NAME, Pod, Sandbox
from netproxy_lab.traffic import ConnectResult, Session

pytestmark = pytest.mark.kernel

WEB_IP, HOLD_IP, DNS_IP = "10.96.0.10", "10.96.0.11", "10.96.0.12"
HOLD_PORT = 7000
NP_TCP, NP_UDP, LOCAL_TCP, LOCAL_UDP = 30080, 30081, 30090, 30091
LOOP_CAP = 100_000  # a loop stopped by the test once the switch is over (about 3 minutes at most)
AFTER = 200
_COUNTERS = re.compile(r"\[\d+:\d+\]")
_COUNTED = re.compile(r"^\[(\d+):\d+\] -A \S+ .*-j DNAT ")


@pytest.fixture(scope="module")
def sb(kernel_env: None) -> Iterator[Sandbox]:
    """Three pods on this node and one on another (for externalTrafficPolicy Local)."""
    require(shutil.which("nft") is not None, "nft is not installed")
    with Sandbox(pods=4, remote_pods=1, tcp_ports=(8080,), udp_ports=(8080,), hold_ports=(HOLD_PORT,)) as box:
        yield box


@pytest.fixture()
def node(sb: Sandbox) -> Iterator[Sandbox]:
    sb.reset_netfilter()
    try:
        yield sb
    finally:
        sb.reset_netfilter()


def _svc(name: str, ip: str, number: int, target: int, pods: Sequence[Pod], protocol: str = "TCP",
         node_port: int = 0, **spec: object) -> List[Manifest]:
    return [service(name, ip, [port(number, target, name="p", protocol=protocol, node_port=node_port)], **spec),
            endpoint_slice(name, pods, [port(target, name="p", protocol=protocol)])]


def cluster(sb: Sandbox) -> List[Manifest]:
    """ClusterIP web (the loop), hold (long-lived TCP) and dns (UDP); NodePorts (cluster policy) and
    Local NodePorts, TCP and UDP.  One port each: the kube-proxy layout lays out one port per service."""
    local, everywhere = sb.pods[:3], sb.pods
    out = [*_svc("web", WEB_IP, 80, 8080, local), *_svc("hold", HOLD_IP, 70, HOLD_PORT, local),
           *_svc("dns", DNS_IP, 53, 8080, local, protocol="UDP")]
    out += [*_svc("np-tcp", "10.96.0.20", 70, HOLD_PORT, local, type="NodePort", node_port=NP_TCP),
            *_svc("np-udp", "10.96.0.21", 53, 8080, local, protocol="UDP", type="NodePort", node_port=NP_UDP),
            *_svc("local-tcp", "10.96.0.30", 70, HOLD_PORT, everywhere, type="NodePort", node_port=LOCAL_TCP,
                  externalTrafficPolicy="Local"),
            *_svc("local-udp", "10.96.0.31", 53, 8080, everywhere, protocol="UDP", type="NodePort",
                  node_port=LOCAL_UDP, externalTrafficPolicy="Local")]
    return out


# ---- foreign rules -----------------------------------------------------------------------------

FOREIGN_NFT = """
table inet np-foreign {
  chain input {
    type filter hook input priority 0; policy accept;
    ip saddr 192.0.2.77 counter accept
  }
}
"""
FOREIGN_IPT = "\n".join([
    "*nat", ":FOREIGN-NAT - [0:0]", "-A FOREIGN-NAT -d 10.99.0.1/32 -j RETURN", "-A PREROUTING -j FOREIGN-NAT",
    "COMMIT",
    # Docker-like: its own chains in filter, jumped to from FORWARD, and a KUBE- chain that is kubelet's.
    "*filter", ":DOCKER-USER - [0:0]", ":DOCKER-ISOLATION-STAGE-1 - [0:0]", ":KUBE-FIREWALL - [0:0]",
    "-A DOCKER-USER -j RETURN", "-A DOCKER-ISOLATION-STAGE-1 -j RETURN", "-A FORWARD -j DOCKER-USER",
    "-A FORWARD -j DOCKER-ISOLATION-STAGE-1", "-A INPUT -j KUBE-FIREWALL",
    "-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
    "COMMIT", ""])
FOREIGN_MARK = re.compile(r"FOREIGN|DOCKER|KUBE-FIREWALL")


def add_foreign(sb: Sandbox) -> str:
    for flavour in ("legacy", "nft"):
        if has_iptables(flavour):
            sb.exec(sb.node, [f"iptables-{flavour}-restore", "--noflush"], input=FOREIGN_IPT, check=True)
    sb.exec(sb.node, ["nft", "-f", "-"], input=FOREIGN_NFT, check=True)
    return foreign(sb)


def foreign(sb: Sandbox) -> str:
    """Every foreign line, in order, without counters: what migrate must leave byte-identical."""
    out = []
    for flavour in ("legacy", "nft"):
        if not has_iptables(flavour):
            continue
        for table in ("nat", "filter"):
            text = sb.exec(sb.node, [f"iptables-{flavour}-save", "-t", table], check=True).stdout
            out += [f"{flavour} {table} {ln}" for ln in text.splitlines() if FOREIGN_MARK.search(ln)]
    out.append(sb.exec(sb.node, ["nft", "list", "table", "inet", "np-foreign"], check=True).stdout)
    return "\n".join(out)


# ---- the old rulesets --------------------------------------------------------------------------


def netproxy_sync(sb: Sandbox, source: str, backend: str, flavour: str = "legacy") -> None:
    proc = sb.netproxy(["sync", "--source", source, "--hostname-override", NODE_NAME, "--backend", backend,
                        "--iptables-flavour", flavour, "--cluster-cidr", "10.244.0.0/16"], flavour="nft")
    assert proc.returncode == 0, proc.stderr


def kube_proxy_rules(sb: Sandbox, objects: List[Manifest], mode: str, flavour: str = "legacy") -> None:
    svcs = kubeproxy_layout.services((o for o in objects if o["kind"] in ("Service", "EndpointSlice")), NODE_NAME)
    if mode == "nftables":
        sb.exec(sb.node, ["nft", "-f", "-"], input=kubeproxy_layout.nft_full(svcs), check=True)
        return
    restore = f"iptables-{flavour}-restore"
    sb.exec(sb.node, [restore, "--noflush"], input=kubeproxy_layout.iptables_full(svcs), check=True)
    sb.exec(sb.node, [restore, "--noflush"], input=kubeproxy_layout.iptables_node_chains(), check=True)


def migrate(sb: Sandbox, source: str, to: str, flavour: str = "legacy", *extra: str) -> str:
    proc = sb.netproxy(["migrate", "--to", to, "--source", source, "--hostname-override", NODE_NAME,
                        "--iptables-flavour", flavour, "--cluster-cidr", "10.244.0.0/16", *extra], flavour="nft")
    assert proc.returncode == 0, f"migrate exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# ---- what is checked ---------------------------------------------------------------------------


def open_sessions(sb: Sandbox, with_nodeports: bool) -> Dict[str, Tuple[Session, str]]:
    """Long-lived connections and flows, each with its first answer (pod, source seen, source port)."""
    wanted: List[Tuple[str, str, int, str, str, str]] = [
        ("clusterip-tcp", HOLD_IP, 70, "tcp", sb.client, ""),
        ("clusterip-udp", DNS_IP, 53, "udp", sb.client, ":40053"),
    ]
    if with_nodeports:
        wanted += [("nodeport-tcp", NODE_EXT4, NP_TCP, "tcp", sb.ext, ""),
                   ("nodeport-udp", NODE_EXT4, NP_UDP, "udp", sb.ext, ":40081"),
                   ("local-tcp", NODE_EXT4, LOCAL_TCP, "tcp", sb.ext, ""),
                   ("local-udp", NODE_EXT4, LOCAL_UDP, "udp", sb.ext, ":40091")]
    out = {}
    for name, addr, number, proto, ns, bind in wanted:
        s = sb.open_session(addr, number, proto=proto, source=ns, bind=bind or None)
        out[name] = (s, _who(s.exchange(f"before-{name}")))
    if with_nodeports:
        assert out["local-tcp"][1].split()[1] == EXT4, "externalTrafficPolicy Local must keep the client address"
    return out


def _who(answer: str) -> str:
    """``pod source port`` of an answer (the echoed line dropped)."""
    return " ".join(answer.split()[:3])


def check_sessions(sessions: Dict[str, Tuple[Session, str]], label: str) -> None:
    for name, (s, first) in sessions.items():
        answer = s.exchange(f"{label}-{name}")
        # A held TCP connection echoes the line (it reached the pod); a UDP pod answers each datagram.
        assert name.endswith("udp") or answer.endswith(f"{label}-{name}"), f"{name}: {answer!r}"
        assert _who(answer) == first, f"{name} after {label}: {answer!r}, was {first!r}: NAT-ed again"


def close_sessions(sessions: Dict[str, Tuple[Session, str]]) -> None:
    for s, _ in sessions.values():
        s.close()


def rules(saved: str) -> List[str]:
    """``iptables-save`` output without its comment lines and the built-in chains' counters (traffic)."""
    return [_COUNTERS.sub("", ln) for ln in saved.splitlines() if not ln.startswith("#")]


def dnat_count(sb: Sandbox, flavour: str) -> int:
    """Packets that the iptables ruleset's DNAT rules took (one per new connection)."""
    text = sb.exec(sb.node, [f"iptables-{flavour}-save", "-c", "-t", "nat"], check=True).stdout
    return sum(int(m.group(1)) for m in map(_COUNTED.match, text.splitlines()) if m)


def old_gone(sb: Sandbox, to: str, flavour: str) -> None:
    """No proxy rules but the target's, in any iptables flavour or nft table."""
    tables = sb.exec(sb.node, ["nft", "list", "tables"], check=True).stdout
    assert "kube-proxy" not in tables, tables
    assert ("netproxy" in tables) == (to == "nftables"), tables
    for fl in ("legacy", "nft"):
        if not has_iptables(fl):
            continue
        for table in ("nat", "filter", "mangle"):
            text = sb.exec(sb.node, [f"iptables-{fl}-save", "-t", table], check=True).stdout
            chains = [ln.split()[0][1:] for ln in text.splitlines() if ln.startswith(":KUBE-")]
            proxy = [c for c in chains if c != "KUBE-FIREWALL"]
            if to == "iptables" and fl == flavour and table == "mangle":
                # netproxy's own stamp (backends/iptables/README.md, "Restart by adoption")
                assert proxy == ["KUBE-NP-STAMP"], (fl, table, chains)
            elif to == "iptables" and fl == flavour:
                assert proxy and not [c for c in proxy if c.startswith("KUBE-SEP-") or "CANARY" in c
                                      or c in ("KUBE-FORWARD", "KUBE-PROXY-FIREWALL")], (fl, table, chains)
            else:
                assert not proxy, (fl, table, chains)


def switch(sb: Sandbox, source: str, to: str, flavour: str, *extra: str) -> str:
    """Migrate in the middle of a loop of new connections; the loop must not see one failure, and new
    connections after the switch go through the new ruleset.  The loop provably spans the switch:
    under way before `migrate` starts, stopped only after it returned."""
    loop = sb.start_connect(WEB_IP, 80, count=LOOP_CAP, interval=0.002, timeout=2.0, announce=True)
    loop.wait_started()
    out = migrate(sb, source, to, flavour, *extra)
    assert loop.stop(), "the loop ended before the switch was over"
    res = loop.result()
    assert res.errors == {} and res.answered == len(res.sequence), \
        f"loop across the switch: {res.errors}, {res.answered}/{len(res.sequence)}"
    assert sorted(res.counts) == ["pod-0", "pod-1", "pod-2"], res.counts
    old_gone(sb, to, flavour)
    if to == "iptables":
        before = dnat_count(sb, flavour)
        after = sb.connect(WEB_IP, 80, count=AFTER)
        assert dnat_count(sb, flavour) - before == AFTER, "new connections not DNAT-ed by the new iptables rules"
    else:
        after, traced = traced_connects(sb)
        assert traced == AFTER, f"{traced} of {AFTER} new connections DNAT-ed by table ip netproxy"
    assert after.errors == {} and after.answered == AFTER, after.errors
    return out


OBSERVER = f"""table ip np-observe {{
  chain pre {{
    type filter hook prerouting priority -150;
    ip daddr {WEB_IP} tcp dport 80 ct state new meta nftrace set 1
  }}
}}
"""
_NETPROXY_DNAT = re.compile(r"^trace id (\S+) ip netproxy \S+ rule .*\bdnat\b.*\(verdict accept\)")


def traced_connects(sb: Sandbox) -> Tuple[ConnectResult, int]:
    """``AFTER`` new connections, with the kernel's nftables trace on for them (after conntrack,
    before NAT: priority -150); how many of them a rule of ``table ip netproxy`` DNAT-ed.  nftables'
    own account of who DNAT-ed, since netproxy's nftables rules carry no counters."""
    sb.exec(sb.node, ["nft", "-f", "-"], input=OBSERVER, check=True)
    path = Path(sb.workdir) / "trace.txt"
    try:
        with open(path, "w") as sink:
            monitor = sb.popen(sb.node, ["nft", "monitor", "trace"], stdout=sink)
            try:
                time.sleep(0.5)  # subscribed before the first packet
                # Paced: a burst of traced packets overflows the monitor's netlink socket (events lost).
                res = sb.connect(WEB_IP, 80, count=AFTER, interval=0.005)
                time.sleep(1.0)
            finally:
                monitor.terminate()
                monitor.wait(timeout=5)
    finally:
        sb.exec(sb.node, ["nft", "delete", "table", "ip", "np-observe"], check=True)
    ids = {m.group(1) for m in map(_NETPROXY_DNAT.match, path.read_text().splitlines()) if m}
    return res, len(ids)


# ---- the tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", ["legacy", "nft"])
def test_iptables_to_nftables_and_back(node: Sandbox, tmp_path: Path, flavour: str) -> None:
    # A flavour this machine lacks is a visible skip (a failure under CI=true), not a test that
    # vanished at import.
    require(has_iptables(flavour), f"iptables-{flavour} is not installed")
    source = str(tmp_path / "cluster.yaml")
    write_manifests(source, cluster(node))
    original = add_foreign(node)
    netproxy_sync(node, source, "iptables", flavour)
    sessions = open_sessions(node, with_nodeports=True)
    try:
        out = switch(node, source, "nftables", flavour)
        assert f"remove: netproxy's iptables-{flavour} rules" in out, out
        check_sessions(sessions, "after-nftables")
        out = switch(node, source, "iptables", flavour)
        assert "remove: netproxy's nftables rules" in out, out
        check_sessions(sessions, "after-iptables")
    finally:
        close_sessions(sessions)
    assert foreign(node) == original


@pytest.mark.parametrize("mode,flavour,to", [
    ("iptables", "legacy", "nftables"), ("iptables", "legacy", "iptables"), ("iptables", "nft", "nftables"),
    ("iptables", "nft", "iptables"), ("nftables", "legacy", "nftables"), ("nftables", "legacy", "iptables"),
], ids=["iptables-legacy-to-nftables", "iptables-legacy-takeover", "iptables-nft-to-nftables",
        "iptables-nft-takeover", "nftables-to-nftables", "nftables-to-iptables-legacy"])
def test_from_kube_proxy(node: Sandbox, tmp_path: Path, mode: str, flavour: str, to: str) -> None:
    """kube-proxy's rules (``flavour``: its iptables', or the target's for its nftables mode) to netproxy's."""
    require(has_iptables(flavour), f"iptables-{flavour} is not installed")
    source = str(tmp_path / "cluster.yaml")
    objects = cluster(node)
    write_manifests(source, objects)
    original = add_foreign(node)
    kube_proxy_rules(node, objects, mode, flavour)
    assert node.connect(WEB_IP, 80, count=30).answered == 30, "the kube-proxy layout does not serve"
    if mode == "iptables" and to == "iptables":
        # The same chain names: without --from-kube-proxy that would be a silent takeover; refused, untouched.
        before = node.exec(node.node, [f"iptables-{flavour}-save", "-t", "nat"], check=True).stdout
        refused = node.netproxy(["migrate", "--to", to, "--source", source, "--hostname-override", NODE_NAME,
                                 "--iptables-flavour", flavour], flavour="nft")
        assert refused.returncode == 1 and "--from-kube-proxy" in refused.stderr, refused.stderr
        after = node.exec(node.node, [f"iptables-{flavour}-save", "-t", "nat"], check=True).stdout
        assert rules(after) == rules(before)
    sessions = open_sessions(node, with_nodeports=True)
    try:
        out = switch(node, source, to, flavour, "--from-kube-proxy")
        held = f"{mode}-{flavour}" if mode == "iptables" else mode
        assert f"remove: kube-proxy's {held}" in out, out
        check_sessions(sessions, "after")
    finally:
        close_sessions(sessions)
    assert foreign(node) == original


def test_refuses_a_different_masquerade_bit(node: Sandbox, tmp_path: Path) -> None:
    """Both rulesets must mark with the same bit while both are installed: refused before any write."""
    source = str(tmp_path / "cluster.yaml")
    write_manifests(source, cluster(node))
    netproxy_sync(node, source, "iptables")
    before = node.exec(node.node, ["iptables-legacy-save", "-t", "nat"], check=True).stdout
    proc = node.netproxy(["migrate", "--to", "nftables", "--source", source, "--hostname-override", NODE_NAME,
                          "--masquerade-bit", "15"], flavour="nft")
    assert proc.returncode == 1 and "--masquerade-bit 14" in proc.stderr, proc.stderr
    assert "netproxy" not in node.exec(node.node, ["nft", "list", "tables"], check=True).stdout
    assert rules(node.exec(node.node, ["iptables-legacy-save", "-t", "nat"], check=True).stdout) == rules(before)


def test_a_refused_write_leaves_the_old_ruleset_working(node: Sandbox, tmp_path: Path) -> None:
    """The kernel refuses the new iptables write (a stale netproxy-named chain that another program's
    rule still jumps to cannot be deleted): exit 1 naming the step, the nftables rules still serve."""
    require(has_iptables("legacy"), "iptables-legacy is not installed")
    source = str(tmp_path / "cluster.yaml")
    write_manifests(source, cluster(node))
    netproxy_sync(node, source, "nftables")
    blocker = "\n".join(["*nat", ":KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]", ":FOREIGN-HOLD - [0:0]",
                         "-A FOREIGN-HOLD -j KUBE-SVC-AAAAAAAAAAAAAAAA", "COMMIT", ""])
    node.exec(node.node, ["iptables-legacy-restore", "--noflush"], input=blocker, check=True)
    before = node.exec(node.node, ["iptables-legacy-save", "-t", "nat"], check=True).stdout
    loop = node.start_connect(WEB_IP, 80, count=LOOP_CAP, interval=0.002, timeout=2.0, announce=True)
    loop.wait_started()
    proc = node.netproxy(["migrate", "--to", "iptables", "--iptables-flavour", "legacy", "--source", source,
                          "--hostname-override", NODE_NAME, "--cluster-cidr", "10.244.0.0/16"], flavour="nft")
    assert loop.stop(), "the loop ended before the refused migration was over"
    res = loop.result()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "netproxy migrate: program:" in proc.stderr and "old rules are untouched" in proc.stderr, proc.stderr
    assert res.errors == {} and res.answered == len(res.sequence), res.errors
    assert "netproxy" in node.exec(node.node, ["nft", "list", "tables"], check=True).stdout
    after = node.exec(node.node, ["iptables-legacy-save", "-t", "nat"], check=True).stdout
    assert rules(after) == rules(before)
    assert node.connect(DNS_IP, 53, proto="udp", count=20).answered == 20


def test_run_with_the_other_backend_removes_the_old_rules_after_its_first_sync(node: Sandbox, tmp_path: Path) -> None:
    """`netproxy run` started with nftables on a node holding netproxy's iptables rules: programs
    nftables in full first, then removes the iptables rules; a loop across it sees no failure.

    The loop provably spans the switch: it is under way before `run` starts, and it is stopped only
    once the log says the old rules were removed (a loop of a fixed length could end before a slow
    start had switched anything)."""
    require(has_iptables("legacy"), "iptables-legacy is not installed")
    source = str(tmp_path / "cluster.yaml")
    write_manifests(source, cluster(node))
    original = add_foreign(node)
    netproxy_sync(node, source, "iptables")
    sessions = open_sessions(node, with_nodeports=True)
    loop = node.start_connect(WEB_IP, 80, count=LOOP_CAP, interval=0.002, timeout=2.0, announce=True)
    loop.wait_started()
    log = tmp_path / "run.log"
    proc = node.start_netproxy(["run", "--source", source, "--backend", "nftables", "--hostname-override", NODE_NAME,
                                "--cluster-cidr", "10.244.0.0/16", "--metrics-bind-address", "",
                                "--healthz-bind-address", ""], flavour="nft", log_path=str(log))
    try:
        deadline = time.monotonic() + 120
        while "left from an earlier run" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.stop(), f"the loop ended before the switch was over:\n{log.read_text()}"
        res = loop.result()
        assert "removed netproxy's iptables-legacy rules (IPv4, IPv6) left from an earlier run" in log.read_text()
        assert res.errors == {} and res.answered == len(res.sequence) > 0, \
            f"loop across the start: {res.errors}\n{log.read_text()}"
        old_gone(node, "nftables", "legacy")
        check_sessions(sessions, "after-run")
        after, traced = traced_connects(node)
        assert after.answered == AFTER and traced == AFTER
    finally:
        close_sessions(sessions)
        proc.terminate()
        proc.wait(timeout=10)
    assert foreign(node) == original
