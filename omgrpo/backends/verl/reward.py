"""Rewards on verl: a per-sample score function and the group-level OM-GRPO reward.

- `compute_score` is verl's custom reward function (`reward.custom_reward_function`, path
  `pkg://omgrpo.backends.verl.reward`). It scores one response on its own: label-free `score`
  (the format reward), `pred` (the normalised boxed answer, so verl's validation reports
  maj@N) and `acc` (equivalence to the label: a diagnostic, and verl's `val-core` metric).
  During training the omgrpo agent loop presets every rollout's reward, so verl calls this
  function only for validation (and for any rollout without a preset reward).
- `score_group` is the training reward of one prompt's G rollouts (paper §3.1, §3.3): the
  reward parts of `omgrpo.rewards` (soft vote over the group plus CAR's pair answers, format,
  ...) computed together, with each rollout's answer-token mask and the record the driver's
  diagnostics read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omgrpo.answers import (
    DEFAULT_GRADING_BUDGET_S,
    DEFAULT_PAIR_TIMEOUT_S,
    equivalent,
    extract_boxed,
    grading_budget,
    normalize,
    set_math_verify,
)
from omgrpo.rewards import compute_rewards, format_score, make_group
from omgrpo.spans import answer_mask_for_ids

__all__ = ["GroupScores", "compute_score", "label_of", "score_group"]

NO_ANSWER = "[no answer]"
"""`pred` of a response without a boxed answer (verl's maj@N needs a string)."""


def label_of(ground_truth: Any) -> str | None:
    """The label as a string (verl datasets store numbers too); None when absent or empty."""
    if ground_truth is None:
        return None
    if isinstance(ground_truth, (list, tuple)):  # some datasets keep a list of accepted answers
        ground_truth = ground_truth[0] if ground_truth else None
        if ground_truth is None:
            return None
    text = str(ground_truth).strip()
    return text or None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    math_verify: bool | None = None,
    **kwargs: Any,
) -> dict[str, float | str]:
    """Per-sample score (verl's `compute_score` signature).

    Returns ``{"score": format reward, "format": same, "acc": 1.0 / 0.0 vs the label (0.0
    without a label), "pred": normalised boxed answer or "[no answer]"}``. The score never
    reads the label, so a run that falls back to per-sample scoring stays label-free.
    `math_verify` (`omgrpo.reward.math_verify`, passed by the presets through
    `reward.custom_reward_function.reward_kwargs`) switches the equivalence fallback of `acc`
    in this process; None leaves it as it is.
    """
    if math_verify is not None:
        set_math_verify(bool(math_verify))
    boxed = extract_boxed(solution_str or "")
    answer = boxed.content if boxed is not None else None
    label = label_of(ground_truth)
    fmt = format_score(answer)
    acc = float(answer is not None and label is not None and equivalent(answer, label))
    return {
        "score": fmt,
        "format": fmt,
        "acc": acc,
        "pred": normalize(answer) if answer is not None else NO_ANSWER,
    }


@dataclass
class GroupScores:
    """Rewards and bookkeeping of one prompt's G rollouts (rollout order)."""

    rewards: list[float]
    """r_i: weighted sum of the reward parts (what verl's GRPO normalises per prompt)."""
    parts: dict[str, list[float]]
    """Each reward part per rollout (`reward/<part>` metrics)."""
    answers: list[str | None]
    """z_i: content of the last `\\boxed{}` (None: no answer)."""
    answer_masks: list[torch.Tensor]
    """(T_i,) int64 per rollout: 1 on the tokens of the answer span (`omgrpo.spans`)."""
    correct: list[bool | None]
    """z_i equivalent to the label (None: no label); diagnostics only."""
    texts: list[str] = field(default_factory=list)
    """Decoded responses."""
    grading_timeouts: int = 0
    """Answer pairs left undecided by the grading budget (`answers/grading_timeouts`)."""


def score_group(
    tokenizer: Any,
    response_ids: Sequence[Sequence[int]],
    label: str | None,
    parts: Sequence[str],
    weights: dict[str, float] | None = None,
    pool: Sequence[str | None] | None = None,
    grading_budget_s: float = DEFAULT_GRADING_BUDGET_S,
    pair_timeout: float = DEFAULT_PAIR_TIMEOUT_S,
) -> GroupScores:
    """Rewards of one group, with every rollout's answer-token mask.

    Args:
        tokenizer: the policy's HF fast tokenizer (offsets map the answer's characters to
            tokens, `omgrpo.spans`).
        response_ids: G lists of generated token ids (the rollouts of one prompt).
        label: ground truth if known; only the `gt` part trains on it, `correct` diagnoses.
        parts, weights: `omgrpo.reward.parts` / `.weights`.
        pool: CAR's pair answers, extra soft-vote voters (never trained on).
        grading_budget_s, pair_timeout: `omgrpo.reward.grading_budget_s` /
            `.equivalence_timeout`; on verl the budget covers one group (groups are scored
            concurrently in the agent-loop workers).
    """
    texts, answers, masks = [], [], []
    for ids in response_ids:
        mask, text = answer_mask_for_ids(tokenizer, list(ids))
        boxed = extract_boxed(text)
        texts.append(text)
        answers.append(boxed.content if boxed is not None else None)
        masks.append(mask.to(torch.int64))
    with grading_budget(grading_budget_s, pair_timeout) as budget:
        group = make_group(answers, label=label, pool=pool)
        total, values = compute_rewards([group], list(parts), dict(weights or {}))
        correct = [
            None if label is None else (a is not None and equivalent(a, label)) for a in answers
        ]
    return GroupScores(
        rewards=[float(x) for x in total],
        parts={k: [float(x) for x in v] for k, v in values.items()},
        answers=answers,
        answer_masks=masks,
        correct=correct,
        texts=texts,
        grading_timeouts=budget.timeouts,
    )
