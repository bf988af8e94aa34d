"""What a task hands the algorithm: its problems (`Problem`, `TaskSplits`) and the hook through
which scoring reads task-specific structure in a response (`TaskProbe`, with the `ProcessGrade`
it returns). The tasks themselves (the toy world, file data sets) live in `omgrpo.tasks`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """One question with its (optional) label.

    `answer` is the ground truth; label-free methods never train on it, it is only used by the
    `gt` reward and by diagnostics. `solution` is a worked chain of thought (toy world only, for
    the SFT warm start). `paraphrase` is a meaning-preserving rewording (CoReward).
    """

    id: str
    question: str
    answer: str | None
    solution: str | None = None
    paraphrase: str | None = None
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TaskSplits:
    train: list[Problem]
    val: list[Problem]
    test: list[Problem]


GUESS_KINDS = ("prior", "truncated", "copy_error", "malformed")
"""The kinds of a guess: a boxed answer that is not the value the reasoning computed last
(`omgrpo.tasks.toy_process.guess_kind`)."""


@dataclass(frozen=True)
class ProcessGrade:
    """One rollout's reasoning graded exactly against its problem (the toy world's ReCEval-style
    rubric, docs/metrics.md "Process quality"): counts of its reasoning lines and what its boxed
    answer has to do with them."""

    lines: int
    """Reasoning lines before the line holding the last box (computed lines and malformed ones;
    blank lines do not count)."""
    valid: int
    """Computed lines `a op b = c` whose arithmetic is right (c = a op b)."""
    informative: int
    """Lines that apply the problem's next operation, in order, to the running value (the
    previous informative line's result, at first the start): each moves toward the result."""
    malformed: int
    """Lines that are not a computed line `a op b = c`."""
    supported: bool
    """The boxed answer is the last line's result, every line is a valid computed line and each
    takes the previous line's result (the first: the problem's start): the answer follows from the
    reasoning as written, whatever the problem asked."""
    chain_correct: bool
    """The reasoning is the problem's own chain: every operation once, in order, all valid, no
    other line (its last value is the label)."""
    guess_kind: str | None
    """None if the box holds the value the reasoning computed last (or there is no box); else one
    of `GUESS_KINDS`: `truncated` (the box holds a proper prefix of the computed value, e.g. "1"
    for 152), `copy_error` (one digit substituted, inserted or deleted, or two neighbours
    swapped), `malformed` (otherwise, where a reasoning line is malformed), `prior` (anything
    else, a bare box included); `omgrpo.tasks.toy_process.guess_kind` gives the order."""


class TaskProbe(Protocol):
    """The hook through which scoring reads task-specific structure in a response, so that
    `omgrpo/core` names no task (`omgrpo.tasks.task_probe(cfg.task)` gives the configured
    task's; the toy world's is `omgrpo.tasks.toy.ToyProbe`)."""

    peak: str | None
    """An answer whose batch share is a diagnostic (`answers/peak_share`); None: not logged."""

    def result_span(self, text: str) -> tuple[int, int] | None:
        """Character span of the value the reasoning computed last (the `result` token role);
        None: no such value."""
        ...

    def is_guess(self, text: str, answer: str | None) -> bool:
        """Whether the boxed `answer` is not what the reasoning computed (guess diagnostics)."""
        ...

    def grade(self, question: str, text: str, answer: str | None) -> ProcessGrade | None:
        """The rollout's reasoning graded against the problem `question`; None where the task
        cannot grade reasoning (file tasks, or a question it cannot read)."""
        ...
