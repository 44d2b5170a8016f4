"""backends/skip.py: what a full sync writes, for every combination of the backends' evidence."""

from __future__ import annotations

from typing import List, Optional

import pytest

from netproxy.backends.skip import Action, SkipPolicy

REWRITE, CHANGES = Action.REWRITE, Action.WRITE_CHANGES


class Asked:
    """Evidence that records whether it was asked (the iptables fingerprint costs a kernel read)."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.answer


# (record, vouched) → action, for both backends' policies (iptables' has a bound, nftables' none).
CASES = [
    (False, True, REWRITE),
    (False, None, REWRITE),
    (True, True, CHANGES),
    (True, False, REWRITE),
    (True, None, REWRITE),
]


@pytest.mark.parametrize("record, vouched, expected", CASES)
def test_table_of_cases(record: bool, vouched: Optional[bool], expected: Action) -> None:
    assert SkipPolicy().decide(record, lambda: vouched) is expected
    assert SkipPolicy(bound=10).decide(record, lambda: vouched) is expected


def test_evidence_is_asked_only_when_the_answer_depends_on_it() -> None:
    vouched = Asked(True)
    assert SkipPolicy().decide(False, vouched) is REWRITE
    assert vouched.calls == 0, "no record: nothing to ask"
    assert SkipPolicy().decide(True, vouched) is CHANGES
    assert vouched.calls == 1


def test_bound_forces_a_rewrite_after_that_many_skips_in_a_row_then_skips_again() -> None:
    policy = SkipPolicy(bound=3)
    vouched = Asked(True)
    got: List[Action] = [policy.decide(True, vouched) for _ in range(9)]
    assert got == [CHANGES] * 3 + [REWRITE] + [CHANGES] * 3 + [REWRITE] + [CHANGES]
    assert vouched.calls == 7, "the bounded rewrite does not read the kernel"


def test_any_rewrite_restarts_the_count() -> None:
    policy = SkipPolicy(bound=2)
    assert [policy.decide(True, lambda: True), policy.decide(True, lambda: None),
            policy.decide(True, lambda: True), policy.decide(True, lambda: True),
            policy.decide(True, lambda: True)] == [CHANGES, REWRITE, CHANGES, CHANGES, REWRITE]


def test_without_a_bound_the_generation_skips_forever() -> None:
    policy = SkipPolicy()
    assert all(policy.decide(True, lambda: True) is CHANGES for _ in range(1000))
    assert policy.skipped == 1000
