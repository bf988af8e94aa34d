"""`WandbTracker`: mirrors a run to Weights & Biases (offline unless an API key is configured),
and the offline-segment bookkeeping a resumed offline run needs."""

from __future__ import annotations

import netrc
import os
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omgrpo.tracking.base import check_status, resolve_tracking_config
from omgrpo.tracking.naming import plain_value, redact, run_method, run_scale, stable_run_id
from omgrpo.tracking.store import RunStore

WANDB_TABLE_ROWS = 200
"""At most this many rollouts (a random sample) go into each W&B table."""

_WANDB_EXIT_CODE = {"finished": 0, "failed": 1, "killed": 130}


def wandb_api_key_configured() -> bool:
    """$WANDB_API_KEY or a netrc entry for the W&B host ($NETRC or ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        auth = netrc.netrc(path).authenticators(host or "api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(mode: str | None) -> str:
    """`mode` if given; else $WANDB_MODE; else online with an API key, offline without."""
    mode = mode or os.environ.get("WANDB_MODE") or None
    if mode is None:
        mode = "online" if wandb_api_key_configured() else "offline"
    if mode == "dryrun":
        mode = "offline"
    if mode not in ("online", "offline", "disabled", "shared"):
        raise ValueError(f"unknown W&B mode {mode!r}; valid: online, offline, disabled")
    return mode


class WandbTracker:
    """Mirrors a run to W&B (offline by default: `<run_dir>/wandb/offline-run-*`).

    The W&B run id is derived from the run's UUID (`stable_run_id(RunStore.run_uuid())`) and
    recorded in the run store (`trackers.json`), so a resumed, moved or synced run keeps it and
    a new run at a path used before gets another (not under a sweep agent, which assigns its
    own id). The run's `provenance.json` goes into the config as `provenance`. Rows are logged with W&B's step = `train/step`, and every
    metric is plotted against `train/step`. Values go in as they are (W&B takes strings, NaN
    and inf). Rollouts: a `wandb.Table` of at most 200 sampled rows per call.

    Resume. Offline (wandb 0.31 ignores `resume` for offline runs, and a second offline
    segment of the same id would repeat the steps after the checkpoint): each start writes a
    new `offline-run-*` folder of the same id that holds the whole history (FanOutTracker
    replays the run store up to the checkpoint step into it, `fresh_segment`), records the
    step it resumed from in the config (`_resumed_from_step`), and moves the older folders of
    that id to `<run_dir>/wandb/superseded/`, where `wandb sync <run_dir>/wandb/offline-run-*`
    does not pick them up. Online: W&B's rewind, `resume_from="<id>?_step=<step>"`, truncates
    the run's history to the checkpoint step (a W&B preview feature; untested here, where
    there is no network).
    """

    name = "wandb"

    def __init__(self, project: str = "omgrpo", entity: str | None = None, mode: str | None = None):
        self.project = project
        self.entity = entity
        self.mode = mode
        self.run = None
        self.run_id: str | None = None
        self.fresh_segment = True

    @classmethod
    def from_config(cls, cfg: Any) -> WandbTracker:
        """The tracker the `tracking` config asks for (config keys over $WANDB_PROJECT /
        $WANDB_ENTITY / $WANDB_MODE)."""
        cfg = resolve_tracking_config(cfg)
        return cls(project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode)

    def start(self, run_dir, config, *, name, group, tags, resume_step=None) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        config = redact(config)
        mode = resolve_wandb_mode(self.mode)
        sweep = bool(os.environ.get("WANDB_SWEEP_ID"))
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        store = RunStore(run_dir)
        extra = [run_method(config), run_scale(config)]
        all_tags = list(dict.fromkeys([*map(str, tags), *extra]))
        settings = wandb.Settings(silent=True, save_code=False, console="off")
        # A sweep agent assigns the run id ($WANDB_RUN_ID): do not override it.
        run_id = os.environ.get("WANDB_RUN_ID") or (
            None if sweep else store.tracker_ids().get("wandb") or stable_run_id(store.run_uuid())
        )
        config = {**config, "omgrpo_run_uuid": store.run_uuid()}
        if provenance := store.read_provenance():
            config["provenance"] = provenance
        # Online with a known id, W&B rewinds the run itself; else a new segment is replayed.
        self.fresh_segment = mode != "online" or resume_step is None or run_id is None
        if self.fresh_segment:
            resume_args: dict[str, Any] = {"id": run_id, "resume": "allow"}
            if resume_step is not None:
                config = {**config, "_resumed_from_step": resume_step}
        else:  # online rewind; the id comes from resume_from
            resume_args = {"resume_from": f"{run_id}?_step={resume_step}"}
        if mode == "offline" and run_id is not None:
            retire_offline_segments(run_dir, run_id)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", self.project) if sweep else self.project,
            entity=self.entity,
            name=name,
            group=group,
            tags=[t[:64] for t in all_tags],
            config=config,
            dir=str(run_dir),
            mode=mode,
            reinit="create_new",
            settings=settings,
            **resume_args,
        )
        self.run_id = self.run.id
        self.run.define_metric("train/step")
        self.run.define_metric("*", step_metric="train/step")
        if not sweep:
            store.set_tracker_id("wandb", self.run_id)

    def log_metrics(self, step, metrics) -> None:
        row = {}
        for name, value in metrics.items():
            value = plain_value(value)
            if value is None or not isinstance(value, str | int | float | bool):
                continue
            row[name] = value
        row["train/step"] = int(step)
        self.run.log(row, step=int(step))

    def log_rollouts(self, step, table) -> None:
        import wandb

        if len(table) > WANDB_TABLE_ROWS:
            table = table.sample(WANDB_TABLE_ROWS, random_state=int(step)).sort_index()
        # Plain Python objects: nullable pandas dtypes (pd.NA) do not serialise.
        table = table.astype(object).where(table.notna(), None).reset_index(drop=True)
        self.run.log(
            {"rollouts": wandb.Table(dataframe=table), "train/step": int(step)}, step=int(step)
        )

    def log_artifact(self, path) -> None:
        import wandb

        path = Path(path)
        name = re.sub(r"[^\w.\-]+", "_", f"{self.run_id}-{path.name}")
        artifact = wandb.Artifact(name=name, type="file")
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self, status) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        run.finish(exit_code=_WANDB_EXIT_CODE[check_status(status)])


def offline_segments(run_dir: Path, run_id: str) -> list[Path]:
    """The `offline-run-*` folders of W&B run `run_id` in `<run_dir>/wandb`, oldest first."""
    return sorted((Path(run_dir) / "wandb").glob(f"offline-run-*-{run_id}"))


def retire_offline_segments(run_dir: Path, run_id: str) -> list[Path]:
    """Move the offline folders of `run_id` to `<run_dir>/wandb/superseded/` (kept, not
    uploaded by `wandb sync <run_dir>/wandb/offline-run-*`); returns their new paths."""
    moved = []
    for folder in offline_segments(run_dir, run_id):
        target = folder.parent / "superseded" / folder.name
        target.parent.mkdir(exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        folder.rename(target)
        moved.append(target)
    return moved
