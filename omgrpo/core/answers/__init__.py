"""Final answers: extraction (`extract`), normalisation (`normalize`), exact values (`exact`)
and grading (`grading`, with its math-verify `worker`).

Every vote-based reward is computed on :func:`cluster` ids, so this package must be fast, total
(never raises) and deterministic, and must never merge two answers that denote different values.
Grading policy (budget, math-verify on/off) is a `Grader` each stage creates and passes in.
"""

from omgrpo.core.answers.extract import Boxed, extract_boxed
from omgrpo.core.answers.grading import (
    DEFAULT_GRADING_BUDGET_S,
    DEFAULT_PAIR_TIMEOUT_S,
    Grader,
    cluster,
    equivalent,
)
from omgrpo.core.answers.normalize import MAX_ANSWER_CHARS, normalize
from omgrpo.core.answers.worker import start_grader_warm_up

__all__ = [
    "DEFAULT_GRADING_BUDGET_S",
    "DEFAULT_PAIR_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "Boxed",
    "Grader",
    "cluster",
    "equivalent",
    "extract_boxed",
    "normalize",
    "start_grader_warm_up",
]
