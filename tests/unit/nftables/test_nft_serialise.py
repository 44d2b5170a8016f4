"""The serialiser and the runner's error parsing."""

from __future__ import annotations

from netproxy.backends.nftables import serialise
from netproxy.backends.nftables.kernel.libnftables import failing_command, sets_from_json
from netproxy.backends.nftables.objects import Chain, Element, Hook, Rule, Set, Table


def test_each_object_as_one_command() -> None:
    assert serialise.op_text("add", "ip", Table("ip", "netproxy", "c")) == 'add table ip netproxy { comment "c"; }'
    assert serialise.op_text("delete", "ip6", Table("ip6", "netproxy")) == "delete table ip6 netproxy"
    assert serialise.op_text("add", "ip", Chain("nat-output", Hook("nat", "output", -100))) == (
        "add chain ip netproxy nat-output { type nat hook output priority -100; policy accept; }")
    assert serialise.op_text("flush", "ip", Chain("c", Hook("nat", "output", -100))) == "flush chain ip netproxy c"
    assert serialise.op_text("add", "ip", Rule("c", "reject", 'a"b')) == 'add rule ip netproxy c reject comment "a_b"'
    assert serialise.op_text("add", "ip", Set("aff-x", "ipv4_addr", flags=("dynamic", "timeout"), timeout=5)) == (
        "add set ip netproxy aff-x { type ipv4_addr; flags dynamic,timeout; timeout 5s; }")
    assert serialise.op_text("delete", "ip", Set("m", "ipv4_addr", "verdict")) == "delete map ip netproxy m"
    assert serialise.op_text("delete", "ip", Element("m", "1.2.3.4 . tcp . 80", "goto x", "c")) == (
        'delete element ip netproxy m { 1.2.3.4 . tcp . 80 comment "c" }')


def test_runs_of_elements_become_one_command_per_set() -> None:
    ops = [("add", "ip", Element("m", "k1", "v1")), ("add", "ip", Element("m", "k2", "v2", "c")),
           ("add", "ip", Element("n", "k3", "v3")), ("delete", "ip", Element("n", "k4", "v4")),
           ("add", "ip", Element("aff", "1.2.3.4", expires=30))]
    assert serialise.ops_lines(ops) == [
        'add element ip netproxy m { k1 : v1, k2 comment "c" : v2 }',
        "add element ip netproxy n { k3 : v3 }",
        "delete element ip netproxy n { k4 }",
        "add element ip netproxy aff { 1.2.3.4 expires 30s }",
    ]


def test_names_cannot_break_out_of_a_command() -> None:
    line = serialise.op_text("add", "ip", Chain('x; flush ruleset; "'))
    assert ";" not in line.split("add chain ip netproxy ", 1)[1]


def test_failing_command_is_the_line_after_error() -> None:
    err = ("internal:0:0-0: Error: Could not process rule: No such file or directory\n"
           "add element ip netproxy cluster-endpoints-3 { 10.0.0.1 . tcp . 80 . 0 : 10.1.0.1 . 8080 }\n"
           "                        ^^^^^^^^^^^^^^^^^^^\n")
    assert failing_command(err) == (
        "add element ip netproxy cluster-endpoints-3 { 10.0.0.1 . tcp . 80 . 0 : 10.1.0.1 . 8080 }")
    assert failing_command("nothing useful") is None


def test_affinity_sets_parsed_from_json_with_time_left() -> None:
    items = [{"metainfo": {}},
             {"set": {"family": "ip", "name": "aff-a", "table": "netproxy", "type": "ipv4_addr",
                      "flags": ["timeout"], "timeout": 60,
                      "elem": [{"elem": {"val": "10.0.0.5", "expires": 41}}, "10.0.0.6",
                               {"elem": {"val": {"concat": ["10.0.0.7", "10.1.0.4", 8080]}, "expires": 7}},
                               {"elem": {"val": {"prefix": {"addr": "10.0.0.0", "len": 8}}}}]}}]
    [(spec, elements)] = sets_from_json(items)
    assert spec.name == "aff-a" and spec.timeout == 60
    assert [(e.key, e.expires) for e in elements] == [
        ("10.0.0.5", 41), ("10.0.0.6", None), ("10.0.0.7 . 10.1.0.4 . 8080", 7)]
