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


# (record, vouched, changed) → action, for nftables' policy (no bound, changes written alone) and
# iptables' (changes rewrite: a write of changes alone would void its fingerprint).
CASES = [
    # record, vouched, changed, nftables, iptables
    (False, True, False, REWRITE, REWRITE),
    (False, None, True, REWRITE, REWRITE),
    (True, True, False, CHANGES, CHANGES),
    (True, True, True, CHANGES, REWRITE),
    (True, False, False, REWRITE, REWRITE),
    (True, False, True, REWRITE, REWRITE),
    (True, None, False, REWRITE, REWRITE),
    (True, None, True, REWRITE, REWRITE),
]


@pytest.mark.parametrize("record, vouched, changed, nft, ipt", CASES)
def test_table_of_cases(record: bool, vouched: Optional[bool], changed: bool, nft: Action, ipt: Action) -> None:
    assert SkipPolicy().decide(record, lambda: vouched, lambda: changed) is nft
    assert SkipPolicy(bound=10, rewrite_changes=True).decide(record, lambda: vouched, lambda: changed) is ipt


def test_evidence_is_asked_only_when_the_answer_depends_on_it() -> None:
    vouched, changed = Asked(True), Asked(True)
    assert SkipPolicy(rewrite_changes=True).decide(False, vouched, changed) is REWRITE
    assert (vouched.calls, changed.calls) == (0, 0), "no record: nothing to ask"
    assert SkipPolicy(rewrite_changes=True).decide(True, vouched, changed) is REWRITE
    assert (vouched.calls, changed.calls) == (0, 1), "changes rewrite anyway: the kernel read is spared"
    assert SkipPolicy().decide(True, vouched, changed) is CHANGES
    assert (vouched.calls, changed.calls) == (1, 1), "changes do not matter without rewrite_changes"


def test_a_policy_that_rewrites_changes_cannot_skip_without_knowing_them() -> None:
    assert SkipPolicy(rewrite_changes=True).decide(True, lambda: True) is REWRITE


def test_bound_forces_a_rewrite_after_that_many_skips_in_a_row_then_skips_again() -> None:
    policy = SkipPolicy(bound=3, rewrite_changes=True)
    vouched = Asked(True)
    got: List[Action] = [policy.decide(True, vouched, lambda: False) for _ in range(9)]
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
