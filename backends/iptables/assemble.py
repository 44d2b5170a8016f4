"""Rendered service ports → one family's desired tables: dispatch trees, NodePorts, masquerade, hairpin.

Pure, like ``render.py``; the node-wide rules live here because they depend on every service (the
trees) or on the node (NodePort addresses), not on one service port.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, TypeVar

from netproxy.backends.iptables import ipset, names
from netproxy.backends.iptables.render import FamilyRuleset, ServiceRules, host_net, reject_target
from netproxy.backends.iptables.tree import (
    Chains,
    DispatchEntry,
    Rule,
    SortedEntries,
    build_port_tree,
    build_sorted_tree,
)
from netproxy.core.config import ProxyConfig
from netproxy.core.model import IPNetwork, NodeInfo

SERVICE_PORTALS = "kubernetes service portals"
NAT_JUMPS: Tuple[Tuple[str, str, Rule], ...] = (
    ("PREROUTING", names.SERVICES, ("-m", "comment", "--comment", SERVICE_PORTALS, "-j", names.SERVICES)),
    ("OUTPUT", names.SERVICES, ("-m", "comment", "--comment", SERVICE_PORTALS, "-j", names.SERVICES)),
    ("POSTROUTING", names.POSTROUTING,
     ("-m", "comment", "--comment", "kubernetes postrouting rules", "-j", names.POSTROUTING)),
)
_NEW = ("-m", "conntrack", "--ctstate", "NEW")
FILTER_JUMPS: Tuple[Tuple[str, str, Rule], ...] = tuple(
    (hook, names.SERVICES, _NEW + ("-m", "comment", "--comment", SERVICE_PORTALS, "-j", names.SERVICES))
    for hook in ("INPUT", "FORWARD", "OUTPUT"))
JUMPS: Dict[str, Tuple[Tuple[str, str, Rule], ...]] = {"nat": NAT_JUMPS, "filter": FILTER_JUMPS}
"""Per table: (built-in chain, target chain, rule) — the jump rules netproxy adds once, at the top."""

TABLES = ("nat", "filter")
NODEPORTS_COMMENT = "kubernetes service nodeports; NOTE: this must be the last rule in this chain"
LOOPBACK = {4: "127.0.0.0/8", 6: "::1/128"}
_NO_NODE = NodeInfo()
LOCALNET_COMMENT = "block incoming localnet connections"


def nodeport_jumps(family: int, config: ProxyConfig, node: NodeInfo, chain: str) -> List[Rule]:
    """The last rules of a ``KUBE-SERVICES``: NodePort traffic is traffic to one of the node's addresses.

    Without ``--nodeport-addresses``: any local address; loopback only for IPv4 with localhost
    NodePorts (kube-proxy's iptables mode: ``! -d 127.0.0.0/8`` only when they are off, ``! -d ::1``
    always).  With it: the node's addresses inside those CIDRs (the core keeps ``node.addresses``
    current and filtered; filtered again here so that a stale list cannot widen it), 127.0.0.1
    among them only with localhost NodePorts.
    """
    comment: Rule = ("-m", "comment", "--comment", NODEPORTS_COMMENT)
    localhost = family == 4 and config.route_localnet_nodeports
    if not config.nodeport_addresses:
        not_loopback: Rule = () if localhost else ("!", "-d", LOOPBACK[family])
        return [not_loopback + comment + ("-m", "addrtype", "--dst-type", "LOCAL", "-j", chain)]
    cidrs = [c for c in config.nodeport_addresses if c.version == family]
    addrs = sorted({a for a in node.addresses
                    if a.version == family and (localhost or not a.is_loopback) and any(a in c for c in cidrs)})
    return [("-d", host_net(a)) + comment + ("-j", chain) for a in addrs]


def localnet_guard(family: int, config: ProxyConfig) -> Tuple[Rule, ...]:
    """With route_localnet on (localhost NodePorts), the kernel would also accept packets for 127/8
    arriving from the network (issues.k8s.io/90259): kubelet's ``KUBE-FIREWALL`` rule drops them, and
    netproxy carries the same rule so that a node without that kubelet rule is not opened.  First
    in filter ``KUBE-SERVICES`` (new connections from INPUT, FORWARD and OUTPUT); a NodePort on
    127.0.0.1 is DNAT-ed before it gets there, so only un-DNAT-ed packets are dropped."""
    if family != 4 or not config.route_localnet_nodeports:
        return ()
    return (("!", "-s", LOOPBACK[4], "-d", LOOPBACK[4], "-m", "comment", "--comment", LOCALNET_COMMENT,
             "-m", "conntrack", "!", "--ctstate", "RELATED,ESTABLISHED,DNAT", "-j", "DROP"),)


def base_chains(config: ProxyConfig, family: int = 4, random_fully: bool = True,
                hairpin: bool = False) -> Chains:
    """Masquerade marking and SNAT (and the multi-CIDR helper), whatever the services."""
    mark = f"{config.masquerade_mark:#x}"
    masquerade: Rule = ("-m", "comment", "--comment", "kubernetes service traffic requiring SNAT",
                        "-j", "MASQUERADE")
    postrouting: List[Rule] = []
    if hairpin:
        # A pod reaching its own service and DNAT-ed to itself: after the DNAT its source is its
        # destination, the endpoint (address and port) — an element of the hairpin set.  Marked here,
        # after the choice, so that only that endpoint's own traffic is SNAT-ed; one set lookup
        # instead of a rule per local endpoint (README.md, "Hairpin").
        postrouting.append(("-m", "conntrack", "--ctstate", "DNAT", "-m", "set", "--match-set",
                            ipset.hairpin_set(family), "src,dst,dst", "-m", "comment", "--comment",
                            "hairpin: endpoints reaching themselves", "-j", names.MARK_MASQ))
    postrouting += [
        ("-m", "mark", "!", "--mark", f"{mark}/{mark}", "-j", "RETURN"),
        ("-j", "MARK", "--xor-mark", mark),
        masquerade + (("--random-fully",) if random_fully else ()),
    ]
    chains: Chains = {
        names.MARK_MASQ: (("-j", "MARK", "--or-mark", mark),),
        names.POSTROUTING: tuple(postrouting),
    }
    cidrs = [c for c in config.local_cidrs if c.version == family]
    if len(cidrs) > 1 and not config.masquerade_all and config.local_interface is None:
        chains[names.MASQ_NONCLUSTER] = tuple(("-s", str(c), "-j", "RETURN") for c in cidrs) + (
            ("-j", names.MARK_MASQ),)
    return chains


T = TypeVar("T")


class Memo:
    """The node-wide parts of the last assembly, reused while their inputs are the same.

    A one-endpoint change re-renders one service port; its dispatch entries, NodePorts and filter
    verdicts are usually what they were, and rebuilding the trees over 10k services cost more than
    the rest of the change (0.16 s of a 0.54 s partial sync at uniform 10k).  Inputs are compared
    per service: by identity (services not rendered again hand over the same tuples), else by value.
    """

    def __init__(self) -> None:
        self._last: Dict[str, Tuple[List[object], object]] = {}
        self._sorted: Dict[str, SortedEntries] = {}

    def get(self, part: str, inputs: List[object], build: Callable[[], T]) -> T:
        last = self._last.get(part)
        if last is not None and len(last[0]) == len(inputs) and \
                all(a is b or a == b for a, b in zip(last[0], inputs)):
            return last[1]  # type: ignore[return-value]
        value = build()
        self._last[part] = (inputs, value)
        return value

    def tree(self, part: str, inputs: List[Tuple[DispatchEntry, ...]], build: Callable[[List[DispatchEntry]], T],
             unique: bool = False) -> T:
        """:meth:`get` for a dispatch tree: ``build`` gets the entries sorted, kept sorted between
        syncs (:class:`SortedEntries`), so that a one-service change does not sort 10k again."""
        entries = self._sorted.get(part)
        if entries is None:
            entries = self._sorted[part] = SortedEntries(unique)
        return self.get(part, inputs, lambda: build(entries.update(inputs)))  # type: ignore[arg-type]


SERVICE_CIDR_COMMENT = "service CIDR: an address no service owns"


def service_cidr_drops(family: int, service_cidrs: Sequence[IPNetwork]) -> Tuple[Rule, ...]:
    """kube-proxy's nftables "drop traffic to unallocated ClusterIPs": after every verdict for the
    addresses services own (their known ports were DNAT-ed in nat; the others refused above), what is
    left inside a service CIDR goes nowhere.  One rule per CIDR (a cluster has one or two), however
    many services there are."""
    # Not to the node's own addresses: filter KUBE-SERVICES runs from INPUT too, and kube-proxy's
    # check sits in forward and output only.
    return tuple(("-d", str(c), "-m", "addrtype", "!", "--dst-type", "LOCAL", "-m", "comment", "--comment",
                  SERVICE_CIDR_COMMENT, "-j", "DROP") for c in service_cidrs if c.version == family)


def assemble(family: int, services: Iterable[ServiceRules], config: ProxyConfig,
             node: NodeInfo = _NO_NODE, random_fully: bool = True, memo: Optional[Memo] = None,
             service_cidrs: Sequence[IPNetwork] = ()) -> FamilyRuleset:
    """One family's desired state from its services' rules (already rendered, possibly cached)."""
    rendered = list(services)
    out = FamilyRuleset(family)
    nat = out.chains("nat")
    filt = out.chains("filter")
    memo = memo if memo is not None else Memo()

    top, sub = memo.tree("dispatch", [s.dispatch for s in rendered], lambda ordered: build_sorted_tree(
        ordered, family, names.dispatch_chain))
    # KUBE-NODEPORTS is walked by every new connection to a node address, not only NodePort traffic:
    # a (protocol, port-range) tree above LEAF_SIZE rules, kube-proxy's flat list below.
    nodeports, np_sub = memo.get("nodeports", [s.nodeports for s in rendered], lambda: build_port_tree(
        (e for s in rendered for e in s.nodeports), names.nodeport_chain))
    nat[names.SERVICES] = top + (tuple(nodeport_jumps(family, config, node, names.NODEPORTS))
                                 if nodeports else ())
    nat[names.NODEPORTS] = nodeports
    out.hairpin = memo.get("hairpin", [s.hairpin for s in rendered],
                           lambda: frozenset(e for s in rendered for e in s.hairpin))
    nat.update(base_chains(config, family, random_fully, hairpin=bool(out.hairpin)))
    nat.update(sub)
    nat.update(np_sub)
    for s in rendered:
        nat.update(s.nat)
    if out.hairpin:
        out.sets[ipset.hairpin_set(family)] = False
    keys: Dict[int, Set[Tuple[int, int, int]]] = {}
    for s in rendered:
        for slot, _ in s.affinity_slots:
            keys.setdefault(slot, set()).update(s.affinity_keys)
    for slot in sorted(keys):
        out.sets[ipset.affinity_set(family, slot)] = True
        out.affinity[slot] = frozenset(keys[slot])

    # dict.fromkeys: the catch-all REJECT of a multi-port service's cluster IP comes once per port.
    ftop, fsub = memo.tree("filter", [s.filter for s in rendered], lambda ordered: build_sorted_tree(
        ordered, family, names.dispatch_chain), unique=True)
    # The same for filter's per-NodePort verdicts: jumped to for every new connection to a node address
    # (INPUT, OUTPUT), so a long list of endpoint-less NodePorts would tax all of the node's traffic.
    external, ext_sub = memo.get("filter-nodeports", [s.filter_nodeports for s in rendered], lambda: build_port_tree(
        (e for s in rendered for e in s.filter_nodeports), names.nodeport_chain))
    out.cluster_ips = memo.get("cluster-ips", [s.cluster_ips for s in rendered],
                               lambda: frozenset(e for s in rendered for e in s.cluster_ips))
    refuse: Tuple[Rule, ...] = ()
    if out.cluster_ips:
        # After every per-address verdict of the tree: a cluster IP's port that no service has (a
        # known port was DNAT-ed in nat, or refused above).  A set, not a rule per cluster IP, so
        # that adding or removing a service leaves the filter table alone.
        out.sets[ipset.cluster_ip_set(family)] = False
        refuse = (("-m", "set", "--match-set", ipset.cluster_ip_set(family), "dst", "-m", "comment", "--comment",
                   "cluster IPs: a port no service has") + reject_target(family),)
    to_nodeports = tuple(nodeport_jumps(family, config, node, names.EXTERNAL_SERVICES)) if external else ()
    filt[names.SERVICES] = localnet_guard(family, config) + ftop + refuse + service_cidr_drops(family, service_cidrs) \
        + to_nodeports
    filt[names.EXTERNAL_SERVICES] = external
    filt.update(fsub)
    filt.update(ext_sub)
    return out
