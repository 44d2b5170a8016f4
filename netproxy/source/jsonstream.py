"""The objects of a JSON ``List`` one at a time, so a 10k-service source never exists twice in memory.

``json.loads`` of ``kubectl get svc,endpointslices -A -o json`` at 10k services builds ~90 MB of
dicts before the first one is converted (the process peaked at 124 MB after the parse alone,
measured in docs/performance.md).  This walks the top-level object with the standard library's own
decoder, value by value, and hands out each element of ``items`` as soon as it is decoded: the peak
is the text plus one object.  Anything that is not a top-level object is decoded whole.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Tuple

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _expect(text: str, i: int, char: str) -> int:
    i = _skip(text, i)
    if i >= len(text) or text[i] != char:
        raise json.JSONDecodeError(f"Expecting {char!r}", text, i)
    return i + 1


def iter_document(text: str) -> Iterator[Tuple[str, Any]]:
    """("item", object) for each element of a top-level ``items`` list, then ("doc", the rest of
    the top-level value without ``items``).  Raises :class:`json.JSONDecodeError` on bad JSON."""
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
