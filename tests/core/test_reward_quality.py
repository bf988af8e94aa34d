"""Proxy-reward quality (`omgrpo.core.reward_quality`) and the per-problem table
(`omgrpo.core.problems`) on hand-computed cases (docs/metrics.md)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from omgrpo.core.problems import PROBLEM_COLUMNS, problem_table
from omgrpo.core.reward_quality import pearson_or_nan, reward_quality_metrics, zero_spread
from omgrpo.core.step import LoopState, StepBatch, step_metrics
from omgrpo.tracking.store import RunStore

# Two groups of G = 4 (a majority-vote reward) and one zero-spread group:
# g0: answers a a a b, correct T T T F, rewards 1 1 1 0 (mean .75): above mean == correct, 4/4
# g1: answers a a b None, correct F F T F, rewards 1 1 0 0 (mean .5): agree on rollouts 2, 3
#     (0 not above, and wrong; b not above but right: disagree) -> rollouts 0, 1 disagree
#     (above, wrong), rollout 2 disagrees (not above, right), rollout 3 agrees -> 1/4
# g2: answers c c c c, correct T T T T, rewards 1 1 1 1: zero spread, left out of reward_acc
REWARDS = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
CORRECT = [[True, True, True, False], [False, False, True, False], [True] * 4]
CLASSES = [[0, 0, 0, 1], [0, 0, 1, None], [0, 0, 0, 0]]


def test_reward_quality_by_hand():
    m = reward_quality_metrics(REWARDS, CORRECT, CLASSES)
    assert m["reward_quality/reward_acc"] == pytest.approx(5 / 8)
    assert m["reward_quality/majority_ratio"] == pytest.approx((3 / 4 + 2 / 4 + 1) / 3)
    assert m["reward_quality/zero_spread_groups"] == pytest.approx(1 / 3)
    # Pearson over all 12 labelled rollouts: r = 1 1 1 0 1 1 0 0 1 1 1 1, c = 1 1 1 0 0 0 1 0 1 1 1 1
    r = [1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1]
    c = [1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1]
    mr, mc = sum(r) / 12, sum(c) / 12
    cov = sum((x - mr) * (y - mc) for x, y in zip(r, c))
    var = math.sqrt(sum((x - mr) ** 2 for x in r) * sum((y - mc) ** 2 for y in c))
    assert m["reward_quality/reward_correct_corr"] == pytest.approx(cov / var)
    # the phi coefficient: 9 rewarded (7 right, 2 wrong), 3 not (1 right, 2 wrong)
    assert cov / var == pytest.approx((7 * 2 - 2 * 1) / math.sqrt(9 * 3 * 8 * 4))


def test_continuous_rewards_compare_with_the_group_mean():
    """A soft reward: above the group's mean is the reward's "good"; a reward at the mean is
    not above it."""
    m = reward_quality_metrics([[0.75, 0.5, 0.25]], [[True, True, False]], [[0, 1, 2]])
    # mean .5: .75 above & right (agree), .5 not above & right (disagree), .25 below & wrong
    assert m["reward_quality/reward_acc"] == pytest.approx(2 / 3)
    assert m["reward_quality/majority_ratio"] == pytest.approx(1 / 3)
    assert m["reward_quality/zero_spread_groups"] == 0.0


def test_no_labels_no_spread_and_constant_inputs_give_nan_not_errors():
    unlabelled = reward_quality_metrics([[1.0, 0.0]], [[None, None]], [[0, 1]])
    assert math.isnan(unlabelled["reward_quality/reward_acc"])
    assert math.isnan(unlabelled["reward_quality/reward_correct_corr"])
    assert unlabelled["reward_quality/majority_ratio"] == 0.5  # label-free: still measured
    flat = reward_quality_metrics([[0.3, 0.3 + 1e-12]], [[True, False]], [[None, None]])
    assert (
        flat["reward_quality/zero_spread_groups"] == 1.0
    )  # std 7e-13 <= ZERO_SPREAD_TOL: GRPO gives it A = 0
    assert math.isnan(flat["reward_quality/reward_acc"])  # no group with spread
    assert flat["reward_quality/majority_ratio"] == 0.0  # no answer at all
    assert math.isnan(flat["reward_quality/reward_correct_corr"])  # constant reward
    assert math.isnan(pearson_or_nan([1.0], [1.0])) and math.isnan(pearson_or_nan([1, 2], [3, 3]))
    assert zero_spread([]) and zero_spread([2.0]) and not zero_spread([0.0, 1e-6])
    empty = reward_quality_metrics([], [], [])
    assert all(math.isnan(v) for v in empty.values())


def test_step_metrics_logs_them_and_label_accuracy_is_top_vote_acc():
    """step_metrics (both backends) logs `reward_quality/*`; TTRL's label accuracy is
    `answers/top_vote_acc`, not logged twice."""
    from omgrpo.core.rewards import make_group
    from omgrpo.tasks import Problem

    answers = [["1", "1", "1", "2"], ["1", "1", "2", None], ["3"] * 4]
    labels = ["1", "2", "3"]
    groups = [make_group(a, label=y) for a, y in zip(answers, labels)]
    batch = StepBatch(
        prompts=[Problem(id=f"p{i}", question="?", answer=y) for i, y in enumerate(labels)],
        group_ids=torch.arange(3).repeat_interleave(4),
        responses=None,
        answers=[a for g in answers for a in g],
        correct=[c for g in CORRECT for c in g],
        groups=groups,
        reward_parts={},
        rewards=np.array([x for g in REWARDS for x in g], dtype=np.float64),
        advantages=None,
    )
    m = step_metrics(batch, LoopState(), 0.6)
    assert m["reward_quality/reward_acc"] == pytest.approx(5 / 8)
    assert m["answers/top_vote_acc"] == pytest.approx(2 / 3)  # g0, g2 voted right
    assert "reward_quality/label_acc" not in m


def test_problem_table_by_hand():
    table = problem_table(
        7,
        ["p0", "p1", "p2"],
        [["4", " 4", "5", None], ["\\text{9}", "8", "8", "9"], [None, None]],
        [[True, True, False, False], [1.0, 0.0, 0.0, 1.0], [False, False]],
    )
    assert list(table.columns) == list(PROBLEM_COLUMNS)
    assert table["step"].tolist() == [7, 7, 7]
    assert table["accuracy"].tolist() == [0.5, 0.5, 0.0]
    # "\text{9}" normalises to "9": 9 and 8 tie 2-2, the first seen wins
    assert table["modal_answer"].tolist()[:2] == ["4", "9"]
    assert pd.isna(table["modal_answer"].iloc[2])  # no answer: missing
    assert table["modal_share"].tolist() == [0.5, 0.5, 0.0]


def test_the_store_appends_problems_and_a_resume_does_not_duplicate_them(tmp_path):
    store = RunStore(tmp_path / "run")
    store.dir.mkdir()
    assert store.read_problems().empty
    for step in (0, 2, 4):
        store.log_problems(step, problem_table(step, ["a", "b"], [["1"], ["2"]], [[1.0], [0.0]]))
    assert store.read_problems()["step"].tolist() == [0, 0, 2, 2, 4, 4]
    store.truncate_metrics(2)  # a resume from the step-2 checkpoint
    assert store.read_problems()["step"].tolist() == [0, 0, 2, 2]
    again = problem_table(2, ["a", "b"], [["1"], ["1"]], [[1.0], [1.0]])
    store.log_problems(2, again)  # the same validation, logged again: replaced, not added
    got = store.read_problems()
    assert got["step"].tolist() == [0, 0, 2, 2] and got["accuracy"].tolist() == [1, 0, 1, 1]
