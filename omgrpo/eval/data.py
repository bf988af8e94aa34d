"""Benchmark files: JSONL / JSON / Parquet in the common public formats, and conversion from a
local Hugging Face `datasets` copy.

Formats read (column names are detected unless the suite names them):

| benchmark | source | question | answer |
|---|---|---|---|
| MATH500 | `HuggingFaceH4/MATH-500` (test, 500) | `problem` | `answer` (LaTeX) |
| GSM8K | `openai/gsm8k` (main, test, 1319) | `question` | `answer`: worked solution ending `#### 72` |
| AIME 2024 | `HuggingFaceH4/aime_2024` (train, 30) | `problem` | `answer` (int or string) |
| AIME 2025 | e.g. `yentinglin/aime_2025` / opencompass (30) | `problem` / `question` | `answer` |
| AMC | TTRL's AMC-TTT / `AI-MO/aimo-validation-amc` (83) | `prompt` / `problem` | `answer` (float, e.g. `27.0`) |

Answers are read as strings: GSM8K's final line after `####` (thousands commas dropped),
integral floats as integers (`27.0` -> `27`). Every bad row is reported with its file and row.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omgrpo.core.task import Problem
from omgrpo.errors import InputError, check_int
from omgrpo.tasks.files import _read_rows

QUESTION_KEYS = ("problem", "question", "prompt", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer", "final_answer", "expected_answer")
ANSWER_FORMATS = ("auto", "plain", "gsm8k")
MAX_REPORTED = 20


class BenchmarkDataError(InputError):
    """A benchmark file with bad rows; the message lists each (file, row, what is wrong)."""


def final_answer(value: Any, answer_format: str = "auto") -> str:
    """The gold answer as a string. `gsm8k`: the text after the last `####` (required);
    `auto`: the same when `####` occurs, else the value; `plain`: the value."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer format '{answer_format}'; valid: {ANSWER_FORMATS}")
    if isinstance(value, bool | np.bool_) or value is None:
        raise ValueError(f"expected a number or a string, got {value!r}")
    if isinstance(value, numbers.Integral):  # numpy integers too (Parquet columns)
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"answer is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a number or a string, got {type(value).__name__}")
    text = value.strip()
    if answer_format == "gsm8k" or (answer_format == "auto" and "####" in text):
        if "####" not in text:
            raise ValueError("GSM8K answer without a final '#### N' line")
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    if not text:
        raise ValueError("empty answer")
    return text


def _pick(row: dict, key: str | None, candidates: Sequence[str], what: str) -> str:
    if key:
        if key not in row:
            raise KeyError(f"no '{key}' column (columns: {sorted(row)})")
        return key
    for name in candidates:
        if name in row:
            return name
    raise KeyError(f"no {what} column: expected one of {list(candidates)} (columns: {sorted(row)})")


def load_benchmark(
    path: str | Path,
    question_key: str | None = None,
    answer_key: str | None = None,
    answer_format: str = "auto",
    id_key: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Problems of a benchmark file. Raises BenchmarkDataError listing every bad row (missing or
    empty question, missing or unreadable answer) by file and row (JSONL: line, 1-based;
    JSON / Parquet: row index, 0-based, as `omgrpo.tasks.files` names them)."""
    path = Path(path)
    check_int(limit, "limit", minimum=1, allow_none=True)  # -1 dropped the last row, 0 none
    if not path.exists():
        raise FileNotFoundError(
            f"benchmark file not found: {path} (convert a local copy with `omgrpo data convert`, "
            "see docs/eval.md)"
        )
    if path.is_dir():
        raise BenchmarkDataError(f"{path}: a directory, not a benchmark file")
    rows = list(_read_rows(path))  # (where: file and row / line, row)
    problems, errors, first_seen = [], [], {}
    for i, (where, row) in enumerate(rows[:limit] if limit else rows):
        try:
            if not isinstance(row, dict):
                raise ValueError(f"expected an object, got {row!r:.60}")
            q = _pick(row, question_key, QUESTION_KEYS, "question")
            question = row[q]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"empty or non-text '{q}'")
            a = _pick(row, answer_key, ANSWER_KEYS, "answer")
            answer = final_answer(row[a], answer_format)
        except (KeyError, ValueError) as e:
            errors.append(f"{where}: {e.args[0] if e.args else e}")
            continue
        pid = str(row.get(id_key or "id", row.get("unique_id", i)))
        if pid in first_seen:  # per-problem results are keyed by id: a duplicate merges two
            errors.append(f"{where}: duplicate id {pid!r} (first at {first_seen[pid]})")
            continue
        first_seen[pid] = where
        problems.append(Problem(id=pid, question=question, answer=answer))
    if errors:
        shown = errors[:MAX_REPORTED]
        more = (
            f"\n  ... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
        )
        raise BenchmarkDataError(
            f"{path}: {len(errors)} bad row(s) of {len(rows)}:\n  " + "\n  ".join(shown) + more
        )
    if not problems:
        raise BenchmarkDataError(f"{path}: no rows")
    return problems


OUT_SUFFIXES = (".jsonl", ".parquet")


def write_problems(problems: Sequence[Problem], out: str | Path) -> Path:
    """Write `id`, `question`, `answer` rows as JSONL (`.jsonl`) or Parquet (`.parquet`): into
    a temporary file of its own next to `out`, then renamed over it (all or nothing)."""
    import os
    import tempfile

    out = Path(out)
    if out.suffix not in OUT_SUFFIXES:
        raise InputError(key="--out", found=str(out), expected="a .jsonl or .parquet file")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": p.id, "question": p.question, "answer": p.answer} for p in problems]
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it (mkstemp: 0600)
    try:
        if out.suffix == ".parquet":
            import pandas as pd

            pd.DataFrame(rows).to_parquet(tmp, index=False)
        else:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)  # ours: removed if the rename did not happen
    return out


def convert(
    source: str | Path,
    out: str | Path,
    *,
    split: str | None = None,
    config: str | None = None,
    question_key: str | None = None,
    answer_key: str | None = None,
    answer_format: str = "auto",
    limit: int | None = None,
    force: bool = False,
) -> tuple[Path, int]:
    """Convert a local benchmark copy into `id`/`question`/`answer` rows. An existing `out` is
    refused unless `force` (then replaced all at once); nothing else is written or deleted.

    `source` is a data file (.jsonl/.json/.parquet), a directory written by
    `Dataset.save_to_disk`, or a dataset name that is already in the local `datasets` cache
    (read with `HF_DATASETS_OFFLINE=1`; nothing is downloaded). Returns (path, rows)."""
    import tempfile

    src, out = Path(source), Path(out)
    check_int(limit, "--limit", minimum=1, allow_none=True)
    if out.suffix not in OUT_SUFFIXES:
        raise InputError(key="--out", found=str(out), expected="a .jsonl or .parquet file")
    if out.is_dir():
        raise InputError("a directory", key="--out", found=str(out), expected="a file name")
    if out.exists() and not force:
        raise InputError(
            "exists; pass --force to replace it", key="--out", found=str(out)
        )  # before: overwritten without asking
    if src.exists() and out.exists() and src.resolve() == out.resolve():
        raise InputError("--out is the source file", key="--out", found=str(out))
    if src.is_file():
        problems = load_benchmark(src, question_key, answer_key, answer_format, limit=limit)
        return write_problems(problems, out), len(problems)
    looks_like_a_path = (
        src.suffix in {".jsonl", ".json", ".parquet"}
        or str(source).startswith((".", "/", "~"))
        or str(source).count("/") > 1
    )  # else a dataset name (org/name), looked up in the local cache
    if not src.exists() and looks_like_a_path:
        raise FileNotFoundError(f"{source}: no such file or directory")
    rows = _dataset_rows(str(source), split, config)
    # the rows go through the file loader from a temporary folder of our own (before: a file
    # next to --out, overwritten and then deleted whatever it was)
    with tempfile.TemporaryDirectory(prefix="omgrpo-convert-") as scratch:
        tmp = Path(scratch) / "rows.jsonl"
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        try:
            problems = load_benchmark(tmp, question_key, answer_key, answer_format, limit=limit)
        except BenchmarkDataError as e:  # name the source, not the scratch file
            raise BenchmarkDataError(str(e).replace(str(tmp), str(source))) from e
    return write_problems(problems, out), len(problems)


def _dataset_rows(source: str, split: str | None, config: str | None) -> list[dict]:
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        from omgrpo.errors import MissingDependency

        raise MissingDependency(
            "reading a Hugging Face dataset needs `pip install datasets`; or pass a "
            ".jsonl/.parquet file"
        ) from e
    if Path(source).is_dir():  # written by save_to_disk (a Dataset or a DatasetDict)
        data = datasets.load_from_disk(source)
    else:
        try:
            data = datasets.load_dataset(source, config, split=split)
        except (ConnectionError, OSError) as e:  # offline: not in the local cache
            raise InputError(
                "not a file, and not a dataset in the local Hugging Face cache (nothing is "
                f"downloaded: {type(e).__name__})",
                key="SOURCE",
                found=source,
                expected="a .jsonl / .json / .parquet file, a save_to_disk folder, or a cached "
                "dataset name",
            ) from e
    if isinstance(data, datasets.DatasetDict):
        if split is None:
            raise InputError(
                "has several splits: choose one with --split",
                file=source,
                key="--split",
                expected=f"one of {list(data)}",
            )
        data = data[split]
    return [dict(r) for r in data]
