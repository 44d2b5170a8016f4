"""The reflector's pieces that need no server: backoff arithmetic and the watch stream's line splitting."""

from __future__ import annotations

import json
from typing import Iterator, List

import pytest

from netproxy.source.kube_reflector import Backoff, Expired, Reflector, WatchError, iter_lines


class FakeResponse:
    def __init__(self, chunks: List[bytes]) -> None:
        self.chunks = chunks

    def stream(self, amt: object = None, decode_content: bool = False) -> Iterator[bytes]:
        yield from self.chunks


def test_backoff_doubles_caps_and_jitters() -> None:
    draws = iter([0.0, 0.5, 0.99, 0.0, 0.0, 0.0, 0.25])
    b = Backoff(initial=0.8, cap=30.0, jitter=1.0, rand=lambda: next(draws))
    got = [b.next_delay() for _ in range(6)]
    assert got == pytest.approx([0.8, 1.6 * 1.5, 3.2 * 1.99, 6.4, 12.8, 25.6])
    assert b.next_delay() == pytest.approx(30.0 * 1.25)  # capped before jitter
    b.reset()
    b.rand = lambda: 0.0
    assert b.next_delay() == pytest.approx(0.8)


def test_backoff_survives_many_failures() -> None:
    b = Backoff(initial=1.0, cap=5.0, jitter=0.0)
    for _ in range(200):
        delay = b.next_delay()
    assert delay == 5.0


@pytest.mark.parametrize("split", [1, 7, 64, 10_000])
def test_lines_survive_any_chunking(split: int) -> None:
    events = [{"type": "ADDED", "object": {"metadata": {"name": f"o{i}", "note": "é" * i}}} for i in range(20)]
    data = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    chunks = [data[i:i + split] for i in range(0, len(data), split)]
    got = [json.loads(line) for line in iter_lines(FakeResponse(chunks))]
    assert got == events


def test_last_line_without_newline_is_kept() -> None:
    assert list(iter_lines(FakeResponse([b'{"a":1}\n{"b"', b":2}"]))) == [b'{"a":1}', b'{"b":2}']


class Recorder:
    def __init__(self) -> None:
        self.events: List[tuple] = []

    def replace(self, items: Iterator[dict]) -> None:
        list(items)

    def apply(self, event_type: str, obj: dict) -> None:
        self.events.append((event_type, obj["metadata"]["resourceVersion"]))


def reflector() -> tuple:
    rec = Recorder()
    return Reflector("Service", lambda **kw: None, rec), rec


def test_event_versions_advance_only_after_apply() -> None:
    r, rec = reflector()
    r.resource_version = "5"
    r._event(b'{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"6"}}}')
    r._event(b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}}')
    assert rec.events == [("ADDED", "6")] and r.resource_version == "9"

    def failing(event_type: str, obj: dict) -> None:
        raise RuntimeError("handler failed")

    rec.apply = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        r._event(b'{"type":"MODIFIED","object":{"metadata":{"name":"a","resourceVersion":"10"}}}')
    assert r.resource_version == "9"  # the resumed watch will deliver version 10 again


def test_error_events() -> None:
    r, _ = reflector()
    with pytest.raises(Expired, match="too old"):
        r._event(b'{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old resource version"}}')
    with pytest.raises(WatchError, match="500"):
        r._event(b'{"type":"ERROR","object":{"kind":"Status","code":500,"message":"etcd leader changed"}}')
    with pytest.raises(WatchError, match="malformed"):
        r._event(b'{"type": "ADDED"')


class PageResponse:
    def __init__(self, body: dict) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def test_the_next_page_is_requested_while_the_current_one_is_converted() -> None:
    """The list's pages overlap the handler's work: page 2 is asked for before page 1's items have
    all been handed over, and the items still arrive whole and in order."""
    import threading

    asked: List[str] = []
    second_asked = threading.Event()

    def list_func(**kwargs: object) -> PageResponse:
        cont = str(kwargs.get("_continue") or "")
        asked.append(cont)
        if cont == "2":
            second_asked.set()
        nxt = {"": "2", "2": "3", "3": ""}[cont]
        page = int(cont or 1)
        return PageResponse({"metadata": {"continue": nxt, "resourceVersion": "9"},
                             "items": [{"metadata": {"name": f"p{page}-{i}"}} for i in range(3)]})

    seen: List[str] = []
    overlapped: List[bool] = []

    class Slow:
        def replace(self, items: Iterator[dict]) -> None:
            for item in items:
                if item["metadata"]["name"] == "p1-0":
                    overlapped.append(second_asked.wait(5))
                seen.append(item["metadata"]["name"])

        def apply(self, event_type: str, obj: dict) -> None:
            raise AssertionError("no watch here")

    assert Reflector("Service", list_func, Slow()).list_once() == "9"
    assert overlapped == [True]
    assert seen == [f"p{p}-{i}" for p in (1, 2, 3) for i in range(3)]
    assert asked == ["", "2", "3"]
