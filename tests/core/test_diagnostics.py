"""Collapse diagnostics on hand-built groups (hand-computed values)."""

import math

import pytest

from omgrpo.core.diagnostics import (
    CollapseDetector,
    answer_diagnostics,
    confidently_wrong,
    guess_diagnostics,
    label_flip_rate,
    majority_answers,
    recovery_metrics,
)
from omgrpo.core.rewards import make_group
from omgrpo.tasks.toy import ToyProbe


def _batch():
    # group A (label 4): 4, 4, 4.0, 5      -> majority 4 (correct), share 3/4
    # group B (label 7): 1, 1, 1, None     -> majority 1 (wrong), share 3/4
    a = make_group(["4", "4", "4.0", "5"], label="4")
    b = make_group(["1", "1", "1", None], label="7")
    correct = [[True, True, True, False], [False, False, False, False]]
    return [a, b], correct


def test_answer_diagnostics_by_hand():
    groups, correct = _batch()
    d = answer_diagnostics(groups, correct)
    assert d["answers/unique_per_prompt"] == 1.5  # (2 + 1) / 2
    assert d["answers/unique_per_batch"] == 3  # {4, 5, 1}
    assert d["answers/batch_mode"] in {"4", "1"} and d["answers/batch_mode_share"] == 3 / 8
    h_a = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert d["answers/vote_entropy"] == pytest.approx((h_a + 0.0) / 2)
    assert d["answers/extract_rate"] == 7 / 8
    assert d["answers/top_vote_acc"] == 0.5
    assert d["acc/train"] == 3 / 8


def test_confidently_wrong_counts_sure_wrong_majorities():
    groups, correct = _batch()
    assert confidently_wrong(groups, correct, min_share=0.75) == 0.5  # group B
    assert confidently_wrong(groups, correct, min_share=0.8) == 0.0
    unlabelled = [make_group(["1", "1"])]
    assert math.isnan(confidently_wrong(unlabelled, [[None, None]], 0.5))


def test_label_flip_rate_between_visits():
    groups, _ = _batch()
    assert majority_answers(groups) == ["4", "1"]
    seen: dict[str, str] = {}
    assert math.isnan(label_flip_rate(["a", "b"], ["4", "1"], seen))  # first visits
    assert label_flip_rate(["a", "b", "c"], ["4", "2", None], seen) == 0.5  # b flipped
    assert seen == {"a": "4", "b": "2"}


def test_recovery_tracks_initially_unsolved_prompts():
    state: dict = {}
    first = recovery_metrics([[False, False], [True, False], [False, False]], state)
    assert first == {
        "recovery/zero_pass_prompts": 2.0,
        "recovery/cum_pass": 0.0,
        "recovery/cum_avg": 0.0,
    }
    later = recovery_metrics([[True, True], [False, False], [False, False]], state)
    assert later["recovery/cum_pass"] == 0.5 and later["recovery/cum_avg"] == 0.5
    again = recovery_metrics([[False, False], [False, False], [False, False]], state)
    assert again["recovery/cum_pass"] == 0.5  # cumulative: solved once stays solved
    assert again["recovery/cum_avg"] == 0.0


def test_collapse_detector_needs_both_signals_for_k_steps():
    det = CollapseDetector(max_unique_per_prompt=1.5, min_mode_share=0.5, patience=2)
    collapsed = {"answers/unique_per_prompt": 1.1, "answers/batch_mode_share": 0.9}
    diverse = {"answers/unique_per_prompt": 4.0, "answers/batch_mode_share": 0.9}
    assert not det.update(1, collapsed)
    assert not det.update(2, diverse)  # streak broken
    assert not det.update(3, collapsed)
    assert det.update(4, collapsed)  # second consecutive step
    assert det.state["detected_step"] == 4
    assert not det.update(5, collapsed)  # reported once


def test_empty_sets_are_nan_and_guesses_come_through_the_task_probe():
    """A mean or share of nothing is nan (`omgrpo.core.means`), not a measured 0."""
    probe = ToyProbe(peak="1")
    empty = guess_diagnostics(["no answer", "none"], [None, None], ["easy", "hard"], probe)
    assert all(math.isnan(v) for k, v in empty.items() if k != "answers/peak_share")
    assert empty["answers/peak_share"] == 0.0  # a share of two rollouts: none boxed "1"
    assert math.isnan(guess_diagnostics([], [], [], probe)["answers/peak_share"])
    assert "answers/peak_share" not in guess_diagnostics([], [], [], ToyProbe())
    d = answer_diagnostics([], [])
    assert all(math.isnan(d[k]) for k in ("answers/unique_per_prompt", "answers/extract_rate"))
