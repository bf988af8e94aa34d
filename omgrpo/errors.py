"""One error surface for bad input (issue 37).

`InputError` is what every verb raises for an expected failure (a bad value, a bad file, a
missing thing): it names where the problem is (file, row, key), what was found and what was
expected. `omgrpo.cli.main` prints it as `omgrpo <verb>: error: ...` and exits 2, with the
traceback only under `--debug` or `OMGRPO_DEBUG=1`; any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

_UNSET = object()


class InputError(ValueError):
    """Bad input, named: `file` (a path), `row` (a row or line, as the file counts them),
    `key` (a config key or column), `found` (the value seen) and `expected` (in words).

    str(e) is one line (or a few): `FILE, row N: KEY: MESSAGE (found X; expected Y)`."""

    def __init__(
        self,
        message: str = "",
        *,
        file: str | Path | None = None,
        row: int | str | None = None,
        key: str | None = None,
        found: Any = _UNSET,
        expected: str | None = None,
    ):
        self.message = message
        self.file = None if file is None else str(file)
        self.row = row
        self.key = key
        self.found = None if found is _UNSET else found
        self.has_found = found is not _UNSET
        self.expected = expected
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.file is not None:
            where.append(self.file)
        if self.row is not None:
            where.append(f"row {self.row}" if isinstance(self.row, int) else str(self.row))
        head = ", ".join(where)
        parts = [p for p in (head, self.key) if p]
        text = ": ".join([*parts, self.message] if self.message else parts)
        detail = []
        if self.has_found:
            detail.append(f"found {self.found!r}")
        if self.expected:
            detail.append(f"expected {self.expected}")
        if detail:
            text = f"{text} ({'; '.join(detail)})" if text else "; ".join(detail)
        return text


class CheckpointError(InputError):
    """A checkpoint that cannot be used: missing, damaged (checksum), or not the one asked for
    (`omgrpo eval --checkpoint`, `omgrpo export`)."""


class MissingDependency(InputError, ImportError):
    """An optional package a command needs is not installed (vLLM, datasets): said with the
    install line; still an ImportError for callers that catch one."""


def debug_enabled() -> bool:
    """`--debug` (set by the CLI) or OMGRPO_DEBUG=1: expected errors show their traceback."""
    return os.environ.get("OMGRPO_DEBUG", "").strip().lower() not in {"", "0", "false", "no"}


_OMEGACONF_DETAIL = ("full_key:", "reference_type=", "object_type=", "Set the environment")


def short_message(e: BaseException) -> str:
    """An exception's message for one error line or a few: without OmegaConf's detail lines
    (full_key, object_type), with the first line of its cause when the message leaves out why
    (Hydra's "Error merging override X")."""

    def lines(x: BaseException) -> list[str]:
        out = [ln.rstrip() for ln in str(x).strip().splitlines()]
        return [ln for ln in out if ln.strip() and not ln.strip().startswith(_OMEGACONF_DETAIL)]

    message = "\n".join(lines(e)) or type(e).__name__
    cause = None if isinstance(e, InputError) else e.__cause__  # an InputError says it all
    why = lines(cause) if cause is not None else []
    if why and why[0] not in message:
        message = f"{message}: {why[0]}"
    return message


# -- value checks, each naming the key --------------------------------------------------------
def check_int(
    value: Any,
    key: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
    file: str | Path | None = None,
) -> int | None:
    """`value` as an int within [minimum, maximum] (a bool is not an int); None if allowed."""
    if value is None and allow_none:
        return None
    words = _range_words("an integer", minimum, maximum, allow_none)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(key=key, found=value, expected=words, file=file)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InputError(key=key, found=value, expected=words, file=file)
    return value


def check_number(
    value: Any,
    key: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    allow_none: bool = False,
    file: str | Path | None = None,
) -> float | None:
    """`value` as a finite number within the bounds (NaN and inf refused); None if allowed."""
    if value is None and allow_none:
        return None
    low = None
    if minimum is not None:
        low = f"> {minimum:g}" if exclusive_minimum else f">= {minimum:g}"
    high = None if maximum is None else f"<= {maximum:g}"
    words = " and ".join(b for b in (low, high) if b)
    words = f"a finite number {words}" if words else "a finite number"
    if allow_none:
        words += " (or null)"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(key=key, found=value, expected=words, file=file)
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        raise InputError(key=key, found=value, expected=words, file=file)
    if maximum is not None and value > maximum:
        raise InputError(key=key, found=value, expected=words, file=file)
    return float(value)


def _range_words(kind: str, minimum: Any, maximum: Any, allow_none: bool) -> str:
    if minimum is not None and maximum is not None:
        words = f"{kind} from {minimum} to {maximum}"
    elif minimum is not None:
        words = f"{kind} >= {minimum}"
    elif maximum is not None:
        words = f"{kind} <= {maximum}"
    else:
        words = kind
    return words + (" (or null)" if allow_none else "")


def inside(base: str | Path, name: str, what: str, *, file: str | Path | None = None) -> Path:
    """`base / name` for a name read from an input (a suite or benchmark name), refused when it
    is empty, absolute, or would leave `base` (`..`, a path separator)."""
    if not isinstance(name, str) or not name.strip():
        raise InputError(key=what, found=name, expected="a non-empty name", file=file)
    if name in {".", ".."} or "/" in name or "\\" in name or "\0" in name:
        raise InputError(
            key=what,
            found=name,
            expected="a plain name (no '/', '\\' or '..': it names a file inside the output "
            "folder)",
            file=file,
        )
    return Path(base) / name


# -- reading input files, each error naming the file --------------------------------------------
def read_text(path: str | Path, what: str = "a text file") -> str:
    """A file's text, refused by name (InputError) when it is missing, a folder or not UTF-8."""
    path = Path(path)
    if not path.exists():
        raise InputError("not found", file=path, expected=what)
    if not path.is_file():
        raise InputError("not a file", file=path, expected=what)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text ({e.reason} at byte {e.start})", file=path) from e


def read_yaml(path: str | Path, what: str = "a YAML file") -> Any:
    """A YAML file's data; a file that does not parse is named with the line and column."""
    import yaml

    text = read_text(path, what)
    # libyaml's parser where PyYAML was built with it: the same data as safe_load, ~10x faster
    # (a study's report reads ~150 run configs)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else None
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError(f"not valid YAML: {problem}", file=path, row=where) from e


def read_json(path: str | Path, what: str = "a JSON file") -> Any:
    """A JSON file's data; a file that does not parse (empty, truncated) is named with the line
    and column."""
    import json

    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise InputError(f"not valid JSON: {e.msg}", file=path, row=where) from e


def read_mapping(path: str | Path, what: str) -> dict:
    """A YAML (or JSON: .json) file that must hold a mapping, e.g. a run's config.yaml."""
    path = Path(path)
    data = read_json(path, what) if path.suffix == ".json" else read_yaml(path, what)
    if not isinstance(data, dict):
        found = data if not isinstance(data, (list, str)) or len(data) < 60 else type(data)
        raise InputError("not a mapping", file=path, found=found, expected=what)
    return data
