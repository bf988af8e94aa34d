"""Each validation problem's state at one validation: the rows of the run store's
`problems.parquet` (`omgrpo.tracking.store.RunStore.log_problems`), one definition for both
backends (the native trainer's `omgrpo.backends.native.validation`, verl's
`OmgrpoTrainer._val_metrics_update`).

Columns: `problem_id` (stable across validations), `step` (the validation's training step; 0:
before training), `accuracy` (share of the problem's k samples that are correct), `modal_answer`
(the most common normalised answer, `omgrpo.core.answers.normalize`; ties: the first seen;
None: no sample boxed an answer) and `modal_share` (its count over all k samples; 0 without an
answer). Answers are compared as normalised strings, not through the grader's equivalence
classes, so verl's per-sample `pred` gives the same table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pandas as pd

from omgrpo.core.answers import normalize

__all__ = ["PROBLEM_COLUMNS", "problem_table"]

PROBLEM_COLUMNS = ("problem_id", "step", "accuracy", "modal_answer", "modal_share")


def problem_table(
    step: int,
    problem_ids: Sequence[str],
    answers: Sequence[Sequence[str | None]],
    correct: Sequence[Sequence[bool | float]],
) -> pd.DataFrame:
    """One row per problem (module docstring): `answers[i]` and `correct[i]` are problem i's
    samples (None: no boxed answer; correctness as bool or 1.0 / 0.0). Answers are normalised
    here (normalising twice changes nothing)."""
    cols: dict[str, list] = {c: [] for c in PROBLEM_COLUMNS}
    for pid, got, ok in zip(problem_ids, answers, correct, strict=True):
        counts = Counter(normalize(a) for a in got if a is not None)
        modal, n = counts.most_common(1)[0] if counts else (None, 0)
        cols["problem_id"].append(str(pid))
        cols["step"].append(int(step))
        cols["accuracy"].append(sum(float(c) for c in ok) / len(ok) if ok else float("nan"))
        cols["modal_answer"].append(modal)
        cols["modal_share"].append(n / len(got) if got else float("nan"))
    table = pd.DataFrame(cols)
    return table.astype({"step": "int64", "accuracy": "float64", "modal_share": "float64"})
