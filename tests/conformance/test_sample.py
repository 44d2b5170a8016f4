"""The kernel stage's sample (``sample.py``) names real flows, covers every table, and its answers
vary: a sample of one kind of answer would let traffic and trace drift apart on the others."""

from __future__ import annotations

from typing import Set

from tests.conformance.sample import SAMPLE
from tests.conformance.tables import flow_id, load_all


def test_the_sample_covers_every_table_with_real_flows_of_every_kind() -> None:
    tables = {t.name: t for t in load_all()}
    assert set(SAMPLE) == set(tables), sorted(set(tables) ^ set(SAMPLE))
    kinds: Set[str] = set()
    for name, picks in SAMPLE.items():
        ids = {flow_id(c, s, f)[len(name) + 2:]: (c, s, f) for c, s, f in tables[name].flows()}
        unknown = [p for p in picks if p not in ids]
        assert not unknown, f"{name}: no such flows {unknown}"
        for pick in picks:
            case, state, flow = ids[pick]
            out = flow.expect.output
            kinds.add(out if out in ("DROP", "REJECT", "", "ACCEPT") else f"endpoints masq={flow.expect.masq}")
            kinds.update({f"proto {flow.protocol}", "IPv6" if ":" in flow.destination else "IPv4"})
            if state.name:
                kinds.add("a later state")
            if flow.source in case.node.addresses or flow.source == "127.0.0.1":
                kinds.add("from the node")
            if out == f"{flow.source}:{flow.port}" or out.startswith(f"{flow.source}:"):
                kinds.add("hairpin")
    assert kinds >= {"DROP", "REJECT", "", "endpoints masq=True", "endpoints masq=False", "proto UDP", "IPv6",
                     "a later state", "from the node", "hairpin"}, kinds
