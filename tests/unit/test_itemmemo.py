"""A changed JSON file's unchanged items are neither decoded nor converted again (netproxy/source/itemmemo.py),
and the load is the same as a fresh one's: same objects accepted, same refusals, same duplicates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from netproxy.source.files import Loaded, Memos, load
from netproxy_lab.manifests import endpoint_slice, port, service


def cluster(n: int, changed: int = -1, bad: int = -1) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    for i in range(n):
        svc = service(f"s{i}", f"10.96.{i // 250}.{i % 250 + 1}", [port(80, 8080, name="http")])
        if i == bad:
            svc["spec"]["ports"][0]["port"] = 70000
        last = 99 if i == changed else 10
        eps = [{"addresses": [f"10.244.{i // 250}.{i % 250}"], "conditions": {"ready": True}},
               {"addresses": [f"10.245.{i // 250}.{last}"], "conditions": {"ready": True}}]
        out += [svc, endpoint_slice(f"s{i}", eps, [port(8080, name="http")])]
    return out


def write(path: Path, items: List[Dict[str, Any]]) -> None:
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def same(a: Loaded, b: Loaded) -> None:
    assert a.services == b.services and a.endpoints == b.endpoints and a.skipped == b.skipped
    assert [str(e) for e in a.errors] == [str(e) for e in b.errors]


def test_only_the_changed_items_are_converted_again_and_the_load_is_a_fresh_ones(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    memos: Memos = {}
    write(path, cluster(50, bad=7))
    first = load(str(path), memos=memos)
    memo = memos[str(path)]
    assert (memo.hits, memo.misses) == (0, 100)
    write(path, cluster(50, changed=3, bad=7))
    again = load(str(path), memos=memos)
    assert (memo.hits, memo.misses) == (99, 101), "one slice changed: one item converted again"
    same(again, load(str(path)))
    key = ("default", "s3-a")
    assert again.endpoints[key] != first.endpoints[key]  # the change is there
    # Unchanged objects are the very objects of the first read (nothing converted again)...
    assert again.endpoints[("default", "s4-a")] is first.endpoints[("default", "s4-a")]
    assert again.services[("default", "s4")] is first.services[("default", "s4")]
    # ...and a reused refusal is reported again, naming the object and field as the first time.
    assert len(again.errors) == 1 and "default/s7" in str(again.errors[0]) and "70000" in str(again.errors[0])


def test_a_reused_object_is_judged_against_the_others_again(tmp_path: Path) -> None:
    """Only one object's conversion is kept: a name defined twice is found whatever was reused."""
    path = tmp_path / "c.json"
    memos: Memos = {}
    items = cluster(3)
    write(path, items)
    load(str(path), memos=memos)
    write(path, items + [items[0]])  # the same Service (same bytes) a second time
    twice = load(str(path), memos=memos)
    assert [e.field_path for e in twice.errors] == ["metadata.name"] and "defined twice" in str(twice.errors[0])
    same(twice, load(str(path)))


def test_an_invalid_service_still_claims_its_name(tmp_path: Path) -> None:
    """As before the memo: a Service refused for a field still holds its name, so a second one of the
    same name is "defined twice", not accepted."""
    path = tmp_path / "c.json"
    items = cluster(2, bad=0)
    write(path, items + [cluster(1)[0]])
    loaded = load(str(path), memos={})
    assert ("default", "s0") not in loaded.services
    assert sorted(e.field_path for e in loaded.errors) == ["metadata.name", "spec.ports[0].port"]


def test_a_file_that_does_not_parse_keeps_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    memos: Memos = {}
    write(path, cluster(5))
    load(str(path), memos=memos)
    path.write_text('{"kind": "List", "items": [')
    try:
        load(str(path), memos=memos)
    except Exception:
        pass
    else:
        raise AssertionError("a truncated file loaded")
    write(path, cluster(5))
    load(str(path), memos=memos)
    assert memos[str(path)].hits == 10, "the good reference survived the bad read"
