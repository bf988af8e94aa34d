"""A verl run's omgrpo run store, written through verl's tracking.

A verl run writes the run store a native run writes (`omgrpo.tracking.store.RunStore`, the same
writer): `<omgrpo.run.root>/<trainer.experiment_name>/` (`runs/<experiment>__<variant>__s<seed>`
by default, the native run directory) with `config.yaml`, `identity.json`, `provenance.json`,
`metrics.jsonl` (every metric verl logs, omgrpo's and verl's own), `status.json`,
`rollouts/step_*.parquet` (`omgrpo.core.step.rollout_table`) and `problems.parquet` (each
validation's per-problem rows, `omgrpo.backends.verl.metrics.validation_problems`); verl's
checkpoints go to its `checkpoints/` folder (`trainer.default_local_dir`,
experiments/verl/paper.yaml). So `omgrpo report / figures / tables`, the notebooks and
`omgrpo export` read verl runs as native ones.

verl's `Tracking` (verl/utils/tracking.py) sends each step's metrics to its backends, named in
`trainer.logger` (console, wandb, mlflow, file, ...): objects in `Tracking.logger` with
`log(data, step)` and `finish()`. verl 0.9.1 has no registry for another backend (the names are
a fixed list, each built by an `if` in `Tracking.__init__`), so the omgrpo trainer puts
`RunStoreBackend` into the `Tracking` its `fit` builds, under the name `omgrpo`
(`OmgrpoTrainer.logger`): verl's own backends (W&B, MLflow, the file logger) keep running
beside it, and it receives exactly what they receive. It is always on: the run store is the
source of truth, the other backends are mirrors.

`config.yaml` has the native layout for what both backends share, so analysis compares verl
and native runs column by column: the `omgrpo` section's keys at the top (`seed`, `method`,
`run` with `name` = `trainer.experiment_name`, `reward`, `algorithm`, `rollout`, `car`,
`collapse`), `backend: verl`, `model.path` (= `actor_rollout_ref.model.path`) and the rest of
the resolved verl config under `verl`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from omgrpo.tracking.naming import plain_value
from omgrpo.tracking.provenance import collect_provenance
from omgrpo.tracking.store import RunStore

__all__ = ["BACKEND_NAME", "RunStoreBackend", "run_dir", "store_config"]

BACKEND_NAME = "omgrpo"
"""The run store's name among verl's tracking backends (`Tracking.logger`)."""


def run_dir(cfg: DictConfig) -> Path:
    """The run directory of a composed verl config: `<omgrpo.run.root>/<experiment_name>`."""
    return Path(str(cfg.omgrpo.run.root)) / str(cfg.trainer.experiment_name)


def store_config(cfg: DictConfig) -> dict[str, Any]:
    """The run store's `config.yaml` of a verl run (module docstring: the native layout for
    the shared keys, the rest of verl's config under `verl`)."""
    full = OmegaConf.to_container(cfg, resolve=True)
    om = full.pop("omgrpo")
    run = {**om.pop("run"), "name": str(cfg.trainer.experiment_name)}
    head = {"seed": om.pop("seed"), "method": om.pop("method"), "run": run}
    model = {"path": full["actor_rollout_ref"]["model"]["path"]}
    return {**head, "backend": "verl", "model": model, **om, "verl": full}


def _number(value: Any) -> float | int | bool | None:
    """A metric value as a JSON number, or None for what is not one (strings, arrays)."""
    value = plain_value(value)
    # NaN / inf stay (written as NaN / Infinity, as the native trainer's)
    return value if isinstance(value, bool | int | float) else None


class RunStoreBackend:
    """verl's tracking backend `omgrpo`: each logged step into the run store (module docstring).

    The trainer hands it the step's rollout table (`add_rollouts`) and a validation's
    per-problem rows (`add_problems`) before verl logs the step; `log` writes the metrics row,
    then the tables, then the status.
    """

    def __init__(self, store: RunStore, total_steps: int, base_model: str | None):
        self.store = store
        self.total_steps = int(total_steps)
        self.base_model = base_model
        self._rollouts: dict[int, pd.DataFrame] = {}
        self._problems: dict[int, pd.DataFrame] = {}

    def start(self, config: dict[str, Any], resume_step: int) -> None:
        """A fresh run (`resume_step` 0: verl found no checkpoint) gets a new identity and its
        config, and earlier rows are dropped; a resumed one keeps both and drops the rows after
        its checkpoint's step (verl logs them again). Provenance and `running` either way."""
        if resume_step > 0:
            self.store.truncate_metrics(resume_step)
            print(f"omgrpo: resuming the run store {self.store.dir} from step {resume_step}")
        else:
            self.store.truncate_metrics(-1)
            self.store.new_identity()
            self.store.write_config(config)
        self.store.write_provenance(collect_provenance())
        self.status("running", resume_step)

    def status(self, state: str, step: int, **extra: Any) -> None:
        self.store.write_status(
            state=state,
            step=int(step),
            total_steps=self.total_steps,
            base_model=self.base_model,
            **extra,
        )

    def add_rollouts(self, step: int, table: pd.DataFrame) -> None:
        """The rollout table of `step`, written when verl logs that step."""
        self._rollouts[int(step)] = table

    def add_problems(self, step: int, table: pd.DataFrame) -> None:
        """The per-problem rows of the validation at `step`, appended to `problems.parquet`
        when verl logs that step (rows of the same step replaced: a resumed run's)."""
        self._problems[int(step)] = table

    def log(self, data: dict[str, Any], step: int) -> None:
        """verl's backend call: the step's metrics (numbers only), its rollouts, the status.
        Step 0 is validation before training, as natively."""
        metrics = {k: v for k, v in ((k, _number(v)) for k, v in data.items()) if v is not None}
        self.store.log_metrics(int(step), metrics)
        table = self._rollouts.pop(int(step), None)
        if table is not None:
            self.store.log_rollouts(int(step), table)
        problems = self._problems.pop(int(step), None)
        if problems is not None:
            self.store.log_problems(int(step), problems)
        if step > 0:
            self.status("running", step)

    def finish(self) -> None:
        """Nothing buffered: every call above has written its file."""
