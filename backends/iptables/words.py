"""An iptables rule's argument words as options with their values: the one reading of them that the
libiptc rule builder and the tracer share (both walk the words iptables itself takes).

An option is a word that starts with ``-`` (``-s``, ``-m``, ``--dport``, ``-j``); its values are the
words up to the next option: none (``--exist``), one (``-p tcp``), or more (``--match-set NAME
src,dst,dst``).  A ``!`` before an option negates it (``! -s 10.0.0.0/8``, ``-m set ! --match-set``).
netproxy's rules never carry a value that starts with ``-``: names, addresses, ports and comments
(a service's ``namespace/name:port``, whose DNS labels cannot start with one) — so a value is never
taken for an option.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence, Tuple


class Option(NamedTuple):
    name: str
    """``-s``, ``-m``, ``--dport``, ``-j``…"""
    values: Tuple[str, ...]
    negated: bool = False

    @property
    def value(self) -> str:
        """The first value, or "" for an option that takes none."""
        return self.values[0] if self.values else ""


def options(words: Sequence[str]) -> Iterator[Option]:
    """The rule's options in order; ValueError for a value with no option before it."""
    i, n = 0, len(words)
    negated = False
    while i < n:
        word = words[i]
        if word == "!":
            negated = True
            i += 1
            continue
        if not word.startswith("-"):
            raise ValueError(f"{' '.join(words)!r}: {word!r} follows no option")
        j = i + 1
        while j < n and words[j] != "!" and not words[j].startswith("-"):
            j += 1
        yield Option(word, tuple(words[i + 1:j]), negated)
        negated = False
        i = j
