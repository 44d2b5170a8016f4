"""The deliberate differences (``differences.yaml``): flows where netproxy answers otherwise than
kube-proxy's table, on purpose, each with both answers and why.

An entry names its flows by id (``table::subtest::state::flow [PROTO]``; ``*`` matches any text) and
the backends it holds for.  The suite holds each entry to its word: it must match some flow, the
table must still say ``kube_proxy`` there (else kube-proxy changed and the entry is stale), and
netproxy must answer ``netproxy`` (else netproxy changed: a fixed difference is an entry to delete).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Optional, Pattern, Tuple

import yaml

from tests.conformance.tables import HERE, Answer, TableError

FILE = HERE / "differences.yaml"
BACKENDS = ("iptables", "nftables")


@dataclass(frozen=True)
class Difference:
    flow: str
    backends: Tuple[str, ...]
    kube_proxy: Answer
    netproxy: Answer
    why: str
    pattern: Pattern[str]

    def matches(self, flow_id: str, backend: str) -> bool:
        return backend in self.backends and self.pattern.fullmatch(flow_id) is not None


def _answer(doc: Mapping[str, Any], where: str) -> Answer:
    if not isinstance(doc, Mapping) or set(doc) - {"expect", "masq"} or "expect" not in doc:
        raise TableError(f"{where}: {{expect: ..., masq: ...}} expected, got {doc!r}")
    return Answer.of(str(doc["expect"]), bool(doc.get("masq", False)))


def load(path: Path = FILE) -> List[Difference]:
    out: List[Difference] = []
    for i, doc in enumerate(yaml.safe_load(path.read_text()) or []):
        where = f"{path.name}[{i}]"
        if set(doc) != {"flow", "backends", "kube_proxy", "netproxy", "why"}:
            raise TableError(f"{where}: fields flow, backends, kube_proxy, netproxy, why expected, got {sorted(doc)}")
        backends = tuple(doc["backends"])
        if not backends or set(backends) - set(BACKENDS):
            raise TableError(f"{where}.backends: {backends!r} is not a list of {BACKENDS}")
        kp, np = _answer(doc["kube_proxy"], f"{where}.kube_proxy"), _answer(doc["netproxy"], f"{where}.netproxy")
        if kp == np:
            raise TableError(f"{where}: kube_proxy and netproxy give the same answer ({kp}): no difference")
        if not str(doc["why"]).strip():
            raise TableError(f"{where}.why: say why")
        flow = str(doc["flow"])
        pattern = re.compile(".*".join(re.escape(part) for part in flow.split("*")))
        out.append(Difference(flow, backends, kp, np, str(doc["why"]).strip(), pattern))
    return out


def find(differences: List[Difference], flow_id: str, backend: str) -> Optional[Difference]:
    """The entry for this flow on this backend, or None; two entries for one check is an error."""
    hits = [d for d in differences if d.matches(flow_id, backend)]
    if len(hits) > 1:
        raise TableError(f"{flow_id} on {backend} is listed {len(hits)} times: {[d.flow for d in hits]}")
    return hits[0] if hits else None
