"""The seam between the backend and the kernel: libnftables in process, or a fake with real semantics.

:class:`LibNftRunner` hands one text buffer to ``nftables.Nftables().cmd()``, which libnftables
sends as one netlink batch: all of it applies or none does.  It binds to the network namespace of
the calling process.  :class:`FakeNft` applies the same operations to an in-memory table with the
kernel's refusals (missing chain or set, an element that exists with another value, deleting an
object still in use) so that unit tests can assert on the resulting state.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import logging
import re
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

try:  # Python 3.8+
    from typing import Protocol
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol  # type: ignore[assignment]

from netproxy.backends.base import BackendUnavailable, SyncError
from netproxy.backends.nftables import names, serialise
from netproxy.backends.nftables.monitor import Monitor
from netproxy.backends.nftables.objects import Chain, Element, ElementRun, Rule, Set, Table
from netproxy.backends.nftables.serialise import Op

log = logging.getLogger(__name__)


class Runner(Protocol):
    def apply(self, ops: Sequence[Op]) -> int:
        """Apply ``ops`` as one transaction; return the payload size; raise SyncError on refusal."""

    def existing_tables(self) -> FrozenSet[str]:
        """The families ("ip", "ip6") in which a ``netproxy`` table exists."""

    def read_sets(self, family: str) -> List[Tuple[Set, List[Element]]]:
        """The named sets (not maps) of ``family netproxy`` with their elements: the affinity state."""

    def delete_tables(self) -> List[str]:
        """Delete netproxy's tables (and only them); return which were deleted."""

    def generation(self) -> Optional[int]:
        """The network namespace's nftables ruleset generation (bumped by every committed
        transaction, of any table, by anyone), or None when it cannot be read."""

    def watch(self, on: bool) -> None:
        """Start (or stop) listening to nftables change notifications (:mod:`monitor`)."""

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        """Whether a transaction not in ``own`` (generations) touched netproxy's tables since the
        last call; None when that cannot be known (not watching, notifications lost)."""


_LOCATE_MAX_BYTES = 1 << 20
_TRIM_AFTER_BYTES = 1 << 20


def _release_heap() -> None:
    """Give the heap libnftables just freed back to the kernel.

    Parsing a 100k-element transaction takes libnftables ~230 MB, freed when the command ends,
    but glibc keeps it mapped: a long-running proxy would sit at its peak forever.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_LINE_MAX = 400


def _shorten(line: Optional[str]) -> Optional[str]:
    """A failing line fit for a log: a full sync's element command can hold 100k elements."""
    if line is None or len(line) <= _LINE_MAX:
        return line
    return f"{line[:_LINE_MAX]}... ({len(line)} characters)"


def failing_command(error: str) -> Optional[str]:
    """The command libnftables echoes after its first ``Error:`` line."""
    lines = error.splitlines()
    for i, line in enumerate(lines):
        if "Error:" in line and i + 1 < len(lines):
            return lines[i + 1].strip()
    return None


class LibNftRunner:
    def __init__(self) -> None:
        try:
            import nftables  # the binding shipped with libnftables (pip-nftables)
        except ImportError as exc:
            raise BackendUnavailable("the nftables Python binding is not installed", detail=str(exc)) from exc
        try:
            self._nft = nftables.Nftables()
        except OSError as exc:
            raise BackendUnavailable("libnftables cannot be loaded", detail=str(exc)) from exc
        self._nft.set_handle_output(False)
        self._check: Optional[Any] = None
        self._gen_socket: Optional[Tuple[Any, int, Any]] = None
        self._monitor: Optional[Monitor] = None

    def _cmd(self, text: str, json_output: bool = False) -> Tuple[int, str, str]:
        self._nft.set_json_output(json_output)
        rc, out, err = self._nft.cmd(text)
        return int(rc), str(out or ""), str(err or "")

    def apply(self, ops: Sequence[Op]) -> int:
        text = serialise.ops_text(ops)
        rc, _, err = self._cmd(text)
        if len(text) > _TRIM_AFTER_BYTES:
            _release_heap()
        if rc != 0:
            line = self.locate_failure(text) or failing_command(err)
            raise SyncError("libnftables refused the transaction", line=_shorten(line), detail=err.strip(),
                            payload=text)
        return len(text)

    def locate_failure(self, text: str) -> Optional[str]:
        """The first command of ``text`` that the kernel refuses, found by dry runs of its prefixes.

        libnftables names the wrong command when the kernel refuses an element in a batch (it
        blamed an earlier ``add map`` for an element's EEXIST), and the failing line is what an
        operator needs.  A prefix of a batch fails iff it contains the first refused command, so a
        binary search over prefixes finds it.  Only for small payloads (incremental syncs): a
        dry run costs what the real transaction costs.
        """
        lines = text.splitlines()
        if len(text) > _LOCATE_MAX_BYTES or not lines:
            return None
        check = self._dry_run_context()
        if check is None:
            return None

        def ok(n: int) -> bool:
            return int(check.cmd("\n".join(lines[:n]) + "\n")[0]) == 0

        lo, hi = 0, len(lines)
        if ok(hi):
            return None  # the refusal did not reproduce (someone else changed the table meanwhile)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lines[hi - 1]

    def _dry_run_context(self) -> Optional[Any]:
        """A second libnftables context in dry-run mode (the kernel checks the batch, then aborts it).

        The Python binding does not wrap ``nft_ctx_set_dry_run``; it is called on the binding's
        context through ctypes, here only.
        """
        if self._check is not None:
            return self._check
        try:
            import nftables

            check = nftables.Nftables()
            ctx = check._Nftables__ctx  # name-mangled private attribute of the binding
            set_dry_run = ctypes.CDLL("libnftables.so.1").nft_ctx_set_dry_run
            set_dry_run.argtypes = [ctypes.c_void_p, ctypes.c_bool]
            set_dry_run(ctx, True)
        except (ImportError, OSError, AttributeError) as exc:
            log.debug("no dry-run context to locate a refused command: %s", exc)
            return None
        self._check = check
        return check

    def _list(self, what: str) -> Optional[List[Dict[str, Any]]]:
        rc, out, err = self._cmd(what, json_output=True)
        if rc != 0:
            if "No such file or directory" in err:
                return None
            raise SyncError("cannot read the nftables ruleset", line=what, detail=err.strip())
        items: List[Dict[str, Any]] = json.loads(out).get("nftables", [])
        return items

    def existing_tables(self) -> FrozenSet[str]:
        items = self._list("list tables") or []
        return frozenset(str(t["table"]["family"]) for t in items
                         if "table" in t and t["table"].get("name") == names.TABLE
                         and t["table"].get("family") in ("ip", "ip6"))

    def read_sets(self, family: str) -> List[Tuple[Set, List[Element]]]:
        # "list sets" leaves the maps out: the 100k-element endpoint maps are not read back.
        items = self._list(f"list sets table {family} {names.TABLE}")
        return sets_from_json(items or [])

    def generation(self) -> Optional[int]:
        # libnftables does not expose NFT_MSG_GETGEN; pyroute2 (already a dependency) does.
        try:
            if self._gen_socket is None:
                # The package first: importing the submodule directly takes its import lock before
                # pyroute2's, the reverse of `import pyroute2` in another thread (the core's node
                # address watcher), and Python aborted that thread with a _DeadlockError.
                import pyroute2  # noqa: F401
                from pyroute2.netlink.nfnetlink.nftsocket import NFT_MSG_GETGEN, NFTSocket, nft_gen_msg

                self._gen_socket = (NFTSocket(), NFT_MSG_GETGEN, nft_gen_msg)
            sock, msg_type, msg_class = self._gen_socket
            for msg in sock.request_get(msg_class(), msg_type):
                gen = msg.get_attr("NFTA_GEN_ID")
                if gen is not None:
                    return int(gen)
        except Exception as exc:  # noqa: BLE001 - any failure only costs a full rewrite
            log.debug("cannot read the nftables generation: %s", exc)
        return None

    def watch(self, on: bool) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if on:
            try:
                self._monitor = Monitor()
            except OSError as exc:
                log.info("no nftables change notifications (%s): every full sync after a foreign write "
                         "rebuilds netproxy's tables", exc)

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        if self._monitor is None:
            return None
        try:
            touched: Optional[bool] = self._monitor.others_touched(own)
            return touched
        except OSError as exc:
            log.info("nftables change notifications failed: %s", exc)
            self.watch(False)
            return None

    def probe(self) -> None:
        if self._list("list tables") is None:
            raise BackendUnavailable("libnftables cannot list tables")

    def delete_tables(self) -> List[str]:
        ours = sorted(self.existing_tables())
        if ours:
            text = "".join(f"delete table {fam} {names.TABLE}\n" for fam in ours)
            rc, _, err = self._cmd(text)
            if rc != 0:
                raise SyncError("cannot delete netproxy's tables", line=failing_command(err), detail=err.strip())
        return [f"{fam} {names.TABLE}" for fam in ours]


def sets_from_json(items: Sequence[Dict[str, Any]]) -> List[Tuple[Set, List[Element]]]:
    """Sets and their elements (with the seconds they have left) from ``nft -j list sets``."""
    out = []
    for item in items:
        s = item.get("set")
        if s is None:
            continue
        timeout = s.get("timeout")
        key_type = s.get("type")
        spec = Set(str(s["name"]), key_type if isinstance(key_type, str) else " . ".join(key_type),
                   flags=tuple(s.get("flags", ())), timeout=int(timeout) if timeout is not None else None)
        elements = []
        for raw in s.get("elem", ()):
            if isinstance(raw, dict) and "elem" in raw:
                val, expires = raw["elem"].get("val"), raw["elem"].get("expires")
            else:
                val, expires = raw, None
            key = _value_text(val)
            if key is not None:
                elements.append(Element(spec.name, key, expires=int(expires) if expires is not None else None))
        out.append((spec, elements))
    return out


def _value_text(val: Any) -> Optional[str]:
    """nft text for a set key from libnftables JSON: an address, a number, or a concatenation."""
    if isinstance(val, (str, int)) and not isinstance(val, bool):
        return str(val)
    if isinstance(val, dict) and isinstance(val.get("concat"), list):
        parts = [_value_text(v) for v in val["concat"]]
        if all(p is not None for p in parts):
            return " . ".join(str(p) for p in parts)
    return None  # a range, a prefix...: not something netproxy writes


# --- the fake ---------------------------------------------------------------------------------------

_CHAIN_REF = re.compile(r"\b(?:goto|jump) ([A-Za-z0-9/_.\-]+)")
_SET_REF = re.compile(r"@([A-Za-z0-9/_.\-]+)")


@dataclass
class _FakeTable:
    table: Table
    chains: Dict[str, Chain] = field(default_factory=dict)
    rules: Dict[str, List[Rule]] = field(default_factory=dict)
    sets: Dict[str, Set] = field(default_factory=dict)
    elements: Dict[str, Dict[str, Element]] = field(default_factory=dict)


def _expand_runs(ops: Sequence[Op]) -> List[Op]:
    out: List[Op] = []
    for verb, family, obj in ops:
        if isinstance(obj, ElementRun):
            out.extend((verb, family, e) for e in obj.elements())
        else:
            out.append((verb, family, obj))
    return out


class FakeNft:
    """An in-memory nftables with the kernel's all-or-nothing transactions and its refusals."""

    def __init__(self) -> None:
        self.tables: Dict[str, _FakeTable] = {}
        self.transactions: List[List[Op]] = []
        self.fail_next: Optional[str] = None
        self.reads = 0
        self.gen = 1
        self.watching = False
        self.events: List[Tuple[int, bool]] = []
        """(generation, touched netproxy's tables) of each transaction while watching."""

    # Runner
    def apply(self, ops: Sequence[Op]) -> int:
        self.transactions.append(list(ops))
        if self.fail_next is not None:
            line, self.fail_next = self.fail_next, None
            raise SyncError("fake kernel refused the transaction", line=line)
        work = copy.deepcopy(self.tables)
        for op in _expand_runs(ops):
            err = self._apply_one(work, op)
            if err is not None:
                line = serialise.op_text(op[0], op[1], op[2])
                raise SyncError(f"fake kernel refused the transaction: {err}", line=line)
        self.tables = work
        self._commit(True)
        return len(serialise.ops_text(ops))

    def existing_tables(self) -> FrozenSet[str]:
        self.reads += 1
        return frozenset(self.tables)

    def read_sets(self, family: str) -> List[Tuple[Set, List[Element]]]:
        self.reads += 1
        t = self.tables.get(family)
        if t is None:
            return []
        return [(s, list(t.elements[n].values())) for n, s in t.sets.items() if not s.is_map]

    def touch(self, family: str, set_name: str, key: str, expires: int) -> None:
        """What the packet path does to an affinity set (``update @set { ip saddr }``)."""
        self.tables[family].elements[set_name][key] = Element(set_name, key, expires=expires)

    def delete_tables(self) -> List[str]:
        gone = [f"{f} {names.TABLE}" for f in sorted(self.tables)]
        self.tables = {}
        self._commit(bool(gone))
        return gone

    def generation(self) -> Optional[int]:
        return self.gen

    def watch(self, on: bool) -> None:
        self.watching = on
        self.events = []

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        if not self.watching:
            return None
        found = any(touched and gen not in own for gen, touched in self.events)
        self.events = []
        return found

    def _commit(self, touched_ours: bool) -> None:
        self.gen += 1
        if self.watching:
            self.events.append((self.gen, touched_ours))

    def foreign_write(self, ours: bool = True) -> None:
        """Another program commits a transaction, to netproxy's tables (``ours``) or to another one.

        (Tests that tamper with :attr:`tables` directly call this with ``ours=True``.)"""
        self._commit(ours)

    # semantics
    def _apply_one(self, tables: Dict[str, _FakeTable], op: Op) -> Optional[str]:
        verb, family, obj = op
        if isinstance(obj, Table):
            if verb == "add":
                tables.setdefault(family, _FakeTable(obj))
                return None
            return None if tables.pop(family, None) is not None else "No such file or directory"
        t = tables.get(family)
        if t is None:
            return "No such file or directory"
        if isinstance(obj, Chain):
            return self._chain_op(t, verb, obj)
        if isinstance(obj, Set):
            return self._set_op(t, verb, obj)
        if isinstance(obj, Rule):
            if obj.chain not in t.chains:
                return "No such file or directory"
            if any(c not in t.chains for c in _CHAIN_REF.findall(obj.body)):
                return "No such file or directory"
            if any(s not in t.sets for s in _SET_REF.findall(obj.body)):
                return "No such file or directory"
            t.rules[obj.chain].append(obj)
            return None
        if isinstance(obj, Element):
            return self._element_op(t, verb, obj)
        return f"unknown object {obj!r}"

    @staticmethod
    def _chain_op(t: _FakeTable, verb: str, obj: Chain) -> Optional[str]:
        have = t.chains.get(obj.name)
        if verb == "add":
            if have is not None and have.hook != obj.hook:
                return "File exists"
            if have is None:
                t.chains[obj.name] = obj
                t.rules[obj.name] = []
            return None
        if have is None:
            return "No such file or directory"
        if verb == "flush":
            t.rules[obj.name] = []
            return None
        if t.rules[obj.name] or FakeNft._chain_used(t, obj.name):
            return "Device or resource busy"
        del t.chains[obj.name]
        del t.rules[obj.name]
        return None

    @staticmethod
    def _chain_used(t: _FakeTable, name: str) -> bool:
        for rules in t.rules.values():
            if any(name in _CHAIN_REF.findall(r.body) for r in rules):
                return True
        return any(e.value in (f"goto {name}", f"jump {name}") for els in t.elements.values() for e in els.values())

    @staticmethod
    def _set_op(t: _FakeTable, verb: str, obj: Set) -> Optional[str]:
        have = t.sets.get(obj.name)
        if verb == "add":
            if have is not None and (have.key_type, have.value_type, have.timeout) != (
                    obj.key_type, obj.value_type, obj.timeout):
                return "File exists"
            if have is None:
                t.sets[obj.name] = obj
                t.elements[obj.name] = {}
            return None
        if have is None:
            return "No such file or directory"
        if verb == "flush":
            t.elements[obj.name] = {}
            return None
        if any(obj.name in _SET_REF.findall(r.body) for rules in t.rules.values() for r in rules):
            return "Device or resource busy"
        del t.sets[obj.name]
        del t.elements[obj.name]
        return None

    @staticmethod
    def _element_op(t: _FakeTable, verb: str, obj: Element) -> Optional[str]:
        els = t.elements.get(obj.set)
        if els is None:
            return "No such file or directory"
        have = els.get(obj.key)
        if verb == "add":
            if have is not None:
                return None if have.value == obj.value else "File exists"
            refs = _CHAIN_REF.findall(obj.value or "")
            if any(c not in t.chains for c in refs):
                return "No such file or directory"
            els[obj.key] = obj
            return None
        if have is None:
            return "No such file or directory"
        del els[obj.key]
        return None

    # inspection
    def dump(self, family: str = "ip") -> str:
        """The table as sorted nft-like text (rule order within a chain kept): what tests assert on."""
        t = self.tables.get(family)
        if t is None:
            return ""
        lines = [f"table {family} {t.table.name}"]
        for name in sorted(t.sets):
            s = t.sets[name]
            lines.append(f"  {'map' if s.is_map else 'set'} {name}{serialise.set_spec(s)}")
            for key in sorted(t.elements[name]):
                lines.append(f"    {serialise.element_text(t.elements[name][key])}")
        for name in sorted(t.chains):
            lines.append(f"  chain {name}{serialise.chain_spec(t.chains[name])}")
            for r in t.rules[name]:
                lines.append(f"    {r.body}" + (f' comment "{r.comment}"' if r.comment else ""))
        return "\n".join(lines) + "\n"

    def elements(self, family: str, set_name: str) -> Dict[str, Optional[str]]:
        t = self.tables.get(family)
        if t is None or set_name not in t.elements:
            return {}
        return {k: e.value for k, e in t.elements[set_name].items()}

    def chain_rules(self, family: str, chain: str) -> List[str]:
        t = self.tables.get(family)
        return [] if t is None or chain not in t.rules else [r.body for r in t.rules[chain]]
