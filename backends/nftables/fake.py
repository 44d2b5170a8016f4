"""An in-memory nftables with the kernel's all-or-nothing transactions and its refusals.

:class:`FakeNft` applies the operations a writer would send to an in-memory table with the
kernel's refusals (missing chain or set, an element that exists with another value, deleting an
object still in use) so that unit tests can assert on the resulting state.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import AbstractSet, Dict, FrozenSet, List, Optional, Sequence, Tuple

from netproxy.backends.base import SyncError
from netproxy.backends.nftables import names, serialise
from netproxy.backends.nftables.objects import (
    ELEMENT_TYPES,
    Chain,
    Element,
    ElementRun,
    Rule,
    Set,
    Table,
    element_items,
)
from netproxy.backends.nftables.serialise import Op

# --- the fake ---------------------------------------------------------------------------------------

_CHAIN_REF = re.compile(r"\b(?:goto|jump) ([A-Za-z0-9/_.\-]+)")
_SET_REF = re.compile(r"@([A-Za-z0-9/_.\-]+)")
_STAMP_DETAIL = re.compile(r"\b(config|gen):\S+")


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
        for item in element_items(obj) if isinstance(obj, ELEMENT_TYPES) else (obj,):
            if isinstance(item, ElementRun):
                out.extend((verb, family, e) for e in item.elements())
            else:
                out.append((verb, family, item))
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

    def read_elements(self, family: str, set_name: str) -> List[Element]:
        self.reads += 1
        t = self.tables.get(family)
        if t is None or set_name not in t.elements:
            return []
        return list(t.elements[set_name].values())

    def read_stamped(self, family: str, set_names: Sequence[str]) -> Dict[str, List[Element]]:
        self.reads += 1
        t = self.tables.get(family)
        if t is None:
            return {}
        return {n: [e._replace(expires=None, timeout=None) for e in t.elements[n].values()]
                for n in set_names if n in t.elements}

    def get_elements(self, family: str, set_name: str, keys: Sequence[str]) -> List[Element]:
        self.reads += 1
        t = self.tables.get(family)
        if t is None or set_name not in t.elements:
            return []
        els = t.elements[set_name]
        return [els[k]._replace(expires=None, timeout=None) for k in keys if k in els]

    def chain_names(self, family: str) -> FrozenSet[str]:
        self.reads += 1
        t = self.tables.get(family)
        return frozenset(t.chains) if t is not None else frozenset()

    def chain_uses(self, family: str) -> Dict[str, int]:
        """As the kernel counts them: a chain's rules, plus the rules and verdict-map elements that
        jump or go to it."""
        self.reads += 1
        t = self.tables.get(family)
        if t is None:
            return {}
        uses = {name: len(t.rules.get(name, ())) for name in t.chains}
        for rules in t.rules.values():
            for r in rules:
                for target in _CHAIN_REF.findall(r.body):
                    uses[target] = uses.get(target, 0) + 1
        for els in t.elements.values():
            for e in els.values():
                verb, _, target = (e.value or "").partition(" ")
                if verb in ("goto", "jump"):
                    uses[target] = uses.get(target, 0) + 1
        return uses

    def probe(self) -> None:
        return None

    def touch(self, family: str, set_name: str, key: str, expires: int, value: Optional[str] = None) -> None:
        """What the packet path does to an affinity set or map (``update @set { key : value }``)."""
        self.tables[family].elements[set_name][key] = Element(set_name, key, value, expires=expires)

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
                element = t.elements[name][key]
                if name == names.STAMP:
                    # Which generation and configuration: tests compare tables across histories and
                    # configurations; the stamp's own tests read it with elements().
                    element = element._replace(comment=_STAMP_DETAIL.sub(r"\1:*", element.comment or ""))
                lines.append(f"    {serialise.element_text(element)}")
        for name in sorted(t.chains):
            lines.append(f"  chain {name}{serialise.chain_spec(t.chains[name])}")
            for r in t.rules[name]:
                lines.append(f"    {r.body}" + (f' comment "{r.comment}"' if r.comment else ""))
        return "\n".join(lines) + "\n"

    def comments(self, family: str, set_name: str) -> Dict[str, Optional[str]]:
        t = self.tables.get(family)
        if t is None or set_name not in t.elements:
            return {}
        return {k: e.comment for k, e in t.elements[set_name].items()}

    def elements(self, family: str, set_name: str) -> Dict[str, Optional[str]]:
        t = self.tables.get(family)
        if t is None or set_name not in t.elements:
            return {}
        return {k: e.value for k, e in t.elements[set_name].items()}

    def chain_rules(self, family: str, chain: str) -> List[str]:
        t = self.tables.get(family)
        return [] if t is None or chain not in t.rules else [r.body for r in t.rules[chain]]
