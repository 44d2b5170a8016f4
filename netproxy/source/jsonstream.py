"""The objects of a JSON ``List`` one at a time, so a 10k-service source never exists twice in memory.

``json.loads`` of ``kubectl get svc,endpointslices -A -o json`` at 10k services builds ~90 MB of
dicts before the first one is converted (the process peaked at 124 MB after the parse alone,
measured in docs/performance.md).  This hands out each element of ``items`` as soon as it is
decoded: the peak is the text plus one object.  A ``List`` is read by msgspec (its frame first, the
items left as raw slices of the text, then decoded one by one); anything else, and anything msgspec
refuses, by the standard library's own decoder, value by value, whose answers and errors are the
reference.  Anything that is not a top-level object is decoded whole.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Optional, Tuple, TypedDict

import msgspec

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


class _List(TypedDict, total=False):
    """A ``kind: List`` document as msgspec first reads it: its items left as undecoded slices."""

    apiVersion: Any
    kind: Any
    metadata: Any
    items: List[msgspec.Raw]


_LIST = msgspec.json.Decoder(_List)
_ANY = msgspec.json.Decoder()


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _expect(text: str, i: int, char: str) -> int:
    i = _skip(text, i)
    if i >= len(text) or text[i] != char:
        raise json.JSONDecodeError(f"Expecting {char!r}", text, i)
    return i + 1


def iter_document(text: str, raw: bool = False) -> Iterator[Tuple[str, Any]]:
    """("item", object) for each element of a top-level ``items`` list, then ("doc", the rest of
    the top-level value without ``items``: of a ``List``, its ``apiVersion``, ``kind`` and
    ``metadata``).  Raises :class:`json.JSONDecodeError` on bad JSON.  ``raw``: a ``List`` read by
    msgspec hands out ("raw", its undecoded bytes) instead, for the caller to :func:`decode`
    only when it needs the object (:mod:`itemmemo`); the standard library's stream never does."""
    items = _raw_items(text, raw)
    if items is not None:
        yield from items
        return
    yield from _stream(text)


def decode(raw: msgspec.Raw) -> Any:
    """One item of a ``List`` from its bytes: by msgspec, or by the standard library where msgspec
    refuses (see :func:`_raw_items`)."""
    try:
        return _ANY.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        return json.loads(bytes(raw))


def _raw_items(text: str, raw: bool = False) -> Optional[Iterator[Tuple[str, Any]]]:
    """The same answers for a well-formed ``List`` document, decoded by msgspec: the list's frame
    first, each item kept as an undecoded slice of the text (``msgspec.Raw``), then decoded one at a
    time — the stream's memory (the text and one item), in C: 0.14 s against 0.22 s for the bench's
    10k-service file.  None for anything else — not a List, or a text msgspec's first read refuses
    (bad JSON, or what only the standard library takes: ``NaN``, a lone surrogate escape): the
    standard library's stream then reads it all, so its answers and its error messages stay the
    only ones.  An item msgspec refuses (a number past a double's range, ``1e400``; an integer past
    its own) is decoded by the standard library alone, for the same reason."""
    try:
        top = _LIST.decode(text)
    except (msgspec.MsgspecError, RecursionError):
        return None
    items = top.get("items")
    if items is None or not (isinstance(top.get("kind"), str) and top["kind"].endswith("List")):
        return None
    return _decoded(items, {k: v for k, v in top.items() if k != "items"}, raw)


def _decoded(items: List[msgspec.Raw], rest: Dict[str, Any], raw: bool) -> Iterator[Tuple[str, Any]]:
    for item in items:
        if raw:
            yield "raw", item
        else:
            yield "item", decode(item)
    yield "doc", rest


def _stream(text: str) -> Iterator[Tuple[str, Any]]:
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "{":
        value, end = _DECODER.raw_decode(text, i)
        if _skip(text, end) != len(text):
            raise json.JSONDecodeError("Extra data", text, _skip(text, end))
        yield "doc", value
        return
    rest: Dict[str, Any] = {}
    i = _skip(text, i + 1)
    if i < len(text) and text[i] == "}":
        i += 1
    else:
        while True:
            key, i = _DECODER.raw_decode(text, _skip(text, i))
            if not isinstance(key, str):
                raise json.JSONDecodeError("Expecting property name", text, i)
            i = _skip(text, _expect(text, i, ":"))
            if key == "items" and i < len(text) and text[i] == "[":
                stop = [i]
                yield from _items(text, i, stop)
                i = stop[0]
            else:
                rest[key], i = _DECODER.raw_decode(text, i)
            i = _skip(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            i = _expect(text, i, "}")
            break
    if _skip(text, i) != len(text):
        raise json.JSONDecodeError("Extra data", text, _skip(text, i))
    yield "doc", rest


def _items(text: str, i: int, end: List[int]) -> Iterator[Tuple[str, Any]]:
    """The elements of the list starting at ``i``; ``end[0]`` is set to where it ends."""
    i = _skip(text, i + 1)
    if i < len(text) and text[i] == "]":
        end[0] = i + 1
        return
    while True:
        value, i = _DECODER.raw_decode(text, _skip(text, i))
        yield "item", value
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        end[0] = _expect(text, i, "]")
        return
