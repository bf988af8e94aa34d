"""Each validation problem's fate over a run, from the run store's `problems.parquet`
(`omgrpo.core.problems`; docs/metrics.md, "Each problem's fate").

A problem is **right** at a validation when its accuracy (share of its k samples correct) is
at least `RIGHT` (0.5: most samples right). From its first and last validation:

- `learned`: wrong at the first, right at the last;
- `forgotten`: right at the first, wrong at the last;
- `sharpened`: right at both, with a higher modal-answer share at the last (more agreement);
- `always`: right at both, not sharpened;
- `never`: wrong at both.

Only the two ends count (a problem that dipped in between keeps its end-to-end fate); a problem
validated once is `always` or `never`. `omgrpo report` writes the counts per run
(`problems_fates.csv`) and each problem's fate (`problems.csv`): the "problems tables" that
`omgrpo.tracking.artifacts` logs with the report.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from omgrpo.analysis.load import find_run_dirs
from omgrpo.errors import InputError
from omgrpo.tracking.store import RunStore

__all__ = [
    "FATES",
    "FATES_FILE",
    "PROBLEMS_FILE",
    "RIGHT",
    "classify_problems",
    "fate_counts",
    "load_problems",
]

RIGHT = 0.5
"""A problem is right at a validation when its accuracy is >= this."""
FATES = ("learned", "forgotten", "sharpened", "always", "never")
"""The fates, in the order the report shows them."""
PROBLEMS_FILE = "problems.csv"
"""The report's per-problem fates (one row per run and problem)."""
FATES_FILE = "problems_fates.csv"
"""The report's fate counts (one row per run)."""


def load_problems(run_dirs: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """Every run's `problems.parquet` with a `run` column (the run directory's name) in front;
    empty if no run wrote one. A table that cannot be read is refused by name (InputError): a
    report that left a damaged run out of its fates would count the others as all of them."""
    if isinstance(run_dirs, str | Path):
        run_dirs = [run_dirs]
    frames = []
    for run_dir in find_run_dirs(*run_dirs):
        store = RunStore(run_dir)
        try:
            table = store.read_problems()
        except (OSError, ValueError, KeyError) as e:  # pyarrow's errors are ValueErrors
            raise InputError(
                f"unreadable ({type(e).__name__}: {e})",
                file=store.problems_path,
                expected="a problems table (Parquet) as omgrpo writes it",
            ) from e
        if not table.empty:
            frames.append(table.assign(run=run_dir.name)[["run", *table.columns]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _fate(first: pd.Series, last: pd.Series, right: float) -> str:
    was, now = first["accuracy"] >= right, last["accuracy"] >= right
    if was and now:
        return "sharpened" if last["modal_share"] > first["modal_share"] else "always"
    if now:
        return "learned"
    return "forgotten" if was else "never"


def classify_problems(history: pd.DataFrame, right: float = RIGHT) -> pd.DataFrame:
    """Each problem's fate (module docstring) from its history (`problems.parquet` rows, with a
    `run` column if several runs): one row per (run,) problem with the first and last step,
    their accuracy and modal share, and `fate`."""
    keys = ["run", "problem_id"] if "run" in history.columns else ["problem_id"]
    columns = [*keys, "first_step", "last_step", "first_accuracy", "last_accuracy"]
    columns += ["first_share", "last_share", "fate"]
    rows = []
    ordered = history.sort_values("step", kind="stable")
    for key, part in ordered.groupby(keys, sort=True):
        first, last = part.iloc[0], part.iloc[-1]
        ids = key if isinstance(key, tuple) else (key,)
        rows.append(
            [
                *ids,
                int(first["step"]),
                int(last["step"]),
                float(first["accuracy"]),
                float(last["accuracy"]),
                float(first["modal_share"]),
                float(last["modal_share"]),
                _fate(first, last, right),
            ]
        )
    return pd.DataFrame(rows, columns=columns)


def fate_counts(fates: pd.DataFrame) -> pd.DataFrame:
    """Problems per fate (columns `FATES`, and `problems`), one row per run (`run` column; one
    row `all` without it)."""
    runs = fates["run"] if "run" in fates.columns else pd.Series("all", index=fates.index)
    counts = pd.crosstab(runs, fates["fate"]).reindex(columns=list(FATES), fill_value=0)
    counts["problems"] = counts.sum(axis=1)
    counts.index.name, counts.columns.name = "run", None
    return counts.reset_index()
