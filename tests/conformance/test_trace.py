"""Every flow of kube-proxy's packet-flow tables, on both backends, through netproxy's rendered rules.

Each flow is traced as ``netproxy trace`` traces it (the backend's tracer over its own rendered
rules, no kernel) and summed up in kube-proxy's words; it must equal the table's answer, or the
answer ``differences.yaml`` lists for it (and then differ from kube-proxy's: a fixed difference fails
until its entry goes).  tests/kernel/test_conformance.py sends real traffic for a sample.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from tests.conformance import differences
from tests.conformance.netproxy_answer import BACKENDS, Answers
from tests.conformance.tables import Case, Flow, State, Table, flow_id, load_all

TABLES: List[Table] = load_all()
DIFFERENCES = differences.load()
CHECKS: List[Tuple[str, Case, State, Flow]] = [
    (backend, case, state, flow) for table in TABLES for case, state, flow in table.flows() for backend in BACKENDS]
_answers: Dict[Tuple[str, int], Answers] = {}


def _answers_for(backend: str, case: Case, state: State) -> Answers:
    key = (backend, id(state))
    got = _answers.get(key)
    if got is None:
        got = _answers[key] = Answers(backend, case, state)
    return got


@pytest.mark.parametrize("backend,case,state,flow", CHECKS,
                         ids=[f"{flow_id(c, s, f)}@{b}" for b, c, s, f in CHECKS])
def test_flow(backend: str, case: Case, state: State, flow: Flow) -> None:
    fid = flow_id(case, state, flow)
    got = _answers_for(backend, case, state)(flow)
    listed = differences.find(DIFFERENCES, fid, backend)
    where = f"{fid} ({flow.protocol} {flow.source} -> {flow.destination}:{flow.port}) on netproxy's {backend} backend"
    if listed is None:
        assert got == flow.expect, f"{where}: kube-proxy {flow.expect}, netproxy {got}"
        return
    assert flow.expect == listed.kube_proxy, (
        f"{where}: differences.yaml says kube-proxy answers {listed.kube_proxy}, its table now says "
        f"{flow.expect}: the entry {listed.flow!r} is stale")
    assert got == listed.netproxy, (
        f"{where}: differences.yaml says netproxy answers {listed.netproxy}, it now answers {got}"
        + (" — the same as kube-proxy: delete the entry" if got == flow.expect else ""))


def test_every_listed_difference_names_a_flow() -> None:
    ids = [(flow_id(c, s, f), b) for b, c, s, f in CHECKS]
    unmatched = [d.flow for d in DIFFERENCES if not any(d.matches(fid, b) for fid, b in ids)]
    assert not unmatched, f"differences.yaml entries that match no flow on their backends: {unmatched}"


def test_tables_cover_both_files_and_name_their_source() -> None:
    """Every table names kube-proxy's file, version and test; both files are here (the README lists
    the test functions, and a table's absence would only show as fewer flows)."""
    files = {t.file for t in TABLES}
    assert files == {"pkg/proxy/iptables/proxier_test.go", "pkg/proxy/nftables/proxier_test.go"}, files
    assert all(t.version and t.test.startswith("Test") for t in TABLES)
    assert {t.name: t.objects_from for t in TABLES if t.objects_from} == {
        "iptables/TestTracePacket": "TestOverallIPTablesRules"}
    assert len(TABLES) == 22 and sum(1 for _ in CHECKS) == 2 * 453, (len(TABLES), len(CHECKS))
