"""`omgrpo data prepare --backend verl`: benchmark files and toy-world splits as training /
validation data of a backend, read by the same loaders as `omgrpo eval`.

A source is a benchmark file (`.jsonl` / `.json` / `.parquet` in the formats of
`omgrpo.eval.data`: MATH500, GSM8K, AIME, AMC, or `id`/`question`/`answer` rows), `toy:train` /
`toy:val` / `toy:test` (a split of the toy world of the composed config), or every benchmark
of a suite (`--suite paper`). Every source is read before anything is written, so a bad row
(named by file and row, with what was expected) leaves no partial output. The verl backend
writes `<out>/<name>.parquet` in verl's RL row format (`omgrpo.backends.verl.data.verl_rows`),
with the source's name as `data_source` (verl groups validation metrics by it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omgrpo.core.task import Problem
from omgrpo.errors import InputError
from omgrpo.eval.data import BenchmarkDataError, load_benchmark
from omgrpo.eval.suite import TOY_SOURCE, load_suite

BACKENDS = ("verl",)
TOY_SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Source:
    name: str
    """Output file stem and `data_source` (benchmark name, file stem or `toy_<split>`)."""
    path: str
    """A benchmark file, or `toy:<split>`."""
    question_key: str | None = None
    answer_key: str | None = None
    answer_format: str = "auto"
    limit: int | None = None


def parse_sources(
    paths: Sequence[str], suite: str | None = None, limit: int | None = None, **keys
) -> list[Source]:
    """Sources of the command line: a suite's benchmarks (with the suite's keys and formats),
    then each path (`keys`: question_key / answer_key / answer_format for the files). Raises
    InputError for two sources with one name (they would write one file)."""
    sources = []
    if suite:
        for b in load_suite(suite).benchmarks:
            path = "toy:test" if b.path == TOY_SOURCE else b.path
            sources.append(
                Source(b.name, path, b.question_key, b.answer_key, b.answer_format, limit)
            )
    for path in paths:
        name = path.replace(":", "_") if path.startswith("toy:") else Path(path).stem
        sources.append(Source(name, path, limit=limit, **keys))
    if not sources:
        raise InputError("nothing to prepare: give benchmark files, toy:<split> or --suite")
    names = [s.name for s in sources]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise InputError(f"two sources would write the same file: {dupes}; rename one of them")
    return sources


def source_problems(source: Source, toy_task=None) -> list[Problem]:
    """The problems of one source (a toy split needs the composed `task` config)."""
    if source.path.startswith("toy:"):
        from omgrpo.tasks.registry import TASKS

        split = source.path.split(":", 1)[1]
        if split not in TOY_SPLITS:
            raise InputError(
                f"'{source.path}': unknown toy split; use toy:{'|toy:'.join(TOY_SPLITS)}"
            )
        if toy_task is None or toy_task.name != "toy":
            raise InputError(f"'{source.path}' needs a toy task (the config's task is not toy)")
        problems = getattr(TASKS["toy"](toy_task), split)
        return problems[: source.limit] if source.limit else problems
    return load_benchmark(
        source.path,
        source.question_key,
        source.answer_key,
        source.answer_format,
        limit=source.limit,
    )


def prepare(
    sources: Sequence[Source],
    out_dir: str | Path,
    backend: str = "verl",
    toy_task=None,
    *,
    force: bool = False,
) -> list[tuple[Path, int]]:
    """Write each source as `<out_dir>/<name>.parquet` for `backend`; returns (path, rows).
    Reads every source first: bad rows, missing files and unknown splits of all sources
    raise one BenchmarkDataError before any file is written. An existing output file is
    refused unless `force`; the files are written aside and moved in together at the end."""
    if backend not in BACKENDS:
        raise InputError(key="--backend", found=backend, expected=" or ".join(BACKENDS))
    import pandas as pd

    from omgrpo.backends.verl.data import verl_rows
    from omgrpo.staging import staged_files

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError("not a folder", key="--out", file=out_dir, expected="an output folder")
    existing = [str(out_dir / f"{s.name}.parquet") for s in sources]
    existing = [p for p in existing if Path(p).exists()]
    if existing and not force:
        raise InputError(
            "exists; pass --force to replace it", key="--out", found=existing, expected="new files"
        )
    loaded, errors = [], []
    for source in sources:
        try:
            loaded.append((source, source_problems(source, toy_task)))
        except (InputError, FileNotFoundError) as e:  # BenchmarkDataError too
            errors.append(str(e))  # every source's problems at once, not one per try
    if errors:
        raise BenchmarkDataError("\n".join(errors))
    written = []
    with staged_files(out_dir) as tmp:
        for source, problems in loaded:
            name = f"{source.name}.parquet"
            pd.DataFrame(verl_rows(problems, source.name)).to_parquet(tmp / name, index=False)
            written.append((out_dir / name, len(problems)))
    return written
