"""`omgrpo export RUN [--checkpoint last|best|step_N] OUT`: a run's checkpoint, chosen as
`omgrpo eval` chooses it (`eval/checkpoints.py`), as a Hugging Face model directory; a verl
run's (config.yaml `backend: verl`) through verl's model merger (`omgrpo.backends.verl.export`)."""

from __future__ import annotations

from pathlib import Path

from omgrpo.backends.native.export import check_export_target, export_checkpoint
from omgrpo.eval.checkpoints import CheckpointError, check_selection_metric, choose_checkpoint
from omgrpo.tracking.store import RunStore


def export_run(
    run_dir: str | Path, out: str | Path, checkpoint: str = "last", select_metric: str = "val/acc"
) -> Path:
    """Export the run's `checkpoint` (last, best or step_N) into `out`; refuses an `out` that
    exists and is not empty, a checkpoint the run does not have (naming the ones it has) and a
    checkpoint whose files fail its manifest."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no config.yaml)")
    check_export_target(out)  # before any work
    if RunStore(run_dir).read_config().get("backend") == "verl":  # through verl's model merger
        from omgrpo.backends.verl.export import export_verl_run

        if checkpoint == "best":
            check_selection_metric(run_dir, select_metric)
        return export_verl_run(run_dir, out, checkpoint, select_metric)
    if checkpoint == "base":
        raise CheckpointError(
            "--checkpoint base: the base is already a model directory (the run's model.path, "
            "or the toy base in model.cache_dir); export last, best or step_N"
        )
    choice = choose_checkpoint(run_dir, checkpoint, RunStore(run_dir).read_config(), select_metric)
    assert choice.path is not None  # every choice but `base` names a checkpoint folder
    return export_checkpoint(choice.path, out, run_dir=run_dir, label=choice.name, why=choice.why)
