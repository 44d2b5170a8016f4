"""Stamps: what netproxy's tables were built from, written into the tables themselves, so that a new
process can adopt them instead of rewriting them (README.md, "Restart by adoption").

Two kinds:

- the **table stamp**, one element of the ``stamp`` set in each of netproxy's tables, replaced by
  every transaction netproxy commits: ``netproxy <layout> config:<digest> gen:<generation>``.  The
  config digest covers netproxy's version, this layout's version, the settings that shape the table
  and the node; the generation is the one the transaction was expected to get (the one before it,
  plus one).  A new process adopts only when both still hold: nothing else committed since.
- the **service stamp**: one element per service port and family in one of the sixteen plain sets
  ``service-stamps-0`` .. ``-f`` (by its key's first hex digit), keyed by a 128-bit hash of the
  port's name, commented ``<namespace/name:port> d:<digest> n:<count>``: the digest of what that
  service port is rendered *from* in that family (:func:`input_digest`: its ServicePort, its
  endpoints, the dispatch keys another service port owns), and how many own elements it has.
  Everything else a render depends on (the node, the settings, netproxy's version and the
  rendering code itself) is in the table stamp's config digest, so an equal service stamp means an
  equal render: a new process compares stamps *before* rendering and renders only the service ports
  whose stamps differ.  Its own elements (dispatch, refusals,
  exemptions, firewall, affinity dispatch) carry ``<namespace/name:port>`` alone; the count lets a
  new process ask for a changed port's old elements by key instead of reading the maps whole.

  The second layout digested what the port *rendered* (so every port was rendered before the
  comparison: ~38 µs each, 0.38 s of a 10k-service restart); the first put the digest in the
  dispatch elements' comments: an endpoint change then replaced the
  service's ``service-ips`` element for its new digest, and adding a verdict-map element with a
  ``goto`` makes the kernel validate every chain the table can reach at commit — 40 ms per commit at
  100k services against 0.09 ms for the endpoint element itself (by hand, the netlink writer in a
  namespace, 2026-12-06, load ~6).  A plain set's element costs what the endpoint's does.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import marshal
import operator
import os
import re
import socket
from typing import Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, cast

from netproxy.backends.nftables import names, render
from netproxy.backends.nftables.objects import Element
from netproxy.core import hashes as hashlib  # hashlib's hashes without OpenSSL (core/hashes.py)
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Endpoint, IPAddress, IPNetwork, NodeInfo, ServicePort, ServicePortName

LAYOUT_VERSION = 5
"""Bumped whenever what an object's name, key or comment means changes without the rendered text
showing it: a table stamped with another layout is never adopted.  5: an endpoint run's index i is
the i-th endpoint in numeric order (address, then port; 4 and before: in the order of their text).
4: the service stamps split over sixteen sets by their keys' first hex digit (3: one
``service-stamps`` set).  3: service stamps digest the port's inputs (2: its rendered objects), and
count its own elements."""

STAMP_SET = names.STAMP
SERVICE_STAMP_SETS = names.SERVICE_STAMP_SETS
STAMP_KEY = "1"
_DIGEST_CHARS = 16
_SUFFIX = " d:"
_COUNT = " n:"
_COUNT_CHARS = 6
"""Room kept in a service stamp's comment for its count (more own elements than this: not counted)."""
_SERVICE_COMMENT = re.compile(r"^(?P<service>.+?)(?: d:(?P<digest>[0-9a-f]{16})(?: n:(?P<count>\d{1,6}))?)?$")
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


def code_digest() -> str:
    """The digest of the code that renders the tables (this package's modules and the core's
    endpoint selection, firewall and model): service stamps digest the *inputs* of a port's render,
    so a change of the code that renders them (an edit between two releases of the same version, a
    local patch) must change the table stamp, or a new process would keep what the old code wrote.
    ~1 ms: the files are read once per process."""
    global _CODE
    if _CODE is None:
        from netproxy.core import endpoints, firewall, model

        here = os.path.dirname(os.path.abspath(__file__))
        paths = sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py"))
        paths += [m.__file__ or m.__name__ for m in (endpoints, firewall, model)]
        h = hashlib.blake2b(digest_size=_DIGEST_CHARS // 2)
        for path in paths:
            h.update(os.path.basename(path).encode() + b"\0")
            try:
                with open(path, "rb") as fh:
                    h.update(fh.read())
            except OSError as exc:  # no source (a bytecode-only install): its name alone, and the version
                h.update(type(exc).__name__.encode())
        _CODE = h.hexdigest()
    return _CODE


_CODE: Optional[str] = None


def config_digest(config: ProxyConfig, node: NodeInfo, version: str) -> str:
    """What every object of the tables depends on besides the services: netproxy's version, the
    layout, the rendering code, the settings that shape the tables and the node."""
    parts = [f"version={version}", f"layout={LAYOUT_VERSION}", f"code={code_digest()}", f"node={node!r}"]
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
    stays unique) to leave room for the digest and count within nft's comment limit."""
    base = names.service_comment(name)
    room = names.MAX_COMMENT - len(_SUFFIX) - _DIGEST_CHARS - len(_COUNT) - _COUNT_CHARS
    if len(base) > room:
        base = f"{base[:room - 9]}-{hashlib.sha256(str(name).encode()).hexdigest()[:8]}"
    return base


class ServiceStamp(NamedTuple):
    """A service stamp's comment, parsed: the service part; the digest and own-element count (None
    when the comment has none)."""

    service: str
    digest: Optional[str]
    elements: Optional[int]


def parse_service_comment(comment: Optional[str]) -> Optional[ServiceStamp]:
    """(service part, digest, count) of an own element's comment (neither) or of a service stamp's;
    None when there is no comment."""
    m = _SERVICE_COMMENT.match(comment or "")
    if m is None:
        return None
    count = m.group("count")
    return ServiceStamp(m.group("service"), m.group("digest"), int(count) if count is not None else None)


def stamp_place(name: ServicePortName) -> Tuple[str, str]:
    """The set and key of ``name``'s service stamp: the key a 128-bit hash of the port's name as an
    IPv6 address (the sets' type), unique whatever addresses services share; the set
    ``service-stamps-<its first hex digit>`` (names.SERVICE_STAMP_SETS): a dump of one set of 100k
    stamps cost ~0.8 s in the kernel, which restarts its walk of a set at every ~32 KiB answer
    (docs/performance.md, "The eighth pass"), sixteen sets of ~6k cost ~0.05 s."""
    digest = hashlib.blake2b(str(name).encode(), digest_size=16).digest()
    where = SERVICE_STAMP_SETS[digest[0] >> 4]
    if digest[:10] == _TEN_ZEROS:  # ::/96 and ::ffff:0:0/96, which inet_ntop writes dotted
        return where, str(ipaddress.IPv6Address(digest))
    # ipaddress' text for every other address, in C: its Python formatting was 4 µs of the 5 µs a
    # stamp key costs, for every service port of every full sync (the unit test holds them equal).
    return where, socket.inet_ntop(socket.AF_INET6, digest)


def stamp_key(name: ServicePortName) -> str:
    """The key of ``name``'s service stamp (:func:`stamp_place`)."""
    return stamp_place(name)[1]


_TEN_ZEROS = bytes(10)


_SERVICE_FIELDS = tuple(f.name for f in dataclasses.fields(ServicePort) if f.name != "name")
_service_values = operator.attrgetter(*_SERVICE_FIELDS)
# Addresses as (integer, version), read in C: int(ip), ip.version and str(ip) are Python-level
# calls, and this runs for every endpoint of every service port at each start (100k at 10k
# services).  Private attributes of ipaddress, stable since 3.3; a unit test pins them to int() and
# .version.
_address = operator.attrgetter("_ip", "_version")
_endpoint_values = operator.attrgetter("ip._ip", "ip._version", *(f for f in Endpoint._fields if f != "ip"))
_ADDRESS_FIELDS = tuple(i for i, f in enumerate(_SERVICE_FIELDS)
                        if f in ("cluster_ips", "external_ips", "load_balancer_ips", "proxy_load_balancer_ips"))
_OTHER_TUPLES = tuple(i for i, f in enumerate(_SERVICE_FIELDS)
                      if {d.name: d.default for d in dataclasses.fields(ServicePort)}[f] == ()
                      and i not in _ADDRESS_FIELDS)
"""The other tuple fields (``source_ranges``: CIDRs), as text."""

Inputs = Tuple[List[object], List[Tuple[object, ...]]]
_Addresses = Tuple[IPAddress, ...]
_Networks = Tuple[IPNetwork, ...]
# cast() to these, not to Tuple[...] written out in inputs(): subscripting a typing generic is a
# cached Python-level call (~1 µs), made at each call, once per service port of every start.


def inputs(svc: ServicePort, endpoints: Sequence[Endpoint]) -> Inputs:
    """What one service port is rendered from, in plain values (:func:`input_digest`)."""
    values: List[object] = list(_service_values(svc))
    for i in _ADDRESS_FIELDS:
        if values[i]:
            values[i] = tuple(map(_address, cast(_Addresses, values[i])))
    for i in _OTHER_TUPLES:
        if values[i]:
            values[i] = tuple(map(str, cast(_Networks, values[i])))
    return values, list(map(_endpoint_values, endpoints))


_FIRST = operator.itemgetter(0)


def endpoint_addresses(made_of: Inputs) -> Iterator[int]:
    """The address of each endpoint in :func:`inputs` (as an integer: the first of its values)."""
    return cast(Iterator[int], map(_FIRST, made_of[1]))


def digest_of(made_of: Inputs, family: str, taken: Sequence[str] = ()) -> str:
    """:func:`input_digest` of :func:`inputs` already computed (a dual-stack port's two families)."""
    data = marshal.dumps((family, tuple(taken), made_of), 2)
    return hashlib.blake2b(data, digest_size=_DIGEST_CHARS // 2).hexdigest()


def input_digest(svc: ServicePort, endpoints: Sequence[Endpoint], family: str, taken: Sequence[str] = ()) -> str:
    """The digest of what one service port's render in ``family`` is made from, beyond what the
    table stamp's config digest covers: every field of its ServicePort, every field of every
    endpoint (as the snapshot gives them, before any selection: the selection is the render's
    code), and the dispatch keys another service port owns (``taken``: they are left out of its
    objects).  ~7 µs a service port with ten endpoints (the render it replaces: ~38 µs).

    marshal (format 2: no references, so the bytes depend on the values alone) of plain tuples,
    ints and strings: several times cheaper than any text of them."""
    return digest_of(inputs(svc, endpoints), family, taken)


def stamped(objs: render.ServiceObjects, name: ServicePortName, digest: str) -> render.ServiceObjects:
    """``objs`` with its own elements commented with its service part and its service stamp added:
    ``digest`` (:func:`input_digest`) and the count of its own elements.  Also when another port
    owns every key it claims (it has no own element then): its stamp says so."""
    base = service_base(name)
    if len(base) == len(names.service_comment(name)):
        # The comment render gave them (names.service_comment) already: the elements as they are.
        elements = dict(objs.elements)
    else:
        # Element(...) rather than _replace(): a third of the cost, for every element of every full sync.
        elements = {k: Element(e.set, e.key, e.value, base) for k, e in objs.elements.items()}
    where, key = stamp_place(name)
    elements.pop((where, key), None)  # stamped again (transaction.claim): its own stamp is not counted
    count = len(elements)
    counted = f"{_COUNT}{count}" if len(str(count)) <= _COUNT_CHARS else ""
    elements[(where, key)] = Element(where, key, None, f"{base}{_SUFFIX}{digest}{counted}")
    # Not dataclasses.replace, which walks the fields in Python (a tenth of this function).
    return render.ServiceObjects(elements=elements, runs=objs.runs, chains=objs.chains, sets=objs.sets,
                                 shared=objs.shared, uses=objs.uses, dispatch_keys=objs.dispatch_keys, refs=objs.refs,
                                 hairpin=objs.hairpin)
