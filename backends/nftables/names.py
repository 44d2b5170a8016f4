"""Object names and comments in netproxy's nftables tables: readable, stable, and always safe to print.

An operator reading ``nft list table ip netproxy`` should see which service an object belongs to, so
per-service names carry ``<namespace>/<name>/<port>`` rather than a hash.  nftables allows 255
characters in a chain or set name, enough for three DNS-1123 labels plus an endpoint.  Validation in
:mod:`netproxy.core.model` already forbids odd characters; these helpers still sanitise, so that no input
can end a name or a quoted comment early.
"""

from __future__ import annotations

import re

from netproxy.core import hashes as hashlib  # hashlib's hashes without OpenSSL (core/hashes.py)
from netproxy.core.model import ServicePortName

TABLE = "netproxy"
MAX_NAME = 255
MAX_COMMENT = 128

# Base and shared objects.  Other programs may rely on these names (README.md).
NAT_PREROUTING = "nat-prerouting"
NAT_OUTPUT = "nat-output"
NAT_POSTROUTING = "nat-postrouting"
FILTER_INPUT = "filter-input"
FILTER_FORWARD = "filter-forward"
FILTER_OUTPUT = "filter-output"
SERVICES = "services"
REJECT = "reject-packet"
SERVICE_IPS = "service-ips"
NO_ENDPOINTS = "no-endpoint-services"
SERVICE_NODEPORTS = "service-nodeports"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
EXEMPT_IPS = "exempt-ips"
EXEMPT_NODEPORTS = "exempt-nodeports"
CLUSTER_IPS = "cluster-ips"
NODEPORT_IPS = "nodeport-ips"
FIREWALL_IPS = "firewall-ips"
FIREWALL_ALLOW = "firewall-allow"
HAIRPIN = "hairpin"
CLUSTER_CIDRS = "cluster-cidrs"
SERVICE_CIDRS = "service-cidrs"
AFFINITY_SERVICES = "affinity-services"
AFFINITY_NODEPORTS = "affinity-nodeports"
STAMP = "stamp"
SERVICE_STAMPS = "service-stamps"
SERVICE_STAMP_SETS = tuple(f"{SERVICE_STAMPS}-{i:x}" for i in range(16))
"""The service stamps, split by the first hex digit of their keys (stamp.py: the kernel's dump of one
set restarts its walk at each ~32 KiB answer, so reading one set of 100k costs its square)."""

# What an unquoted nft identifier may contain (nft's scanner: a letter first, then letters, digits,
# '/', '-', '_' and '.').
_IDENT_BAD = re.compile(r"[^A-Za-z0-9/_.\-]")
_COMMENT_BAD = re.compile(r"[^A-Za-z0-9 /_.:\-]")


def identifier(text: str) -> str:
    """``text`` as an nft identifier: bad characters become '_', too long names end in a hash."""
    safe = _IDENT_BAD.sub("_", text)
    if not safe or not safe[0].isalpha():
        safe = "x" + safe
    if len(safe) > MAX_NAME:
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        safe = f"{safe[:MAX_NAME - 13]}-{digest}"
    return safe


def comment(text: str) -> str:
    """``text`` safe inside nft double quotes (no quote, backslash or newline) and within 128 bytes."""
    safe = _COMMENT_BAD.sub("_", text)
    if len(safe) > MAX_COMMENT:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        safe = f"{safe[:MAX_COMMENT - 9]}-{digest}"
    return safe


def service_id(name: ServicePortName) -> str:
    """``namespace/name/port`` (``namespace/name`` for an unnamed port): unique per service port."""
    base = f"{name.namespace}/{name.name}"
    return f"{base}/{name.port}" if name.port else base


def service_comment(name: ServicePortName) -> str:
    return comment(str(name))


AFFINITY_PREFIX = {"cluster": "svc", "external": "ext", "local": "ext", "exempt": "all"}


def affinity_chain(name: ServicePortName, kind: str) -> str:
    """The chain that applies ClientIP affinity for one service port's traffic of ``kind``
    (``svc-``: cluster, ``ext-``: external, ``all-``: externalTrafficPolicy Local's exceptions)."""
    return identifier(f"{AFFINITY_PREFIX[kind]}-{service_id(name)}")


def affinity_set(name: ServicePortName, address: str, port: int) -> str:
    """The dynamic set of clients that a service port's affinity sends to one endpoint."""
    return identifier(f"aff-{service_id(name)}-{address}-{port}")


def _pick_infix(nodeport: bool, sticky: bool) -> str:
    return ("-nodeport" if nodeport else "") + ("-sticky" if sticky else "")


def pick_chain(kind: str, proto: str, count: int, nodeport: bool = False, sticky: bool = False) -> str:
    """The shared chain that picks one of ``count`` endpoints for ``proto`` traffic of ``kind``
    (``sticky``: a client remembered by ClientIP affinity keeps its endpoint)."""
    return f"{kind}-{proto}{_pick_infix(nodeport, sticky)}-pick-{count}"


def endpoints_map(kind: str, proto: str, count: int, nodeport: bool = False, sticky: bool = False) -> str:
    """The map that ``pick_chain(kind, proto, count, nodeport, sticky)`` looks endpoints up in."""
    return f"{kind}-{proto}{_pick_infix(nodeport, sticky)}-endpoints-{count}"


def affinity_map(proto: str) -> str:
    """The dynamic map ``client . service address . port : endpoint . port`` of ``proto``'s ClientIP affinity."""
    return f"affinity-{proto}"
