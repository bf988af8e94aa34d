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

import yaml

from omgrpo.core.prompt import SYSTEM_PROMPT

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
    raise ValueError(f"unknown suite '{name}': use paper, toy or a YAML file")


def load_suite(name_or_path: str) -> Suite:
    """A built-in suite by name, or a suite YAML file (errors name the file and key; relative
    benchmark paths are read from the working directory, like `task.*_path`)."""
    path = Path(name_or_path)
    if path.suffix not in {".yaml", ".yml"}:
        return builtin_suite(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"suite file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), dict):
        raise ValueError(f"{path}: needs a 'benchmarks' mapping (name -> {{path, k, ...}})")
    defaults = data.get("defaults") or {}
    fields = {f.name for f in dataclasses.fields(BenchmarkSpec)} - {"name"}
    benchmarks = []
    for bench, spec in data["benchmarks"].items():
        merged = {**defaults, **(spec or {})}
        unknown = sorted(set(merged) - fields)
        if unknown:
            raise ValueError(
                f"{path}: benchmarks.{bench}: unknown key(s) {unknown}; valid: {sorted(fields)}"
            )
        for required in ("path", "k"):
            if required not in merged:
                raise ValueError(f"{path}: benchmarks.{bench}: missing '{required}'")
        if not isinstance(merged["k"], int) or merged["k"] < 1:
            raise ValueError(f"{path}: benchmarks.{bench}.k: expected an integer >= 1")
        benchmarks.append(BenchmarkSpec(name=str(bench), **merged))
    return Suite(str(data.get("name") or path.stem), benchmarks)
