"""kube-proxy's iptables rules on a node: which chains are its, and the payload that removes them.

kube-proxy (iptables mode, ``pkg/proxy/iptables/proxier.go``) writes, in nat, filter and mangle of
both families: ``KUBE-SERVICES``, ``KUBE-NODEPORTS``, ``KUBE-POSTROUTING``, ``KUBE-MARK-MASQ``,
``KUBE-EXTERNAL-SERVICES``, ``KUBE-FORWARD``, ``KUBE-PROXY-FIREWALL``, ``KUBE-PROXY-CANARY`` and per
service/endpoint ``KUBE-SVC-``, ``KUBE-SVL-``, ``KUBE-EXT-``, ``KUBE-FW-``, ``KUBE-SEP-`` (older
releases ``KUBE-XLB-``), and the jumps to them from the built-in chains.

Most of these are netproxy's own iptables names too (``names.py``: kube-proxy's hashes, so that an
operator finds a service's chain where kube-proxy put it).  Two consequences:

- which of the two wrote the ``KUBE-*`` chains of a table is told by what only kube-proxy writes
  (:data:`MARKERS`: per-endpoint ``KUBE-SEP-`` chains, its canary, ``KUBE-FORWARD``,
  ``KUBE-PROXY-FIREWALL``); netproxy writes endpoints inline and none of those;
- removing kube-proxy's rules after netproxy took the same names over must keep netproxy's chains
  and jumps: :func:`removal_payload` takes what to keep.

kubelet's chains in the same tables (``KUBE-FIREWALL``, ``KUBE-KUBELET-CANARY``, ``KUBE-MARK-DROP``,
``KUBE-IPTABLES-HINT``) are not kube-proxy's and are never touched, nor is any other rule but the
jumps into a chain being removed.
"""

from __future__ import annotations

from typing import AbstractSet, FrozenSet, List, Tuple

from netproxy.backends.iptables import save
from netproxy.backends.iptables.payload import quote

TABLES = ("nat", "filter", "mangle")
CHAINS = frozenset({"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
                    "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY"})
PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-")
MARKERS = frozenset({"KUBE-PROXY-CANARY", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL"})
MARKER_PREFIXES = ("KUBE-SEP-",)


def is_kube_proxy(chain: str) -> bool:
    """Whether kube-proxy writes a chain of this name (netproxy may write it too: see the module)."""
    return chain in CHAINS or chain.startswith(PREFIXES)


def is_marker(chain: str) -> bool:
    """Whether only kube-proxy (never netproxy) writes a chain of this name."""
    return chain in MARKERS or chain.startswith(MARKER_PREFIXES)


def removal_payload(saved: save.SavedTable, keep: AbstractSet[str] = frozenset(),
                    keep_jumps: AbstractSet[Tuple[str, str]] = frozenset()) -> List[str]:
    """``iptables-restore --noflush`` lines removing kube-proxy's chains of one table but ``keep``.

    Every rule outside the removed chains that jumps into one of them is deleted by its saved spec;
    so is a built-in chain's jump into a kept chain unless (built-in chain, target) is in
    ``keep_jumps`` (kube-proxy's extra entry points, e.g. ``FORWARD -j KUBE-EXTERNAL-SERVICES``, into
    a chain netproxy now fills with its own rules).  Chains are flushed first and deleted last, so
    the one table write never references a chain that is gone.
    """
    remove = frozenset(c for c in saved.chains if is_kube_proxy(c) and c not in keep)
    unjump: List[Tuple[str, str]] = []
    for chain in saved.chains.values():
        if chain.name in remove:
            continue
        builtin = chain.policy != "-"
        for rule in chain.rules:
            target = save.rule_target(rule)
            if target is None:
                continue
            if target in remove or (builtin and target in keep and is_kube_proxy(target)
                                    and (chain.name, target) not in keep_jumps):
                unjump.append((chain.name, rule))
    if not remove and not unjump:
        return []
    lines = [f"*{saved.name}"]
    lines.extend(f":{c} - [0:0]" for c in sorted(remove))
    lines.extend(f"-D {quote(chain)} {rule}" for chain, rule in unjump)
    # Deleted in reverse name order: libiptc rebuilds its chain index when a deleted chain starts an
    # index bucket, which forward order hits again and again (kube-proxy's 110k chains at 10k
    # services: 4.8 s of iptables-legacy-restore CPU forward, 1.6 s reversed).
    lines.extend(f"-X {c}" for c in sorted(remove, reverse=True))
    lines.append("COMMIT")
    return lines


def masquerade_marks(saved: save.SavedTable) -> FrozenSet[str]:
    """The marks ``KUBE-MARK-MASQ`` sets (``--or-mark 0x4000`` → ``0x4000``), normalised to hex."""
    chain = saved.chains.get("KUBE-MARK-MASQ")
    found = set()
    for rule in chain.rules if chain is not None else ():
        words = rule.split()
        for flag in ("--or-mark", "--set-xmark", "--set-mark"):
            if flag in words and words.index(flag) + 1 < len(words):
                value = words[words.index(flag) + 1].split("/")[0]
                try:
                    found.add(hex(int(value, 0)))
                except ValueError:
                    continue
    return frozenset(found)
