"""omgrpo's training diagnostics from one verl step, under omgrpo's metric names.

The agent loop stores a `RolloutRecord` per rollout in `extra_fields["omgrpo"]` (answer, label,
correctness, reward parts, CAR pair answers of the anchor, CAR timings). The driver regroups the
records by prompt (`uid`) into the step's `omgrpo.core.step.StepBatch` and calls the native
trainer's `omgrpo.core.step.step_metrics`, so names and definitions are the native trainer's
(`answers/*`, `acc/train`, `reward/*`, `reward_quality/*`, `car/*`). Labels only diagnose.

`validation_problems` turns verl's validation samples (the per-sample `problem`, `pred` and
`acc` of `omgrpo.backends.verl.reward.compute_score`) into the rows of the run store's
`problems.parquet` (`omgrpo.core.problems.problem_table`, as the native validation writes).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from omgrpo.backends.verl.record import RolloutRecord
from omgrpo.backends.verl.reward import NO_ANSWER
from omgrpo.core.answers import Grader
from omgrpo.core.car import CarResult
from omgrpo.core.problems import problem_table
from omgrpo.core.rewards import make_group
from omgrpo.core.step import LoopState, StepBatch
from omgrpo.core.step import step_metrics as batch_metrics
from omgrpo.tasks import Problem

__all__ = [
    "batch_from_records",
    "records_metrics",
    "records_step",
    "records_texts",
    "validation_problems",
]


def _group_rows(uids: Sequence[Any], records: Sequence[RolloutRecord]) -> list[list[int]]:
    """Row indices grouped by prompt (first-seen order), each group in session order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, uid in enumerate(uids):
        groups[str(uid)].append(i)
    return [sorted(g, key=lambda i: records[i].session) for g in groups.values()]


def _car_result(rows: list[list[int]], records: Sequence[RolloutRecord]) -> CarResult | None:
    """The step's CAR pair answers per group (anchors in session order) with the groups'
    counters summed; None unless every rollout carries CAR's output."""
    if not all(r.car is not None for r in records):
        return None
    cars = [[records[i].car for i in g] for g in rows]
    firsts = [c[0] for c in cars]  # the counters are the group's, on every rollout
    pairs = [[p for c in group for p in c.pairs] for group in cars]
    return CarResult(
        pairs=pairs,
        answers=[[a for c in group for a in c.answers] for group in cars],
        truncated=sum(c.truncated for c in firsts),
        unclosed=sum(c.unclosed for c in firsts),
        empty=sum(c.empty for c in firsts),
        num_pairs=sum(len(p) for p in pairs),
    )


def batch_from_records(
    uids: Sequence[Any],
    records: Sequence[RolloutRecord],
    rewards: Sequence[float],
    grader: Grader | None = None,
    advantages: Sequence[float] | None = None,
) -> StepBatch:
    """The step's rollouts as a `StepBatch` (group order), from the agent loop's records.

    The groups' answer classes are rebuilt with CAR's pair answers as the pool, as the agent
    loop rewarded them; rewards are verl's `rm_scores` (the agent loop's group rewards);
    `advantages`: each row's GRPO advantage A_i (before answer weighting), if known.
    """
    rows = _group_rows(uids, records)
    order = [i for g in rows for i in g]
    recs = [records[i] for i in order]
    car = _car_result(rows, records)
    prompts, groups = [], []
    for k, g in enumerate(rows):
        first = records[g[0]]
        prompts.append(Problem(id=first.prompt_id, question=first.question, answer=first.label))
        pool = car.answers[k] if car is not None else None
        groups.append(
            make_group([records[i].answer for i in g], label=first.label, pool=pool, grader=grader)
        )
    parts = recs[0].rewards
    return StepBatch(
        prompts=prompts,
        group_ids=torch.tensor([k for k, g in enumerate(rows) for _ in g], dtype=torch.int64),
        responses=None,
        answers=[r.answer for r in recs],
        correct=[r.correct for r in recs],
        groups=groups,
        reward_parts={p: np.array([r.rewards[p] for r in recs], dtype=np.float64) for p in parts},
        rewards=np.asarray([rewards[i] for i in order], dtype=np.float64),
        advantages=(
            None
            if advantages is None
            else torch.tensor([advantages[i] for i in order], dtype=torch.float32)
        ),
        car=car,
        grader=grader,
        # the PRM's step scores, when the step's reward had the `process` part
        step_scores=[r.step_scores for r in recs] if "process" in parts else None,
        process=[r.process for r in recs] if "process" in parts else None,
    )


def records_metrics(
    uids: Sequence[Any],
    records: Sequence[RolloutRecord | dict],
    rewards: Sequence[float],
    *,
    confident_share: float,
    state: LoopState,
    grader: Grader | None = None,
) -> dict[str, float]:
    """Diagnostics of one step's rollouts: `records_step`'s metrics."""
    return records_step(
        uids, records, rewards, confident_share=confident_share, state=state, grader=grader
    )[0]


def records_step(
    uids: Sequence[Any],
    records: Sequence[RolloutRecord | dict],
    rewards: Sequence[float],
    *,
    confident_share: float,
    state: LoopState,
    grader: Grader | None = None,
    advantages: Sequence[float] | None = None,
) -> tuple[dict[str, float], StepBatch | None]:
    """Diagnostics of one step's rollouts (`omgrpo.core.step.step_metrics`), and the step's
    `StepBatch` they were computed on (None without records), for the rollout table.

    Args:
        uids: verl's prompt uid of each rollout (padding rows excluded).
        records: each rollout's `extra_fields["omgrpo"]` (same order), as the agent loop
            wrote it (`RolloutRecord.to_dict`) or already read back.
        rewards: each rollout's total reward (`rm_scores` summed).
        confident_share: `omgrpo.collapse.confident_share`.
        state: the trainer's loop state (`last_majority` is updated: label flips).
        grader: the driver's `Grader` for re-clustering the groups (`omgrpo.reward`).
        advantages: each rollout's GRPO advantage A_i (same order), kept in the batch.

    Returns:
        `reward/total`, `reward/<part>`, the `answers/*` diagnostics (without the string
        `answers/batch_mode`; `answers/grading_timeouts` summed over the groups' budgets), `acc/train`, and with CAR the `car/*` diagnostics,
        `car/top_vote_acc` (the pool's vote), `car/seconds` (summed over groups) and `car/span_s`
        (wall clock from the first pair request to the last answer of the step).
    """
    if not records:
        return {}, None
    records = [r if isinstance(r, RolloutRecord) else RolloutRecord.from_dict(r) for r in records]
    batch = batch_from_records(uids, records, rewards, grader or Grader(), advantages)
    metrics = batch_metrics(batch, state, confident_share)
    metrics.pop("answers/batch_mode")  # a string: verl's loggers take numbers
    rows = _group_rows(uids, records)
    # each group was graded within its own budget (the agent loop); its count is on every row
    metrics["answers/grading_timeouts"] = float(sum(records[g[0]].grading_timeouts for g in rows))
    if all(r.car is not None for r in records):
        firsts = [records[g[0]].car for g in rows]
        metrics["car/seconds"] = float(sum(c.end - c.start for c in firsts))
        metrics["car/span_s"] = float(max(c.end for c in firsts) - min(c.start for c in firsts))
    return metrics, batch


def records_texts(uids: Sequence[Any], records: Sequence[RolloutRecord]) -> list[str | None]:
    """The records' response texts in `batch_from_records`' row order (group order)."""
    return [records[i].text for g in _group_rows(uids, records) for i in g]


def validation_problems(
    step: int, sample_uids: Sequence[Any], extra: dict[str, Sequence[Any]]
) -> pd.DataFrame | None:
    """One validation's `problems.parquet` rows from verl's per-sample validation outputs:
    `sample_uids` (verl's uid of each sample's prompt, fresh at each validation) and
    `reward_extra_infos_dict` (`problem`, `pred`, `acc` per sample, `compute_score`). Samples
    are grouped by uid and named by their `problem`; None when no sample names its problem
    (a dataset without `extra_info.id` or `.index`)."""
    problems, preds, accs = (list(extra.get(k) or []) for k in ("problem", "pred", "acc"))
    if not any(p is not None for p in problems):
        return None
    by_uid: dict[str, dict[str, list]] = {}
    for uid, problem, pred, acc in zip(sample_uids, problems, preds, accs):
        if problem is None or acc is None:
            continue
        row = by_uid.setdefault(str(uid), {"id": str(problem), "answers": [], "correct": []})
        row["answers"].append(None if pred in (None, NO_ANSWER) else str(pred))
        row["correct"].append(float(acc))
    rows = list(by_uid.values())
    return problem_table(
        step, [r["id"] for r in rows], [r["answers"] for r in rows], [r["correct"] for r in rows]
    )
