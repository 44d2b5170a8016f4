"""Stamps: what netproxy's tables were built from, written into the tables themselves, so that a new
process can adopt them instead of rewriting them (README.md, "Restart by adoption").

Two kinds:

- the **table stamp**, one element of the ``stamp`` set in each of netproxy's tables, replaced by
  every transaction netproxy commits: ``netproxy <layout> config:<digest> gen:<generation>``.  The
  config digest covers netproxy's version, this layout's version, the settings that shape the table
  and the node; the generation is the one the transaction was expected to get (the one before it,
  plus one).  A new process adopts only when both still hold: nothing else committed since.
- the **service stamp**: one element per service port and family in the plain set
  ``service-stamps``, keyed by a 128-bit hash of the port's name, commented ``<namespace/name:port>
  d:<digest>``: the digest of what that service port renders beyond its own elements (endpoint
  runs, chains, sets, shared elements).  Its own elements (dispatch, refusals, exemptions,
  firewall, affinity dispatch) carry ``<namespace/name:port>`` alone, so a new process groups them by
  service and compares them one by one, reading the small per-service maps only.

  Not in the dispatch elements' comments (the first layout): an endpoint change then replaced the
  service's ``service-ips`` element for its new digest, and adding a verdict-map element with a
  ``goto`` makes the kernel validate every chain the table can reach at commit — 40 ms per commit at
  100k services against 0.09 ms for the endpoint element itself (by hand, the netlink writer in a
  namespace, 2026-12-06, load ~6).  A plain set's element costs what the endpoint's does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
import socket
from typing import Dict, Iterable, List, Optional, Tuple

from netproxy.backends.nftables import names, render
from netproxy.backends.nftables.objects import Element
from netproxy.core.config import ProxyConfig
from netproxy.core.model import NodeInfo, ServicePortName

LAYOUT_VERSION = 2
"""Bumped whenever what an object's name, key or comment means changes without the rendered text
showing it: a table stamped with another layout is never adopted."""

STAMP_SET = names.STAMP
SERVICE_STAMPS = names.SERVICE_STAMPS
STAMP_KEY = "1"
_DIGEST_CHARS = 16
_SUFFIX = " d:"
_SERVICE_COMMENT = re.compile(r"^(?P<service>.+?)(?: d:(?P<digest>[0-9a-f]{16}))?$")
_TABLE_STAMP = re.compile(r"^netproxy (?P<layout>\d+) config:(?P<config>[0-9a-f]{16}) gen:(?P<gen>\d+)$")

RUN_ONLY = frozenset({"sync_period", "min_sync_period", "metrics_bind_address", "healthz_bind_address",
                      "one_shot", "iptables_lock_timeout", "nftables_writer", "iptables_writer", "backend"})
"""ProxyConfig fields that do not shape the tables (every other field does, new ones included: a
field added later changes the digest until someone decides it belongs here).  The writer is one of
them: both write the same objects, so a process may adopt what the other writer wrote."""


def _digest(parts: Iterable[str]) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_CHARS // 2)
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def config_digest(config: ProxyConfig, node: NodeInfo, version: str) -> str:
    """What every object of the tables depends on besides the services: netproxy's version, the
    layout, the settings that shape the tables and the node."""
    parts = [f"version={version}", f"layout={LAYOUT_VERSION}", f"node={node!r}"]
    for f in dataclasses.fields(config):
        if f.name not in RUN_ONLY:
            parts.append(f"{f.name}={getattr(config, f.name)!r}")
    return _digest(parts)


def table_stamp(config: str, generation: int) -> Element:
    return Element(STAMP_SET, STAMP_KEY, comment=f"netproxy {LAYOUT_VERSION} config:{config} gen:{generation}")


@dataclasses.dataclass(frozen=True)
class TableStamp:
    layout: int
    config: str
    generation: int


def parse_table_stamp(comment: Optional[str]) -> Optional[TableStamp]:
    m = _TABLE_STAMP.match(comment or "")
    if m is None:
        return None
    return TableStamp(int(m.group("layout")), m.group("config"), int(m.group("gen")))


def service_base(name: ServicePortName) -> str:
    """The service part of a service stamp: ``names.service_comment``, shortened (with a hash, so it
    stays unique) to leave room for the digest within nft's comment limit."""
    base = names.service_comment(name)
    room = names.MAX_COMMENT - len(_SUFFIX) - _DIGEST_CHARS
    if len(base) > room:
        base = f"{base[:room - 9]}-{hashlib.sha256(str(name).encode()).hexdigest()[:8]}"
    return base


def parse_service_comment(comment: Optional[str]) -> Optional[Tuple[str, Optional[str]]]:
    """(service part, digest) of an own element's comment (no digest) or of a service stamp's; None
    when there is no comment."""
    m = _SERVICE_COMMENT.match(comment or "")
    return None if m is None else (m.group("service"), m.group("digest"))


def stamp_key(name: ServicePortName) -> str:
    """The key of ``name``'s element in ``service-stamps``: a 128-bit hash of the port's name as an
    IPv6 address (the set's type), unique whatever addresses services share."""
    digest = hashlib.blake2b(str(name).encode(), digest_size=16).digest()
    if digest[:10] == _TEN_ZEROS:  # ::/96 and ::ffff:0:0/96, which inet_ntop writes dotted
        return str(ipaddress.IPv6Address(digest))
    # ipaddress' text for every other address, in C: its Python formatting was 4 µs of the 5 µs a
    # stamp key costs, for every service port of every full sync (the unit test holds them equal).
    return socket.inet_ntop(socket.AF_INET6, digest)


_TEN_ZEROS = bytes(10)


def service_digest(objs: render.ServiceObjects) -> str:
    """The digest of what one service port renders in one family beyond its own elements (which a new
    process compares one by one, verdicts included, so the shared chains they jump to too): its
    endpoint runs, chains, sets and shared elements.  Refs sorted: they come out of sets (hairpin
    pairs), whose order changes from process to process.  ~5 µs a service port: it runs for every
    one in every full sync."""
    parts: List[str] = []
    for (role, _), run in objs.runs.items():
        parts.append(f"r {role} {run.set} {run.prefix}")
        parts.extend(run.values)
    for cname, rules in objs.chains.items():
        parts.append(f"c {cname}")
        parts.extend(f"{r.body} # {r.comment}" for r in rules)
    parts.extend(f"s {s!r}" for s in objs.sets.values())
    parts.append("f")
    parts.extend(sorted(f"{r.set} {r.key}" for r in objs.refs))
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=_DIGEST_CHARS // 2).hexdigest()


def stamped(objs: render.ServiceObjects, name: ServicePortName) -> render.ServiceObjects:
    """``objs`` with its own elements commented with its service part and its service stamp added."""
    if not objs.elements:
        return objs
    base = service_base(name)
    # Element(...) rather than _replace(): a third of the cost, for every element of every full sync.
    elements: Dict[Tuple[str, str], Element] = {k: Element(e.set, e.key, e.value, base)
                                                for k, e in objs.elements.items()}
    key = stamp_key(name)
    elements[(SERVICE_STAMPS, key)] = Element(SERVICE_STAMPS, key, None, f"{base}{_SUFFIX}{service_digest(objs)}")
    # Not dataclasses.replace, which walks the fields in Python (a tenth of this function).
    return render.ServiceObjects(elements=elements, runs=objs.runs, chains=objs.chains, sets=objs.sets,
                                 shared=objs.shared, uses=objs.uses, dispatch_keys=objs.dispatch_keys, refs=objs.refs)
