"""Datasets from local JSONL / Parquet files with `question` / `answer` columns (MATH, GSM8K)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from omgrpo.tasks.base import Problem


def load_problems(
    path: str | Path,
    question_key: str = "question",
    answer_key: str = "answer",
    split: str = "data",
    require_answer: bool = True,
) -> list[Problem]:
    """Read problems from a `.jsonl` / `.json` / `.parquet` file.

    Every row must have a non-empty `question_key` and (unless `require_answer` is False, as in
    unlabeled test-time training) an `answer_key`; otherwise a ValueError names the file and row.
    An optional `paraphrase` column feeds CoReward.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    rows = _read_rows(path)
    problems = []
    for i, row in enumerate(rows):
        where = f"{path}, row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with '{question_key}', got {row!r:.80}")
        question = row.get(question_key)
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"{where}: missing or empty '{question_key}' (columns: {sorted(row)}); "
                f"set task.question_key if your file names it differently"
            )
        answer = row.get(answer_key)
        if answer is None or (isinstance(answer, float) and answer != answer):
            if require_answer:
                raise ValueError(
                    f"{where}: missing '{answer_key}' (columns: {sorted(row)}); "
                    f"set task.answer_key if your file names it differently"
                )
            answer = None
        problems.append(
            Problem(
                id=str(row.get("id", f"{split}-{i}")),
                question=question,
                answer=None if answer is None else str(answer),
                paraphrase=row.get("paraphrase"),
            )
        )
    return problems


def _read_rows(path: Path) -> list:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pd.read_parquet(path).to_dict(orient="records")
    if suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
        return data
    if suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, row {lineno}: invalid JSON ({e.msg})") from e
        return rows
    raise ValueError(f"{path}: unsupported dataset format '{suffix}' (use .jsonl, .json, .parquet)")
