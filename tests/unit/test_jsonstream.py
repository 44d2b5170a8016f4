"""The streaming JSON reader gives exactly what json.loads gives, object by object, and the same errors."""

from __future__ import annotations

import json

import pytest

from netproxy.core.model import ValidationError
from netproxy.source.files import SourceError, flatten, read_documents, read_objects
from netproxy.source.jsonstream import iter_document

SVC = {"kind": "Service", "apiVersion": "v1", "metadata": {"name": "a \\\" ] } [ {", "namespace": "x"}}
EPS = {"kind": "EndpointSlice", "metadata": {"name": "b"}, "endpoints": [{"addresses": ["10.0.0.1"]}]}


@pytest.mark.parametrize("doc", [
    {"apiVersion": "v1", "items": [SVC, EPS], "kind": "List", "metadata": {}},
    {"kind": "List", "items": []},
    {"items": [SVC], "kind": "ServiceList"},
    SVC,
    {"kind": "ServiceList", "items": [{"metadata": {"name": "typed"}}], "metadata": {"resourceVersion": "1"}},
])
def test_objects_are_those_of_a_whole_parse(tmp_path: object, doc: object) -> None:
    path = f"{tmp_path}/cluster.json"
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    assert list(read_objects(path)) == list(flatten(read_documents(path)))


def test_items_come_one_at_a_time_before_the_rest_of_the_document() -> None:
    text = json.dumps({"apiVersion": "v1", "items": [SVC, EPS], "kind": "List"})
    got = list(iter_document(text))
    assert got == [("item", SVC), ("item", EPS), ("doc", {"apiVersion": "v1", "kind": "List"})]


@pytest.mark.parametrize("text", ['{"items": [{"kind": "Service"}, {"a": }', '{"items": [] "kind": "List"}',
                                  '{"a": 1} x', "[1, 2", ""])
def test_broken_json_is_a_source_error_naming_the_file(tmp_path: object, text: str) -> None:
    path = f"{tmp_path}/broken.json"
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(SourceError, match="broken.json: not valid JSON"):
        list(read_objects(path))


def test_a_non_object_item_names_the_file(tmp_path: object) -> None:
    path = f"{tmp_path}/odd.json"
    with open(path, "w") as f:
        f.write('{"kind": "List", "items": [3]}')
    (rejected,) = list(read_objects(path))  # refused alone, naming the file: the rest of it is used
    assert isinstance(rejected, ValidationError) and "odd.json" in str(rejected), rejected


@pytest.mark.parametrize("item", [
    '{"kind": "Service", "spec": {"port": 1e400}}',  # msgspec refuses the number, the standard library reads inf
    '{"kind": "Service", "metadata": {"name": "\\ud800"}}',  # a lone surrogate escape
    '{"kind": "Service", "spec": {"port": ' + "9" * 5000 + '}}',  # past the standard library's digit limit
    '{"kind": "Service", "spec": ' + "[" * 3000 + "]" * 3000 + '}',  # nested past the recursion limit
    '{"kind": "Service", "a": 1, "a": 2}',  # a duplicate key: the last one, as json.loads
    '{"kind": "Service", "spec": {"port": NaN}}',  # not JSON, which the standard library takes
])
def test_lists_read_by_msgspec_answer_as_the_standard_library(tmp_path: object, item: str) -> None:
    """A List is read by msgspec (its items as raw slices); where msgspec and the standard library
    differ, the answer or the error is still the standard library's, for that item or for the file."""
    from netproxy.source import jsonstream

    text = '{"kind": "List", "apiVersion": "v1", "items": [' + json.dumps(SVC) + ", " + item + "]}"
    path = f"{tmp_path}/cluster.json"
    with open(path, "w") as f:
        f.write(text)
    try:
        expected = ("objects", list(flatten([json.loads(text)], path)))
    except (ValueError, RecursionError) as err:
        expected = ("error", type(err).__name__)
    try:
        got = ("objects", list(read_objects(path)))
    except SourceError as err:
        got = ("error", "RecursionError" if "nested too deeply" in str(err) else "ValueError")
    assert repr(got) == repr(expected)  # repr: inf and a lone surrogate compare as text
    assert jsonstream._raw_items('{"kind": "List", "items": [' + json.dumps(SVC) + "]}") is not None


def test_only_lists_are_read_by_msgspec() -> None:
    from netproxy.source import jsonstream

    for text in (json.dumps(SVC), '{"items": [1]}', '{"kind": "Thing", "items": [1]}', '[1]', '{"kind": "List"}'):
        assert jsonstream._raw_items(text) is None, text
        assert [v for _, v in iter_document(text)] == [v for _, v in jsonstream._stream(text)]
