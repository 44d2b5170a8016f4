"""Version and mode skew, checked before the first write (issue 16 item 7).

- Rules in the tables netproxy's iptables-nft writes that an iptables-nft newer than the node's (or
  ``nft`` itself) wrote: the node's iptables-nft prints "table `nat' is incompatible, use 'nft' tool"
  instead of them, yet its restore still appends beside them, so every read netproxy makes of that
  table is blind.  Refused, in one line: nothing is written.
- Leftovers of the other mode: KUBE-* chains in an iptables (legacy or nft) that netproxy is not
  writing, netproxy's own ``netproxy`` nftables tables when it writes iptables, kube-proxy's
  ``kube-proxy`` nftables tables.  They would still catch service traffic (before or beside the rules
  netproxy writes) and send it to endpoints of the past.  Removed, each announced in one line, as
  kube-proxy removes the other modes' rules when its mode changes.

Probes run the node's own tools (``iptables-<flavour>-save``, ``nft``); both are injectable.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence

from netproxy.backends.base import BackendUnavailable
from netproxy.config import ProxyConfig

log = logging.getLogger(__name__)

INCOMPATIBLE = re.compile(r"[Tt]able `(\w+)' is incompatible, use 'nft' tool")
Run = Callable[[Sequence[str]], Optional[str]]
"""Runs a command; its stdout, or None when the tool is not installed or fails."""


@dataclass(frozen=True)
class Finding:
    line: str
    """What was found and what is done about it, in one line."""
    fix: Optional[Callable[[], None]] = None
    """Removes the leftovers; None means netproxy refuses to write beside them."""


def _run(argv: Sequence[str]) -> Optional[str]:
    path = shutil.which(argv[0]) or shutil.which(argv[0], path="/usr/sbin:/sbin:/usr/local/sbin")
    if path is None:
        return None
    try:
        proc = subprocess.run([path, *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def incompatible(run: Run = _run) -> List[str]:
    """"ip nat", "ip6 filter"... : the tables the node's iptables-nft cannot read."""
    out = []
    for family, tool in (("ip", "iptables-nft-save"), ("ip6", "ip6tables-nft-save")):
        text = run([tool]) or ""
        # Only the tables netproxy writes: a newer tool's rules in mangle or raw are not in its way.
        out += [f"{family} {m.group(1)}" for m in INCOMPATIBLE.finditer(text) if m.group(1) in ("nat", "filter")]
    return out


def _kube_chains(run: Run, flavour: str) -> List[str]:
    chains = []
    for tool in (f"iptables-{flavour}-save", f"ip6tables-{flavour}-save"):
        text = run([tool, "-t", "nat"]) or ""
        chains += re.findall(r"^:(KUBE-[A-Z0-9-]+) ", text, re.M)
    return chains


def _nft_tables(run: Run) -> List[str]:
    text = run(["nft", "list", "tables"]) or ""
    return re.findall(r"^table (ip6? \S+)$", text, re.M)


def findings(backend: str, config: ProxyConfig, run: Run = _run) -> List[Finding]:
    """What skew there is on this node for ``backend`` (``"iptables"`` or ``"nftables"``)."""
    found: List[Finding] = []
    if backend == "iptables" and config.iptables_flavour == "nft":
        bad = incompatible(run)
        if bad:
            found.append(Finding(
                f"iptables-nft cannot read table(s) {', '.join(bad)}: their rules were written by a newer "
                "iptables-nft or by nft ('incompatible, use the nft tool'); netproxy will not write beside rules "
                "it cannot see: use --backend nftables, or remove those rules with nft"))
    others = ["legacy", "nft"] if backend == "nftables" else [
        f for f in ("legacy", "nft") if f != config.iptables_flavour]
    for flavour in others:
        chains = _kube_chains(run, flavour)
        if "KUBE-SERVICES" in chains:
            cfg = replace(config, backend="iptables", iptables_flavour=flavour, iptables_writer="restore")
            found.append(Finding(
                f"leftovers: iptables-{flavour} holds {len(chains)} KUBE-* nat chains (kube-proxy's iptables mode, "
                f"or netproxy's iptables backend) that would still route service traffic: removing them",
                _cleanup("iptables", cfg)))
    tables = _nft_tables(run)
    if backend == "iptables":
        ours = [t for t in tables if t.endswith(" netproxy")]
        if ours:
            found.append(Finding(f"leftovers: nftables table(s) {', '.join(ours)} of netproxy's nftables backend "
                                 "would still route service traffic: removing them",
                                 _cleanup("nftables", replace(config, backend="nftables"))))
    theirs = [t for t in tables if t.endswith(" kube-proxy")]
    if theirs:
        def drop() -> None:
            for table in theirs:
                run(["nft", "delete", "table", *table.split()])
        found.append(Finding(f"leftovers: nftables table(s) {', '.join(theirs)} of kube-proxy's nftables mode "
                             "would still route service traffic: removing them", drop))
    return found


def _cleanup(backend: str, config: ProxyConfig) -> Callable[[], None]:
    """``netproxy cleanup`` of one backend (it removes what that backend and kube-proxy's same mode own)."""
    def run() -> None:
        from netproxy.backends import create

        create(backend, config).cleanup()
    return run


def settle(backend: str, config: ProxyConfig, run: Run = _run) -> None:
    """Report each finding in one line; remove leftovers; raise BackendUnavailable for a refusal."""
    if backend not in ("iptables", "nftables"):
        return
    for finding in findings(backend, config, run):
        if finding.fix is None:
            raise BackendUnavailable(finding.line)
        log.warning("%s", finding.line)
        finding.fix()
