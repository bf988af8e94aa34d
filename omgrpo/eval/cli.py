"""`omgrpo eval ...`, `omgrpo export ...`, `omgrpo data convert ...` and `omgrpo data prepare
...` (exit status 0). Bad input raises InputError (file / row / key, found, expected), which
`omgrpo.cli.main` prints with exit status 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import time

from omgrpo.analysis.cli import _parse
from omgrpo.errors import InputError, check_int, check_number
from omgrpo.eval.sampler import BACKENDS


def eval_main(argv: list[str]) -> int:
    from omgrpo.eval.runner import evaluate
    from omgrpo.eval.suite import load_suite

    parser = argparse.ArgumentParser(
        prog="omgrpo eval",
        description="Evaluate runs' checkpoints (or local Hugging Face model directories) on a "
        "benchmark suite: writes <run>/eval/<suite>[-<checkpoint>]/ (<benchmark>.parquet, "
        "summary.json) and logs to the run's MLflow / W&B run. Resumable per benchmark.",
    )
    parser.add_argument("targets", nargs="+", help="run directories or HF model directories")
    parser.add_argument(
        "--suite",
        help="paper, toy, or a suite YAML (docs/eval.md); default: the run's own (toy for a toy "
        "run or its export, else paper)",
    )
    parser.add_argument(
        "--checkpoint",
        default="last",
        help="last (default), best (by --select-metric on the validation split), step_N, base",
    )
    parser.add_argument("--select-metric", default="val/acc", help="metric for 'best'")
    parser.add_argument("--select-split", default="val", help="split of that metric (val)")
    parser.add_argument("--backend", default="native", choices=BACKENDS)
    parser.add_argument("--batch-size", type=int, default=256, help="rollouts sampled at once")
    parser.add_argument(
        "--tensor-parallel-size", type=int, help="vLLM: GPUs one model is split over"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="vLLM: share of each GPU's memory vLLM may take (vLLM's default 0.9)",
    )
    parser.add_argument("--device", default="auto", help="auto (the run's), cpu, cuda[:N]")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", help="output folder (one target only)")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow / W&B")
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    if ns.out and len(ns.targets) > 1:
        raise InputError("--out takes one target", key="--out", found=ns.targets)
    _check_eval_flags(ns)
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    suite = load_suite(ns.suite) if ns.suite else None  # None: each run's own
    for target in ns.targets:
        start = time.perf_counter()
        out = evaluate(
            target,
            suite,
            checkpoint=ns.checkpoint,
            select_metric=ns.select_metric,
            select_split=ns.select_split,
            backend=ns.backend,
            batch_size=ns.batch_size,
            device=ns.device,
            tensor_parallel_size=ns.tensor_parallel_size,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            out=ns.out,
            track=not ns.no_track,
        )
        print(f"eval: {out / 'summary.json'}  ({time.perf_counter() - start:.1f} s)")
    return 0


def _check_eval_flags(ns: argparse.Namespace) -> None:
    """`omgrpo eval`'s numeric flags within their ranges (InputError naming the flag)."""
    check_int(ns.batch_size, "--batch-size", minimum=1)
    check_int(ns.threads, "--threads", minimum=1, allow_none=True)
    check_int(ns.tensor_parallel_size, "--tensor-parallel-size", minimum=1, allow_none=True)
    check_number(
        ns.gpu_memory_utilization,
        "--gpu-memory-utilization",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        allow_none=True,
    )


def export_main(argv: list[str]) -> int:
    from omgrpo.eval.export import export_run

    parser = argparse.ArgumentParser(
        prog="omgrpo export",
        description="Export a run's checkpoint as a Hugging Face model directory (safetensors, "
        "tokenizer, generation config, omgrpo_export.json) that vLLM, transformers and "
        "`omgrpo eval` load.",
    )
    parser.add_argument("run", help="a run directory (runs/<name>)")
    parser.add_argument("out", help="a new (or empty) folder")
    parser.add_argument(
        "--checkpoint", default="last", help="last (default), best (by --select-metric), step_N"
    )
    parser.add_argument("--select-metric", default="val/acc", help="metric for 'best'")
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    out = export_run(ns.run, ns.out, ns.checkpoint, ns.select_metric)
    print(f"exported {ns.run} ({ns.checkpoint}) -> {out}")
    return 0


def data_main(argv: list[str]) -> int:
    from omgrpo.eval.data import convert

    parser = argparse.ArgumentParser(
        prog="omgrpo data",
        description="Benchmark data. `convert` turns a local copy (a .jsonl/.json/.parquet "
        "file, a `save_to_disk` directory, or a dataset already in the local Hugging Face "
        "cache; nothing is downloaded) into id/question/answer rows for `omgrpo eval`; "
        "`prepare` writes benchmark files and toy splits as a backend's training data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert a local benchmark copy")
    conv.add_argument("source", help="file, save_to_disk dir, or cached dataset name")
    conv.add_argument("--out", required=True, help="output .jsonl or .parquet")
    conv.add_argument("--split", help="dataset split (e.g. test)")
    conv.add_argument("--config", help="dataset config (e.g. main for openai/gsm8k)")
    conv.add_argument("--question-key", help="question column (default: detected)")
    conv.add_argument("--answer-key", help="answer column (default: detected)")
    conv.add_argument(
        "--answer-format",
        default="auto",
        choices=["auto", "plain", "gsm8k"],
        help="gsm8k: the answer ends in '#### N' (auto detects it)",
    )
    conv.add_argument("--limit", type=int, help="first N rows only")
    conv.add_argument("--force", action="store_true", help="replace an existing --out file")
    _add_prepare(sub)
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    if ns.command == "prepare":
        return _prepare(ns)
    path, n = convert(
        ns.source,
        ns.out,
        split=ns.split,
        config=ns.config,
        question_key=ns.question_key,
        answer_key=ns.answer_key,
        answer_format=ns.answer_format,
        limit=ns.limit,
        force=ns.force,
    )
    print(f"wrote {n} problems to {path}")
    return 0


def _add_prepare(sub) -> None:
    from omgrpo.eval.prepare import BACKENDS

    prep = sub.add_parser(
        "prepare",
        help="benchmark files / toy splits -> a backend's data files",
        description="Write each source as OUT/<name>.parquet in the backend's format (verl: "
        "its RL parquet rows), read with `omgrpo eval`'s loaders; a bad row stops it before "
        "anything is written. KEY=VALUE arguments are config overrides for toy:<split> "
        "(e.g. experiment=toy_shortcut task.n_train=500).",
    )
    prep.add_argument("sources", nargs="*", help="benchmark files, toy:train|val|test, KEY=VALUE")
    prep.add_argument("--backend", required=True, choices=BACKENDS)
    prep.add_argument("--out", required=True, help="output folder")
    prep.add_argument("--suite", help="also every benchmark of a suite (paper, toy, SUITE.yaml)")
    prep.add_argument("--question-key", help="question column of the files (default: detected)")
    prep.add_argument("--answer-key", help="answer column of the files (default: detected)")
    prep.add_argument("--answer-format", default="auto", choices=["auto", "plain", "gsm8k"])
    prep.add_argument("--limit", type=int, help="first N problems of each source only")
    prep.add_argument("--force", action="store_true", help="replace existing OUT/<name>.parquet")


def _prepare(ns) -> int:
    import re
    from pathlib import Path

    from omgrpo.eval.prepare import parse_sources, prepare

    if ns.limit is not None:
        check_int(ns.limit, "--limit", minimum=1)
    # KEY=VALUE (Hydra's override syntax) that is not a file: a config override
    is_override = [re.match(r"^[\w.+~/-]+=", a) and not Path(a).exists() for a in ns.sources]
    overrides = [a for a, o in zip(ns.sources, is_override) if o]
    paths = [a for a, o in zip(ns.sources, is_override) if not o]
    sources = parse_sources(
        paths,
        ns.suite,
        ns.limit,
        question_key=ns.question_key,
        answer_key=ns.answer_key,
        answer_format=ns.answer_format,
    )
    toy_task = None
    if any(s.path.startswith("toy:") for s in sources):
        toy_task = _toy_task(overrides)
    elif overrides:
        raise InputError(
            "config overrides apply to toy:<split> sources only",
            found=overrides,
            expected="benchmark files that exist, or toy:train|val|test",
        )
    written = prepare(sources, ns.out, ns.backend, toy_task, force=ns.force)
    for path, n in written:
        print(f"wrote {n} problems to {path}")
    return 0


def _toy_task(overrides: list[str]):
    """The `task` of the config the overrides compose, its values checked (InputError)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from omgrpo.config import check_values, compose
    from omgrpo.errors import short_message

    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise InputError(f"the config does not compose: {short_message(e)}") from e
    check_values(cfg)
    return cfg.task
