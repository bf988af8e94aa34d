"""Process rewards: a response split into steps, each step scored by a process reward model (PRM),
the step scores aggregated into one reward per rollout (the paper's appendix "PRM-based Process
Reward Baselines").

Pure functions: the PRM itself (a model) lives in `omgrpo.models.prm` and reaches scoring as a
`ProcessScorer`, a callable from (questions, responses) to each response's step scores.

Aggregations (`reward.prm.aggregate`), the choices of the PRM literature:

| name    | reward of a rollout with step scores s_1..s_K                         |
|---------|-----------------------------------------------------------------------|
| min     | min_k s_k (PURE's min-form credit assignment: the weakest step)       |
| last    | s_K (the final step's score, an outcome-like reading)                 |
| mean    | (1/K) sum_k s_k                                                       |
| product | prod_k s_k (the chain's probability of being right, steps independent) |
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

AGGREGATIONS = ("min", "last", "mean", "product")

T = TypeVar("T")
StepScores = list[float] | None
"""One response's step scores in [0, 1], in step order; None: not scored (budget spent)."""


class ProcessScorer(Protocol):
    """What `omgrpo.core.step.score_step` calls: the step scores of each (question, response),
    None for a response its time budget left unscored."""

    def __call__(self, questions: list[str], responses: list[str]) -> list[StepScores]: ...


def split_steps(text: str, separator: str = "\n") -> list[tuple[int, int]]:
    """Character spans (start, end) of the steps of `text`: the pieces between separators,
    stripped of surrounding whitespace, blank pieces dropped.

    >>> text = "7+5=12\\n\\n12*3=36\\nSo the answer is \\\\boxed{36}."
    >>> [text[a:b] for a, b in split_steps(text)]
    ['7+5=12', '12*3=36', 'So the answer is \\\\boxed{36}.']
    """
    if not separator:
        raise ValueError("the step separator must be a non-empty string")
    spans, start = [], 0
    while start <= len(text):
        end = text.find(separator, start)
        end = len(text) if end < 0 else end
        piece = text[start:end]
        if piece.strip():
            lead = len(piece) - len(piece.lstrip())
            spans.append((start + lead, start + len(piece.rstrip())))
        start = end + len(separator)
    return spans


def aggregate(scores: Sequence[float], how: str) -> float:
    """One reward from a response's step scores (module table); 0.0 for a response without steps.

    >>> [aggregate([0.9, 0.5, 0.8], h) for h in AGGREGATIONS]
    [0.5, 0.8, 0.7333333333333334, 0.36000000000000004]
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown reward.prm.aggregate '{how}'; valid: {', '.join(AGGREGATIONS)}")
    if not scores:
        return 0.0
    if how == "min":
        return float(min(scores))
    if how == "last":
        return float(scores[-1])
    if how == "mean":
        return float(sum(scores) / len(scores))
    return float(math.prod(scores))


def score_within_budget(
    items: Sequence[T],
    score_batch: Callable[[list[T]], list[list[float]]],
    batch_size: int,
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> list[StepScores]:
    """`score_batch` over `items` in batches of `batch_size`, in order, until `budget_s` seconds
    have passed: the items of the batches not started by then get None. A batch is never cut
    short, so one call takes at most the budget plus one batch (the PRM's own forward pass)."""
    if batch_size < 1:
        raise ValueError(f"reward.prm.batch_size must be >= 1, got {batch_size}")
    start = clock()
    out: list[StepScores] = [None] * len(items)
    for b0 in range(0, len(items), batch_size):
        if clock() - start >= budget_s:
            break
        chunk = list(items[b0 : b0 + batch_size])
        for i, scores in enumerate(score_batch(chunk)):
            out[b0 + i] = [float(s) for s in scores]
    return out


def process_metrics(
    step_scores: Sequence[StepScores],
    aggregated: Sequence[float | None],
    correct: Sequence[bool | None],
) -> dict[str, float]:
    """The step's `prm/*` diagnostics (docs/metrics.md): per-step scores (mean, first and last
    step, the weakest step), steps per response, the aggregate, the share left unscored by the
    budget, and the aggregate on rollouts whose answer is right vs wrong (labels diagnose only;
    nan where there are none)."""
    scored = [s for s in step_scores if s is not None]
    steps = [x for s in scored for x in s]
    with_steps = [s for s in scored if s]
    values = [a for a in aggregated if a is not None]

    def mean(xs) -> float:
        return float(np.mean(xs)) if len(xs) else float("nan")

    return {
        "prm/step_score_mean": mean(steps),
        "prm/step_score_first": mean([s[0] for s in with_steps]),
        "prm/step_score_last": mean([s[-1] for s in with_steps]),
        "prm/step_score_min": mean([min(s) for s in with_steps]),
        "prm/steps_per_response": mean([len(s) for s in scored]),
        "prm/aggregate_mean": mean(values),
        "prm/unscored_share": 1.0 - len(scored) / max(len(step_scores), 1),
        "prm/aggregate_correct": mean(
            [a for a, c in zip(aggregated, correct) if c and a is not None]
        ),
        "prm/aggregate_wrong": mean(
            [a for a, c in zip(aggregated, correct) if c is False and a is not None]
        ),
    }
