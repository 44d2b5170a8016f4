"""An in-memory iptables that reads the same restore text the restore writer pipes to
``iptables-restore --noflush``, with the kernel's (and the tool's) refusals.

:class:`FakeIptables` is a :class:`~.kernel.Writer`: :meth:`~FakeIptables.apply` turns the backend's
changes into restore text with :func:`~.payload.restore_chunks` (the restore writer's own code path)
and parses it; :meth:`~FakeIptables.restore` takes any payload (``cleanup``, or a test playing
another program).  It keeps tables → chains → rules per family and applies ``:CHAIN``, ``-N``,
``-A``, ``-I``, ``-D``, ``-F``, ``-X`` lines to a copy of a table, swapped in at its ``COMMIT`` (each
table all or nothing, as the legacy kernel swaps whole tables; a block committed before a refused
line stays).  It refuses, with :class:`~netproxy.backends.base.SyncError` naming the line, what
the tool or the kernel would: an unknown table, a malformed line, a rule or jump to a chain that
does not exist, a target in a table that does not take it, a chain declared twice in one block,
deleting a built-in chain, a chain with rules or one still jumped to, a jump loop, a block without
``COMMIT``.  :meth:`~FakeIptables.read` reports what it holds, so that a second backend can do a
full sync against it.
"""

from __future__ import annotations

import copy
import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from netproxy.backends.base import SyncError
from netproxy.backends.iptables.assemble import TABLES
from netproxy.backends.iptables.diff import KernelTable, TableChange
from netproxy.backends.iptables.kernel import Counts
from netproxy.backends.iptables.kernel.stamp import GENERATION_KEY, Expected, Stamp, stamp_value
from netproxy.backends.iptables.payload import ChainTextCache, restore_chunks, rule_line
from netproxy.core import hashes as hashlib  # hashlib's hashes without OpenSSL (core/hashes.py)

Rule = Tuple[str, ...]

BUILTIN: Dict[str, Tuple[str, ...]] = {
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
    "security": ("INPUT", "FORWARD", "OUTPUT"),
}
"""The tables the kernel knows, with their built-in chains."""

NAT_TARGETS = frozenset({"DNAT", "SNAT", "MASQUERADE", "REDIRECT", "NETMAP"})
"""Targets only the nat table takes."""
TARGETS = NAT_TARGETS | frozenset({"ACCEPT", "DROP", "RETURN", "QUEUE", "NFQUEUE", "REJECT", "MARK",
                                   "CONNMARK", "SET", "LOG", "NFLOG", "CT", "NOTRACK", "TCPMSS"})
"""Targets that are extensions, not chains."""
MAX_CHAIN_NAME = 28
"""XT_EXTENSION_MAXNAMELEN - 1: ``iptables`` refuses longer chain names."""
_JUMPS = ("-j", "--jump", "-g", "--goto")


class _Refused(Exception):
    """One line refused: the message iptables-restore (or the kernel) would give."""


@dataclass
class Commit:
    """What one committed ``*table`` block did, as read from its text."""

    family: int
    table: str
    declared: Tuple[str, ...] = ()
    """Chains declared (``:CHAIN``: created, or flushed when they existed), in order."""
    deleted: Tuple[str, ...] = ()
    """Chains deleted (``-X``)."""
    inserted: Tuple[Tuple[str, Rule], ...] = ()
    """(chain, rule) of each ``-I``."""

    @property
    def written(self) -> FrozenSet[str]:
        """The user chains this block (re)wrote: declared and not deleted."""
        return frozenset(c for c in self.declared if c not in self.deleted and c not in BUILTIN[self.table])


@dataclass
class _Block:
    """A ``*table`` block being read: a copy of the table, changed line by line until COMMIT."""

    family: int
    table: str
    chains: Dict[str, List[Rule]]
    declared: List[str] = field(default_factory=list)
    deleted: List[str] = field(default_factory=list)
    inserted: List[Tuple[str, Rule]] = field(default_factory=list)

    def declare(self, line: str) -> None:
        parts = line[1:].split()
        if len(parts) not in (2, 3) or (len(parts) == 3 and not _is_counters(parts[2])):
            raise _Refused(f"bad chain line {line!r}")
        name, policy = parts[0], parts[1]
        if name in self.declared:
            raise _Refused(f"chain {name} declared twice")
        builtin = name in BUILTIN[self.table]
        if builtin and policy not in ("ACCEPT", "DROP"):
            raise _Refused(f"bad policy {policy!r} for built-in chain {name}")
        if not builtin and policy != "-":
            raise _Refused(f"cannot set policy {policy!r} on user chain {name}")
        self.declared.append(name)
        if not builtin:
            _check_name(name)
            self.chains[name] = []  # created, or flushed (--noflush flushes only declared chains)

    def command(self, args: List[str]) -> None:
        verb, rest = args[0], args[1:]
        if verb in ("-A", "--append", "-I", "--insert", "-D", "--delete", "-N", "--new-chain") and not rest:
            raise _Refused(f"{verb} needs a chain")
        if verb in ("-A", "--append"):
            self.chain(rest[0]).append(self.rule(rest[1:]))
        elif verb in ("-I", "--insert"):
            rules = self.chain(rest[0])
            at, rule = (int(rest[1]), rest[2:]) if len(rest) > 1 and rest[1].isdigit() else (1, rest[1:])
            if not 1 <= at <= len(rules) + 1:
                raise _Refused(f"index of insertion too big: {at} in {rest[0]}")
            rules.insert(at - 1, self.rule(rule))
            self.inserted.append((rest[0], tuple(rule)))
        elif verb in ("-D", "--delete"):
            self.delete_rule(rest[0], rest[1:])
        elif verb in ("-F", "--flush"):
            for name in rest[:1] or list(self.chains):
                self.chain(name).clear()
        elif verb in ("-N", "--new-chain"):
            if rest[0] in self.chains:
                raise _Refused(f"chain {rest[0]} already exists")
            _check_name(rest[0])
            self.chains[rest[0]] = []
        elif verb in ("-X", "--delete-chain"):
            if len(rest) != 1:
                raise _Refused("-X takes one chain here")
            self.delete_chain(rest[0])
        else:
            raise _Refused(f"unknown command {verb!r}")

    def chain(self, name: str) -> List[Rule]:
        rules = self.chains.get(name)
        if rules is None:
            raise _Refused(f"no chain {name!r} in table {self.table}")
        return rules

    def rule(self, args: Sequence[str]) -> Rule:
        """``args`` as a rule, refused if its target cannot be used here."""
        for i, arg in enumerate(args):
            if arg in ("-m", "--match", "-p", "--protocol", "--comment") and i + 1 >= len(args):
                raise _Refused(f"option {arg} needs a value")
            if arg not in _JUMPS:
                continue
            if i + 1 >= len(args):
                raise _Refused(f"option {arg} needs a target")
            target = args[i + 1]
            if target in TARGETS and arg in ("-j", "--jump"):
                if target in NAT_TARGETS and self.table != "nat":
                    raise _Refused(f"target {target} is only valid in the nat table")
                if target == "REJECT" and self.table == "nat":
                    raise _Refused("target REJECT is not valid in the nat table")
            elif target in BUILTIN[self.table] or target not in self.chains:
                raise _Refused(f"couldn't load target {target!r}: no such chain in table {self.table}")
        return tuple(args)

    def delete_rule(self, name: str, spec: Sequence[str]) -> None:
        rules = self.chain(name)
        if len(spec) == 1 and spec[0].isdigit():
            at = int(spec[0])
            if not 1 <= at <= len(rules):
                raise _Refused(f"index of deletion too big: {at} in {name}")
            del rules[at - 1]
            return
        try:
            rules.remove(tuple(spec))
        except ValueError:
            raise _Refused(f"bad rule (does a matching rule exist in {name}?)") from None

    def delete_chain(self, name: str) -> None:
        if name in BUILTIN[self.table]:
            raise _Refused(f"cannot delete built-in chain {name}")
        if self.chain(name):
            raise _Refused(f"chain {name} is not empty")
        users = sorted(c for c, rules in self.chains.items() if any(_target(r) == name for r in rules))
        if users:
            raise _Refused(f"chain {name} is still jumped to from {', '.join(users)}")
        del self.chains[name]
        self.deleted.append(name)

    def check_loops(self) -> None:
        """The kernel refuses a table whose jumps loop (ELOOP at the table swap)."""
        done: Set[str] = set()

        def visit(name: str, path: Tuple[str, ...]) -> None:
            if name in path:
                raise _Refused(f"jump loop: {' -> '.join(path + (name,))}")
            if name in done:
                return
            for rule in self.chains.get(name, ()):
                target = _target(rule)
                if target in self.chains and target not in BUILTIN[self.table]:
                    visit(target, path + (name,))
            done.add(name)

        for chain in self.chains:
            visit(chain, ())


def _is_counters(text: str) -> bool:
    packets, _, octets = text.strip("[]").partition(":")
    return text.startswith("[") and text.endswith("]") and packets.isdigit() and octets.isdigit()


def _check_name(name: str) -> None:
    if len(name) > MAX_CHAIN_NAME or name.startswith(("-", "!")) or name in TARGETS:
        raise _Refused(f"invalid chain name {name!r}")


def _target(rule: Rule) -> Optional[str]:
    """The ``-j``/``-g`` target of a rule (the last one), if any."""
    found = [rule[i + 1] for i, arg in enumerate(rule[:-1]) if arg in _JUMPS]
    return found[-1] if found else None


def _fresh(table: str) -> Dict[str, List[Rule]]:
    return {chain: [] for chain in BUILTIN[table]}


class FakeIptables:
    """A kernel for :class:`~netproxy.backends.iptables.IptablesBackend` (``kernel=``): tables per
    family, filled only by restore text (see the module docstring)."""

    name = "fake"

    def __init__(self, flavour: str = "legacy", keep_text: bool = True) -> None:
        self.flavour = flavour
        """"legacy": :meth:`stamp` fingerprints the tables; "nft": it gives the nf_tables generation
        (as the real writers)."""
        self.generation = 0
        """The nf_tables generation of an "nft" fake: one more at every committed block, anyone's."""
        self.stamps = True
        """False: :meth:`stamp` cannot read anything (a kernel that refuses the fingerprint or GETGEN)."""
        self.tables: Dict[Tuple[int, str], Dict[str, List[Rule]]] = {
            (f, t): _fresh(t) for f in (4, 6) for t in TABLES}
        """(family, table) → chain → rules (argument tuples, as the renderer makes them)."""
        self.texts: List[Tuple[int, str]] = []
        """Every payload given, in order, with its family (refused ones too)."""
        self.commits: List[Commit] = []
        """Every committed block, in order."""
        self.reads = 0
        self.fingerprinted: List[Tuple[str, int]] = []
        """Every fingerprinting read of a family's tables, in order: ("read", family) for :meth:`read`
        with ``fingerprint``, ("stamp", family) for :meth:`stamp` (legacy)."""
        self.fail_next: Optional[str] = None
        """Refuse the next payload whatever it holds, naming this line (a kernel that says no)."""
        self.misdirected = False
        """Payloads are accepted but land in tables this fake does not show (an nf_tables
        ``iptables-restore`` behind a "legacy" name): the state stays as it was."""
        self._texts: Dict[int, ChainTextCache] = {}
        self._keep_text = keep_text

    # -- what tests look at ------------------------------------------------------------------------

    def chains(self, family: int, table: str) -> Dict[str, Tuple[Rule, ...]]:
        """One table's chains as the renderer's ``Chains``: name → tuple of rules."""
        return {c: tuple(r) for c, r in self.tables.get((family, table), {}).items()}

    def last(self, family: int, table: str) -> Commit:
        """The latest committed block of this table."""
        return [c for c in self.commits if (c.family, c.table) == (family, table)][-1]

    # -- Writer ------------------------------------------------------------------------------------

    def probe(self) -> None:
        return None

    def read(self, family: int, fingerprint: bool = False) -> Dict[str, KernelTable]:
        self.reads += 1
        tables = {t: self._kernel_table(family, t) for t in TABLES}
        if fingerprint and self.flavour == "legacy" and self.stamps:
            tables = {t: dataclasses.replace(k, fingerprint=self._print(family, t), header=self._header(family, t))
                      for t, k in tables.items()}
            self.fingerprinted.append(("read", family))
        return tables

    def header(self, family: int, table: str) -> Optional[bytes]:
        return self._header(family, table) if self.flavour == "legacy" else None

    def _header(self, family: int, table: str) -> bytes:
        """This fake's ``ipt_getinfo``: as the kernel's, it moves with the number of chains and rules and
        their size, not with a rule edited to another of the same length (``iptables -R``)."""
        chains = self.tables.get((family, table), {})
        size = sum(len(c) for c in chains) + sum(len("\0".join(r)) for rules in chains.values() for r in rules)
        return f"{len(chains)} {sum(len(r) for r in chains.values())} {size}".encode()

    def _print(self, family: int, table: str) -> bytes:
        """This fake's fingerprint of a table (what :meth:`stamp` gives for it)."""
        return hashlib.sha256(repr(self.chains(family, table)).encode()).digest()

    def apply(self, family: int, changes: List[TableChange],
              before_commit: Optional[Callable[[], None]] = None,
              meanwhile: Optional[Callable[[], None]] = None) -> int:
        # The restore writer's own text: restore_chunks, with a chain-text cache when it keeps one.
        cache = self._texts.setdefault(family, ChainTextCache()) if self._keep_text else None
        text = "".join(restore_chunks(changes, cache))
        if text:
            self._restore(family, text, before_commit)
        if meanwhile is not None:
            meanwhile()  # as the restore writer: once the whole payload is in (here: committed)
        return len(text.encode())

    def stamp(self, families: Sequence[int], expect: Optional[Expected] = None) -> Optional[Stamp]:
        if not self.stamps:
            return None
        if self.flavour != "legacy":
            return {GENERATION_KEY: self.generation.to_bytes(4, "big")}
        for (f, t), counts in (expect or {}).items():
            held = self.tables.get((f, t), {})
            if any(c not in held or len(held[c]) != n for c, n in counts.items()):
                return None
        self.fingerprinted += [("stamp", f) for f in families]
        return {(f, t): stamp_value(self._print(f, t), self._header(f, t)) for f in families for t in TABLES}

    def counts(self, family: int, table: str) -> Counts:
        if (family, table) not in self.tables:
            return None, set()
        return {c: len(r) for c, r in self.tables[(family, table)].items()}, set(
            self._kernel_table(family, table).jumps)

    def own_pids(self) -> AbstractSet[int]:
        return set()

    def save(self, family: int, table: str) -> str:
        chains = self.tables.get((family, table))
        if chains is None:
            return ""
        lines = [f"*{table}"]
        lines += [f":{c} {'ACCEPT' if c in BUILTIN[table] else '-'} [0:0]" for c in chains]
        lines += [rule_line("-A", c, r) for c, rules in chains.items() for r in rules]
        return "\n".join(lines + ["COMMIT"]) + "\n"

    def restore(self, family: int, payload: str) -> None:
        self._restore(family, payload, None)

    # -- others ------------------------------------------------------------------------------------

    # -- the parser ----------------------------------------------------------------------------------

    def _kernel_table(self, family: int, table: str) -> KernelTable:
        chains = self.tables.get((family, table), {})
        jumps = {(c, t) for c in BUILTIN[table] for t in map(_target, chains.get(c, ())) if t is not None}
        return KernelTable(frozenset(chains), frozenset(jumps))

    def _restore(self, family: int, payload: str, before_commit: Optional[Callable[[], None]]) -> None:
        self.texts.append((family, payload))
        if self.fail_next is not None:
            line, self.fail_next = self.fail_next, None
            raise SyncError("fake iptables-restore refused the payload", line=line)
        tables = self.tables if not self.misdirected else copy.deepcopy(self.tables)
        block: Optional[_Block] = None
        lineno, raw = 0, ""
        try:
            for index, raw in enumerate(payload.splitlines(), 1):
                lineno = index  # named in the error
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith("*"):
                    if block is not None:
                        raise _Refused(f"table {block.table} has no COMMIT")
                    name = line[1:]
                    if name not in BUILTIN:
                        raise _Refused(f"unknown table {name!r}")
                    held = tables.get((family, name))
                    block = _Block(family, name, copy.deepcopy(held) if held is not None else _fresh(name))
                elif block is None:
                    raise _Refused(f"{line!r} outside a table")
                elif line == "COMMIT":
                    block.check_loops()
                    if before_commit is not None:
                        before_commit()  # as the restore writer: just before the tool's first commit
                        before_commit = None
                    tables[(family, block.table)] = block.chains
                    self.generation += 1
                    self.commits.append(Commit(family, block.table, tuple(block.declared), tuple(block.deleted),
                                               tuple(block.inserted)))
                    block = None
                elif line.startswith(":"):
                    block.declare(line)
                else:
                    block.command(_words(line))
            if block is not None:
                lineno, raw = lineno + 1, ""
                raise _Refused(f"COMMIT expected for table {block.table}")
        except _Refused as exc:
            raise SyncError(f"fake iptables-restore: line {lineno} failed", line=raw or None,
                            detail=str(exc)) from None


def _words(line: str) -> List[str]:
    """A line as iptables-restore tokenizes it (double quotes, backslash escapes inside them), the
    ``[packets:bytes]`` prefix of ``--counters`` dropped."""
    try:
        words = shlex.split(line, posix=True)
    except ValueError as exc:
        raise _Refused(f"cannot parse {line!r}: {exc}") from None
    if words and _is_counters(words[0]):
        words = words[1:]
    if not words:
        raise _Refused(f"empty rule line {line!r}")
    return words
