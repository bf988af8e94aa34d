"""The process reward: steps, aggregations, the time budget and the `process` reward in a scored
step, on hand-computed cases (the PRM is a stub callable here; real checkpoints: tests/models)."""

import math

import numpy as np
import pytest
import torch

from omgrpo.config import compose
from omgrpo.core.process import (
    AGGREGATIONS,
    aggregate,
    process_metrics,
    score_within_budget,
    split_steps,
)
from omgrpo.core.rewards import compute_rewards, make_group
from omgrpo.core.step import LoopState, score_step, step_metrics
from omgrpo.core.task import Problem
from omgrpo.models.tokenizer import build_char_tokenizer


def test_steps_are_the_non_blank_lines_stripped():
    text = "  a=1 \n\n\t\nb=2\nend"
    assert [text[a:b] for a, b in split_steps(text)] == ["a=1", "b=2", "end"]
    assert split_steps("") == [] and split_steps("\n \n") == []
    tagged = "x<s> y <s>"
    assert [tagged[a:b] for a, b in split_steps(tagged, "<s>")] == ["x", "y"]
    with pytest.raises(ValueError, match="separator"):
        split_steps("x", "")


def test_aggregations_by_hand():
    s = [0.5, 0.25, 1.0]
    assert [aggregate(s, h) for h in AGGREGATIONS] == [0.25, 1.0, 1.75 / 3, 0.125]
    assert all(aggregate([], h) == 0.0 for h in AGGREGATIONS)
    with pytest.raises(ValueError, match="min, last, mean, product"):
        aggregate(s, "max")


def test_the_budget_stops_between_batches():
    """A fake clock advancing 1 s per batch: a 2.5 s budget scores three batches of two (the
    third starts at 2 s < 2.5 s) and leaves the rest unscored; every batch is whole."""
    now = [0.0]

    def score_batch(chunk):
        now[0] += 1.0
        return [[float(x)] for x in chunk]

    out = score_within_budget(list(range(9)), score_batch, 2, 2.5, clock=lambda: now[0])
    assert out == [[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], None, None, None]
    now[0] = 0.0
    assert None not in score_within_budget(list(range(9)), score_batch, 2, math.inf, lambda: 0.0)


def test_unscored_rollouts_get_their_group_mean():
    totals, parts = compute_rewards(
        [make_group(["1", "2", None], process=[0.2, None, 0.6]), make_group(["3"], process=[None])],
        ["process", "format"],
        {"format": 0.5},
    )
    assert parts["process"].tolist() == pytest.approx([0.2, 0.4, 0.6, 0.0])
    assert totals.tolist() == pytest.approx([0.7, 0.9, 0.6, 0.5])
    with pytest.raises(ValueError, match=r"reward\.prm"):
        compute_rewards([make_group(["1"])], ["process"])


def test_process_metrics_by_hand():
    m = process_metrics(
        [[0.5, 1.0], [0.25], [], None], [0.5, 0.25, 0.0, None], [True, False, False, None]
    )
    assert m["prm/step_score_mean"] == pytest.approx(1.75 / 3)
    assert m["prm/step_score_first"] == pytest.approx(0.375)
    assert m["prm/step_score_last"] == pytest.approx(0.625)
    assert m["prm/step_score_min"] == pytest.approx(0.375)
    assert m["prm/steps_per_response"] == pytest.approx(1.0)
    assert m["prm/aggregate_mean"] == pytest.approx(0.75 / 3)
    assert m["prm/unscored_share"] == 0.25
    assert (m["prm/aggregate_correct"], m["prm/aggregate_wrong"]) == (0.5, 0.125)
    assert np.isnan(process_metrics([None], [None], [None])["prm/aggregate_correct"])


def test_score_step_rewards_the_prms_aggregate():
    """A stub PRM scoring a step 0.9 when its line's arithmetic holds, else 0.1: with `min`,
    the slipped rollout gets 0.1 + format, the others 0.9 + format; the PRM sees each rollout
    with its own question, and the metrics carry its step scores."""
    tok = build_char_tokenizer()
    texts = ["1+1=2\nSo \\boxed{2}.", "1+1=3\nSo \\boxed{3}.", "1+1=2\nSo \\boxed{7}.", "no box"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    response_ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    problems = [
        Problem(id="a", question="q1", answer="2"),
        Problem(id="b", question="q2", answer="2"),
    ]
    seen = []

    def prm(questions, responses):
        seen.extend(questions)
        return [[0.1 if "1+1=3" in line else 0.9 for line in r.split("\n")] for r in responses]

    cfg = compose(["method=prm", "reward.math_verify=false"])
    batch = score_step(tok, response_ids, mask, problems, cfg, process=prm)
    assert seen == ["q1", "q1", "q2", "q2"]
    assert batch.process == pytest.approx([0.9, 0.1, 0.9, 0.9])
    assert batch.rewards.tolist() == pytest.approx([1.9, 1.1, 1.9, 0.9])
    assert batch.advantages[0] > 0 > batch.advantages[1]
    metrics = step_metrics(batch, LoopState(), 0.75)
    assert metrics["reward/process"] == pytest.approx(0.7)
    assert metrics["prm/step_score_min"] == pytest.approx(0.7)
    assert metrics["prm/aggregate_correct"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match=r"reward\.prm"):
        score_step(tok, response_ids, mask, problems, cfg)
