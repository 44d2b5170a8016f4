"""The reference: the same services in kube-proxy's own layout, as raw-tool payloads.

kube-proxy's iptables mode writes a ``KUBE-SVC-<hash>`` chain per service port and a
``KUBE-SEP-<hash>`` chain per endpoint (``pkg/proxy/iptables/proxier.go``); its nftables mode a
``service-<hash>-<ns>/<name>/<proto>/<port>`` chain per service port with a ``numgen`` vmap and an
``endpoint-<hash>-…`` chain per endpoint (``pkg/proxy/nftables/proxier.go``).  This module prints
both as text for ``iptables-legacy-restore`` and ``nft -f`` — the payloads kube-proxy hands the kernel —
so that the benchmark can time the kernel's cost of that layout next to netproxy's.  It reads the
generated Kubernetes objects directly and shares no code with netproxy.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

MASQ_MARK = "0x4000"
CLUSTER_CIDR = "10.244.0.0/16"  # the sandbox's pod network (netproxy_lab.topology.CLUSTER_CIDR4)


@dataclass(frozen=True)
class Svc:
    namespace: str
    name: str
    port_name: str
    protocol: str  # "tcp" / "udp"
    ip: str
    port: int
    affinity: int  # timeout in seconds, 0 for none
    endpoints: Tuple[Tuple[str, int], ...]
    node_port: int = 0
    local: bool = False
    """externalTrafficPolicy: Local (its NodePort reaches ``local_endpoints`` only)."""
    local_endpoints: Tuple[Tuple[str, int], ...] = ()

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}:{self.port_name}"


def services(objects: Iterable[Dict[str, Any]], node: Optional[str] = None) -> List[Svc]:
    """Service ports with their endpoints, from generated Service/EndpointSlice dicts (one port each).

    ``node``: this node's name.  Given, NodePorts are laid out too, and externalTrafficPolicy Local
    with the endpoints on that node (``netproxy migrate``'s tests take over from such a node); the
    benchmark's references leave both out."""
    specs: Dict[Tuple[str, str], Dict[str, Any]] = {}
    eps: Dict[Tuple[str, str], List[Tuple[str, int]]] = {}
    local: Dict[Tuple[str, str], List[Tuple[str, int]]] = {}
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] == "Service":
            specs[(meta["namespace"], meta["name"])] = obj["spec"]
        elif obj["kind"] == "EndpointSlice":
            key = (meta["namespace"], meta["labels"]["kubernetes.io/service-name"])
            port = obj["ports"][0]["port"]
            eps.setdefault(key, []).extend((e["addresses"][0], port) for e in obj["endpoints"])
            local.setdefault(key, []).extend((e["addresses"][0], port) for e in obj["endpoints"]
                                             if node is not None and e.get("nodeName") == node)
    out = []
    for (ns, name), spec in sorted(specs.items()):
        p = spec["ports"][0]
        affinity = 0
        if spec.get("sessionAffinity") == "ClientIP":
            affinity = int(spec["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"])
        node_port = int(p.get("nodePort", 0)) if node is not None else 0
        out.append(Svc(ns, name, p.get("name", ""), p["protocol"].lower(), spec["clusterIP"], p["port"],
                       affinity, tuple(eps.get((ns, name), ())), node_port,
                       node_port > 0 and spec.get("externalTrafficPolicy") == "Local",
                       tuple(local.get((ns, name), ()))))
    return out


def _hash(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


# -- iptables ------------------------------------------------------------------------------------

def svc_chain(s: Svc) -> str:
    return "KUBE-SVC-" + _hash(s.ref + s.protocol)


def sep_chain(s: Svc, ep: Tuple[str, int]) -> str:
    return "KUBE-SEP-" + _hash(s.ref + s.protocol + f"{ep[0]}:{ep[1]}")


def _iptables_service(s: Svc, head: List[str], body: List[str]) -> None:
    svc = svc_chain(s)
    head.append(f":{svc} - [0:0]")
    comment = f'-m comment --comment "{s.ref} cluster IP"'
    match = f"-d {s.ip}/32 -p {s.protocol} -m {s.protocol} --dport {s.port}"
    n = len(s.endpoints)
    if n == 0:
        return
    body.append(f"-A KUBE-SERVICES {comment} {match} -j {svc}")
    body.append(f"-A {svc} {comment} ! -s {CLUSTER_CIDR} {match} -j KUBE-MARK-MASQ")
    seps = [sep_chain(s, ep) for ep in s.endpoints]
    if s.affinity:
        for sep, ep in zip(seps, s.endpoints):
            body.append(f'-A {svc} -m comment --comment "{s.ref} -> {ep[0]}:{ep[1]}" -m recent --name {sep} '
                        f"--mask 255.255.255.255 --rsource --rcheck --seconds {s.affinity} --reap -j {sep}")
    for i, (sep, ep) in enumerate(zip(seps, s.endpoints)):
        prob = "" if i == n - 1 else f"-m statistic --mode random --probability {1.0 / (n - i):0.10f} "
        body.append(f'-A {svc} -m comment --comment "{s.ref} -> {ep[0]}:{ep[1]}" {prob}-j {sep}')
    if s.node_port:
        _iptables_nodeport(s, svc, dict(zip(s.endpoints, seps)), head, body)
    for sep, ep in zip(seps, s.endpoints):
        head.append(f":{sep} - [0:0]")
        body.append(f"-A {sep} -m comment --comment {s.ref} -s {ep[0]}/32 -j KUBE-MARK-MASQ")
        recent = f"-m recent --name {sep} --mask 255.255.255.255 --rsource --set " if s.affinity else ""
        body.append(f"-A {sep} -m comment --comment {s.ref} {recent}-m {s.protocol} -p {s.protocol} "
                    f"-j DNAT --to-destination {ep[0]}:{ep[1]}")


def _iptables_nodeport(s: Svc, svc: str, seps: Dict[Tuple[str, int], str], head: List[str], body: List[str]) -> None:
    """kube-proxy's ``KUBE-NODEPORTS`` rule and ``KUBE-EXT-`` chain (and ``KUBE-SVL-`` for policy Local)."""
    ext = "KUBE-EXT-" + svc[len("KUBE-SVC-"):]
    head.append(f":{ext} - [0:0]")
    body.append(f'-A KUBE-NODEPORTS -m comment --comment "{s.ref}" -m {s.protocol} -p {s.protocol} '
                f"--dport {s.node_port} -j {ext}")
    if not s.local:
        body.append(f'-A {ext} -m comment --comment "masquerade traffic for {s.ref} external destinations" '
                    "-j KUBE-MARK-MASQ")
        body.append(f"-A {ext} -j {svc}")
        return
    svl = "KUBE-SVL-" + svc[len("KUBE-SVC-"):]
    head.append(f":{svl} - [0:0]")
    body.append(f'-A {ext} -s {CLUSTER_CIDR} -m comment --comment "pod traffic for {s.ref} external destinations" '
                f"-j {svc}")
    body.append(f'-A {ext} -m comment --comment "masquerade LOCAL traffic for {s.ref} external destinations" '
                "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ")
    body.append(f'-A {ext} -m comment --comment "route LOCAL traffic for {s.ref} external destinations" '
                f"-m addrtype --src-type LOCAL -j {svc}")
    body.append(f"-A {ext} -j {svl}")
    n = len(s.local_endpoints)
    for i, ep in enumerate(s.local_endpoints):
        prob = "" if i == n - 1 else f"-m statistic --mode random --probability {1.0 / (n - i):0.10f} "
        body.append(f'-A {svl} -m comment --comment "{s.ref} -> {ep[0]}:{ep[1]}" {prob}-j {seps[ep]}')


_NAT_BASE = [
    ":KUBE-SERVICES - [0:0]", ":KUBE-NODEPORTS - [0:0]", ":KUBE-POSTROUTING - [0:0]", ":KUBE-MARK-MASQ - [0:0]",
]
_NAT_FIXED = [
    '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
    '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
    f"-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN",
    f"-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}",
    '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE',
    f"-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}",
]
_NODEPORTS_LAST = ('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the '
                   'last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS')


def iptables_full(svcs: Sequence[Svc]) -> str:
    """The whole nat table as ``iptables-restore`` input (applied to a fresh namespace)."""
    head = ["*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]",
            ":POSTROUTING ACCEPT [0:0]", *_NAT_BASE]
    body = list(_NAT_FIXED)
    for s in svcs:
        _iptables_service(s, head, body)
    body.append(_NODEPORTS_LAST)
    return "\n".join(head + body + ["COMMIT", ""])


_NODE_CHAINS = """*mangle
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:KUBE-PROXY-CANARY - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" \
-j KUBE-EXTERNAL-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" \
-j KUBE-EXTERNAL-SERVICES
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark {mark}/{mark} -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED \
-j ACCEPT
COMMIT
*nat
:KUBE-PROXY-CANARY - [0:0]
COMMIT
"""


def iptables_node_chains() -> str:
    """What kube-proxy adds beside the nat service chains on every node (its canaries in mangle, nat
    and filter; filter's forwarding, firewall and external-service entry points), for
    ``iptables-restore --noflush`` after :func:`iptables_full`: a node as kube-proxy leaves it
    (``netproxy migrate --from-kube-proxy`` must remove all of it, and nothing else)."""
    return _NODE_CHAINS.replace("\\\n", "").format(mark=MASQ_MARK)


def iptables_change(svcs: Sequence[Svc], old: Svc, new: Svc) -> str:
    """kube-proxy's minimal partial restore (``--noflush``) after ``old`` became ``new``.

    As kube-proxy does: KUBE-SERVICES is rewritten whole, the changed service's chains are rewritten,
    stale endpoint chains are deleted.  The legacy kernel still replaces the whole table.
    """
    head = ["*nat", ":KUBE-SERVICES - [0:0]"]
    body: List[str] = []
    for s in svcs:
        if s == new:
            _iptables_service(s, head, body)
        elif s.endpoints:
            body.append(f'-A KUBE-SERVICES -m comment --comment "{s.ref} cluster IP" -d {s.ip}/32 '
                        f"-p {s.protocol} -m {s.protocol} --dport {s.port} -j {svc_chain(s)}")
    body.append(_NODEPORTS_LAST)
    gone = {sep_chain(old, ep) for ep in old.endpoints} - {sep_chain(new, ep) for ep in new.endpoints}
    for chain in sorted(gone):
        head.append(f":{chain} - [0:0]")
        body.append(f"-X {chain}")
    return "\n".join(head + body + ["COMMIT", ""])


# -- nftables ------------------------------------------------------------------------------------

def _nft_svc_chain(s: Svc) -> str:
    return f"service-{_hash(s.ref + s.protocol)[:8]}-{s.namespace}/{s.name}/{s.protocol}/{s.port_name}"


def _nft_ep_chain(s: Svc, ep: Tuple[str, int]) -> str:
    return (f"endpoint-{_hash(s.ref + s.protocol + f'{ep[0]}:{ep[1]}')[:8]}-{s.namespace}/{s.name}/"
            f"{s.protocol}/{s.port_name}__{ep[0]}/{ep[1]}")


_NFT_BASE = """add table ip kube-proxy {{ comment "rules for kube-proxy" ; }}
add chain ip kube-proxy nat-prerouting {{ type nat hook prerouting priority dstnat ; }}
add chain ip kube-proxy nat-output {{ type nat hook output priority -100 ; }}
add chain ip kube-proxy nat-postrouting {{ type nat hook postrouting priority srcnat ; }}
add chain ip kube-proxy mark-for-masquerade
add chain ip kube-proxy masquerading
add chain ip kube-proxy services
add map ip kube-proxy service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; }}
add set ip kube-proxy cluster-ips {{ type ipv4_addr ; }}
add rule ip kube-proxy nat-prerouting jump services
add rule ip kube-proxy nat-output jump services
add rule ip kube-proxy nat-postrouting jump masquerading
add rule ip kube-proxy mark-for-masquerade mark set mark or {mark}
add rule ip kube-proxy masquerading mark and {mark} == 0 return
add rule ip kube-proxy masquerading mark set mark xor {mark}
add rule ip kube-proxy masquerading masquerade fully-random
add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips
"""


_NFT_NODEPORTS = ("add map ip kube-proxy service-nodeports { type inet_proto . inet_service : verdict ; }\n"
                  "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 "
                  "meta l4proto . th dport vmap @service-nodeports\n")


def _nft_service(s: Svc, out: List[str]) -> None:
    chain = _nft_svc_chain(s)
    out.append(f'add chain ip kube-proxy {chain}')
    out.append(f"add element ip kube-proxy cluster-ips {{ {s.ip} }}")
    if not s.endpoints:
        return
    out.append(f"add rule ip kube-proxy {chain} ip daddr {s.ip} {s.protocol} dport {s.port} "
               f"ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade")
    eps = [_nft_ep_chain(s, ep) for ep in s.endpoints]
    for name, ep in zip(eps, s.endpoints):
        out.append(f'add chain ip kube-proxy {name}')
        out.append(f'add rule ip kube-proxy {name} ip saddr {ep[0]} jump mark-for-masquerade')
        out.append(f'add rule ip kube-proxy {name} meta l4proto {s.protocol} dnat to {ep[0]}:{ep[1]}')
    vmap = ", ".join(f'{i} : goto {name}' for i, name in enumerate(eps))
    out.append(f'add rule ip kube-proxy {chain} numgen random mod {len(eps)} vmap {{ {vmap} }}')
    out.append(f'add element ip kube-proxy service-ips {{ {s.ip} . {s.protocol} . {s.port} : goto {chain} }}')
    if s.node_port:
        _nft_nodeport(s, chain, dict(zip(s.endpoints, eps)), out)


def _nft_nodeport(s: Svc, chain: str, eps: Dict[Tuple[str, int], str], out: List[str]) -> None:
    """kube-proxy's ``external-…`` chain (and ``local-…`` for policy Local) and its NodePort element."""
    ext = "external-" + chain[len("service-"):]
    out.append(f"add chain ip kube-proxy {ext}")
    if not s.local:
        out.append(f"add rule ip kube-proxy {ext} jump mark-for-masquerade")
        out.append(f"add rule ip kube-proxy {ext} goto {chain}")
    else:
        local = "local-" + chain[len("service-"):]
        out.append(f"add chain ip kube-proxy {local}")
        out.append(f"add rule ip kube-proxy {ext} ip saddr {CLUSTER_CIDR} goto {chain}")
        out.append(f"add rule ip kube-proxy {ext} fib saddr type local jump mark-for-masquerade")
        out.append(f"add rule ip kube-proxy {ext} fib saddr type local goto {chain}")
        out.append(f"add rule ip kube-proxy {ext} goto {local}")
        vmap = ", ".join(f"{i} : goto {eps[ep]}" for i, ep in enumerate(s.local_endpoints))
        out.append(f"add rule ip kube-proxy {local} numgen random mod {len(s.local_endpoints)} vmap {{ {vmap} }}")
    out.append(f"add element ip kube-proxy service-nodeports {{ {s.protocol} . {s.node_port} : goto {ext} }}")


def nft_full(svcs: Sequence[Svc]) -> str:
    """kube-proxy's whole table as one ``nft -f`` transaction (applied to a fresh namespace)."""
    out = [_NFT_BASE.format(mark=MASQ_MARK)]
    if any(s.node_port for s in svcs):
        out.append(_NFT_NODEPORTS)
    for s in svcs:
        _nft_service(s, out)
    return "\n".join(out) + "\n"


def nft_change(old: Svc, new: Svc) -> str:
    """kube-proxy's transaction after one service's endpoints changed: flush its chain, refill, drop stale."""
    chain = _nft_svc_chain(new)
    out = [f'flush chain ip kube-proxy {chain}']
    body: List[str] = []
    _nft_service(new, body)
    old_eps = {_nft_ep_chain(old, ep) for ep in old.endpoints}
    new_eps = {_nft_ep_chain(new, ep) for ep in new.endpoints}
    for line in body:
        # Existing endpoint chains are flushed and refilled, as kube-proxy does for every changed service.
        for name in new_eps & old_eps:
            if line == f'add chain ip kube-proxy {name}':
                out.append(f'flush chain ip kube-proxy {name}')
        out.append(line)
    out.extend(f'delete chain ip kube-proxy {name}' for name in sorted(old_eps - new_eps))
    return "\n".join(out) + "\n"
