"""`MLflowTracker`: mirrors a run to MLflow, plus the client and SQLite-store helpers it needs
(a store created or upgraded once per process, behind a file lock; fail fast on a locked one)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from omgrpo.tracking.base import TrackerWarning, check_status, resolve_tracking_config
from omgrpo.tracking.naming import (
    as_float,
    flatten,
    param_value,
    redact,
    run_dir_key,
    run_group_tags,
    run_method,
    run_scale,
    sanitize_metric_name,
)
from omgrpo.tracking.provenance import provenance_tags
from omgrpo.tracking.retry import is_transient, quiet_mlflow_http_retries, retrying
from omgrpo.tracking.store import RunStore
from omgrpo.tracking.worker import Worker

STALL_TIMEOUT_S = 4.0
"""MLflow: `finish` gives up when the store has not answered for this long, and opening a
locked SQLite store fails after it."""
RUN_DIR_TAG = "omgrpo.run_dir"
"""Where the run store was when the run (segment) started: informative only."""
RUN_UUID_TAG = "omgrpo.run_uuid"
"""The run's identity (`RunStore.run_uuid()`): supersession, resume and sync match on it."""
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag that picks the MLflow UI's view (3.x); without it the UI guesses, and
shows an omgrpo experiment as a GenAI one ("Evaluations")."""
MODEL_TRAINING_KIND = "custom_model_development"
"""The kind the UI labels "Machine learning": runs, their metrics' charts, artifacts."""
ML_WORKFLOW_QUERY = "workflowType=machine_learning"
"""MLflow 3.17's UI picks its view from a per-browser switch ("GenAI" / "Model training",
GenAI by default) and not from the experiment's kind tag: a link with this query opens the
model-training view (and makes it the browser's choice from then on)."""
PROBE_S = float(os.environ.get("OMGRPO_MLFLOW_PROBE_S", "5"))
"""While the store is not answering, writes are dropped (the run store has them) and one call
is tried again at most this often ($OMGRPO_MLFLOW_PROBE_S, seconds); the first that passes
ends the outage."""
MAX_PENDING_POINTS = 100_000
"""Metric points waiting for the writer thread (~30 MB) before newer ones are dropped."""


def default_mlflow_uri(runs_root: Path) -> str:
    return "sqlite:///" + str(Path(runs_root).expanduser().resolve() / "mlflow.db")


_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
_READY_STORES: set[str] = set()
_READY_LOCK = threading.Lock()


def sqlite_db_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///") :].split("?")[0])
    return Path(path) if path and path != ":memory:" else None


def mlflow_client(uri: str):
    """An MlflowClient for `uri`. A SQLite store is created or upgraded once per process,
    behind an exclusive file lock on `<db>.lock`: parallel runs starting on a fresh DB would
    otherwise race on the alembic migration (~7 s) and crash."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    with _READY_LOCK:
        if uri in _READY_STORES:
            return MlflowClient(tracking_uri=uri)
        db = sqlite_db_path(uri)
        if db is None:
            client = MlflowClient(tracking_uri=uri)
        else:
            _check_sqlite(db)
            # MLflow creates a fresh DB's tables and upgrades an older one on first open (every
            # older schema lacks a table 3.17 has; tests/tracking/test_identity.py opens one)
            with _file_lock(db.with_name(db.name + ".lock")):
                client = MlflowClient(tracking_uri=uri)
                client.search_experiments(max_results=1)  # the store is opened lazily
        _READY_STORES.add(uri)
        return client


def _check_sqlite(db: Path) -> None:
    """Fail fast on a DB MLflow cannot open or that another process holds locked: MLflow
    itself retries for ~20-100 s before raising, and silently creates missing folders (a typo
    in the URI would start a new store)."""
    import sqlite3

    if not db.parent.is_dir():
        raise FileNotFoundError(f"folder of the MLflow database {db} does not exist")
    if db.exists() and not db.is_file():
        raise IsADirectoryError(f"MLflow database {db} is not a file")
    try:
        conn = sqlite3.connect(f"file:{quote(str(db))}?mode=rwc", uri=True, timeout=STALL_TIMEOUT_S)
        try:
            conn.execute("pragma schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise RuntimeError(f"cannot open the MLflow database {db}: {e}") from e


def _file_lock(path: Path):
    """An exclusive lock on `path` across processes (`filelock`: flock on POSIX, msvcrt on
    Windows)."""
    from filelock import FileLock

    return FileLock(str(path))


def _filter_literal(value: str) -> str:
    quote = "'" if "'" not in value else '"'
    return f"{quote}{value}{quote}"


def _quiet_mlflow_db_errors() -> None:
    """MLflow logs every SQLAlchemy error with its traceback (~20 lines each) before raising
    it; the tracker reports the error itself, once, as a TrackerWarning."""
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


class MLflowTracker:
    """Mirrors a run to MLflow with `MlflowClient` calls (no global active run).

    Metric names go through `sanitize_metric_name`; strings, None, NaN and inf are skipped
    (MLflow would store inf as the largest float; the local store has them all). `start` runs in
    the caller's thread; afterwards, with `background=True` (the default), MLflow calls run in
    order on a worker thread: a SQLite `log_batch` of 50 metrics costs ~50 ms of ORM work and
    commits, which the training loop does not wait for. Metrics queued while a batch is being
    written go out together in the next `log_batch` (≤ 1000 metrics each). An error surfaces on
    the next call; `finish` waits for the queue (at most STALL_TIMEOUT_S without an answer).
    The resolved, redacted config goes in as params (`a.b.c` keys) and as the artifact
    `config.yaml`; rollouts as `rollouts/step_XXXXXX.parquet`. The run carries the tags
    `omgrpo.run_uuid` (its identity) and `omgrpo.run_dir`; each start opens a new run and
    retires the older ones of the same identity (`_open_run`), so a resumed or re-synced run is
    one active run with one value per step, and runs of other machines that used the same path
    are left alone.

    Faults: a call that fails with a transient error (server unreachable, 5xx, a locked
    SQLite store; `omgrpo.tracking.retry`) is retried with backoff for up to `RETRY_S`; `start`
    raises after that (FanOutTracker warns and carries on without MLflow). On the writer thread
    the tracker instead goes *down*: it warns once per run, records `unsynced` in the run store,
    drops writes (the run store has them) and tries one call every PROBE_S until the store
    answers again, then logs live again. Training never waits for this: the writer's queue is
    bounded (MAX_QUEUED_CALLS calls, MAX_PENDING_POINTS points), and what does not fit is
    dropped the same way. `omgrpo sync RUN --to mlflow` later adds exactly the missing points
    to the same MLflow run (`omgrpo.tracking.sync`).
    """

    name = "mlflow"

    def __init__(self, uri: str, experiment: str | None = None, background: bool = True):
        self.uri = uri
        self.experiment = experiment
        self.background = background
        self.client = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.fresh_segment = True  # every start opens a new run (see `_open_run`)
        self._keys: dict[str, str] = {}
        self._owners: dict[str, str] = {}
        self._worker: Worker | None = None
        self._pending: list = []  # Metric points not yet sent
        self._pending_lock = threading.Lock()
        self._tmp: str | None = None
        self._run_dir: Path | None = None
        self._down = False  # the store stopped answering (writer thread)
        self._probe_at = 0.0  # while down: when the next call may try again (monotonic)
        self._warned = False  # the one warning of this run was given
        self._warn_lock = threading.Lock()

    @classmethod
    def from_config(
        cls, cfg: Any, runs_root: Path | None, background: bool = True
    ) -> MLflowTracker:
        """The tracker the `tracking` config asks for (config keys over $MLFLOW_TRACKING_URI /
        $MLFLOW_EXPERIMENT_NAME); without a URI, the SQLite store `<runs_root>/mlflow.db`."""
        cfg = resolve_tracking_config(cfg)
        uri = cfg.mlflow_uri
        if uri is None:
            if runs_root is None:
                raise ValueError("mlflow_uri is null and no runs root was given")
            uri = default_mlflow_uri(runs_root)
            with contextlib.suppress(OSError):  # if it fails, MLflow's start says so
                Path(runs_root).mkdir(parents=True, exist_ok=True)
        return cls(uri, experiment=cfg.mlflow_experiment, background=background)

    # -- Tracker ------------------------------------------------------------------------------
    def start(self, run_dir, config, *, name, group, tags, resume_step=None) -> None:
        """Open a new MLflow run for `run_dir` and retire the runs it replaces (see
        `_open_run`), in the caller's thread (a fresh SQLite store is created, ~7 s, once; a
        locked one raises after STALL_TIMEOUT_S, where MLflow's own retries would take ~20 s).
        Later calls run on the worker thread with `background=True`."""
        self._run_dir = Path(run_dir)
        self.start_client()
        # a failed attempt may leave a run behind: the next attempt's `find_runs` retires it
        for attempt in retrying():
            with attempt:
                self._open_run(Path(run_dir), redact(config), name, group, list(tags), resume_step)
        self._tmp = tempfile.mkdtemp(prefix="omgrpo-mlflow-")
        if self.background:
            self._worker = Worker(f"omgrpo-mlflow-{self.run_id[:8]}")

    def start_client(self) -> None:
        """Open the client (a SQLite store: created or upgraded once; fail fast if locked)."""
        _quiet_mlflow_db_errors()
        quiet_mlflow_http_retries()
        self.client = mlflow_client(self.uri)
        if db := sqlite_db_path(self.uri):
            _check_sqlite(db)

    def _open_run(self, run_dir: Path, config, name, group, tags, resume_step) -> None:
        """A new run holding the config (params, `config.yaml`) and tags (the run's UUID, its
        provenance); the active runs of the same identity (found by the tag `omgrpo.run_uuid`,
        or by the id the run store recorded, for a run from before identities) are soft-deleted
        and tagged
        `omgrpo.superseded_by`: MLflow cannot delete single points, and the new run gets the
        run store's history replayed, so exactly one active run shows each step once."""
        from mlflow.entities import Param

        client = self.client
        self.experiment_id = self._experiment(self.experiment or group or "omgrpo")
        store = RunStore(run_dir)
        run_tags = {
            RUN_UUID_TAG: store.run_uuid(),
            RUN_DIR_TAG: run_dir_key(run_dir),
            **provenance_tags(store.read_provenance()),
            "mlflow.runName": name,
            "group": str(group),
            "method": run_method(config),
            "scale": run_scale(config),
            **run_group_tags(config),  # arm, seed, experiment, unit, base, sweep
        }
        if resume_step is not None:
            run_tags["omgrpo.resumed_from_step"] = str(resume_step)
        if tags:
            run_tags["omgrpo.tags"] = ",".join(map(str, tags))
            for tag in tags:
                key, _, value = str(tag).partition("=")
                run_tags[sanitize_metric_name(key)] = value
        with contextlib.suppress(Exception):  # mlflow.user, mlflow.source.*
            from mlflow.tracking.context.registry import resolve_tags

            run_tags = resolve_tags(run_tags)
        old = self.find_runs(run_dir)
        run = client.create_run(self.experiment_id, run_name=name, tags=run_tags)
        self.run_id = run.info.run_id
        params = [
            Param(sanitize_metric_name(k), param_value(v)) for k, v in flatten(config).items()
        ]
        for chunk in _chunks(params, 100):
            client.log_batch(self.run_id, params=chunk, synchronous=True)
        client.log_dict(self.run_id, config, "config.yaml")
        for previous in old:
            client.set_tag(previous.info.run_id, "omgrpo.superseded_by", self.run_id)
            if previous.info.status == "RUNNING":
                client.set_terminated(previous.info.run_id, "KILLED")
            client.delete_run(previous.info.run_id)
        with contextlib.suppress(OSError):  # a read-only run store: the tag still finds it
            RunStore(run_dir).set_tracker_id("mlflow", self.run_id)

    def log_metrics(self, step, metrics) -> None:
        self.log_metrics_rows([(step, metrics)])

    def log_metrics_rows(self, rows) -> None:
        """Log several steps with as few `log_batch` calls as possible (≤ 1000 metrics each)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = []
        for step, metrics in rows:
            for name, value in metrics.items():
                value = as_float(value)
                if value is None or name == "train/step":
                    continue
                points.append(Metric(self._key(name), value, now, int(step)))
        if self._worker is not None and self._skipping():
            return
        with self._pending_lock:
            if len(self._pending) + len(points) > MAX_PENDING_POINTS and self._worker is not None:
                full = True
            else:
                full, idle = False, not self._pending
                self._pending += points
        if full:
            self._lost(f"more than {MAX_PENDING_POINTS} metric points waiting to be written")
        elif idle:  # otherwise a flush is queued already and will take these too
            self._call(self._send_pending)

    def log_rollouts(self, step, table) -> None:
        if self._worker is not None and self._skipping():
            return
        path = Path(self._tmp) / f"step_{int(step):06d}.parquet"
        table.to_parquet(path, index=False)
        self._call(self._log_file, path, "rollouts")

    def log_artifact(self, path) -> None:
        path = Path(path)
        if path.is_dir():
            self._call(
                self._attempt, lambda: self.client.log_artifacts(self.run_id, str(path), path.name)
            )
        else:
            self._call(self._attempt, lambda: self.client.log_artifact(self.run_id, str(path)))

    def finish(self, status) -> None:
        """Send what is queued and set the run's status (tried once more even while the store
        is down). Gives up when the store has not answered for STALL_TIMEOUT_S: the run then
        stays RUNNING in MLflow until `omgrpo sync` sets its status, and a TimeoutError says so
        unless this run already warned that the store is down."""
        status = _MLFLOW_STATUS[check_status(status)]
        worker = self._worker
        try:
            if worker is None:
                if self.run_id is not None:
                    self._attempt(lambda: self.client.set_terminated(self.run_id, status))
                return
            try:
                self._probe_at = 0.0  # down or not, the run's end is worth one more try
                terminate = lambda: self.client.set_terminated(self.run_id, status)  # noqa: E731
                if not worker.wait(stall_s=STALL_TIMEOUT_S) or not (
                    self._call(self._attempt, terminate) and worker.wait(stall_s=STALL_TIMEOUT_S)
                ):
                    worker.abandon()
                    with self._warn_lock:
                        warned, self._warned = self._warned, True
                    with contextlib.suppress(OSError):
                        RunStore(self._run_dir).mark_unsynced("mlflow")
                    if warned:  # said once already: the run store has it all
                        return
                    raise TimeoutError(
                        f"the MLflow store {self.uri} did not answer for {STALL_TIMEOUT_S:.0f} s "
                        "(locked or unreachable); its run is left as it is"
                    )
            finally:
                self._worker = None
                worker.close()
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _call(self, fn, *args) -> bool:
        """Run `fn(*args)` on the writer thread (queued; False if the queue was full and the
        call dropped) or, without one, here."""
        if self._worker is None:
            fn(*args)
            return True
        if self._worker.submit(fn, *args):
            return True
        self._lost(f"more than {self._worker.queue.maxsize} writes waiting")
        return False

    def _attempt(self, call) -> bool:
        """`call()` with the fault policy: retried while it fails transiently; without a
        writer thread the last error is raised, on it the tracker goes down (`_lost`) and
        False is returned. While down, only one call per PROBE_S is tried, once. A
        non-transient error is raised (the FanOutTracker disables the tracker)."""
        worker = self._worker
        if worker is None:
            for attempt in retrying():
                with attempt:
                    call()
            return True
        if self._skipping():
            return False
        try:
            if self._down:
                call()
            else:
                for attempt in retrying(give_up=lambda: worker.abandoned):
                    with attempt:
                        call()
        except Exception as e:
            if not is_transient(e):
                raise
            self._down, self._probe_at = True, time.monotonic() + PROBE_S
            self._lost(f"{type(e).__name__}: {_first_line(e)}")
            return False
        self._down = False
        return True

    def _skipping(self) -> bool:
        """Down, and not yet time to try again: the write is dropped (and recorded)."""
        if self._down and time.monotonic() < self._probe_at:
            self._lost("")
            return True
        return False

    def _lost(self, why: str) -> None:
        """Some writes did not reach the store: say so once per run, and record it in the run
        store so that `omgrpo sync` (and whoever lists runs) knows."""
        with self._warn_lock:
            warned, self._warned = self._warned, True
        if warned:
            return
        where = self._run_dir if self._run_dir is not None else "the run"
        with contextlib.suppress(OSError):
            if self._run_dir is not None:
                RunStore(self._run_dir).mark_unsynced("mlflow")
        warnings.warn(
            redact(
                f"MLflow at {self.uri} is not taking this run's writes ({why}); training goes "
                f"on and {where} keeps every step; MLflow is tried again every {PROBE_S:.0f} s "
                f"and logs live once it answers; `omgrpo sync {where} --to mlflow` adds the "
                "missing steps to the same MLflow run afterwards"
            ),
            TrackerWarning,
            stacklevel=2,
        )

    def _send_pending(self) -> None:
        with self._pending_lock:
            points, self._pending = self._pending, []
        for chunk in _chunks(points, 1000):
            if not self._attempt(
                lambda c=chunk: self.client.log_batch(self.run_id, metrics=c, synchronous=True)
            ):
                return  # the rest is dropped too: the store is down

    def _log_file(self, path: Path, artifact_path: str) -> None:
        try:
            self._attempt(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))
        finally:
            path.unlink(missing_ok=True)

    # -- helpers ------------------------------------------------------------------------------
    def find_runs(self, run_dir: Path) -> list:
        """The active runs (in any experiment) of this run's identity: tagged with its UUID, or
        recorded in its run store (`trackers.json`) and carrying no other UUID (a run logged
        before identities existed). A run at the same path with another UUID is not one."""
        from mlflow.entities import ViewType

        client = self.client or mlflow_client(self.uri)
        store = RunStore(run_dir)
        run_uuid = store.run_uuid()
        experiments = [e.experiment_id for e in _all_experiments(client)]
        flt = f"tags.`{RUN_UUID_TAG}` = {_filter_literal(run_uuid)}"
        runs = {}
        for chunk in _chunks(experiments, 100):
            for run in client.search_runs(
                chunk, filter_string=flt, run_view_type=ViewType.ACTIVE_ONLY, max_results=1000
            ):
                runs[run.info.run_id] = run
        recorded = store.tracker_ids().get("mlflow")
        if recorded and recorded not in runs:
            with contextlib.suppress(Exception):  # recorded in another store, or deleted
                run = client.get_run(recorded)
                if (
                    run.info.lifecycle_stage == "active"
                    and run.data.tags.get(RUN_UUID_TAG, run_uuid) == run_uuid
                ):
                    runs[recorded] = run
        return list(runs.values())

    def metric_key(self, name: str) -> str:
        """The MLflow key this tracker uses for metric `name`."""
        return self._key(name)

    def _key(self, name: str) -> str:
        key = self._keys.get(name)
        if key is None:
            key = sanitize_metric_name(name)
            owner = self._owners.setdefault(key, name)
            if owner != name:  # two names sanitise alike: keep them apart
                key = f"{key}_{hashlib.sha1(name.encode()).hexdigest()[:6]}"
                warnings.warn(
                    f"MLflow: metrics {owner!r} and {name!r} sanitise to the same name; "
                    f"logging {name!r} as {key!r}",
                    TrackerWarning,
                    stacklevel=3,
                )
                self._owners[key] = name
            self._keys[name] = key
        return key

    def _experiment(self, name: str) -> str:
        """The id of experiment `name`, created if missing. Agents starting together race on
        the creation: on a SQLite store a file lock orders them; on any store (a server) the
        loser's RESOURCE_ALREADY_EXISTS is answered by reading the winner's experiment."""
        from mlflow.exceptions import MlflowException

        client = self.client
        db = sqlite_db_path(self.uri)
        lock = _file_lock(db.with_name(db.name + ".lock")) if db else contextlib.nullcontext()
        with lock:  # two runs creating the same experiment at once
            exp = client.get_experiment_by_name(name)
            if exp is not None:
                if exp.lifecycle_stage == "deleted":
                    client.restore_experiment(exp.experiment_id)
                return _model_training(client, exp)
            location = None
            if db is not None:  # next to the DB, not in the working directory
                slug = re.sub(r"[^\w.\-]+", "_", name)
                location = (db.resolve().parent / "mlartifacts" / slug).as_uri()
            try:
                kind = {EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}
                return client.create_experiment(name, artifact_location=location, tags=kind)
            except MlflowException as e:  # another agent created it since we looked
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = client.get_experiment_by_name(name)
                if exp is None:
                    raise
                return _model_training(client, exp)


def dashboard_url(
    server: str, experiment_id: str, run_id: str | None = None, tab: str = "model-metrics"
) -> str:
    """The MLflow UI's page of an experiment (its runs) or of a run (`tab`: `model-metrics`,
    `overview`, `artifacts`, ...) on `server` (`http://host:port`), in the model-training
    view (`ML_WORKFLOW_QUERY`)."""
    page = f"{server.rstrip('/')}/#/experiments/{experiment_id}"
    if run_id is not None:
        page += f"/runs/{run_id}/{tab}"
    return f"{page}?{ML_WORKFLOW_QUERY}"


def _model_training(client, experiment) -> str:
    """The experiment's id, after tagging it as model training (`EXPERIMENT_KIND_TAG`) unless it
    has a kind already: one the user picked in the UI or set themselves is kept."""
    if not (experiment.tags or {}).get(EXPERIMENT_KIND_TAG):
        client.set_experiment_tag(
            experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND
        )
    return experiment.experiment_id


def _all_experiments(client):
    from mlflow.entities import ViewType

    out, token = [], None
    while True:
        page = client.search_experiments(
            view_type=ViewType.ACTIVE_ONLY, max_results=1000, page_token=token
        )
        out += list(page)
        token = page.token
        if not token:
            return out


def _first_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]
