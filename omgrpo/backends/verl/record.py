"""The typed hand-off from verl's agent loop (producer) to the driver's step metrics (consumer).

The agent loop scores a prompt's G rollouts in a worker process; the driver computes the step's
diagnostics from what each rollout carries in `extra_fields[RECORD_KEY]`. That field travels
through verl's TransferQueue between processes, so it holds plain builtins
(`RolloutRecord.to_dict`, read back by `RolloutRecord.from_dict`): the dataclasses below are
the one declaration of its fields. No verl import here, so the metrics can be tested without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["CarRecord", "RolloutRecord"]


@dataclass
class CarRecord:
    """CAR's output seen from one rollout: its own pairs as anchor, and the group's counters."""

    pairs: list[tuple[int, int]]
    """The ordered pairs (i, j) whose anchor i is this rollout (i = its `session`)."""
    answers: list[str | None]
    """Their pair answers, aligned with `pairs` (None: unclosed or empty, no vote)."""
    truncated: int
    """The group's solutions cut to `max_solution_tokens` (each counted once per group)."""
    unclosed: int
    """The group's pair answers whose brace never closed (`omgrpo.core.car.read_pair_answer`)."""
    empty: int
    """The group's pair answers that closed an empty `\\boxed{}`."""
    start: float
    """Wall-clock time (s) the group's first pair request was sent."""
    end: float
    """Wall-clock time (s) the group's last pair answer came back."""


@dataclass
class RolloutRecord:
    """What the driver's diagnostics need of one training rollout (labels only diagnose)."""

    answer: str | None
    """The rollout's final `\\boxed{}` answer (None: none)."""
    correct: bool | None
    """Whether `answer` matches the label (None: no label)."""
    label: str | None
    """The prompt's ground truth, if any."""
    prompt_id: str
    """Stable id of the prompt across steps (label flips)."""
    session: int
    """The rollout's index within its group (orders the group's rows)."""
    rewards: dict[str, float]
    """Reward part name -> this rollout's value (the group-level rewards)."""
    grading_timeouts: int
    """Comparisons the group's grading budget left undecided (the group's, on every rollout)."""
    car: CarRecord | None = None
    """CAR's pair answers of this anchor and the group's counters; None without CAR."""
    text: str | None = None
    """The decoded response (the run store's rollout table, `text`); None: not recorded."""
    question: str = ""
    """The prompt's question, the last user message of its chat prompt ("" if it has none)."""
    step_scores: list[float] | None = None
    """Reward `process`: the PRM's score of each step (None: unscored, or no PRM)."""
    process: float | None = None
    """Reward `process`: their aggregate (`reward.prm.aggregate`; None: unscored, or no PRM)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain builtins for TransferQueue (pairs as lists)."""
        out = dataclasses.asdict(self)
        if self.car is not None:
            out["car"]["pairs"] = [list(p) for p in self.car.pairs]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutRecord:
        """The record `to_dict` wrote (a missing field is an error, not a default)."""
        car = data.get("car")
        if car is not None:
            car = CarRecord(**{**car, "pairs": [(int(i), int(j)) for i, j in car["pairs"]]})
        return cls(**{**data, "car": car})
