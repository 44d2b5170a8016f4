"""The start-up choice of backend: kube-proxy's iptables version check, extended for nf_tables nodes.

- ``iptables --version`` says ``(nf_tables)``      → nftables backend (the node's iptables is nft-based)
- a legacy iptables at or above 1.4.0              → iptables backend, legacy flavour
- no iptables binary, but libnftables is loadable  → nftables backend
- an older or unparsable iptables, or nothing      → a clear error

And one node fact for the nftables backend: where IPv6 ClientIP affinity lives
(:func:`ipv6_affinity_layout`, from ``nft --version``).

Versions are compared with :mod:`packaging.version`, not by hand.  The probes (running a binary,
finding a library) are injectable so unit tests feed real version strings without the binaries.
"""

from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from packaging.version import InvalidVersion, Version

MIN_IPTABLES = Version("1.4.0")
_VERSION_LINE = re.compile(r"^iptables v(?P<version>\d+(?:\.\d+)*)(?:\s+\((?P<mode>[a-z_]+)\))?\s*$")
MIN_NFT_IPV6_AFFINITY_MAPS = Version("1.1")
"""The first nft that lists IPv6 ClientIP affinity map elements in a form it loads again (1.0.x
aborts on ``update @map { ip6 ... : ip6 daddr . ... }``; tried on 1.0.6 and 1.1.3: docs/parity.md)."""
_NFT_VERSION_LINE = re.compile(r"^nftables v(?P<version>\d+(?:\.\d+)*)(?:\s.*)?$")


class DetectError(Exception):
    """No backend can run on this node; the message says what was found."""


@dataclass(frozen=True)
class Decision:
    backend: str                 # "iptables" or "nftables"
    flavour: Optional[str]       # for iptables: "legacy" or "nft"; None when no iptables is involved
    reason: str                  # one sentence, printed by `netproxy detect`
    evidence: Tuple[str, ...]    # what was probed and what it said


def run_iptables_version(binary: str = "iptables") -> Optional[str]:
    """The first line of ``iptables --version``, or None when there is no such binary."""
    path = shutil.which(binary)
    if path is None:
        return None
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return None
    out = (proc.stdout or proc.stderr).strip()
    return out.splitlines()[0] if out else ""


def tool_versions(backend: str, flavour: str, probe: Callable[[str], Optional[str]] = run_iptables_version) -> str:
    """The versions a start-up line names: the kernel, and the tools the chosen backend drives
    (``iptables-legacy``/``iptables-nft`` for the iptables backend, ``nft`` for nftables; the
    netlink writer needs no tool, but ``nft`` is what lists its rules).  A missing tool says so."""
    seen = [f"kernel {os.uname().release}"]
    if backend == "iptables":
        binary = f"iptables-{flavour}" if flavour in ("legacy", "nft") else "iptables"
        tools = [binary, binary.replace("iptables", "ip6tables", 1)]
    elif backend == "nftables":
        tools = ["nft"]
    else:
        tools = []
    for tool in tools:
        line = probe(tool)
        seen.append(f"{tool}: {line or 'not found'}")
    return ", ".join(seen)


def run_nft_version() -> Optional[str]:
    """The first line of ``nft --version`` (``nftables v1.0.6 (Lester Gooch #5)``), or None."""
    return run_iptables_version("nft")


@dataclass(frozen=True)
class AffinityLayout:
    """Where the nftables backend keeps IPv6 ClientIP affinity on this node (ProxyConfig.ipv6_affinity)."""

    layout: str                  # "maps" or "sets"
    reason: str                  # one sentence, printed by `netproxy detect` and logged at start


def ipv6_affinity_layout(probe: Callable[[], Optional[str]] = run_nft_version) -> AffinityLayout:
    """The IPv6 affinity layout this node's own nft can list and load back: the shared maps' elements
    from nft 1.1 on, one set per endpoint before it, and also when nft is missing or unreadable
    (the layout every nft reads back)."""
    line = probe()
    if line is None:
        return AffinityLayout("sets", "no nft binary: one set per endpoint, the layout every nft lists back")
    m = _NFT_VERSION_LINE.match(line.strip())
    try:
        version = Version(m.group("version")) if m else None
    except InvalidVersion:
        version = None
    if version is None:
        return AffinityLayout("sets", f"unrecognised nft --version output {line!r}: one set per endpoint")
    if version >= MIN_NFT_IPV6_AFFINITY_MAPS:
        return AffinityLayout("maps", f"nft {version} >= {MIN_NFT_IPV6_AFFINITY_MAPS} lists and loads "
                              "IPv6 affinity map elements: the shared maps, as IPv4")
    return AffinityLayout("sets", f"nft {version} < {MIN_NFT_IPV6_AFFINITY_MAPS} cannot list the IPv6 "
                          "affinity maps back: one set per endpoint")


def libnftables_present() -> bool:
    return ctypes.util.find_library("nftables") is not None


def parse_iptables_version(line: str) -> Tuple[Version, Optional[str]]:
    """``"iptables v1.8.9 (nf_tables)"`` → (Version("1.8.9"), "nf_tables"); ValueError if unparsable."""
    m = _VERSION_LINE.match(line.strip())
    if not m:
        raise ValueError(f"unrecognised iptables version output {line!r}")
    try:
        return Version(m.group("version")), m.group("mode")
    except InvalidVersion:
        raise ValueError(f"unrecognised iptables version {m.group('version')!r}") from None


def detect(version_probe: Callable[[], Optional[str]] = run_iptables_version,
           libnft_probe: Callable[[], bool] = libnftables_present) -> Decision:
    """The backend for this node, or :class:`DetectError` saying why there is none."""
    line = version_probe()
    has_lib = libnft_probe()
    evidence = (f"iptables --version: {line!r}" if line is not None else "iptables: not found",
                f"libnftables: {'found' if has_lib else 'not found'}")
    if line is None:
        if has_lib:
            return Decision("nftables", None, "no iptables binary; libnftables is present", evidence)
        raise DetectError("no backend available: no iptables binary and no libnftables")
    try:
        version, mode = parse_iptables_version(line)
    except ValueError as err:
        raise DetectError(f"cannot use this node's iptables: {err}") from None
    if mode == "nf_tables":
        if not has_lib:
            return Decision("iptables", "nft", f"iptables {version} is nf_tables-based but libnftables is "
                            "missing: falling back to the iptables backend through iptables-nft", evidence)
        return Decision("nftables", None, f"iptables {version} is nf_tables-based: the node uses nftables",
                        evidence)
    if version < MIN_IPTABLES:
        raise DetectError(f"iptables {version} is older than the minimum {MIN_IPTABLES}")
    return Decision("iptables", "legacy", f"legacy iptables {version} >= {MIN_IPTABLES}", evidence)


def iptables_flavour(version_probe: Callable[[], Optional[str]] = run_iptables_version) -> str:
    """Which iptables the node's ``iptables`` is ("legacy" or "nft"), for a forced iptables backend."""
    line = version_probe()
    if line:
        try:
            _, mode = parse_iptables_version(line)
        except ValueError:
            return "legacy"
        if mode == "nf_tables":
            return "nft"
    return "legacy"
