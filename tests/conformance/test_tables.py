"""The table loader refuses what it does not understand, naming the file and the field: a typo in a
table must not drop a flow or an answer unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.tables import TableError, load

HEAD = """kube_proxy: {file: pkg/proxy/iptables/proxier_test.go, version: v1.37.2, test: TestX}
node: {name: n, addresses: [192.168.0.2], primary: [192.168.0.2], flags: []}
cases:
  - objects: [{kind: Service, metadata: {namespace: a, name: b}}]
    states:
"""


def _load(tmp_path: Path, states: str) -> None:
    d = tmp_path / "iptables"
    d.mkdir()
    (d / "TestX.yaml").write_text(HEAD + states)
    load(d / "TestX.yaml")


CASES = [
    ("      - flows: [{name: f, from: 10.0.0.2, to: 10.0.0.3, port: 80, expect: DROP, masquerade: true}]",
     "unknown field(s) ['masquerade']"),
    ("      - flows: [{name: f, from: 10.0.0.2, to: 10.0.0.3, port: 80, expect: DROP}]\n"
     "        overrides: {g: {masq: true}}", "overrides name no flow: ['g']"),
    ("      - flows: [{name: f, from: 10.0.0.2, to: 10.0.0.3, port: 80, expect: DROP}]\n"
     "        overrides: {f: {expect: DROP}}", "is the flow's own value"),
    ("      - flows: [{name: f, from: 10.0.0.2, to: 10.0.0.3, port: 80, expect: DROP},"
     " {name: f, from: 10.0.0.2, to: 10.0.0.4, port: 80, expect: DROP}]", "flows named twice"),
    ("      - flows: [{name: f, from: 10.0.0.2, to: 10.0.0.3, port: 80, expect: DROP, protocol: ICMP}]",
     "'ICMP' is not one of"),
    ("      - flows: [{name: f, from: 10.0.0.2, to: 10.0.0.3, port: 80, expect: 'DROP,x'}]",
     "'DROP' of 'DROP,x' is not an endpoint"),
    ("      - delete: [Service/a/c]\n        flows: []", "Service/a/c is not one of the case's objects"),
    ("      - {}", "a required field is missing: 'flows'"),
]


@pytest.mark.parametrize("states,says", CASES, ids=[says for _, says in CASES])
def test_a_bad_table_is_refused_naming_the_field(tmp_path: Path, states: str, says: str) -> None:
    with pytest.raises(TableError, match="iptables/TestX.yaml") as err:
        _load(tmp_path, states)
    assert says in str(err.value)
