"""Which weights an evaluation uses, and why (recorded in the summary).

- `last`: the newest complete checkpoint of the run.
- `best`: the complete checkpoint with the highest validation metric (`--select-metric`,
  default `val/acc` = avg@k on the run's validation split). Refused when that split is a test
  set (test-time training validates on the evaluation split) or a benchmark of the suite.
- `step_N`: the checkpoint of step N.
- `base`: the run's base model before any RL step ("before training" rows).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omgrpo.errors import CheckpointError
from omgrpo.tracking.store import RunStore


@dataclass
class Choice:
    name: str  # last | best | step_N | base | model
    step: int
    path: str | None  # checkpoint directory; None for the base / a model directory
    why: str
    selected_by: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return asdict(self)


def check_selection_metric(run_dir: Path, metric: str) -> None:
    """Refuse (InputError naming the file, step and key) a logged `metric` that is a fraction
    out of [0, 1] (`omgrpo.analysis.load.check_fractions`): `--checkpoint best` would otherwise
    pick the checkpoint whose damaged val/acc reads 1e308."""
    from omgrpo.analysis.load import check_fractions

    store = RunStore(run_dir)
    rows = [(step, {metric: row[metric]}) for step, row in store.metric_rows() if metric in row]
    source = store.metrics_path if store.metrics_path.exists() else store.compact_metrics_path
    check_fractions(rows, source)


def choose_checkpoint(
    run_dir: Path,
    which: str,
    config: dict[str, Any],
    metric: str = "val/acc",
    split: str = "val",
    test_paths: tuple[str, ...] = (),
) -> Choice:
    store = RunStore(run_dir)
    done = store.checkpoints_by_step()
    if which == "base":
        return Choice("base", 0, None, "the base model, before any RL step")
    if which == "last":
        if not done:
            raise CheckpointError(
                f"{run_dir}: no complete checkpoint (the trainer writes one at the end and every "
                "trainer.save_every steps); evaluate `--checkpoint base` or finish the run"
            )
        step = max(done)
        return Choice("last", step, str(done[step]), f"newest complete checkpoint (step {step})")
    if which.startswith("step_"):
        try:
            step = int(which[len("step_") :])
        except ValueError:
            raise CheckpointError(f"--checkpoint {which}: expected step_N, N an integer") from None
        if step not in done:
            raise CheckpointError(
                f"{run_dir}: no complete checkpoint for step {step}; available: "
                f"{', '.join(f'step_{s}' for s in sorted(done)) or 'none'}"
            )
        return Choice(which, step, str(done[step]), f"requested step {step}")
    if which == "best":
        _check_selection_split(run_dir, config, metric, split, test_paths)
        check_selection_metric(run_dir, metric)
        best = store.best_checkpoint(metric)
        if best is None:
            raise CheckpointError(
                f"{run_dir}: no complete checkpoint at a step that logged {metric} "
                f"(checkpoints: {sorted(done) or 'none'}); validation runs every eval.every steps"
            )
        step, value, candidates = best
        return Choice(
            "best",
            step,
            str(done[step]),
            f"highest {metric} on the '{split}' split among the kept checkpoints",
            {"metric": metric, "split": split, "value": value, "candidates": candidates},
        )
    raise CheckpointError(f"--checkpoint {which}: expected last, best, step_N or base")


def _check_selection_split(
    run_dir: Path, config: dict, metric: str, split: str, test_paths: tuple[str, ...]
) -> None:
    """Selection must not look at test data: the trainer's in-loop metrics (`val/*`) come from
    the run's validation split, which must be a separate split."""
    task = config.get("task") or {}
    if split != "val" or not metric.startswith("val/"):
        raise CheckpointError(
            f"--checkpoint best selects on the metrics the trainer logs on its validation "
            f"split (split 'val', metrics val/*), got split {split!r}, metric {metric!r}"
        )
    if task.get("ttt"):
        raise CheckpointError(
            f"{run_dir}: a test-time-training run validates on its evaluation split; choosing "
            "its best checkpoint would select on test data: use --checkpoint last"
        )
    if task.get("name") == "files" and not task.get("val_path") and task.get("test_path"):
        raise CheckpointError(
            f"{run_dir}: the run has no task.val_path, so it validated on its test file "
            f"{task['test_path']}; use --checkpoint last (or train with a separate val_path)"
        )
    val_path = task.get("val_path")
    if val_path and any(Path(val_path).resolve() == Path(p).resolve() for p in test_paths):
        raise CheckpointError(
            f"{run_dir}: the validation file {val_path} is a benchmark of this suite; "
            "selecting on it would select on test data: use --checkpoint last"
        )
