"""Replay a local run (`runs/<name>/`) into MLflow or W&B after the fact.

A run whose tracker failed during training (a broken MLflow URI, no network for W&B) loses
nothing: the run store has the config, every metric row and the rollouts, and

    omgrpo sync runs/toy__om_grpo__s0 --to mlflow

sends them with the same tracker classes the trainer uses. Works on finished and on partial
runs (a killed run's last, half-written metrics line is ignored).

MLflow: when the run's identity (the UUID in `identity.json`) has exactly one active MLflow run
and every point in it equals the run store's (a run whose server was down for a while, or that
fell behind: `trackers.json` then lists it as `unsynced`), the sync adds exactly the points it
lacks (per metric and step) and the rollout tables it lacks to *that* run and sets its status
from `status.json`: the run keeps its id, nothing is logged twice, and re-running adds nothing.
Otherwise (no run yet, several, or one holding a value the store does not have, such as the
steps a killed run logged after its last checkpoint) the whole history goes into a new run and
the older active runs of the identity are soft-deleted and tagged `omgrpo.superseded_by` (the
same thing a resumed training run does, see `omgrpo.tracking`); runs of other machines that
used the same path are never touched. A run still "running" in `status.json` is marked KILLED.

W&B: the run id recorded in the run store (else derived from the run's UUID). Offline,
the sync writes a new `<run_dir>/wandb/offline-run-*` folder with the whole history and moves
the older ones to `wandb/superseded/`; upload it with `wandb sync`. Online, the run is
resumed with resume="allow" and every step is appended again (W&B history cannot be read
back cheaply to skip what it has).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from omgrpo.tracking.fanout import replay_store
from omgrpo.tracking.mlflow_tracker import _MLFLOW_STATUS, MLflowTracker, _chunks
from omgrpo.tracking.naming import as_float
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
    # every file read before a tracker is touched: a damaged store is refused (InputError,
    # named) with nothing written to the tracker or to the run directory
    store.metric_rows()
    store.read_status()
    store.rollout_files()
    run = config.get("run") or {}
    name = str(run.get("name") or run_dir.name)
    group = str(run.get("experiment") or "omgrpo")
    tags = [str(t) for t in run.get("tags") or []]

    if to == "mlflow":
        tracker: MLflowTracker | WandbTracker = MLflowTracker.from_config(
            tracking_cfg, run_dir.parent, background=False
        )
        if fill_mlflow_run(tracker, store) is not None:
            store.mark_unsynced("mlflow", False)
            assert tracker.run_id is not None
            return tracker.run_id
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
    store.mark_unsynced(to, False)
    assert run_id is not None
    return run_id


def fill_mlflow_run(tracker: MLflowTracker, store: RunStore) -> int | None:
    """Add to the one active MLflow run of the store's identity the metric points (per key
    and step) and rollout tables it lacks, and set its status; returns how many points were
    added. None, with nothing written, when there is no such single run or it holds a point
    the store does not (the caller then replays the whole store into a new run)."""
    from mlflow.entities import Metric

    tracker.start_client()
    runs = tracker.find_runs(store.dir)
    if len(runs) != 1:
        return None
    run = runs[0]
    client, run_id = tracker.client, run.info.run_id
    want: dict[str, dict[int, float]] = {}
    for step, metrics in store.metric_rows():
        for name, value in metrics.items():
            value = as_float(value)
            if value is not None and name != "train/step":
                want.setdefault(tracker.metric_key(name), {})[step] = value
    if set(run.data.metrics) - set(want):
        return None
    now, missing = int(time.time() * 1000), []
    for key, values in want.items():
        have = []
        if key in run.data.metrics:
            have = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        steps = {step for step, _ in have}
        if len(steps) < len(have) or any(
            step not in values or not math.isclose(value, values[step], rel_tol=1e-9)
            for step, value in have
        ):
            return None
        missing += [Metric(key, v, now, s) for s, v in values.items() if s not in steps]
    tracker.run_id = run_id
    for chunk in _chunks(missing, 1000):
        tracker._attempt(lambda c=chunk: client.log_batch(run_id, metrics=c, synchronous=True))
    uploaded = {Path(f.path).name for f in client.list_artifacts(run_id, "rollouts")}
    for _, path in store.rollout_files():
        if path.name not in uploaded:
            tracker._attempt(lambda p=path: client.log_artifact(run_id, str(p), "rollouts"))
    status = _MLFLOW_STATUS[final_status(store)]
    tracker._attempt(lambda: client.set_terminated(run_id, status))
    return len(missing)
