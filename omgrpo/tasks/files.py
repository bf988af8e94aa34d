"""Datasets from local JSONL / Parquet files with `question` / `answer` columns (MATH, GSM8K).

Every row is checked when the file is read, so a bad file fails before the first training step
with an error naming the file and the row: JSONL rows are named by their line (1-based, as in an
editor), Parquet and JSON rows by their index (0-based, as pandas shows them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import pandas as pd

from omgrpo.core.task import Problem
from omgrpo.errors import InputError


def load_problems(
    path: str | Path,
    question_key: str = "question",
    answer_key: str = "answer",
    split: str = "data",
    require_answer: bool = True,
) -> list[Problem]:
    """Read problems from a `.jsonl` / `.json` / `.parquet` file.

    Every row must have a non-empty `question_key` and (unless `require_answer` is False, as in
    unlabeled test-time training) an `answer_key`. Both must be single values: text, or a number
    (taken as its text: `12` -> "12"; a whole float such as `2.0`, which pandas makes of an
    integer column with gaps, -> "2"). Lists, dicts and booleans are refused. An empty file, a
    line that is not UTF-8 or not JSON, and a bad row raise a ValueError naming the file and row.
    An optional `paraphrase` column feeds CoReward. Each problem's `meta["source"]` says where
    it came from ("file, line 3").
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    problems = []
    for i, (where, row) in enumerate(_read_rows(path)):
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected an object with '{question_key}', got {row!r:.80}")
        if row.get(question_key) is None:
            raise InputError(
                f"{where}: missing '{question_key}' (columns: {sorted(row)}); "
                f"set task.question_key if your file names it differently"
            )
        question = _scalar_text(row[question_key], where, question_key)
        if question is None or not question.strip():
            raise InputError(f"{where}: empty '{question_key}'")
        answer = _scalar_text(row.get(answer_key), where, answer_key)
        if answer is None and require_answer:
            raise InputError(
                f"{where}: missing '{answer_key}' (columns: {sorted(row)}); "
                f"set task.answer_key if your file names it differently"
            )
        paraphrase = _scalar_text(row.get("paraphrase"), where, "paraphrase")
        problems.append(
            Problem(
                id=str(row.get("id", f"{split}-{i}")),
                question=question,
                answer=answer,
                paraphrase=paraphrase,
                meta={"source": where},
            )
        )
    if not problems:
        raise InputError(f"{path}: the {split} file has no rows")
    return problems


def _scalar_text(value: Any, where: str, key: str) -> str | None:
    """A cell as text: None for a missing value (None / NaN), str for text and numbers."""
    if value is None or value is pd.NA:
        return None
    if isinstance(value, Real) and not isinstance(value, Integral) and math.isnan(value):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bool):  # bool is an Integral: refuse it before the number cases
        raise InputError(f"{where}: '{key}' must be text or a number, got the boolean {value}")
    if isinstance(value, Integral):
        return str(int(value))
    if isinstance(value, Real):
        number = float(value)
        return str(int(number)) if number.is_integer() else repr(number)
    shown = value.tolist() if hasattr(value, "tolist") else value  # Parquet lists are arrays
    kind = "a list" if isinstance(shown, list | tuple) else type(value).__name__
    raise InputError(
        f"{where}: '{key}' must be a single value (text or a number), got {kind} "
        f"{shown!r:.80}; a list of answers cannot be graded as one label"
    )


def _read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the file; `where` names the file and the row."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            table = pd.read_parquet(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise InputError(f"not a readable Parquet file ({str(e)[:200]})", file=path) from e
        for i, row in enumerate(table.to_dict(orient="records")):
            yield f"{path}, row {i}", row
    elif suffix == ".json":
        try:
            data = json.loads(_utf8(path.read_bytes(), f"{path}"))
        except json.JSONDecodeError as e:
            raise InputError(f"invalid JSON ({e.msg}, line {e.lineno})", file=path) from e
        except ValueError as e:  # json's own limits: an integer of more than 4300 digits
            raise InputError(f"invalid JSON ({e})", file=path) from e
        if not isinstance(data, list):
            raise InputError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
        for i, row in enumerate(data):
            yield f"{path}, row {i}", row
    elif suffix == ".jsonl":
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}, line {lineno}"
                line = _utf8(raw, where)
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}: invalid JSON ({e.msg})") from e
                except ValueError as e:  # an integer of more than 4300 digits
                    raise InputError(f"{where}: invalid JSON ({e})") from e
    else:
        raise InputError(
            f"{path}: unsupported dataset format '{suffix}' (use .jsonl, .json, .parquet)"
        )


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start}); "
            "re-encode the file as UTF-8"
        ) from e
