"""Where runs go: the local run store, the trackers (MLflow, W&B) behind one protocol, and sync.

The local run store (`omgrpo.tracking.store.RunStore`: config.yaml, metrics.jsonl, rollouts/) is
the source of truth and is written by the trainer itself. Trackers are mirrors for dashboards:

    tracker = build_trackers(cfg.tracking, runs_root)      # a FanOutTracker, never raises
    tracker.start(run_dir, config, name=..., group=..., tags=[...], resume_step=None)
    tracker.log_metrics(step, metrics)                      # every step
    tracker.log_rollouts(step, table)                       # when the store writes rollouts
    tracker.finish("finished")                              # or "failed" / "killed"

`FanOutTracker` calls each backend and turns the first error of a backend into one warning
(`TrackerWarning`) and disables that backend for the rest of the run: training never stops
because of a tracker, and a backend that stops answering (a locked database) holds up the end of
the run by at most `STALL_TIMEOUT_S`. Transient failures (a server down or restarting, 5xx, a
locked SQLite store; `retry`) do not disable MLflow: the call is retried with backoff, then the
tracker warns once, drops writes while the store is down (bounded queue, probing every
`PROBE_S`) and logs live again when it answers. `omgrpo.tracking.sync.sync_run` fills in what a
backend missed afterwards (MLflow: exactly the missing points, into the same run).

Identity: a run is its UUID (`RunStore.run_uuid()`, `identity.json`), not its path: the MLflow
tag `omgrpo.run_uuid` and the W&B run id derive from it, and resume, sync and supersession
touch only runs of that UUID. Config keys are resolved over the ecosystem's environment
variables (`resolve_tracking_config`: config > $MLFLOW_TRACKING_URI etc. > defaults).

Resume: a tracker's history must show each step once, with the resumed values. MLflow cannot
delete points and an offline W&B run cannot be resumed, so a resumed run (`resume_step=S`)
opens a fresh MLflow run / W&B offline segment, `replay_store` copies steps <= S from the run
store into it, and the runs it replaces are retired (MLflow: soft-deleted, tagged
`omgrpo.superseded_by`; W&B: their `offline-run-*` folders moved to `wandb/superseded/`).
Online, W&B rewinds the same run to S instead (`resume_from`).

Modules, one job each:
- `base`: the `Tracker` protocol, `NullTracker`, `TrackingConfig`, run statuses.
- `provenance`: what produced a run (commit, versions, torch build, devices).
- `naming`: secrets (`redact`), metric names (`sanitize_metric_name`), params, run ids.
- `fanout`: `FanOutTracker`, `build_trackers`, `replay_store`.
- `mlflow_tracker`, `wandb_tracker`: one backend each (a new tracker is one new module here,
  implementing `Tracker`, plus a line in `build_trackers`); `worker`: MLflow's writer thread
  (a bounded queue); `retry`: which errors are transient, and the retry policy (tenacity).
- `artifacts`: `omgrpo report`'s figures and tables logged to its runs' MLflow runs
  (`log_report_artifacts`).
- `store`: the local run store; `sync`: replay a run store into a backend afterwards.
"""

from omgrpo.tracking.base import (
    STATUSES,
    NullTracker,
    Tracker,
    TrackerWarning,
    TrackingConfig,
    as_tracking_config,
    resolve_tracking_config,
)
from omgrpo.tracking.fanout import FanOutTracker, build_trackers, replay_store
from omgrpo.tracking.mlflow_tracker import (
    PROBE_S,
    RUN_DIR_TAG,
    RUN_UUID_TAG,
    STALL_TIMEOUT_S,
    MLflowTracker,
    default_mlflow_uri,
    mlflow_client,
    sqlite_db_path,
)
from omgrpo.tracking.naming import (
    as_float,
    flatten,
    is_secret_key,
    redact,
    run_method,
    run_scale,
    sanitize_metric_name,
    stable_run_id,
)
from omgrpo.tracking.wandb_tracker import (
    WandbTracker,
    offline_segments,
    resolve_wandb_mode,
    retire_offline_segments,
)

__all__ = [
    "PROBE_S",
    "RUN_DIR_TAG",
    "RUN_UUID_TAG",
    "STALL_TIMEOUT_S",
    "STATUSES",
    "FanOutTracker",
    "MLflowTracker",
    "NullTracker",
    "Tracker",
    "TrackerWarning",
    "TrackingConfig",
    "WandbTracker",
    "as_float",
    "as_tracking_config",
    "build_trackers",
    "default_mlflow_uri",
    "flatten",
    "is_secret_key",
    "mlflow_client",
    "offline_segments",
    "redact",
    "replay_store",
    "resolve_tracking_config",
    "resolve_wandb_mode",
    "retire_offline_segments",
    "run_method",
    "run_scale",
    "sanitize_metric_name",
    "sqlite_db_path",
    "stable_run_id",
]
