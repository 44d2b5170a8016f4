"""The backend/writer combinations that the kernel tests, the fault suite and the benchmark run, and
which of them this machine can run.

One :class:`Combo` is one way of running netproxy: its backend, that backend's writer, and the node's
iptables flavour (what ``iptables`` is on that node).  The tests parametrise over
:func:`selected` (``NETPROXY_BACKENDS``, else the tier's choice); the benchmark over :func:`parse` (``--backends``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from netproxy_lab import tier

IPTABLES_TOOLS = ("iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore")


def flavoured(tool: str, flavour: str) -> str:
    """``iptables-save`` with flavour "legacy" → ``iptables-legacy-save``."""
    family, _, verb = tool.partition("-")
    return f"{family}-{flavour}" + (f"-{verb}" if verb else "")


def has_iptables(flavour: str) -> bool:
    """Whether every ``iptables-<flavour>*`` tool of :data:`IPTABLES_TOOLS` is installed."""
    return all(shutil.which(flavoured(tool, flavour)) for tool in IPTABLES_TOOLS)


def iptables_bindir(path: str, flavour: str) -> str:
    """``path``, made a directory whose ``iptables*``/``ip6tables*`` are the ``flavour`` binaries.

    Put first in PATH, it makes what netproxy's version check runs that flavour, without touching
    the system's alternatives.  ValueError when a tool is not installed.
    """
    if os.path.isdir(path):
        return path
    os.makedirs(path)
    for tool in IPTABLES_TOOLS:
        real = shutil.which(flavoured(tool, flavour))
        if real is None:
            shutil.rmtree(path)
            raise ValueError(f"{flavoured(tool, flavour)} is not installed")
        os.symlink(real, os.path.join(path, tool))
    return path


@dataclass(frozen=True)
class Combo:
    """One backend/writer: what ``netproxy --backend B --…-writer W --iptables-flavour F`` runs."""

    name: str
    backend: str
    writer: str
    flavour: str
    """The iptables the node has ("legacy"/"nft"): first in PATH for netproxy, and what tests read back."""

    @property
    def family(self) -> str:
        """Which kube-proxy reference the benchmark compares it with: "iptables" or "nft"."""
        return "nft" if self.backend == "nftables" or self.flavour == "nft" else "iptables"

    @property
    def slug(self) -> str:
        """The name as a file-name part."""
        return self.name.replace("/", "-")

    @property
    def path_flavour(self) -> Optional[str]:
        """The iptables put first in PATH: the combination's, if installed (a pure nftables node has none)."""
        return self.flavour if has_iptables(self.flavour) else None

    @property
    def flags(self) -> List[str]:
        """netproxy's command-line flags for this combination."""
        writer_flag = "--nftables-writer" if self.backend == "nftables" else "--iptables-writer"
        return ["--backend", self.backend, writer_flag, self.writer, "--iptables-flavour", self.flavour]

    def missing(self) -> Optional[str]:
        """Why this combination cannot run here, or None."""
        if self.backend == "iptables":
            if not has_iptables(self.flavour):
                return f"iptables-{self.flavour} (and its -save/-restore, ip6tables-{self.flavour}*) is not installed"
            if self.writer == "libiptc" and importlib.util.find_spec("iptc") is None:
                return "python-iptables (iptc) is not importable"
        else:
            if shutil.which("nft") is None:
                return "nft is not installed"
            if self.writer == "libnftables" and importlib.util.find_spec("nftables") is None:
                return "the nftables Python binding is not importable"
        return None


COMBOS: Dict[str, Combo] = {c.name: c for c in (
    # An nftables node's `iptables` is iptables-nft: the version check must see that.
    Combo("nftables", "nftables", "netlink", "nft"),
    Combo("nftables/libnftables", "nftables", "libnftables", "nft"),
    Combo("iptables-legacy/restore", "iptables", "restore", "legacy"),
    Combo("iptables-legacy/libiptc", "iptables", "libiptc", "legacy"),
    Combo("iptables-nft/restore", "iptables", "restore", "nft"),
)}
ALIASES = {"nft": "nftables", "netlink": "nftables", "libnftables": "nftables/libnftables",
           "legacy": "iptables-legacy/restore", "restore": "iptables-legacy/restore",
           "libiptc": "iptables-legacy/libiptc", "iptables-nft": "iptables-nft/restore"}


def parse(spec: Optional[str]) -> List[Combo]:
    """Comma-separated names or :data:`ALIASES`; empty or "all" means all.  ValueError naming an unknown one."""
    if not spec or spec.strip() in ("", "all"):
        return list(COMBOS.values())
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name = ALIASES.get(part, part)
        if name not in COMBOS:
            raise ValueError(f"unknown backend {part!r}; one of {', '.join(COMBOS)} (or {', '.join(ALIASES)})")
        out.append(COMBOS[name])
    return out


def selected(quick: Sequence[str] = ()) -> List[Combo]:
    """The combinations this run covers for a module whose quick-tier list is ``quick`` (empty: the
    defaults): ``NETPROXY_BACKENDS`` when set, else by ``NETPROXY_TIER`` (:mod:`netproxy_lab.tier`)."""
    return parse(tier.quick_combos(quick))
