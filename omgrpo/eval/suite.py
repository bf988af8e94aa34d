"""Evaluation suites: per benchmark the data, the sampling settings and the prompt template.

Built in:
- `paper`: the paper's protocol (appendix "Evaluation"): AIME24/25 avg@16, MATH500 and GSM8K
  avg@4, AMC avg@8, all at temperature 0.8 and top-p 0.95, up to 3072 new tokens, the paper's
  system prompt through the model's own chat template. Files under `data/benchmarks/`
  (`omgrpo data convert` writes them; docs/eval.md says where each comes from).
- `toy`: the toy world's test split of the run's own task config, avg@8 at 0.8 / 0.95.

A YAML file defines its own suite::

    name: my_suite
    defaults: {temperature: 0.8, top_p: 0.95, max_new_tokens: 3072}
    benchmarks:
      math500: {path: data/benchmarks/math500.jsonl, k: 4}
      gsm8k: {path: data/gsm8k_test.parquet, question_key: question, answer_format: gsm8k}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omgrpo.core.prompt import SYSTEM_PROMPT
from omgrpo.errors import InputError, check_int, check_number, inside, read_yaml

TOY_SOURCE = "toy:test"  # the toy world's test split, from the run's task config


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    path: str
    """A .jsonl/.json/.parquet file, or `toy:test` (the toy world's test split)."""
    k: int
    """Samples per problem (avg@k, pass@1..k, maj@k)."""
    temperature: float = 0.8
    top_p: float = 0.95
    max_new_tokens: int = 3072
    question_key: str | None = None
    """Column of the question; null: detected (problem, question, prompt)."""
    answer_key: str | None = None
    """Column of the answer; null: detected (answer, final_answer, ...)."""
    answer_format: str = "auto"
    """`gsm8k`: the answer is a solution ending in `#### N`; `plain`; `auto` detects `####`."""
    system_prompt: str = SYSTEM_PROMPT
    """The template: this system prompt, then the question, through the model's chat template
    (plain text for models without one), as in training."""
    limit: int | None = None
    """Evaluate only the first N problems (smoke tests)."""
    seed: int = 0
    """Seed of the sampling RNG."""

    def settings(self) -> dict[str, Any]:
        """What the summary records about how the benchmark was sampled."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}


@dataclass(frozen=True)
class Suite:
    name: str
    benchmarks: list[BenchmarkSpec] = field(default_factory=list)


PAPER_BENCHMARKS = {  # name -> (file, k); the paper's appendix "Evaluation"
    "aime24": ("data/benchmarks/aime24.jsonl", 16),
    "aime25": ("data/benchmarks/aime25.jsonl", 16),
    "math500": ("data/benchmarks/math500.jsonl", 4),
    "gsm8k": ("data/benchmarks/gsm8k.jsonl", 4),
    "amc": ("data/benchmarks/amc.jsonl", 8),
}


def default_suite_name(config: dict[str, Any] | None) -> str:
    """A run's own suite: `toy` for a run on the toy world (its test split), `paper` for any
    other run and for a model directory omgrpo did not export."""
    task = (config or {}).get("task") or {}
    return "toy" if task.get("name") == "toy" else "paper"


def builtin_suite(name: str) -> Suite:
    if name == "paper":
        return Suite(
            "paper",
            [BenchmarkSpec(b, path, k) for b, (path, k) in PAPER_BENCHMARKS.items()],
        )
    if name == "toy":
        return Suite("toy", [BenchmarkSpec("toy_test", TOY_SOURCE, 8, max_new_tokens=64)])
    raise InputError(
        "unknown suite", key="--suite", found=name, expected="paper, toy or a .yaml file"
    )


def load_suite(name_or_path: str) -> Suite:
    """A built-in suite by name, or a suite YAML file, validated as a whole before anything
    loads: every error names the file and the key (`benchmarks.<name>.<field>`), with the value
    found and what was expected. Relative benchmark paths are read from the working directory,
    like `task.*_path`. Suite and benchmark names become file names in the output folder: they
    must be plain names (no '/', no '..')."""
    path = Path(name_or_path)
    if path.suffix not in {".yaml", ".yml"}:
        return builtin_suite(name_or_path)
    data = _read_suite_file(path)
    benchmarks_node = data.get("benchmarks")
    if not isinstance(benchmarks_node, dict) or not benchmarks_node:
        raise InputError(
            "no benchmarks (an empty suite would overwrite an existing summary with nothing)",
            file=path,
            key="benchmarks",
            found=_short(benchmarks_node),
            expected="a non-empty mapping name -> {path, k, ...}",
        )
    name = data.get("name")
    if name is None:
        name = path.stem
    if not isinstance(name, str):
        raise InputError(file=path, key="name", found=name, expected="a string")
    inside(".", name, "name", file=path)
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise InputError(file=path, key="defaults", found=_short(defaults), expected="a mapping")
    fields = {f.name for f in dataclasses.fields(BenchmarkSpec)} - {"name"}
    unknown = sorted(set(defaults) - fields, key=str)
    if unknown:
        raise InputError(
            f"unknown key(s) {unknown}",
            file=path,
            key="defaults",
            expected=f"some of {sorted(fields)}",
        )
    benchmarks = [
        _benchmark_spec(bench, spec, defaults, fields, path)
        for bench, spec in benchmarks_node.items()
    ]
    return Suite(name, benchmarks)


def _read_suite_file(path: Path) -> dict:
    """A suite file's YAML as a mapping of the known top-level keys (InputError otherwise)."""
    if not path.exists():
        raise InputError("suite file not found", file=path)
    data = read_yaml(path, "a suite YAML file")
    expected = "a mapping with 'benchmarks: {name: {path: ..., k: ...}}'"
    if not isinstance(data, dict):
        raise InputError("not a suite", file=path, found=_short(data), expected=expected)
    unknown = sorted(set(data) - {"name", "defaults", "benchmarks"}, key=str)
    if unknown:
        raise InputError(
            f"unknown top-level key(s) {unknown}", file=path, expected="name, defaults, benchmarks"
        )
    return data


def _benchmark_spec(
    bench: Any, spec: Any, defaults: dict, fields: set, path: Path
) -> BenchmarkSpec:
    """One `benchmarks.<bench>` entry over the suite's defaults, checked (InputError)."""
    if not isinstance(bench, str):
        raise InputError(
            "a benchmark name must be a string", file=path, key="benchmarks", found=bench
        )
    inside(".", bench, f"benchmarks.{bench}", file=path)
    if spec is not None and not isinstance(spec, dict):
        raise InputError(
            file=path,
            key=f"benchmarks.{bench}",
            found=_short(spec),
            expected="a mapping {path, k, ...}",
        )
    merged = {**defaults, **(spec or {})}
    unknown = sorted(set(merged) - fields, key=str)
    if unknown:
        raise InputError(
            f"unknown key(s) {unknown}",
            file=path,
            key=f"benchmarks.{bench}",
            expected=f"some of {sorted(fields)}",
        )
    for required in ("path", "k"):
        if required not in merged:
            raise InputError("missing", file=path, key=f"benchmarks.{bench}.{required}")
    _check_fields(merged, f"benchmarks.{bench}", path)
    return BenchmarkSpec(name=bench, **merged)


def _check_fields(spec: dict[str, Any], prefix: str, file: Path) -> None:
    """Each field of a benchmark's spec within its range (InputError naming the key)."""
    from omgrpo.eval.data import ANSWER_FORMATS

    def key(field_name: str) -> str:
        return f"{prefix}.{field_name}"

    bench_path = spec["path"]
    if not isinstance(bench_path, str) or not bench_path.strip():
        raise InputError(
            file=file,
            key=key("path"),
            found=bench_path,
            expected="a .jsonl / .json / .parquet file, or toy:test",
        )
    check_int(spec["k"], key("k"), minimum=1, file=file)
    if "temperature" in spec:
        check_number(spec["temperature"], key("temperature"), minimum=0, file=file)
    if "top_p" in spec:
        check_number(
            spec["top_p"], key("top_p"), minimum=0, maximum=1, exclusive_minimum=True, file=file
        )
    if "max_new_tokens" in spec:
        check_int(spec["max_new_tokens"], key("max_new_tokens"), minimum=1, file=file)
    if "limit" in spec:
        check_int(spec["limit"], key("limit"), minimum=1, allow_none=True, file=file)
    if "seed" in spec:
        check_int(spec["seed"], key("seed"), minimum=0, file=file)
    for name in ("question_key", "answer_key"):
        value = spec.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise InputError(
                file=file, key=key(name), found=value, expected="a column name (or null: detected)"
            )
    if "answer_format" in spec and spec["answer_format"] not in ANSWER_FORMATS:
        raise InputError(
            file=file,
            key=key("answer_format"),
            found=spec["answer_format"],
            expected=f"one of {', '.join(ANSWER_FORMATS)}",
        )
    if "system_prompt" in spec and not isinstance(spec["system_prompt"], str):
        raise InputError(
            file=file,
            key=key("system_prompt"),
            found=_short(spec["system_prompt"]),
            expected="a string",
        )


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."
