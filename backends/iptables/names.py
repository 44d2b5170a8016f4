"""Chain names: kube-proxy's hashing, cached.

``KUBE-SVC-<hash>`` is base32(sha256("<ns>/<name>:<port>" + protocol))[:16], as kube-proxy names it, so
that people who grep for a service's chain find it where they expect.  Hashing is cached because
recomputing sha256 for every service on every sync cost 1.1 s at 10k services (docs/performance.md).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from netproxy.core import hashes as hashlib  # hashlib's hashes without OpenSSL (core/hashes.py)
from netproxy.core.model import ServicePortName

MAX_CHAIN_LEN = 28
"""iptables' limit on chain names (XT_EXTENSION_MAXNAMELEN - 1)."""

SERVICES = "KUBE-SERVICES"
POSTROUTING = "KUBE-POSTROUTING"
MARK_MASQ = "KUBE-MARK-MASQ"
SVC_PREFIX = "KUBE-SVC-"
SEP_PREFIX = "KUBE-SEP-"
EXT_PREFIX = "KUBE-EXT-"
SVL_PREFIX = "KUBE-SVL-"
FW_PREFIX = "KUBE-FW-"
DISPATCH_PREFIX = "KUBE-SVCS-"
HAIRPIN_PREFIX = "KUBE-HP-"
NODEPORT_PREFIX = "KUBE-NPS-"
"""(protocol, port-range) tree chains under nat ``KUBE-NODEPORTS`` and filter ``KUBE-EXTERNAL-SERVICES``."""
NODEPORTS = "KUBE-NODEPORTS"
EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
HAIRPIN = "KUBE-HAIRPIN"
"""nat: where earlier netproxy versions marked hairpin traffic (a destination-prefix tree of ``KUBE-HP-``
chains, one ``-s ep -d ep`` rule per endpoint).  Nothing writes it, or ``KUBE-HP-`` chains, now: hairpin
is one rule in ``KUBE-POSTROUTING`` matching the ``NETPROXY-HAIRPIN-<family>`` ipset (``ipset.py``).
Both names stay owned so that ``cleanup`` removes what those versions left."""
MASQ_NONCLUSTER = "KUBE-MASQ-NONCLUSTER"
"""nat: marks for masquerade unless the source is inside one of several cluster CIDRs of a family."""

STAMP_TABLE = "mangle"
STAMP_CHAIN = "KUBE-NP-STAMP"
"""Where netproxy stamps what it wrote into nat and filter (adopt.py): a table it does not otherwise
write (kube-proxy and kubelet keep their canary chains there), in a chain nothing jumps to."""

USERSPACE_CHAINS = ("KUBE-PORTALS-CONTAINER", "KUBE-PORTALS-HOST", "KUBE-NODEPORT-CONTAINER",
                    "KUBE-NODEPORT-HOST")
"""The chains of kube-proxy's old userspace mode; cleanup removes them, as kube-proxy's iptables proxier
did at start."""

OWNED_CHAINS = (SERVICES, POSTROUTING, MARK_MASQ, NODEPORTS, EXTERNAL_SERVICES, HAIRPIN,
                MASQ_NONCLUSTER) + USERSPACE_CHAINS
OWNED_PREFIXES = (SVC_PREFIX, SEP_PREFIX, EXT_PREFIX, DISPATCH_PREFIX, FW_PREFIX, "KUBE-XLB-", SVL_PREFIX,
                  HAIRPIN_PREFIX, NODEPORT_PREFIX)
"""Only chains named here (exactly, or by prefix) are ever flushed or deleted. Not "KUBE-" as a
whole: kubelet owns KUBE-FIREWALL, KUBE-KUBELET-CANARY and friends in the same tables."""


def is_owned(chain: str) -> bool:
    return chain in OWNED_CHAINS or chain.startswith(OWNED_PREFIXES)


_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_B32_PAIRS = tuple(a + b for a in _B32 for b in _B32)
"""Two base32 characters for each 10-bit value (RFC 4648's alphabet, as ``base64.b32encode``)."""


def _hash16(text: str) -> str:
    """kube-proxy's name hash: the first 16 base32 characters of sha256(text).  Base32 turns each
    5 bytes into 8 characters, so those are exactly the encoding of the first 10 bytes: 80 bits, 8
    pairs of characters read from a table (``base64.b32encode`` is pure Python: 6.4 µs a name
    against 1.6 µs, for each of the ~10.7k chains a new process names at 10k services)."""
    n = int.from_bytes(hashlib.sha256(text.encode()).digest()[:10], "big")
    p = _B32_PAIRS
    return p[n >> 70] + p[(n >> 60) & 1023] + p[(n >> 50) & 1023] + p[(n >> 40) & 1023] + \
        p[(n >> 30) & 1023] + p[(n >> 20) & 1023] + p[(n >> 10) & 1023] + p[n & 1023]


_svc_cache: Dict[Tuple[ServicePortName, str, str], str] = {}
"""(service port, protocol, prefix) → its chain.  The backend forgets a service port that left its
ruleset (:func:`forget`), so that the cache holds the ruleset's names, not every name the process ever saw."""
_net_cache: Dict[Tuple[str, str], str] = {}
CACHE_LIMIT = 1 << 19
"""Entries a name cache keeps before it starts over: the last resort for callers that never
:func:`forget` (a second backend in one process, tests), so that no history outgrows this."""
SERVICE_PREFIXES = (SVC_PREFIX, EXT_PREFIX, FW_PREFIX, SVL_PREFIX)
"""The prefixes :func:`service_chain` is asked for."""


def remember(cache: Dict[Any, str], key: Any, value: str) -> str:
    """``cache[key] = value``, emptying the cache first when it is full (bounded, still O(1))."""
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def service_chain(name: ServicePortName, protocol: str, prefix: str = SVC_PREFIX) -> str:
    """``KUBE-SVC-<hash>`` (or another per-service prefix such as ``KUBE-EXT-``) for one service port."""
    key = (name, protocol, prefix)
    chain = _svc_cache.get(key)
    if chain is None:
        chain = remember(_svc_cache, key, prefix + _hash16(str(name) + protocol.lower()))
    return chain


def forget(name: ServicePortName, protocol: str) -> None:
    """Drop a service port's cached chain names: the backend calls this when the port leaves its
    ruleset (or changes protocol).  Without it a storm of renames grew the cache by ~150 bytes a sync
    up to CACHE_LIMIT (~100 MB): bounded by the process's history, not by the ruleset (docs/testing.md)."""
    for prefix in SERVICE_PREFIXES:
        _svc_cache.pop((name, protocol, prefix), None)


def dispatch_chain(network: str, prefix: str = DISPATCH_PREFIX) -> str:
    """``KUBE-SVCS-<hash>`` (or ``KUBE-NPS-<hash>``): a lower-level tree chain for one destination prefix
    (or protocol and port range)."""
    key = (network, prefix)
    chain = _net_cache.get(key)
    if chain is None:
        chain = remember(_net_cache, key, prefix + _hash16(network))
    return chain


def nodeport_chain(ports: str) -> str:
    """``KUBE-NPS-<hash>`` for ``"tcp"`` or ``"tcp/30720:30975"`` (``tree.port_space``)."""
    return dispatch_chain(ports, NODEPORT_PREFIX)
