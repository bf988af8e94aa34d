"""Task registry: `load_task(cfg)` returns the train/val/test splits of the configured task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omgrpo.core.task import TaskProbe, TaskSplits
from omgrpo.tasks.files import load_problems
from omgrpo.tasks.toy import ToyProbe, ToyWorldSpec, generate_toy_splits


def _toy(cfg: Any) -> TaskSplits:
    spec = ToyWorldSpec.from_config(cfg)
    return generate_toy_splits(cfg.n_train, cfg.n_val, cfg.n_test, seed=cfg.seed, spec=spec)


def _files(cfg: Any) -> TaskSplits:
    if not cfg.train_path:
        raise ValueError("task=files needs task.train_path (a .jsonl or .parquet file)")

    def load(path: str | None, split: str, require_answer: bool):
        if not path:
            return []
        return load_problems(path, cfg.question_key, cfg.answer_key, split, require_answer)

    # Test-time training trains on the evaluation split, which may be unlabeled.
    train = load(cfg.train_path, "train", require_answer=not cfg.ttt)
    val = load(cfg.val_path, "val", require_answer=True)
    test = load(cfg.test_path, "test", require_answer=False)
    return TaskSplits(train=train, val=val or test, test=test)


TASKS: dict[str, Callable[[Any], TaskSplits]] = {"toy": _toy, "files": _files}


def task_probe(cfg: Any) -> TaskProbe:
    """The configured task's hook into scoring (`TaskProbe`). File tasks read the `result` role
    with the toy world's `a op b = c` lines too (math text has such lines; the role was defined
    so before the hook existed) and log no peak share."""
    if cfg.name == "toy":
        return ToyProbe(peak=str(cfg.guess_peak))
    return ToyProbe(peak=None)


def load_task(cfg: Any) -> TaskSplits:
    """Build the splits for `cfg.name`; in test-time-training mode the train split is the
    evaluation split with its labels kept only for diagnostics."""
    if cfg.name not in TASKS:
        raise ValueError(f"unknown task '{cfg.name}'; valid tasks: {', '.join(sorted(TASKS))}")
    splits = TASKS[cfg.name](cfg)
    if cfg.ttt:
        evaluation = splits.test or splits.val
        splits = TaskSplits(train=list(evaluation), val=list(evaluation), test=list(evaluation))
    if not splits.train:
        raise ValueError(f"task '{cfg.name}' has an empty train split")
    return splits
