"""The tracker contract: the `Tracker` protocol, the do-nothing tracker and the `tracking` config.

A backend (`MLflowTracker`, `WandbTracker`) implements `Tracker`; `FanOutTracker`
(`omgrpo.tracking.fanout`) drives several of them and never lets one stop training.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pandas as pd

STATUSES = ("finished", "failed", "killed")


@dataclass
class TrackingConfig:
    mlflow: bool = True
    """Mirror the run to MLflow (a local SQLite store unless `mlflow_uri` says otherwise)."""
    mlflow_uri: str | None = None
    """MLflow tracking URI; null: $MLFLOW_TRACKING_URI, else `sqlite:///<run.root>/mlflow.db`
    (view it with `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`)."""
    mlflow_experiment: str | None = None
    """MLflow experiment; null: $MLFLOW_EXPERIMENT_NAME, else the run's experiment name
    (`run.experiment`, the run group)."""
    wandb: bool = True
    """Mirror the run to Weights & Biases (offline unless an API key is configured)."""
    wandb_project: str | None = None
    """W&B project; null: $WANDB_PROJECT, else `omgrpo`."""
    wandb_entity: str | None = None
    """W&B entity (user or team); null: $WANDB_ENTITY, else the account's default entity."""
    wandb_mode: str | None = None
    """W&B mode: online, offline or disabled; null: $WANDB_MODE if set, else online when an API
    key is configured ($WANDB_API_KEY or a netrc entry), else offline (runs land in
    `<run_dir>/wandb/offline-run-*`; upload them with `wandb sync` or `omgrpo sync`)."""
    log_every: int = 1
    """Send metrics to the trackers every N steps (buffered: no step is dropped, the dashboards
    just lag by up to N steps). The local run store always gets every step at once."""


class TrackerWarning(UserWarning):
    """A tracking backend failed and was disabled for the rest of the run."""


@runtime_checkable
class Tracker(Protocol):
    def start(
        self,
        run_dir: Path,
        config: dict[str, Any],
        *,
        name: str,
        group: str,
        tags: list[str],
        resume_step: int | None = None,
    ) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None: ...

    def log_rollouts(self, step: int, table: pd.DataFrame) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def finish(self, status: str) -> None: ...


class NullTracker:
    """Does nothing: lets the training loop call the tracker unconditionally."""

    name = "null"

    def start(self, run_dir, config, *, name, group, tags, resume_step=None) -> None:
        pass

    def log_metrics(self, step, metrics) -> None:
        pass

    def log_rollouts(self, step, table) -> None:
        pass

    def log_artifact(self, path) -> None:
        pass

    def finish(self, status) -> None:
        pass


def as_tracking_config(cfg: Any) -> TrackingConfig:
    """A TrackingConfig from a TrackingConfig, a dict, an OmegaConf node or None (defaults)."""
    if cfg is None:
        return TrackingConfig()
    if isinstance(cfg, TrackingConfig):
        return cfg
    if not isinstance(cfg, Mapping):
        try:  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        except Exception as e:
            raise TypeError(f"cannot read a tracking config from {type(cfg).__name__}") from e
    fields = {f.name for f in dataclasses.fields(TrackingConfig)}
    unknown = set(cfg) - fields
    if unknown:
        raise ValueError(f"unknown tracking fields {sorted(unknown)}; valid: {sorted(fields)}")
    return TrackingConfig(**dict(cfg))


ENV_VARS = {
    "mlflow_uri": "MLFLOW_TRACKING_URI",
    "mlflow_experiment": "MLFLOW_EXPERIMENT_NAME",
    "wandb_project": "WANDB_PROJECT",
    "wandb_entity": "WANDB_ENTITY",
    "wandb_mode": "WANDB_MODE",
}
"""`tracking` key -> the ecosystem's environment variable that fills it when the key is null."""
DEFAULT_WANDB_PROJECT = "omgrpo"


def resolve_tracking_config(cfg: Any) -> TrackingConfig:
    """The `tracking` config with nothing left to the environment: a key set in the config wins,
    else its environment variable (`ENV_VARS`), else the default (W&B project `omgrpo`;
    `mlflow_uri` / `mlflow_experiment` / `wandb_entity` / `wandb_mode` stay null and mean the
    run store's SQLite DB, the run group, the account's entity and `resolve_wandb_mode`)."""
    cfg = as_tracking_config(cfg)
    filled = {
        key: os.environ.get(var) or None
        for key, var in ENV_VARS.items()
        if getattr(cfg, key) is None
    }
    out = dataclasses.replace(cfg, **{k: v for k, v in filled.items() if v is not None})
    if out.wandb_project is None:
        out.wandb_project = DEFAULT_WANDB_PROJECT
    return out


def check_status(status: str) -> str:
    if status not in STATUSES:
        raise ValueError(f"unknown run status {status!r}; valid: {', '.join(STATUSES)}")
    return status
