"""Replay a local run (`runs/<name>/`) into MLflow or W&B after the fact.

A run whose tracker failed during training (a broken MLflow URI, no network for W&B) loses
nothing: the run store has the config, every metric row and the rollouts, and

    omgrpo sync runs/toy__om_grpo__s0 --to mlflow

sends them with the same tracker classes the trainer uses. Works on finished and on partial
runs (a killed run's last, half-written metrics line is ignored).

Re-running is safe:
- MLflow: the run is found by its tag `omgrpo.run_dir` (also a run the trainer created before
  its backend failed) and completed in place: only (metric, step, value) points it does not
  have yet are logged, so a second sync adds nothing. Params already set are left alone (MLflow
  params are immutable), rollouts artifacts are overwritten with identical files, and the run
  status is set from `status.json` (finished / failed; a run still "running" there is marked
  KILLED). If a resumed run recomputed a step with other values, both values are kept.
- W&B: the run id is derived from the run directory (the trainer's id), with resume="allow";
  W&B history cannot be read back offline, so a second sync appends every step again (charts
  against `train/step` overlay the duplicates exactly). In offline mode each sync writes a new
  `<run_dir>/wandb/offline-run-*` folder; upload it with `wandb sync`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from omgrpo.store import RunStore
from omgrpo.tracking import MLflowTracker, WandbTracker, mlflow_tracker, wandb_tracker

BACKENDS = ("mlflow", "wandb")


def read_metric_rows(store: RunStore) -> list[tuple[int, dict[str, Any]]]:
    """(step, metrics) per line of metrics.jsonl, as written (no NaN filling of metrics a row
    lacks, unlike `RunStore.read_metrics`). A half-written last line is skipped."""
    path = store.metrics_path
    lines = path.read_text().splitlines() if path.exists() else []
    rows = []
    for lineno, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno != len(lines) - 1:
                raise ValueError(f"{path}, line {lineno + 1}: invalid JSON") from e
            continue
        step = int(row.pop("train/step", lineno))
        rows.append((step, row))
    return rows


def rollout_files(store: RunStore) -> list[tuple[int, Path]]:
    files = sorted(store.rollouts_dir.glob("step_*.parquet"))
    return [(int(f.stem.split("_")[1]), f) for f in files]


def final_status(store: RunStore) -> str:
    state = store.read_status().get("state")
    return state if state in ("finished", "failed") else "killed"


def sync_run(run_dir: str | Path, to: str, tracking_cfg: Any = None) -> str:
    """Replay the run in `run_dir` into `to` ("mlflow" or "wandb"); returns the backend's run
    id. `tracking_cfg` is the `tracking` config section (a TrackingConfig, dict or None for
    the defaults); its on/off switches are ignored: naming a backend here means use it. The
    default MLflow store is `<run_dir>/../mlflow.db`, the one the trainer uses. Errors raise
    (unlike during training)."""
    run_dir = Path(run_dir)
    store = RunStore(run_dir)
    config = store.read_config()
    run = config.get("run") or {}
    name = str(run.get("name") or run_dir.name)
    group = str(run.get("experiment") or "omgrpo")
    tags = [str(t) for t in run.get("tags") or []]

    if to == "mlflow":
        tracker: MLflowTracker | WandbTracker = mlflow_tracker(
            tracking_cfg, run_dir.parent, background=False
        )
    elif to == "wandb":
        tracker = wandb_tracker(tracking_cfg)
    else:
        raise ValueError(f"unknown tracking backend {to!r}; valid: {', '.join(BACKENDS)}")

    tracker.start(run_dir, config, name=name, group=group, tags=tags, resume=True)
    run_id = tracker.run_id
    try:
        rows = read_metric_rows(store)
        if isinstance(tracker, MLflowTracker):
            tracker.log_metrics_rows(rows, skip_existing=tracker.resumed)
        else:
            for step, metrics in rows:
                tracker.log_metrics(step, metrics)
        for step, path in rollout_files(store):
            tracker.log_rollouts(step, pd.read_parquet(path))
    finally:
        tracker.finish(final_status(store))  # the training run's status, not the sync's
    assert run_id is not None
    return run_id
