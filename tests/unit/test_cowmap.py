"""netproxy.core.cowmap: the tracker's copy-on-write maps, held to a plain dict doing the same."""

from __future__ import annotations

import random
from typing import Dict, List, Mapping, Tuple

import pytest

from netproxy.core import cowmap
from netproxy.core.cowmap import CowMap, FrozenView


def _check(view: Mapping[int, str], want: Dict[int, str]) -> None:
    assert len(view) == len(want)
    assert sorted(view) == sorted(want)
    assert dict(view.items()) == want
    for key in range(-2, 60):
        assert (key in view) == (key in want)
        assert view.get(key) == want.get(key)
        assert view.get(key, "default") == want.get(key, "default")
        if key in want:
            assert view[key] == want[key]
        else:
            with pytest.raises(KeyError):
                view[key]


@pytest.mark.parametrize("seed", range(20))
def test_every_view_keeps_what_the_map_held_when_it_was_taken(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cowmap, "MERGE_MIN", 4)  # merges every few changes, so that both paths run
    rng = random.Random(seed)
    m: CowMap[int, str] = CowMap()
    model: Dict[int, str] = {}
    taken: List[Tuple[Mapping[int, str], Dict[int, str]]] = []
    for step in range(400):
        key = rng.randrange(50)
        if rng.random() < 0.35:
            m.pop(key)
            model.pop(key, None)
        else:
            m[key] = f"{key}@{step}"
            model[key] = f"{key}@{step}"
        assert len(m) == len(model) and (key in m) == (key in model) and m.get(key) == model.get(key)
        if rng.random() < 0.2:
            taken.append((m.frozen(), dict(model)))
    assert taken
    for view, want in taken:  # every view, however many changes and merges came after it
        _check(view, want)


def test_a_view_copies_only_the_changes_since_the_last_merge() -> None:
    m: CowMap[int, str] = CowMap()
    for k in range(100_000):
        m[k] = str(k)
    first = m.frozen()  # the initial fill is merged at once: the view is the base itself
    assert type(first) is dict and len(first) == 100_000
    assert m.frozen() is first  # nothing changed: the same object, no copy
    m[5] = "five"
    m.pop(6)
    second = m.frozen()
    assert isinstance(second, FrozenView) and len(second._delta) == 2 and second._base is first
    assert (second[5], 6 in second, first[5], 6 in first) == ("five", False, "5", True)


def test_the_delta_is_merged_past_its_bound_into_a_new_base() -> None:
    m: CowMap[int, str] = CowMap()
    for k in range(100_000):
        m[k] = str(k)
    base = m.frozen()
    bound = max(cowmap.MERGE_MIN, 100_000 // cowmap.MERGE_FRACTION)
    for k in range(bound):
        m[k] = "x"
    view = m.frozen()
    assert isinstance(view, FrozenView) and len(view._delta) == bound  # at the bound: not yet
    m[bound] = "x"
    merged = m.frozen()
    assert type(merged) is dict and merged is not base and merged[bound] == "x" and base[bound] == str(bound)
    assert view[bound] == str(bound) and view[0] == "x"  # the earlier view is untouched by the merge


def test_none_is_refused_as_a_value() -> None:
    m: CowMap[int, object] = CowMap()
    with pytest.raises(AssertionError):
        m[1] = None
