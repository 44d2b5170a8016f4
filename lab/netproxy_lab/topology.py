"""The lab's topology, for kernel tests, the demo and the benchmark: client, node, ext and pod namespaces.

Topology (all addresses fixed: every sandbox has namespaces of its own, so they never clash)::

    ext  192.0.2.100 ─── 192.0.2.1  ┐                    ┌ 10.244.1.1 ─── 10.244.1.10 pod-0
    (off-cluster client; the node's │  node              │ 10.244.1.1 ─── 10.244.1.11 pod-1
     default route points at it)    │  ip_forward=1      │ ...
    client 10.244.1.2 ─ 10.244.1.1  ┘  netproxy runs here└ (one veth per pod, routed, no bridge)

- Pods and the client are routed like a CNI without a bridge: each has a /32 (and a /128) on its
  ``eth0`` and a default route to the node's gateway address, which the node puts on every
  pod-facing veth; the node has a /32 route per pod.  Hairpin traffic (a pod reaching its own
  service) is then plain routing, without bridge hairpin mode.
- The node's default route goes to the ``ext`` namespace, as a real node's goes to its gateway:
  locally generated connections to service addresses need *some* route before the nat OUTPUT hook
  can DNAT them.  ``ext`` does not forward, so traffic that netproxy does not DNAT dies there.
- Every pod runs :mod:`netproxy_lab.pods` (answers with its name and the source it saw); a batch
  of connections from any namespace is one :mod:`netproxy_lab.client` subprocess
  (:mod:`netproxy_lab.traffic` reads what it saw).

Namespaces are named ``np-<role>-<shortid>``.  :meth:`Sandbox.close` stops the processes it
started (by PID) and deletes its namespaces by name (:mod:`netproxy_lab.cleanup`), which takes the
veths, addresses, routes, sysctls and netfilter state with them; it runs on ``with`` exit, on
failure during setup, and at interpreter exit as a last resort.  Nothing here touches the namespace the caller runs in.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from netproxy_lab.cleanup import delete_namespace, stop_process
from netproxy_lab.combos import iptables_bindir
from netproxy_lab.traffic import ConnectResult, PendingConnect, SandboxError, Session

log = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
PODSERVER = os.path.join(_HERE, "pods.py")
CLIENT = os.path.join(_HERE, "client.py")
"""Both run as plain files inside namespaces (stdlib only), so that a VM without netproxy installed runs them."""

GATEWAY4 = "10.244.1.1"
GATEWAY6 = "fd00:10:244:1::1"
CLIENT4 = "10.244.1.2"
CLIENT6 = "fd00:10:244:1::2"
NODE_EXT4 = "192.0.2.1"
EXT4 = "192.0.2.100"
NODE_EXT6 = "fd00:192:0:2::1"
EXT6 = "fd00:192:0:2::100"
CLUSTER_CIDR4 = "10.244.0.0/16"
NODE_NAME = "np-node"
"""The node name this sandbox's node claims (pass it as netproxy's hostname override)."""
REMOTE_NODE_NAME = "np-other-node"
DEFAULT_PORTS = (8080,)

IFA_F_NODAD = 0x02
_RT_SCOPE_LINK = 253

# IPv6 duplicate address detection would hold every new address "tentative" for about a second.
_NS_SYSCTLS = {
    "net/ipv6/conf/all/accept_dad": "0",
    "net/ipv6/conf/default/accept_dad": "0",
    "net/ipv6/conf/all/disable_ipv6": "0",
    "net/ipv6/conf/default/disable_ipv6": "0",
}
# The node routes and hairpins: no reverse-path filter, no ICMP redirects back into a pod.
_NODE_SYSCTLS = {
    "net/ipv4/ip_forward": "1",
    "net/ipv6/conf/all/forwarding": "1",
    "net/ipv4/conf/all/rp_filter": "0",
    "net/ipv4/conf/default/rp_filter": "0",
    "net/ipv4/conf/all/send_redirects": "0",
    "net/ipv4/conf/default/send_redirects": "0",
}

@dataclass(frozen=True)
class Pod:
    """One endpoint namespace."""

    name: str
    netns: str
    ip: str
    ip6: str
    node_name: str
    """The node this endpoint is labelled as running on (``nodeName`` in EndpointSlices)."""


def _iproute_ns(name: str):  # type: ignore[no-untyped-def]
    # Imported late: pyroute2 is a test/demo dependency, and `import netproxy_lab.topology` for
    # addresses and names only should not need it.
    from pyroute2 import NetNS

    return NetNS(name)


class Sandbox:
    """A client, a node, an off-cluster ``ext`` client and ``pods`` endpoint namespaces.

    Use as a context manager (or call :meth:`setup` and :meth:`close`).  ``remote_pods`` of the
    pods are labelled as running on another node (:data:`REMOTE_NODE_NAME`); they are still
    reached through this node, which is what traffic-policy tests need.
    """

    def __init__(self, pods: int = 3, *, tcp_ports: Sequence[int] = DEFAULT_PORTS,
                 udp_ports: Sequence[int] = DEFAULT_PORTS, remote_pods: int = 0, ipv6: bool = True,
                 shortid: Optional[str] = None, hold_ports: Sequence[int] = (),
                 sctp_ports: Sequence[int] = ()) -> None:
        self.id = shortid or secrets.token_hex(3)
        self.node = f"np-node-{self.id}"
        self.client = f"np-client-{self.id}"
        self.ext = f"np-ext-{self.id}"
        self.client_ip, self.ext_ip = CLIENT4, EXT4
        self.node_ips = (NODE_EXT4, GATEWAY4)
        """The node's own IPv4 addresses (where NodePorts answer): its ext-side one first."""
        self.tcp_ports = tuple(tcp_ports)
        self.udp_ports = tuple(udp_ports)
        self.hold_ports = tuple(hold_ports)
        """TCP ports whose connections the pods keep open (:meth:`open_session`)."""
        self.sctp_ports = tuple(sctp_ports)
        self.reset_timeout = 60.0
        """Seconds :meth:`reset_netfilter` may take (the bench's ``--scale`` run raises it)."""
        """SCTP ports the pods answer on (only where the kernel has SCTP: :func:`kernel_has_sctp`)."""
        self.ipv6 = ipv6
        self.pods: List[Pod] = []
        self._want_pods = pods
        self._remote_pods = remote_pods
        self._namespaces: List[str] = []
        self._client_extra: List[str] = []
        self._servers: Dict[str, subprocess.Popen] = {}  # type: ignore[type-arg]
        self._procs: List[subprocess.Popen] = []  # type: ignore[type-arg]
        self.workdir = ""
        self._closed = False
        _LIVE.add(self)

    # ---- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        """Build the whole topology and start the pod servers; cleans up itself if anything fails."""
        t0 = time.monotonic()
        try:
            self.workdir = tempfile.mkdtemp(prefix=f"np-sandbox-{self.id}-")
            for name in (self.node, self.client, self.ext):
                self._create_ns(name)
            self._sysctls(self.node, _NODE_SYSCTLS)
            self._wire_ext()
            self._wire_pod_like(self.client, "client", CLIENT4, CLIENT6)
            for i in range(self._want_pods):
                remote = i >= self._want_pods - self._remote_pods
                self.add_pod(f"pod-{i}", node_name=REMOTE_NODE_NAME if remote else NODE_NAME, start=False)
            for pod in self.pods:
                self.start_server(pod, wait=False)
            self._wait_servers_ready()
        except BaseException:
            self.close()
            raise
        log.info("sandbox %s up in %.2fs (%d pods)", self.id, time.monotonic() - t0, len(self.pods))

    def close(self) -> None:
        """Kill what was started here (by PID) and delete every namespace by name.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in list(self._servers.values()) + self._procs:
            stop_process(proc)
        self._servers.clear()
        self._procs.clear()
        for name in reversed(self._namespaces):
            delete_namespace(name)
        self._namespaces.clear()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        _LIVE.discard(self)

    # ---- building -----------------------------------------------------------------------------

    def _create_ns(self, name: str) -> None:
        from pyroute2 import netns

        netns.create(name)
        self._namespaces.append(name)
        self._sysctls(name, _NS_SYSCTLS)
        with _iproute_ns(name) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")

    def _sysctls(self, ns: str, values: Mapping[str, str]) -> None:
        # /proc/sys/net shows the namespace of the process that opens it, so write from inside.
        script = "; ".join(f"echo {v} > /proc/sys/{k}" for k, v in values.items()
                           if self.ipv6 or "ipv6" not in k)
        self.exec(ns, ["sh", "-c", script], check=True)

    def _veth(self, peer_ns: str, node_side: str) -> int:
        """A veth from the node to ``peer_ns`` (named ``eth0`` there); returns the peer's index."""
        tmp = f"np{secrets.token_hex(4)}"
        with _iproute_ns(self.node) as ipr:
            ipr.link("add", ifname=node_side, kind="veth", peer=tmp)
            ipr.link("set", index=ipr.link_lookup(ifname=tmp)[0], net_ns_fd=peer_ns)
            ipr.link("set", index=ipr.link_lookup(ifname=node_side)[0], state="up")
        with _iproute_ns(peer_ns) as ipr:
            idx = ipr.link_lookup(ifname=tmp)[0]
            ipr.link("set", index=idx, ifname="eth0")
            ipr.link("set", index=idx, state="up")
            return int(idx)

    def _wire_ext(self) -> None:
        """The node's uplink: one /24 (and /64) that both ends share, each end's default route via the other."""
        self._veth(self.ext, "ext0")
        self._uplink_end(self.node, "ext0", (NODE_EXT4, EXT4), (NODE_EXT6, EXT6))
        self._uplink_end(self.ext, "eth0", (EXT4, NODE_EXT4), (EXT6, NODE_EXT6))

    def _uplink_end(self, ns: str, ifname: str, v4: Tuple[str, str], v6: Tuple[str, str]) -> None:
        """``ifname`` in ``ns`` gets the first address of each (own, other end) pair; its default route
        goes via the second."""
        with _iproute_ns(ns) as ipr:
            idx = ipr.link_lookup(ifname=ifname)[0]
            ipr.addr("add", index=idx, address=v4[0], prefixlen=24)
            ipr.route("add", dst="0.0.0.0/0", gateway=v4[1])
            if self.ipv6:
                ipr.addr("add", index=idx, address=v6[0], prefixlen=64, flags=IFA_F_NODAD)
                ipr.route("add", dst="::/0", gateway=v6[1], family=10)

    def _wire_pod_like(self, ns: str, role: str, ip4: str, ip6: str) -> None:
        node_side = f"v-{role}"[:15]
        peer_idx = self._veth(ns, node_side)
        with _iproute_ns(self.node) as ipr:
            idx = ipr.link_lookup(ifname=node_side)[0]
            ipr.addr("add", index=idx, address=GATEWAY4, prefixlen=32)
            ipr.route("add", dst=f"{ip4}/32", oif=idx)
            if self.ipv6:
                ipr.addr("add", index=idx, address=GATEWAY6, prefixlen=128, flags=IFA_F_NODAD)
                ipr.route("add", dst=f"{ip6}/128", oif=idx, family=10)
        with _iproute_ns(ns) as ipr:
            ipr.addr("add", index=peer_idx, address=ip4, prefixlen=32)
            # The gateway is on-link through eth0 although no prefix says so: a link-scope route.
            ipr.route("add", dst=f"{GATEWAY4}/32", oif=peer_idx, scope=_RT_SCOPE_LINK)
            ipr.route("add", dst="0.0.0.0/0", gateway=GATEWAY4, oif=peer_idx)
            if self.ipv6:
                ipr.addr("add", index=peer_idx, address=ip6, prefixlen=128, flags=IFA_F_NODAD)
                ipr.route("add", dst=f"{GATEWAY6}/128", oif=peer_idx, family=10)
                ipr.route("add", dst="::/0", gateway=GATEWAY6, oif=peer_idx, family=10)

    def add_pod(self, name: str, *, node_name: str = NODE_NAME, start: bool = True,
                ip: Optional[str] = None, ip6: Optional[str] = None) -> Pod:
        """Another endpoint namespace, wired to the node (and its server started unless told).

        ``ip``: the pod's IPv4 address (default 10.244.1.<10+n>); any address outside the node's own
        works, since the node routes each pod by a /32 (the demo uses the example's endpoint IPs);
        ``ip6`` likewise its IPv6 address (default fd00:10:244:1::<10+n>, routed by a /128).
        """
        n = len(self.pods)
        if n >= 200:
            raise SandboxError("a sandbox holds at most 200 pods")
        pod = Pod(name=name, netns=f"np-pod{n}-{self.id}", ip=ip or f"10.244.1.{10 + n}",
                  ip6=ip6 or f"fd00:10:244:1::{10 + n:x}", node_name=node_name)
        self._create_ns(pod.netns)
        self._wire_pod_like(pod.netns, f"pod{n}", pod.ip, pod.ip6)
        self.pods.append(pod)
        if start:
            self.start_server(pod)
        return pod

    def client_addresses(self, n: int) -> List[str]:
        """``n`` IPv4 addresses of the client namespace (extra ones added on first ask), so that one
        namespace can act as many clients (per-client-address behaviour such as affinity)."""
        if n > 100:
            raise SandboxError("at most 100 client addresses")
        have = len(self._client_extra)
        if n > have:
            with _iproute_ns(self.client) as cli:
                cidx = cli.link_lookup(ifname="eth0")[0]
                with _iproute_ns(self.node) as node:
                    nidx = node.link_lookup(ifname="v-client")[0]
                    for k in range(have, n):
                        addr = f"10.244.1.{100 + k}"
                        cli.addr("add", index=cidx, address=addr, prefixlen=32)
                        node.route("add", dst=f"{addr}/32", oif=nidx)
                        self._client_extra.append(addr)
        return self._client_extra[:n]

    # ---- processes ----------------------------------------------------------------------------

    def start_server(self, pod: Pod, *, wait: bool = True) -> None:
        """Start (or restart) ``pod``'s answering server."""
        self.stop_server(pod)
        argv = [sys.executable, PODSERVER, "--name", pod.name,
                "--tcp", ",".join(map(str, self.tcp_ports)), "--udp", ",".join(map(str, self.udp_ports))]
        if self.hold_ports:
            argv += ["--hold", ",".join(map(str, self.hold_ports))]
        if self.sctp_ports:
            argv += ["--sctp", ",".join(map(str, self.sctp_ports))]
        self._servers[pod.name] = self.popen(pod.netns, argv, track=False, stdout=subprocess.PIPE)
        if wait:
            self._wait_servers_ready([pod.name])

    def stop_server(self, pod: Pod) -> None:
        """Kill ``pod``'s server: the namespace stays, connections to it are refused."""
        proc = self._servers.pop(pod.name, None)
        if proc is not None:
            stop_process(proc)

    def _wait_servers_ready(self, names: Optional[Sequence[str]] = None) -> None:
        for name in names or list(self._servers):
            proc = self._servers[name]
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != b"ready":
                proc.wait(timeout=5)
                raise SandboxError(f"pod server {name} did not start (exit {proc.returncode})")

    def popen(self, ns: str, argv: Sequence[str], *, track: bool = True, env: Optional[Mapping[str, str]] = None,
              **kwargs: object) -> subprocess.Popen:  # type: ignore[type-arg]
        """Start ``argv`` inside ``ns``; tracked processes are killed (by PID) on :meth:`close`."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=_env(env), **kwargs)  # type: ignore[call-overload]
        if track:
            self._procs.append(proc)
        return proc  # type: ignore[no-any-return]

    def exec(self, ns: str, argv: Sequence[str], *, check: bool = False, timeout: float = 60.0,
             env: Optional[Mapping[str, str]] = None, input: Optional[str] = None) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        """Run ``argv`` inside ``ns`` to completion, capturing text output."""
        proc = subprocess.run(["ip", "netns", "exec", ns, *argv], env=_env(env), input=input, text=True,
                              capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise SandboxError(f"in {ns}: {' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    # ---- traffic ------------------------------------------------------------------------------

    def connect(self, address: str, port: int, *, proto: str = "tcp", count: int = 1, source: Optional[str] = None,
                timeout: float = 1.0, concurrency: int = 32, interval: float = 0.0,
                bind: Optional[str] = None, sources: Sequence[str] = ()) -> ConnectResult:
        """``count`` connections to ``address:port`` from namespace ``source`` (default: the client).

        ``sources``: source addresses used round-robin (attempt i from ``sources[i % len]``), e.g.
        from :meth:`client_addresses`; ``bind``: one fixed ``ADDRESS:PORT`` (or ``:PORT``) for all;
        ``interval``: seconds between attempt starts (attempts then run one at a time, in order).
        """
        return self.start_connect(address, port, proto=proto, count=count, source=source, timeout=timeout,
                                  concurrency=concurrency, interval=interval, bind=bind, sources=sources).result()

    def start_connect(self, address: str, port: int, *, proto: str = "tcp", count: int = 1,
                      source: Optional[str] = None, timeout: float = 1.0, concurrency: int = 32,
                      interval: float = 0.0, bind: Optional[str] = None,
                      sources: Sequence[str] = (), announce: bool = False,
                      progress: bool = False) -> PendingConnect:
        """:meth:`connect` in the background (e.g. a paced UDP flow while a test changes endpoints);
        ``announce``: :meth:`PendingConnect.wait_started` can wait for its first attempt; ``progress``:
        :meth:`PendingConnect.wait_outcome` for what it has seen so far."""
        argv = [sys.executable, CLIENT, address, str(port), "--proto", proto, "--count", str(count),
                "--timeout", str(timeout), "--concurrency", str(concurrency), "--interval", str(interval)]
        if announce:
            argv.append("--announce")
        if progress:
            argv.append("--progress")
        if bind:
            argv += ["--bind", bind]
        if sources:
            argv += ["--sources", ",".join(sources)]
        proc = self.popen(source or self.client, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return PendingConnect(proc, budget=10.0 + count * (interval + timeout), on_done=self._untrack)

    def open_session(self, address: str, port: int, *, proto: str = "tcp", source: Optional[str] = None,
                     bind: Optional[str] = None, timeout: float = 2.0) -> Session:
        """One long-lived connection (TCP to a ``hold_ports`` port, or a UDP flow) from ``source``."""
        argv = [sys.executable, CLIENT, address, str(port), "--proto", proto, "--session", "--timeout", str(timeout)]
        if bind:
            argv += ["--bind", bind]
        proc = self.popen(source or self.client, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return Session(proc)

    def _untrack(self, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
        if proc in self._procs:
            self._procs.remove(proc)

    # ---- netproxy -----------------------------------------------------------------------------

    def netproxy(self, args: Sequence[str], *, flavour: Optional[str] = None, timeout: float = 120.0,
                 env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        """Run ``netproxy ARGS`` in the node namespace, with ``flavour``'s iptables first in PATH."""
        return self.exec(self.node, [*netproxy_command(), *args], timeout=timeout, env=self._np_env(flavour, env))

    def start_netproxy(self, args: Sequence[str], *, flavour: Optional[str] = None,
                       env: Optional[Mapping[str, str]] = None,
                       log_path: Optional[str] = None) -> subprocess.Popen:  # type: ignore[type-arg]
        """Start a long-running ``netproxy ARGS`` (e.g. ``run``) in the node; killed on :meth:`close`.

        Its stdout and stderr go to ``log_path`` (default: a file in the sandbox's work directory).
        """
        log_path = log_path or os.path.join(self.workdir, f"netproxy-{len(self._procs)}.log")
        with open(log_path, "wb") as log_file:
            return self.popen(self.node, [*netproxy_command(), *args], env=self._np_env(flavour, env),
                              stdout=log_file, stderr=subprocess.STDOUT)

    def _np_env(self, flavour: Optional[str], env: Optional[Mapping[str, str]]) -> Dict[str, str]:
        out = dict(env or {})
        if flavour:
            out["PATH"] = self.iptables_bindir(flavour) + os.pathsep + os.environ.get("PATH", "/usr/sbin:/usr/bin")
        return out

    # ---- netfilter helpers for tests ----------------------------------------------------------

    def iptables_bindir(self, flavour: str) -> str:
        """A directory whose ``iptables*``/``ip6tables*`` are the ``flavour`` ("legacy"/"nft") binaries.

        Put it first in PATH so that what netproxy's version check runs is that flavour, without
        touching the system's alternatives.
        """
        try:
            return iptables_bindir(os.path.join(self.workdir, f"bin-{flavour}"), flavour)
        except ValueError as err:
            raise SandboxError(str(err)) from None

    def reset_netfilter(self, ns: Optional[str] = None) -> None:
        """Empty every nft and legacy iptables table and the conntrack table in ``ns`` (default: node),
        within :attr:`reset_timeout` seconds (a legacy table of 100k services takes minutes to empty)."""
        ns = ns or self.node
        script = [
            "command -v nft >/dev/null && nft flush ruleset",
            # Legacy tables: restoring an empty table flushes it and deletes its user chains.
            "for t in $(cat /proc/net/ip_tables_names 2>/dev/null); do"
            " printf '*%s\\nCOMMIT\\n' $t | iptables-legacy-restore; done",
            "for t in $(cat /proc/net/ip6_tables_names 2>/dev/null); do"
            " printf '*%s\\nCOMMIT\\n' $t | ip6tables-legacy-restore; done",
            "command -v conntrack >/dev/null && conntrack -F >/dev/null 2>&1",
            # netproxy's ipsets (hairpin, affinity), now that no rule names them: each run starts cold.
            f"{shlex.quote(sys.executable)} -m netproxy.backends.iptables.ipset destroy-all >/dev/null 2>&1",
            "true",
        ]
        self.exec(ns, ["sh", "-c", "; ".join(script)], check=True, timeout=self.reset_timeout)


def netproxy_command() -> List[str]:
    """How to start netproxy: ``$NETPROXY_CMD`` (split on spaces) or this interpreter's ``-m netproxy.cli``.

    ``sys.executable`` rather than a console script, so that the same lab works in a VM where
    netproxy is importable but not installed with entry points.
    """
    override = os.environ.get("NETPROXY_CMD", "").strip()
    return shlex.split(override) if override else [sys.executable, "-m", "netproxy.cli"]


def kernel_has_sctp() -> Optional[str]:
    """None when this kernel opens SCTP sockets (loading the ``sctp`` module if it must, as any SCTP
    socket would), else why not.  Modules are the kernel's, not a namespace's: the answer here is
    the pods' answer too."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, getattr(socket, "IPPROTO_SCTP", 132)).close()
    except OSError as err:
        return f"this kernel has no SCTP ({os.strerror(err.errno) if err.errno else err})"
    return None


def _env(extra: Optional[Mapping[str, str]]) -> Optional[Dict[str, str]]:
    if not extra:
        return None
    env = dict(os.environ)
    env.update(extra)
    return env


# Sandboxes still open at interpreter exit (a test run interrupted between setup and teardown)
# are closed here, so that no namespace outlives the process that made it.
_LIVE: weakref.WeakSet[Sandbox] = weakref.WeakSet()


@atexit.register
def _close_leftovers() -> None:
    for sandbox in list(_LIVE):
        sandbox.close()
