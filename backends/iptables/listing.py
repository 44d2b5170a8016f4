"""The iptables backend's rules as ``iptables-save`` lists them (``netproxy plan --diff``).

Only what netproxy owns is kept: the declarations and rules of ``KUBE-`` chains, and rules of the
built-in chains that jump to one.  Counters are dropped (traffic moves them).  Not the stamp chain
(``KUBE-NP-STAMP`` in mangle, adopt.py): it says what the rules were built from, it is not a rule
anything reaches, and no plan holds it.
"""

from __future__ import annotations

import re
import shlex
import sys
from typing import Dict, Iterable, List, Set, Tuple

from netproxy.backends.base import Outcome, Packet
from netproxy.backends.iptables import ipset, names
from netproxy.backends.iptables.ipset import KernelIpsets
from netproxy.backends.iptables.kernel.restore import tool
from netproxy.backends.iptables.render import FamilyRuleset
from netproxy.backends.listing import run
from netproxy.core.config import ProxyConfig

PREFIX = "KUBE-"
_FAMILY = re.compile(r"^# IPv([46]) ")
_JUMP = re.compile(r"\s-[jg]\s+" + PREFIX)
_SETS = re.compile(ipset.PREFIX + r"[A-Z-]+?-[46](?:-\d+)?\b")


def _ours(save: str, family: int) -> List[str]:
    """Our lines, declarations first (sorted: chain order is creation order), then each chain's rules
    in order (chains sorted by name, for the same reason)."""
    decls: List[str] = []
    rules: List[Tuple[str, str]] = []
    table = ""
    for line in save.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":" + PREFIX):
            if line[1:].split()[0] != names.STAMP_CHAIN:
                decls.append(f"ipv{family} {table} :{line[1:].split()[0]}")
        elif line.startswith("-A "):
            chain = line.split(None, 2)[1]
            if chain != names.STAMP_CHAIN and (chain.startswith(PREFIX) or _JUMP.search(line)):
                rules.append((f"{table} {chain}", f"ipv{family} {table} {line}"))
    return sorted(decls) + [line for _, line in sorted(rules, key=lambda item: item[0])]


def split_plan(plan: str) -> Dict[int, str]:
    """The plan text per family (it holds one restore payload per family, each under a header)."""
    parts: Dict[int, List[str]] = {}
    family = 4
    for line in plan.splitlines():
        m = _FAMILY.match(line)
        if m:
            family = int(m.group(1))
        parts.setdefault(family, []).append(line)
    return {f: "\n".join(lines) + "\n" for f, lines in parts.items()}


class IptablesListing:
    def __init__(self, config: ProxyConfig) -> None:
        self.flavour = config.iptables_flavour

    def kernel(self) -> List[str]:
        out: List[str] = []
        for family in (4, 6):
            out += _ours(run([tool(family, self.flavour, "save")]), family)
        return out

    def programmed(self) -> List[Tuple[str, str, Tuple[str, ...]]]:
        return programmed(self.kernel())

    def trace(self, packet: Packet) -> List[Outcome]:
        from netproxy.backends.iptables.trace import Tracer

        family = 6 if packet.family == "ip6" else 4
        ruleset = kernel_ruleset(self.kernel(), family)
        sets = KernelIpsets()
        present = sets.sets()
        # Who hairpins, and which addresses are cluster IPs, is the sets' content, not a rule's.
        if ipset.hairpin_set(family) in present:
            ruleset.hairpin = frozenset(sets.elements(ipset.hairpin_set(family)))
        if ipset.cluster_ip_set(family) in present:
            ruleset.cluster_ips = frozenset(sets.elements(ipset.cluster_ip_set(family)))
        outcomes: List[Outcome] = Tracer(ruleset, packet.local).outcomes(packet)
        return outcomes

    def rendered(self, plan: str) -> List[str]:
        out: List[str] = []
        for family, payload in sorted(split_plan(plan).items()):
            restore, save = (shlex.quote(tool(family, self.flavour, v)) for v in ("restore", "save"))
            # The scratch namespace has none of the sets the rules name: make them (empty) first.
            names = sorted(set(_SETS.findall(payload)))
            make = " ".join([shlex.quote(sys.executable), "-m", "netproxy.backends.iptables.ipset", "create",
                             *names]) + " && " if names else ""
            out += _ours(run([f"{make}{restore} --noflush; {save}"], stdin=payload, scratch=True), family)
        return out


def _opt(args: List[str], flag: str) -> str:
    return args[args.index(flag) + 1] if flag in args else ""


def programmed(lines: Iterable[str]) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """(service, "address:port/proto", endpoints or ("reject",)) for every service port the tables
    dispatch, read from :meth:`IptablesListing.kernel`'s lines (``netproxy status --kernel``): the
    KUBE-SERVICES / KUBE-NODEPORTS jumps, followed to the DNAT targets they can reach."""
    rules: Dict[Tuple[str, str, str], List[List[str]]] = {}
    for line in lines:
        family, table, rest = line.split(" ", 2)
        if rest.startswith("-A "):
            args = shlex.split(rest)
            rules.setdefault((family, table, args[1]), []).append(args)

    def targets(family: str, chain: str, depth: int = 0) -> Set[str]:
        found: Set[str] = set()
        for args in rules.get((family, "nat", chain), []) if depth < 8 else []:
            jump = _opt(args, "-j")
            if jump == "DNAT":
                found.add(_opt(args, "--to-destination"))
            elif jump.startswith(PREFIX) and jump != "KUBE-MARK-MASQ":
                found |= targets(family, jump, depth + 1)
        return found

    out: List[Tuple[str, str, Tuple[str, ...]]] = []
    for (family, table, chain), chain_rules in sorted(rules.items()):
        if chain not in ("KUBE-SERVICES", "KUBE-NODEPORTS"):
            continue
        for args in chain_rules:
            svc, port, proto, jump = _opt(args, "--comment"), _opt(args, "--dport"), _opt(args, "-p"), _opt(args, "-j")
            if "/" not in svc or not port:
                continue  # the NodePort jump, or a rule that is not one service's
            addr = _opt(args, "-d").split("/")[0] or "*"
            front = f"[{addr}]:{port}/{proto}" if ":" in addr else f"{addr}:{port}/{proto}"
            if table == "filter":
                if jump == "REJECT":
                    out.append((svc, front, ("reject",)))
                continue
            out.append((svc, front, tuple(sorted(targets(family, jump)))))
    return sorted(out)


def kernel_ruleset(lines: Iterable[str], family: int) -> FamilyRuleset:
    """The node's netproxy chains of one family as a :class:`FamilyRuleset` (argument lists as
    ``iptables-save`` spells them), for tracing what the kernel holds (``netproxy trace --kernel``)."""
    ruleset = FamilyRuleset(family)
    collected: Dict[Tuple[str, str], List[Tuple[str, ...]]] = {}
    for line in lines:
        fam, table, rest = line.split(" ", 2)
        if fam != f"ipv{family}":
            continue
        if rest.startswith(":"):
            collected.setdefault((table, rest[1:]), [])
        elif rest.startswith("-A "):
            args = shlex.split(rest)
            collected.setdefault((table, args[1]), []).append(tuple(args[2:]))
    for (table, chain), rules in collected.items():
        ruleset.chains(table)[chain] = tuple(rules)
    return ruleset
