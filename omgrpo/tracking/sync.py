"""Replay a local run (`runs/<name>/`) into MLflow or W&B after the fact.

A run whose tracker failed during training (a broken MLflow URI, no network for W&B) loses
nothing: the run store has the config, every metric row and the rollouts, and

    omgrpo sync runs/toy__om_grpo__s0 --to mlflow

sends them with the same tracker classes the trainer uses. Works on finished and on partial
runs (a killed run's last, half-written metrics line is ignored).

Re-running is safe: each sync writes the run store's whole history into a new tracker run and
retires the older ones of the same run identity (the UUID in `identity.json`; the same thing a
resumed training run does, see `omgrpo.tracking`), so there is always one active run with one
value per step, and runs of other machines that used the same path are never touched:
- MLflow: a new run, tagged `omgrpo.run_uuid`; the older active runs of the identity (also one
  the trainer created before its backend failed, or one left RUNNING by a locked database) are
  soft-deleted and tagged `omgrpo.superseded_by`. The run status is set from `status.json`
  (finished / failed; a run still "running" there is marked KILLED).
- W&B: the run id recorded in the run store (else derived from the run's UUID). Offline,
  the sync writes a new `<run_dir>/wandb/offline-run-*` folder with the whole history and moves
  the older ones to `wandb/superseded/`; upload it with `wandb sync`. Online, the run is
  resumed with resume="allow" and every step is appended again (W&B history cannot be read
  back to skip what it has).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omgrpo.tracking.fanout import replay_store
from omgrpo.tracking.mlflow_tracker import MLflowTracker
from omgrpo.tracking.store import RunStore
from omgrpo.tracking.wandb_tracker import WandbTracker

BACKENDS = ("mlflow", "wandb")


def final_status(store: RunStore) -> str:
    state = store.read_status().get("state")
    return {"finished": "finished", "collapsed": "finished", "failed": "failed"}.get(
        state, "killed"
    )


def sync_run(run_dir: str | Path, to: str, tracking_cfg: Any = None) -> str:
    """Replay the run in `run_dir` into `to` ("mlflow" or "wandb"); returns the backend's run
    id. `tracking_cfg` is the `tracking` config section (a TrackingConfig, dict or None for
    the defaults); its on/off switches are ignored: naming a backend here means use it. The
    default MLflow store is $MLFLOW_TRACKING_URI, else `<run_dir>/../mlflow.db`, as for the
    trainer. Errors raise
    (unlike during training)."""
    run_dir = Path(run_dir)
    store = RunStore(run_dir)
    config = store.read_config()
    run = config.get("run") or {}
    name = str(run.get("name") or run_dir.name)
    group = str(run.get("experiment") or "omgrpo")
    tags = [str(t) for t in run.get("tags") or []]

    if to == "mlflow":
        tracker: MLflowTracker | WandbTracker = MLflowTracker.from_config(
            tracking_cfg, run_dir.parent, background=False
        )
    elif to == "wandb":
        tracker = WandbTracker.from_config(tracking_cfg)
    else:
        raise ValueError(f"unknown tracking backend {to!r}; valid: {', '.join(BACKENDS)}")

    tracker.start(run_dir, config, name=name, group=group, tags=tags)
    run_id = tracker.run_id
    try:
        replay_store(tracker, store)
    finally:
        tracker.finish(final_status(store))  # the training run's status, not the sync's
    assert run_id is not None
    return run_id
