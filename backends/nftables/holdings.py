"""What of netproxy's and kube-proxy's nf_tables tables this node holds, and removing kube-proxy's:
the nftables side of ``netproxy detect`` and ``netproxy migrate`` (reached through
:mod:`netproxy.backends`).  Table names and families from the kernel over netlink; the masquerade
marks from ``nft --terse`` (rules without set elements: seconds less at 10k services)."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import FrozenSet, List, Sequence, Set

from netproxy.backends.base import Held

KUBE_PROXY_TABLE = "kube-proxy"
NETPROXY_TABLE = "netproxy"
_NFT_MARK = re.compile(r"meta mark set meta mark \| (0x[0-9a-f]+)")


def families_with_table(table: str) -> FrozenSet[str]:
    """The families (``ip``, ``ip6``) with a table of this name; BackendError when nf_tables is unreadable."""
    from netproxy.backends.nftables.kernel.netlink import NetlinkRunner

    fams: FrozenSet[str] = NetlinkRunner().existing_tables(table)
    return fams


def marks(table: str, families: Sequence[str]) -> FrozenSet[str]:
    """The marks a table's rules OR into the packet mark (empty without nft)."""
    nft = shutil.which("nft")
    if nft is None:
        return frozenset()
    found: Set[str] = set()
    for fam in families:
        proc = subprocess.run([nft, "--terse", "list", "table", fam, table], capture_output=True, text=True,
                              timeout=120, check=False)
        found.update(hex(int(m, 16)) for m in _NFT_MARK.findall(proc.stdout))
    return frozenset(found)


def held(with_marks: bool = True) -> List[Held]:
    """netproxy's and kube-proxy's tables, each with its families (and marks when asked);
    BackendError or OSError when nf_tables cannot be read."""
    out: List[Held] = []
    for owner, table in (("netproxy", NETPROXY_TABLE), ("kube-proxy", KUBE_PROXY_TABLE)):
        fams = families_with_table(table)
        if fams:
            families = tuple(4 if f == "ip" else 6 for f in sorted(fams))
            out.append(Held(owner, families, marks(table, sorted(fams)) if with_marks else frozenset()))
    return out


def remove_kube_proxy() -> List[str]:
    """Delete kube-proxy's nftables tables (both families); the families deleted."""
    from netproxy.backends.nftables.kernel.netlink import NetlinkRunner

    gone: List[str] = NetlinkRunner().delete_tables(KUBE_PROXY_TABLE)
    return gone
