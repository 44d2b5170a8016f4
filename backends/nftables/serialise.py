"""The one place that turns typed objects into libnftables input (nft text syntax).

Text, not JSON: building libnftables JSON as Python dicts for 10k services measured 25-35x the cost
of the equivalent text (docs/performance.md), and text is what an operator reads in logs and test
failures.  Consecutive element operations on one set become one command with many elements, which
is what keeps a 100k-element transaction cheap to parse.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from netproxy.backends.nftables import names
from netproxy.backends.nftables.objects import (
    ELEMENT_TYPES,
    Chain,
    Element,
    ElementRun,
    Object,
    Rule,
    Set,
    Table,
    element_items,
)

Op = Tuple[str, str, Object]
"""(verb, family, object): verb is "add", "flush" or "delete"."""


def quoted(text: str) -> str:
    return f'"{names.comment(text)}"'


def _comment(text: Optional[str]) -> str:
    return "" if text is None else f" comment {quoted(text)}"


def chain_spec(chain: Chain) -> str:
    parts = []
    if chain.hook is not None:
        h = chain.hook
        parts.append(f"type {h.type} hook {h.hook} priority {h.priority}; policy {h.policy};")
    if chain.comment is not None:
        parts.append(f"comment {quoted(chain.comment)};")
    return f" {{ {' '.join(parts)} }}" if parts else ""


def set_spec(s: Set) -> str:
    kw = "typeof" if s.typeof else "type"
    kind = f"{kw} {s.key_type}" + (f" : {s.value_type}" if s.value_type is not None else "")
    parts = [f"{kind};"]
    if s.flags:
        parts.append(f"flags {','.join(s.flags)};")
    if s.timeout is not None:
        parts.append(f"timeout {s.timeout}s;")
    if s.size is not None:
        parts.append(f"size {s.size};")
    if s.comment is not None:
        parts.append(f"comment {quoted(s.comment)};")
    return f" {{ {' '.join(parts)} }}"


def element_text(e: Element, with_value: bool = True) -> str:
    text: str = (e.key + ("" if e.timeout is None else f" timeout {e.timeout}s")
                 + ("" if e.expires is None else f" expires {e.expires}s") + _comment(e.comment))
    if with_value and e.value is not None:
        text += f" : {e.value}"
    return text


def op_text(verb: str, family: str, obj: Object, table: str = names.TABLE) -> str:
    """One nft command for one operation."""
    where = f"{family} {table}"
    if isinstance(obj, Table):
        spec = f" {{ comment {quoted(obj.comment)}; }}" if verb == "add" and obj.comment else ""
        return f"{verb} table {family} {obj.name}{spec}"
    if isinstance(obj, Chain):
        spec = chain_spec(obj) if verb == "add" else ""
        return f"{verb} chain {where} {names.identifier(obj.name)}{spec}"
    if isinstance(obj, Rule):
        if verb != "add":
            raise ValueError("rules are only added (chains are flushed to remove them)")
        return f"add rule {where} {names.identifier(obj.chain)} {obj.body}{_comment(obj.comment)}"
    if isinstance(obj, Set):
        kw = "map" if obj.is_map else "set"
        spec = set_spec(obj) if verb == "add" else ""
        return f"{verb} {kw} {where} {names.identifier(obj.name)}{spec}"
    if isinstance(obj, ELEMENT_TYPES):
        return ops_lines([(verb, family, obj)], table)[0]
    raise TypeError(f"not an nftables object: {obj!r}")


def ops_lines(ops: Sequence[Op], table: str = names.TABLE) -> List[str]:
    """The commands for ``ops``, with runs of element operations on one set merged into one command."""
    lines: List[str] = []
    i, n = 0, len(ops)
    while i < n:
        verb, family, obj = ops[i]
        if not isinstance(obj, ELEMENT_TYPES):
            lines.append(op_text(verb, family, obj, table))
            i += 1
            continue
        j = i
        with_value = verb == "add"
        batch: List[str] = []
        while j < n:
            v2, f2, o2 = ops[j]
            if v2 != verb or f2 != family or not isinstance(o2, ELEMENT_TYPES) or o2.set != obj.set:
                break
            for item in element_items(o2):
                if isinstance(item, ElementRun):
                    # This loop runs once per endpoint (100k at 10k services): keep it to one f-string.
                    p = item.prefix
                    if not item.indexed:
                        batch.extend([f"{p} : {v}" if with_value else p for v in item.values])
                    elif with_value:
                        batch.extend([f"{p} . {k} : {v}" for k, v in enumerate(item.values)])
                    else:
                        batch.extend([f"{p} . {k}" for k in range(len(item.values))])
                else:
                    batch.append(element_text(item, with_value))
            j += 1
        lines.append(f"{verb} element {family} {table} {names.identifier(obj.set)} {{ {', '.join(batch)} }}")
        i = j
    return lines


def ops_text(ops: Sequence[Op], table: str = names.TABLE) -> str:
    return "\n".join(ops_lines(ops, table)) + "\n"
