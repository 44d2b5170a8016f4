"""Restart by adoption on iptables: a stamp of what netproxy last wrote, kept in the kernel, so that a
new process can write only the chains that differ from what it would write (README.md, "Restart by
adoption").

The stamp is the chain ``KUBE-NP-STAMP`` of each family's ``mangle`` table (a table netproxy does not
otherwise write, where kube-proxy and kubelet keep their canaries): rules that match nothing but a
comment, never jumped to.  The first rule is the header, ``netproxy-stamp <format> config:<digest>
v:<validator> n:<chains> sum:<digest>``; the others carry ``<n|f> <chain>=<digest> ...``: one
12-hex-digit digest of every chain netproxy wrote into nat (``n``) and filter (``f``), several per
comment (a comment holds at most 255 bytes).

- *config*: netproxy's version, this format and every setting that shapes the rules (all but the
  run-time ones), the node, and whether MASQUERADE takes ``--random-fully`` here;
- *validator*: what proves that nat and filter are still exactly what the stamp describes.  Legacy
  tables: ``fp:<digest>/<headers>``, a digest of both tables' fingerprints (``kernel/stamp.py``: the
  table blob with counters masked) taken right after netproxy's write, checked against the rule
  counts it wrote, then a digest of their headers from the same reads (``ipt_getinfo``: entry count,
  size, hook offsets), which a new process compares before it reads the blobs: headers that differ
  mean a stale stamp without the fingerprint's walk of the blob (format 2); the stamp lives outside
  those tables, so writing it does not change them.  iptables-nft: the nf_tables generation the
  stamp's own commits leave (the one read before them plus their number);
- *n* and *sum*: the number of chain digests and a digest over them all, so that a stamp cut short
  or edited is refused.

Pure: the backend reads and writes the stamp through its writer's ``save``/``restore``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from netproxy.backends.iptables import names, save
from netproxy.backends.iptables.assemble import JUMPS, TABLES
from netproxy.backends.iptables.diff import STALE_EXACT, KernelTable, TableChange
from netproxy.backends.iptables.kernel.stamp import GENERATION_KEY, Stamp, header_of
from netproxy.backends.iptables.tree import Chains, Rule
from netproxy.core import hashes as hashlib  # hashlib's hashes without OpenSSL (core/hashes.py)
from netproxy.core.config import ProxyConfig
from netproxy.core.model import NodeInfo

STAMP_TABLE = names.STAMP_TABLE
STAMP_CHAIN = names.STAMP_CHAIN
FORMAT = 2
"""Bumped whenever what a digest covers changes without the rules showing it, or what the stamp
says changes (2: the legacy validator carries the tables' headers; a stamp of format 1 is not
adopted: the first start after the upgrade rewrites everything)."""
_DIGEST = 12
"""Hex digits of a chain's digest (48 bits): a changed chain taken for unchanged is a 2^-48 chance."""
_TABLE_CODE = {"nat": "n", "filter": "f"}
_CODE_TABLE = {v: k for k, v in _TABLE_CODE.items()}
MAX_COMMENT = 255
_HEADER = re.compile(r"^netproxy-stamp (?P<format>\d+) config:(?P<config>[0-9a-f]{16}) v:(?P<validator>\S+) "
                     r"n:(?P<count>\d+) sum:(?P<sum>[0-9a-f]{16})$")
_ENTRY = re.compile(r"^(?P<chain>[A-Za-z0-9_.\-]{1,28})=(?P<digest>[0-9a-f]{12})$")
_COMMENT = re.compile(r'--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))')

RUN_ONLY = frozenset({"sync_period", "min_sync_period", "metrics_bind_address", "healthz_bind_address",
                      "one_shot", "iptables_lock_timeout", "nftables_writer", "iptables_writer", "backend"})
"""ProxyConfig fields that do not shape the rules (every other field does, new ones included).  The
writer is one of them: both writers leave the same tables, so either may adopt the other's."""


class NotAdoptable(Exception):
    """Why the tables cannot be adopted (logged at info; the sync then rewrites everything)."""


def _hex(parts: Iterable[str], digits: int) -> str:
    h = hashlib.blake2b(digest_size=(digits + 1) // 2)
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:digits]


def config_digest(config: ProxyConfig, node: NodeInfo, version: str, random_fully: bool) -> str:
    parts = [f"version={version}", f"format={FORMAT}", f"node={node!r}", f"random_fully={random_fully}"]
    parts += [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config) if f.name not in RUN_ONLY]
    return _hex(parts, 16)


def chain_digest(rules: Tuple[Rule, ...]) -> str:
    """A chain's rules, in order (a rule's arguments joined by NUL, rules by a newline)."""
    return hashlib.blake2b("\n".join("\0".join(r) for r in rules).encode(), digest_size=6).hexdigest()


class Digests:
    """Chain digests, remembered while a chain's rules are the same tuple (a long-running proxy
    stamps after every full write; unchanged chains are the very same objects)."""

    def __init__(self) -> None:
        self._memo: Dict[Tuple[int, str, str], Tuple[Tuple[Rule, ...], str]] = {}

    def of(self, family: int, table: str, chains: Mapping[str, Tuple[Rule, ...]], remember: bool = True
           ) -> Dict[str, str]:
        """Each chain's digest; ``remember=False`` (a one-shot sync's stamp) uses what is remembered
        (an adopting restart's digests) but adds nothing: at 100k services the memo is ~32 MiB, which
        a one-shot sync would carry under the fingerprint's table blob for nothing."""
        return {chain: self._digest(family, table, chain, rules, remember) for chain, rules in chains.items()}

    def pairs(self, family: int, table: str, chains: Mapping[str, Tuple[Rule, ...]], remember: bool = True
              ) -> Iterator[Tuple[str, str]]:
        """(chain, digest) in chain order, made as they are read (:func:`stamp_body`)."""
        for chain in sorted(chains):
            yield chain, self._digest(family, table, chain, chains[chain], remember)

    def _digest(self, family: int, table: str, chain: str, rules: Tuple[Rule, ...], remember: bool) -> str:
        """One chain's digest: the memo's while it holds these very rules, else made (and kept if
        ``remember``)."""
        key = (family, table, chain)
        hit = self._memo.get(key)
        if hit is None or hit[0] is not rules:
            hit = (rules, chain_digest(rules))
            if remember:
                self._memo[key] = hit
        return hit[1]

    def keep(self, held: Mapping[int, Mapping[str, Mapping[str, object]]]) -> None:
        """Forget the digests of chains no longer held (``held``: family → table → chains)."""
        self._memo = {k: v for k, v in self._memo.items() if k[2] in held.get(k[0], {}).get(k[1], {})}


@dataclass(frozen=True)
class KernelStamp:
    config: str
    validator: str
    chains: Dict[str, Dict[str, str]]
    """table → chain → digest."""


def validator(flavour: str, now: Optional[Stamp], family: int) -> Optional[str]:
    """The validator of ``family``'s tables from the writer's stamp (None: cannot tell)."""
    if now is None:
        return None
    if flavour == "nft":
        gen = now.get(GENERATION_KEY)
        return None if gen is None else f"gen:{int.from_bytes(gen, 'big')}"
    parts = [p for p in (now.get((family, t)) for t in TABLES) if p is not None]
    if len(parts) != len(TABLES):
        return None
    return "fp:" + hashlib.blake2b(b"".join(parts), digest_size=8).hexdigest() + "/" + \
        _headers([header_of(p) for p in parts])


def _headers(headers: Sequence[bytes]) -> str:
    """The legacy validator's second part: nat's and filter's headers, hashed."""
    return hashlib.blake2b(b"".join(headers), digest_size=6).hexdigest()


class StampBody(NamedTuple):
    """The stamp's chain digests packed into comments, with their count and sum: all of the stamp
    but its header's config and validator (:func:`stamp_body`, :func:`stamp_rules`)."""

    comments: Tuple[str, ...]
    entries: int
    total: str


def stamp_body(digests: Mapping[str, Iterable[Tuple[str, str]]]) -> StampBody:
    """The chain digests (table → (chain, digest) pairs in chain order) packed into comments.  Needs
    no fingerprint, so that a full sync makes it while ``iptables-restore`` commits (the backend's
    ``_prepare_stamp``).  The pairs are read once, as they come: made lazily (:meth:`Digests.pairs`),
    no digest outlives its comment, so that what is left under the fingerprint's table blob is the
    comments alone (~0.5 MB at 10k services)."""
    total = hashlib.blake2b(digest_size=8)  # as _hex(): each "code chain=digest", then a NUL
    comments: List[str] = []
    count = 0
    for table in TABLES:
        code = _TABLE_CODE[table]
        line = ""
        for chain, digest in digests.get(table, ()):
            entry = f"{chain}={digest}"
            total.update(f"{code} {entry}".encode())
            total.update(b"\0")
            count += 1
            if line and len(line) + 1 + len(entry) > MAX_COMMENT:
                comments.append(line)
                line = ""
            line = f"{line or code} {entry}"
        if line:
            comments.append(line)
    return StampBody(tuple(comments), count, total.hexdigest()[:16])


def stamp_rules(config: str, valid: str, digests: Union[Mapping[str, Mapping[str, str]], StampBody]
                ) -> Tuple[Rule, ...]:
    """The stamp chain's rules: the header, then the chain digests packed into comments (``digests``:
    table → chain → digest, or their :func:`stamp_body` made before)."""
    body = digests if isinstance(digests, StampBody) else stamp_body({t: sorted(d.items()) for t, d in digests.items()})
    header = f"netproxy-stamp {FORMAT} config:{config} v:{valid} n:{body.entries} sum:{body.total}"
    return tuple(("-m", "comment", "--comment", text) for text in (header,) + body.comments)


def stamp_change(rules: Tuple[Rule, ...]) -> TableChange:
    """The stamp chain declared (created, or flushed) and filled: one ``*mangle`` block, all or nothing."""
    return TableChange(STAMP_TABLE, {STAMP_CHAIN: rules})


def _comment(rule: str) -> str:
    m = _COMMENT.search(rule)
    if m is None:
        raise NotAdoptable(f"a rule of the stamp carries no comment: {rule[:80]!r}")
    return m.group(1).replace('\\"', '"').replace("\\\\", "\\") if m.group(1) is not None else m.group(2)


def parse(saved: str) -> KernelStamp:
    """The stamp in ``iptables-save -t mangle`` text; NotAdoptable naming what is wrong with it."""
    try:
        tables = save.parse(saved)
    except save.SaveParseError as exc:
        raise NotAdoptable(f"the mangle table does not parse: {exc}") from None
    chain = tables[STAMP_TABLE].chains.get(STAMP_CHAIN) if STAMP_TABLE in tables else None
    if chain is None:
        raise NotAdoptable(f"no {STAMP_CHAIN} chain in the mangle table")
    if not chain.rules:
        raise NotAdoptable(f"the {STAMP_CHAIN} chain is empty")
    comments = [_comment(r) for r in chain.rules]
    head = _HEADER.match(comments[0])
    if head is None:
        raise NotAdoptable(f"the stamp's header does not parse: {comments[0][:120]!r}")
    if int(head.group("format")) != FORMAT:
        raise NotAdoptable(f"the stamp has format {head.group('format')}, this netproxy writes {FORMAT}")
    chains: Dict[str, Dict[str, str]] = {t: {} for t in TABLES}
    flat: List[str] = []
    for text in comments[1:]:
        code, *entries = text.split(" ")
        table = _CODE_TABLE.get(code)
        if table is None or not entries:
            raise NotAdoptable(f"a stamp rule does not parse: {text[:80]!r}")
        for entry in entries:
            m = _ENTRY.match(entry)
            if m is None:
                raise NotAdoptable(f"a stamp entry does not parse: {entry!r}")
            chains[table][m.group("chain")] = m.group("digest")
            flat.append(f"{code} {entry}")
    if len(flat) != int(head.group("count")) or _hex(flat, 16) != head.group("sum"):
        raise NotAdoptable(f"the stamp is torn: {len(flat)} chain digests, its header says {head.group('count')} "
                           "(or their sum differs)")
    return KernelStamp(head.group("config"), head.group("validator"), chains)


def _check_config(found: KernelStamp, config: str) -> None:
    if found.config != config:
        raise NotAdoptable(f"the stamp was written by another netproxy version, configuration or node "
                           f"(config {found.config}, this process {config})")


def check_headers(found: KernelStamp, config: str, headers: Sequence[Optional[bytes]]) -> None:
    """Legacy, before the tables are read: NotAdoptable unless the stamp was made with this config and
    nat's and filter's headers now (``headers``, in TABLES order; None: unreadable) are those its
    fingerprints were taken with.  Cheap (one ``IPT_SO_GET_INFO`` per table): a stamp that fails
    here is stale without reading, masking and hashing the blobs (~1 s at 100k services); one that
    passes is judged by :func:`check` with the fingerprints (a same-size edit keeps the headers)."""
    _check_config(found, config)
    _, _, stamped = found.validator.partition("/")
    if not found.validator.startswith("fp:") or not stamped:
        raise NotAdoptable(f"the stamp has no legacy tables' headers (validator {found.validator})")
    now = [h for h in headers if h is not None]
    if len(now) != len(TABLES) or _headers(now) != stamped:
        raise NotAdoptable("the tables changed since netproxy stamped them (their headers — entry counts, sizes — "
                           "differ from the stamp's)")


def check(found: KernelStamp, config: str, valid: Optional[str]) -> None:
    """NotAdoptable unless the stamp was made with this config and its validator holds now."""
    _check_config(found, config)
    if valid is None:
        raise NotAdoptable("the tables' fingerprint or generation cannot be read")
    if found.validator != valid:
        raise NotAdoptable(f"the tables changed since netproxy stamped them (stamp {found.validator}, now {valid})")


def as_read(found: KernelStamp) -> Dict[str, KernelTable]:
    """What a full sync's read would give for tables that the stamp, still valid, describes: its
    chains, and every jump netproxy adds (a stamp is written only when they are in place)."""
    return {t: KernelTable(frozenset(found.chains.get(t, {})), frozenset((h, c) for h, c, _ in JUMPS[t]))
            for t in TABLES}


def changes(desired: Mapping[str, Chains], digests: Mapping[str, Mapping[str, str]], found: KernelStamp,
            kernel: Mapping[str, KernelTable]) -> List[TableChange]:
    """Per table, what turns the adopted tables into ``desired``: the chains whose digest differs from
    the stamp's (or that it lacks), the chains of ours the kernel holds and the render does not, the
    missing jumps from built-in chains.  NotAdoptable if the kernel lacks a chain the stamp names (the
    validator should have said so; the kernel is the judge)."""
    out: List[TableChange] = []
    for table in TABLES:
        have = kernel[table] if table in kernel else KernelTable()
        stamped = found.chains.get(table, {})
        lacking = sorted(set(stamped) - have.chains)
        if lacking:
            raise NotAdoptable(f"the stamp names {table} chain {lacking[0]}, which the kernel lacks")
        now = digests[table]
        want = desired[table]
        write = {c: r for c, r in want.items() if c not in have.chains or stamped.get(c) != now[c]}
        stale = sorted(c for c in have.chains if c not in want and (
            c in stamped or c.startswith(names.OWNED_PREFIXES) or c in STALE_EXACT))
        jumps = [(hook, rule) for hook, target, rule in JUMPS[table] if (hook, target) not in have.jumps]
        out.append(TableChange(table, write, stale, jumps, have.chains))
    return out


