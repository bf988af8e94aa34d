"""omgrpo's training diagnostics from one verl step, under omgrpo's metric names.

The agent loop stores a small record per rollout in `extra_fields["omgrpo"]` (answer, label,
correctness, reward parts, CAR pair answers of the anchor, CAR timings). The driver regroups the
records by prompt (`uid`) and reuses `omgrpo.diagnostics` and `omgrpo.car` unchanged, so the
names and definitions match the native trainer's (`answers/*`, `acc/train`, `reward/*`,
`car/*`). Labels only diagnose.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from omgrpo.car import car_diagnostics, top_vote_metrics
from omgrpo.diagnostics import (
    answer_diagnostics,
    confidently_wrong,
    label_flip_rate,
    majority_answers,
)
from omgrpo.rewards import RewardGroup, make_group

__all__ = ["group_records", "step_metrics"]


def group_records(uids: Sequence[Any], records: Sequence[dict]) -> list[list[dict]]:
    """Records grouped by prompt (first-seen order), each group in session order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for uid, record in zip(uids, records):
        groups[str(uid)].append(record)
    return [sorted(g, key=lambda r: r["session"]) for g in groups.values()]


def step_metrics(
    uids: Sequence[Any],
    records: Sequence[dict],
    rewards: Sequence[float],
    *,
    confident_share: float,
    last_majority: dict[str, str],
) -> dict[str, float]:
    """Diagnostics of one step's rollouts.

    Args:
        uids: verl's prompt uid of each rollout (padding rows excluded).
        records: each rollout's `extra_fields["omgrpo"]` (same order).
        rewards: each rollout's total reward (`rm_scores` summed).
        confident_share: `omgrpo.collapse.confident_share`.
        last_majority: prompt id -> previous majority answer; updated in place (label flips).

    Returns:
        `reward/total`, `reward/<part>`, the `answers/*` diagnostics (without the string
        `answers/batch_mode`; `answers/grading_timeouts` summed over the groups' budgets), `acc/train`, and with CAR the `car/*` diagnostics,
        `car/top_vote_acc_without_car`, `car/seconds` (summed over groups) and `car/span_s`
        (wall clock from the first pair request to the last answer of the step).
    """
    if not records:
        return {}
    grouped = group_records(uids, records)
    groups: list[RewardGroup] = []
    correct: list[list[bool | None]] = []
    has_car = all("car" in r for r in records)
    pairs, pair_answers = [], []
    for g in grouped:
        pool = None
        if has_car:
            pairs.append([tuple(p) for r in g for p in r["car"]["pairs"]])
            pool = [a for r in g for a in r["car"]["answers"]]
            pair_answers.append(pool)
        groups.append(make_group([r["answer"] for r in g], label=g[0]["label"], pool=pool))
        correct.append([r["correct"] for r in g])

    metrics: dict[str, float] = {"reward/total": float(np.mean(rewards))}
    parts = records[0].get("rewards", {})
    for part in parts:
        metrics[f"reward/{part}"] = float(np.mean([r["rewards"][part] for r in records]))
    diag = answer_diagnostics(groups, correct)
    diag.pop("answers/batch_mode")  # a string: verl's loggers take numbers
    metrics.update(diag)
    metrics["answers/confidently_wrong"] = confidently_wrong(groups, correct, confident_share)
    metrics["answers/label_flip_rate"] = label_flip_rate(
        [g[0]["prompt_id"] for g in grouped], majority_answers(groups), last_majority
    )
    metrics["answers/grading_timeouts"] = float(
        sum(g[0].get("grading_timeouts", 0) for g in grouped)
    )
    if has_car:
        rollout_answers = [[r["answer"] for r in g] for g in grouped]
        firsts = [g[0]["car"] for g in grouped]
        metrics.update(
            car_diagnostics(
                pairs,
                pair_answers,
                rollout_answers,
                correct,
                unclosed=sum(c["unclosed"] for c in firsts),
                truncated=sum(c["truncated"] for c in firsts),
            )
        )
        metrics.update(
            top_vote_metrics(rollout_answers, pair_answers, [g[0]["label"] for g in grouped])
        )
        metrics["car/seconds"] = float(sum(c["end"] - c["start"] for c in firsts))
        metrics["car/span_s"] = float(
            max(c["end"] for c in firsts) - min(c["start"] for c in firsts)
        )
    return metrics
