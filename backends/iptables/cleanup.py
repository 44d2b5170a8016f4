"""``netproxy cleanup``: remove the jump rules and every chain netproxy owns (its own, and those kube-proxy's
old userspace mode left: ``names.USERSPACE_CHAINS``), nothing else."""

from __future__ import annotations

import logging
from typing import List

from netproxy.backends.base import BackendError
from netproxy.backends.iptables import names, save
from netproxy.backends.iptables.assemble import TABLES
from netproxy.backends.iptables.kernel import Text
from netproxy.backends.iptables.payload import quote

log = logging.getLogger(__name__)


def cleanup_payload(saved: save.SavedTable) -> List[str]:
    """Restore lines that delete the rules of other chains jumping to ours, then flush and delete ours.

    Foreign rules are deleted by their saved spec (``-D chain <spec>``): only rules whose target is a
    chain we own, so that ``-X`` can succeed; every other rule stays.
    """
    owned = frozenset(c for c in saved.chains if names.is_owned(c))
    if not owned:
        return []
    lines = [f"*{saved.name}"]
    lines.extend(f":{c} - [0:0]" for c in sorted(owned))
    for chain, rule in saved.references_to(owned):
        if chain not in owned:
            lines.append(f"-D {quote(chain)} {rule}")
    lines.extend(f"-X {c}" for c in sorted(owned))
    lines.append("COMMIT")
    return lines


def stamp_payload(tools: Text, family: int) -> List[str]:
    """Restore lines that delete netproxy's stamp chain (adopt.py) from the mangle table, if it is there."""
    try:
        mangle = save.parse(tools.save(family, names.STAMP_TABLE)).get(names.STAMP_TABLE)
    except (BackendError, save.SaveParseError) as exc:
        log.info("IPv%d: the mangle table cannot be read (%s): no stamp to remove", family, exc)
        return []
    if mangle is None or names.STAMP_CHAIN not in mangle.chains:
        return []
    return [f"*{names.STAMP_TABLE}", f":{names.STAMP_CHAIN} - [0:0]", f"-X {names.STAMP_CHAIN}", "COMMIT"]


def cleanup(tools: Text) -> None:
    """Both families, both tables; a family whose tools or kernel support are missing is skipped."""
    for family in (4, 6):
        lines: List[str] = []
        try:
            for table in TABLES:
                tables = save.parse(tools.save(family, table))
                if table in tables:
                    lines.extend(cleanup_payload(tables[table]))
        except BackendError as exc:
            if family == 4:
                raise
            log.info("skipping IPv6 cleanup: %s", exc)
            continue
        lines.extend(stamp_payload(tools, family))
        if lines:
            tools.restore(family, "\n".join(lines) + "\n")
            log.info("removed netproxy's IPv%d chains", family)
