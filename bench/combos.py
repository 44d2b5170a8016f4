"""The backend/writer combinations the benchmark measures, and which of them can run here."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class Combo:
    """One backend/writer: what `netproxy --backend B --iptables-writer W --iptables-flavour F` runs."""

    key: str
    backend: str
    writer: str = "restore"
    flavour: str = "legacy"

    @property
    def family(self) -> str:
        """Which kube-proxy reference it is compared with: "iptables" or "nft"."""
        return "nft" if self.backend == "nftables" or self.flavour == "nft" else "iptables"

    @property
    def slug(self) -> str:
        """The key as a file-name part."""
        return self.key.replace("/", "-")

    def cli_args(self) -> List[str]:
        if self.backend == "nftables":
            return ["--backend", self.backend, "--nftables-writer", self.writer, "--iptables-flavour", self.flavour]
        return ["--backend", self.backend, "--iptables-writer", self.writer, "--iptables-flavour", self.flavour]

    def raw_tools(self) -> Sequence[str]:
        """The raw tool(s) that apply this combo's own ``plan()`` payload."""
        if self.backend == "nftables":
            return ("nft",)
        return (f"iptables-{self.flavour}-restore", f"ip6tables-{self.flavour}-restore")


COMBOS = (
    Combo("nftables", "nftables", "netlink", "nft"),
    Combo("nftables/libnftables", "nftables", "libnftables", "nft"),
    Combo("iptables-legacy/restore", "iptables", "restore", "legacy"),
    Combo("iptables-legacy/libiptc", "iptables", "libiptc", "legacy"),
    Combo("iptables-nft/restore", "iptables", "restore", "nft"),
)
BY_KEY = {c.key: c for c in COMBOS}
ALIASES = {"nft": "nftables", "netlink": "nftables", "libnftables": "nftables/libnftables",
           "legacy": "iptables-legacy/restore", "restore": "iptables-legacy/restore",
           "libiptc": "iptables-legacy/libiptc", "iptables-nft": "iptables-nft/restore"}


def parse(spec: Optional[str]) -> List[Combo]:
    """``--backends`` value: comma-separated keys or aliases; empty means all."""
    if not spec or spec == "all":
        return list(COMBOS)
    out = []
    for part in (p.strip() for p in spec.split(",")):
        key = ALIASES.get(part, part)
        if key not in BY_KEY:
            raise ValueError(f"unknown backend {part!r}; one of {', '.join(BY_KEY)} (or {', '.join(ALIASES)})")
        out.append(BY_KEY[key])
    return out


def missing_tools(combo: Combo) -> List[str]:
    return [t for t in combo.raw_tools() if shutil.which(t) is None]
