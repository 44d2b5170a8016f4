"""The hostile-input floor's verdict (tests/unit/hostile_floor.py): judged only when all five tests
ran, failed under 5,000 cases."""

from __future__ import annotations

from tests.unit.hostile_floor import judge


def test_the_floor_is_judged_on_all_five_tests_and_fails_below_5000() -> None:
    assert judge({}) == []
    assert judge({"a": 3000, "b": 1000})[0].startswith("hostile-input floor not judged: 2 of its 5")
    five = {"a": 3000, "b": 1000, "c": 400, "d": 500, "e": 600}
    assert judge(five) == ["hostile-input floor met: 5,500 generated cases (3000, 1000, 400, 500, 600)"]
    assert judge(dict(five, a=2400))[0].startswith("FAILED hostile-input floor: 4,900 generated cases")
