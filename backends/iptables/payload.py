"""Rules → ``iptables-restore`` text, with quoting that no argument can escape."""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from netproxy.backends.iptables.diff import TableChange
from netproxy.backends.iptables.tree import Chains, Rule

_SAFE = re.compile(r"[A-Za-z0-9_.:/\-\[\]!,=+@%]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def quote(arg: str) -> str:
    """One argument as iptables-restore's tokenizer reads it back unchanged.

    Inside double quotes the tokenizer takes a backslash as "next character is literal"; a newline
    would end the line whatever the quoting, so control characters are refused here (the renderer's
    :func:`safe_comment` already removed them from comments).
    """
    if _SAFE.fullmatch(arg):
        return arg
    if _CONTROL.search(arg):  # one regex, not a Python test per character (the stamp's comments: 9 MB at 100k)
        raise ValueError(f"argument {arg!r} contains a control character")
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def quote_always(arg: str) -> str:
    """Comments are always quoted, as iptables-save prints them, so that payload and save output read alike."""
    quoted = quote(arg)
    return quoted if quoted.startswith('"') else f'"{quoted}"'


_SAFE_WORDS = re.compile(r"[A-Za-z0-9_.:/\-\[\]!,=+@%]*")


def rule_line(verb: str, chain: str, rule: Rule) -> str:
    """``-A CHAIN args...`` with comments always quoted and any other odd argument quoted too."""
    if "--comment" not in rule:
        # Most rules at scale (large-cluster endpoint rules carry no comment): all plain words.
        if _SAFE_WORDS.fullmatch("".join(rule)) and "" not in rule:
            return " ".join((verb, chain) + rule)
    else:
        at = rule.index("--comment") + 1
        plain = rule[:at] + rule[at + 1:]
        # One regex over the arguments run together (no separator: a space in any argument fails it).
        if _SAFE_WORDS.fullmatch("".join(plain)) and "" not in plain:
            return " ".join((verb, chain) + rule[:at] + (quote_always(rule[at]),) + rule[at + 1:])
    parts = [verb, chain]
    after_comment = False
    for arg in rule:
        parts.append(quote_always(arg) if after_comment else quote(arg))
        after_comment = arg == "--comment"
    return " ".join(parts)


class ChainTextCache:
    """Rule text per chain, reused while the chain's rules are the same tuple (the backend caches
    rendered services, so unchanged chains are the very same objects on the next sync)."""

    def __init__(self) -> None:
        self._texts: Dict[str, Tuple[Tuple[Rule, ...], str]] = {}

    def text(self, chain: str, rules: Tuple[Rule, ...]) -> str:
        """The chain's ``-A`` lines as one string (each line ending in a newline)."""
        hit = self._texts.get(chain)
        if hit is not None and (hit[0] is rules or hit[0] == rules):
            return hit[1]
        text = "".join(rule_line("-A", chain, r) + "\n" for r in rules)
        self._texts[chain] = (rules, text)
        return text

    def lines(self, chain: str, rules: Tuple[Rule, ...]) -> List[str]:
        return self.text(chain, rules).splitlines()

    def forget(self, chains: Iterable[str]) -> None:
        for chain in chains:
            self._texts.pop(chain, None)


def table_text(change: TableChange, counters: Optional[Mapping[str, str]] = None,
               cache: Optional[ChainTextCache] = None) -> List[str]:
    """One ``*table ... COMMIT`` block: declare (flush) every chain written or deleted, append rules,
    insert jump rules, then delete stale chains — in the one order that never references a chain
    that is gone."""
    counters = counters or {}
    lines = [f"*{change.table}"]
    for chain in list(change.write) + change.delete:
        lines.append(f":{chain} - {counters.get(chain, '[0:0]')}")
    for chain, rules in change.write.items():
        lines.extend(cache.lines(chain, rules) if cache else [rule_line("-A", chain, r) for r in rules])
    for hook, rule in change.jumps:
        lines.append(rule_line("-I", f"{hook} 1", rule))
    lines.extend(f"-X {chain}" for chain in change.delete)
    lines.append("COMMIT")
    return lines


def restore_chunks(changes: Iterable[TableChange], cache: Optional[ChainTextCache] = None) -> Iterator[str]:
    """The same text as :func:`table_text` for every non-empty change, in pieces (a chain each) so
    that a writer can stream them into ``iptables-restore`` while the next ones are being made."""
    for change in changes:
        if change.empty():
            continue
        yield "".join([f"*{change.table}\n"] + [f":{chain} - [0:0]\n" for chain in list(change.write) + change.delete])
        for chain, rules in change.write.items():
            # Without a cache (one sync and done) each chain's text is made, sent and dropped.
            yield cache.text(chain, rules) if cache is not None else \
                "".join(rule_line("-A", chain, r) + "\n" for r in rules)
        tail = [rule_line("-I", f"{hook} 1", rule) for hook, rule in change.jumps]
        tail += [f"-X {chain}" for chain in change.delete]
        yield "".join(line + "\n" for line in tail + ["COMMIT"])
        if cache is not None:
            cache.forget(change.delete)


def restore_payload(changes: Iterable[TableChange], cache: Optional[ChainTextCache] = None) -> str:
    return "".join(restore_chunks(changes, cache))


def plan_text(families: Iterable[Tuple[int, Mapping[str, Chains], Mapping[str, Tuple[Tuple[str, Rule], ...]]]]
              ) -> str:
    """The full ruleset as restore text, per family, each under a header line saying which tool."""
    out: List[str] = []
    for family, tables, jumps in families:
        tool = "iptables-restore" if family == 4 else "ip6tables-restore"
        out.append(f"# IPv{family} ({tool} --noflush)")
        for table, chains in tables.items():
            change = TableChange(table, dict(chains), [], list(jumps.get(table, ())))
            out.extend(table_text(change))
    return "\n".join(out) + "\n"
