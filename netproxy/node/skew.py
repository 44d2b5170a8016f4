"""Version skew, checked before the first write.

Rules in the tables netproxy's iptables-nft writes that an iptables-nft newer than the node's (or
``nft`` itself) wrote: the node's iptables-nft prints "table `nat' is incompatible, use 'nft' tool"
instead of them, yet its restore still appends beside them, so every read netproxy makes of that
table is blind.  Refused, in one line: nothing is written.

Leftovers of the other mode (netproxy's own rules of the other backend, kube-proxy's of any mode) are
not this module's: they are removed *after* the first full write, in ``netproxy migrate``'s order
(:func:`netproxy.migration.migrate.remove_leftovers`), so that no connection meets neither ruleset.

Probes run the node's own tools (``iptables-<flavour>-save``, ``nft``); both are injectable.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from netproxy.backends.base import BackendUnavailable
from netproxy.core.config import ProxyConfig

log = logging.getLogger(__name__)

INCOMPATIBLE = re.compile(r"[Tt]able `(\w+)' is incompatible, use 'nft' tool")
Run = Callable[[Sequence[str]], Optional[str]]
"""Runs a command; its stdout, or None when the tool is not installed or fails."""


@dataclass(frozen=True)
class Finding:
    line: str
    """What was found and what is done about it, in one line."""
    fix: Optional[Callable[[], None]] = None
    """What netproxy does about it; None: it refuses to write."""


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
    return found


def settle(backend: str, config: ProxyConfig, run: Run = _run) -> None:
    """Report each finding in one line; raise BackendUnavailable for a refusal."""
    if backend not in ("iptables", "nftables"):
        return
    for finding in findings(backend, config, run):
        if finding.fix is None:
            raise BackendUnavailable(finding.line)
        log.warning("%s", finding.line)
        finding.fix()
