"""``netproxy plan --diff``: what a sync would change, against what the kernel holds now.

Both sides come from the backend's listing (``netproxy.backends.listing``): the node's tables, and the
rendered plan loaded into a scratch namespace, both listed and normalised the same way.  The lines
that differ are grouped by the service they belong to (named by the rule's or element's comment, or
by a service address and port they carry), so an operator reads "shop/cart: +2 -1", not a raw dump.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Sequence, Tuple

from netproxy.core.model import Snapshot

SHARED = "(not a single service: dispatch, masquerade, shared chains)"
_COMMENT = re.compile(r'"([a-z0-9][a-z0-9-]*/[a-z0-9][a-z0-9.-]*(?::[a-z0-9-]+)?)"')
_TOKENS = re.compile(r"[0-9A-Fa-f:.]+")


def _owners(snapshot: Snapshot) -> Dict[str, List[Tuple[str, str]]]:
    """Service address → [(port, "ns/name:port")] for naming lines without a comment."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    for name, svc in snapshot.services.items():
        for addr in svc.addresses():
            out.setdefault(str(addr), []).append((str(svc.port), str(name)))
    return out


def owner(line: str, owners: Dict[str, List[Tuple[str, str]]]) -> str:
    m = _COMMENT.search(line)
    if m:
        return m.group(1)
    tokens = [t.split("/")[0] for t in _TOKENS.findall(line)]
    present = set(tokens)
    for tok in tokens:
        for port, name in owners.get(tok, ()):
            if port in present:
                return name
    return SHARED


def diff(kernel: Sequence[str], rendered: Sequence[str], snapshot: Snapshot) -> Dict[str, Tuple[List[str], List[str]]]:
    """{service: (lines to add, lines to remove)}; empty when the kernel matches the plan.

    Compared as multisets of normalised lines: a listing's order within a chain is the rule order,
    which is part of the line's context only through position, so a reordering alone shows as the
    moved lines removed and added.
    """
    have, want = Counter(kernel), Counter(rendered)
    if have == want and list(kernel) == list(rendered):
        return {}
    owners = _owners(snapshot)
    out: Dict[str, Tuple[List[str], List[str]]] = {}
    if have == want:  # same lines, another order: name the chains whose order differs
        out[SHARED] = ([f"(order) {line}" for line, k in zip(rendered, kernel) if line != k], [])
        return out
    for line in (want - have).elements():
        out.setdefault(owner(line, owners), ([], []))[0].append(line)
    for line in (have - want).elements():
        out.setdefault(owner(line, owners), ([], []))[1].append(line)
    return out


def render(changes: Dict[str, Tuple[List[str], List[str]]]) -> str:
    if not changes:
        return "the kernel already holds this plan: a sync would change nothing\n"
    lines: List[str] = []
    for service in sorted(changes, key=lambda s: (s == SHARED, s)):
        add, remove = changes[service]
        lines.append(f"{service}: +{len(add)} -{len(remove)}")
        lines += [f"  - {x}" for x in remove] + [f"  + {x}" for x in add]
    return "\n".join(lines) + "\n"
