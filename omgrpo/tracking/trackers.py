"""Experiment trackers behind one small Protocol: MLflow, Weights & Biases, or nothing.

The local run store (`omgrpo.tracking.store.RunStore`: config.yaml, metrics.jsonl, rollouts/) is the
source of truth and is written by the trainer itself. Trackers are mirrors for dashboards:

    tracker = build_trackers(cfg.tracking, runs_root)      # a FanOutTracker, never raises
    tracker.start(run_dir, config, name=..., group=..., tags=[...], resume_step=None)
    tracker.log_metrics(step, metrics)                      # every step
    tracker.log_rollouts(step, table)                       # when the store writes rollouts
    tracker.finish("finished")                              # or "failed" / "killed"

`FanOutTracker` calls each backend and turns the first error of a backend into one warning
(`TrackerWarning`) and disables that backend for the rest of the run: training never stops
because of a tracker, and a backend that stops answering (a locked database) holds up the end of
the run by at most `STALL_TIMEOUT_S`. `omgrpo.tracking.sync.sync_run` replays the local run into a
backend afterwards.

Resume: a tracker's history must show each step once, with the resumed values. MLflow cannot
delete points and an offline W&B run cannot be resumed, so a resumed run (`resume_step=S`)
opens a fresh MLflow run / W&B offline segment, `replay_store` copies steps <= S from the run
store into it, and the runs it replaces are retired (MLflow: soft-deleted, tagged
`omgrpo.superseded_by`; W&B: their `offline-run-*` folders moved to `wandb/superseded/`).
Online, W&B rewinds the same run to S instead (`resume_from`).

Secrets: `redact` masks secret-looking config values before any backend sees the config.
Names: `sanitize_metric_name` maps the metric names of the README/DESIGN contract onto what
MLflow accepts (`val/pass@4` -> `val/pass_at_4`); W&B gets the names unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import netrc
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import quote, unquote, urlparse

import pandas as pd

from omgrpo.tracking.store import RunStore

STATUSES = ("finished", "failed", "killed")
STALL_TIMEOUT_S = 4.0
"""MLflow: `finish` gives up when the store has not answered for this long, and opening a
locked SQLite store fails after it."""
RUN_DIR_TAG = "omgrpo.run_dir"
WANDB_TABLE_ROWS = 200
"""At most this many rollouts (a random sample) go into each W&B table."""


@dataclass
class TrackingConfig:
    mlflow: bool = True
    """Mirror the run to MLflow (a local SQLite store unless `mlflow_uri` says otherwise)."""
    mlflow_uri: str | None = None
    """MLflow tracking URI; null: `sqlite:///<run.root>/mlflow.db` (view it with
    `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`)."""
    mlflow_experiment: str | None = None
    """MLflow experiment; null: the run's experiment name (`run.experiment`, the run group)."""
    wandb: bool = True
    """Mirror the run to Weights & Biases (offline unless an API key is configured)."""
    wandb_project: str = "omgrpo"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (user or team); null: the account's default entity."""
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


# -- fan-out ---------------------------------------------------------------------------------
class FanOutTracker:
    """Calls every backend; a backend that raises is warned about once and then disabled.

    Metrics are buffered and flushed every `log_every` steps (and at `finish`), so a larger
    `log_every` lowers the overhead without losing steps. Never raises `Exception`s from a
    backend (KeyboardInterrupt and the like still propagate).
    """

    def __init__(self, trackers: Sequence[Tracker], log_every: int = 1):
        self.trackers = list(trackers)
        self.log_every = max(int(log_every), 1)
        self.failed: dict[str, BaseException] = {}
        self._disabled: set[int] = set()
        self._buffer: list[tuple[int, dict[str, Any]]] = []
        self._run_dir: Path | None = None

    @property
    def active(self) -> list[str]:
        """Names of the backends still enabled."""
        return [_backend_name(t) for i, t in enumerate(self.trackers) if i not in self._disabled]

    def start(self, run_dir, config, *, name, group, tags, resume_step=None) -> None:
        """Start every backend; a resumed run (`resume_step`: the checkpoint step it continues
        from) has steps <= resume_step replayed from the run store into the backends that
        opened an empty run (`fresh_segment`)."""
        self._run_dir = Path(run_dir)
        safe = redact(config)
        self._each(
            "start",
            lambda t: t.start(
                Path(run_dir),
                safe,
                name=name,
                group=group,
                tags=list(tags or []),
                resume_step=resume_step,
            ),
        )
        if resume_step is not None:
            store = RunStore(run_dir)
            self._each(
                "start",
                lambda t: (
                    replay_store(t, store, resume_step)
                    if getattr(t, "fresh_segment", False)
                    else None
                ),
            )

    def log_metrics(self, step, metrics) -> None:
        self._buffer.append((int(step), dict(metrics)))
        if len(self._buffer) >= self.log_every:
            self.flush()

    def flush(self) -> None:
        rows, self._buffer = self._buffer, []
        if rows:
            self._each("log_metrics", lambda t: _log_rows(t, rows))

    def log_rollouts(self, step, table) -> None:
        self.flush()  # W&B's history must not see a step before the buffered earlier ones
        self._each("log_rollouts", lambda t: t.log_rollouts(step, table))

    def log_artifact(self, path) -> None:
        self._each("log_artifact", lambda t: t.log_artifact(Path(path)))

    def finish(self, status: str = "finished") -> None:
        _check_status(status)  # a wrong status is the caller's bug: raise
        self.flush()
        self._each("finish", lambda t: t.finish(status))

    def __enter__(self) -> FanOutTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("finished")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish("killed")
        else:
            self.finish("failed")

    def _each(self, what: str, call) -> None:
        for i, tracker in enumerate(self.trackers):
            if i in self._disabled:
                continue
            try:
                call(tracker)
            except Exception as e:
                self._disable(i, tracker, what, e)

    def _disable(self, i: int, tracker, what: str, error: Exception) -> None:
        self._disabled.add(i)
        name = _backend_name(tracker)
        self.failed[name] = error
        where = f" {self._run_dir}" if self._run_dir is not None else ""
        hint = (
            f"; the local run store{where} still has everything: "
            f"`omgrpo sync{where} --to {name}` uploads it later"
            if name in ("mlflow", "wandb")
            else ""
        )
        warnings.warn(
            f"tracking backend {name!r} failed in {what}() and is disabled for the rest of this "
            f"run: {type(error).__name__}: {redact(_first_line(error))}{hint}",
            TrackerWarning,
            stacklevel=4,
        )
        if what != "finish":  # best effort: mark its run failed, quietly
            with contextlib.suppress(Exception):
                tracker.finish("failed")


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The gist of an error (SQLAlchemy's run to a dozen lines of SQL and parameters)."""
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def replay_store(tracker, store: RunStore, up_to: int | None = None) -> None:
    """Log the run store's metric rows and rollout tables (steps <= `up_to`, all if None) into
    `tracker`, in step order: each rollout table right after the metrics of its step, the
    metrics in between in batches."""
    tables = dict(store.rollout_files(up_to))
    batch: list[tuple[int, dict[str, Any]]] = []
    for step, metrics in store.metric_rows(up_to):
        batch.append((step, metrics))
        if step in tables:
            _log_rows(tracker, batch)
            batch = []
            tracker.log_rollouts(step, pd.read_parquet(tables.pop(step)))
    _log_rows(tracker, batch)
    for step, path in sorted(tables.items()):  # tables of steps without a metrics row
        tracker.log_rollouts(step, pd.read_parquet(path))


def _log_rows(tracker, rows: list[tuple[int, dict[str, Any]]]) -> None:
    if not rows:
        return
    if hasattr(tracker, "log_metrics_rows"):
        tracker.log_metrics_rows(rows)
    else:
        for step, metrics in rows:
            tracker.log_metrics(step, metrics)


def _backend_name(tracker) -> str:
    return getattr(tracker, "name", type(tracker).__name__)


# -- building from the config ------------------------------------------------------------------
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


def default_mlflow_uri(runs_root: Path) -> str:
    return "sqlite:///" + str(Path(runs_root).expanduser().resolve() / "mlflow.db")


def build_trackers(tracking_cfg: Any, runs_root: Path) -> FanOutTracker:
    """The enabled backends behind a FanOutTracker (constructing them never touches a backend:
    a broken backend only shows up, as a warning, at `start`)."""
    cfg = as_tracking_config(tracking_cfg)
    trackers: list[Tracker] = []
    # W&B first: MLflow's background writer would otherwise compete for the GIL during W&B's
    # call (measured: ~2.7 ms per step in this order, ~9 ms in the other).
    if cfg.wandb:
        trackers.append(wandb_tracker(cfg))
    if cfg.mlflow:
        trackers.append(mlflow_tracker(cfg, runs_root))
    return FanOutTracker(trackers, log_every=cfg.log_every)


def mlflow_tracker(cfg: Any, runs_root: Path | None, background: bool = True) -> MLflowTracker:
    cfg = as_tracking_config(cfg)
    uri = cfg.mlflow_uri
    if uri is None:
        if runs_root is None:
            raise ValueError("mlflow_uri is null and no runs root was given")
        uri = default_mlflow_uri(runs_root)
        with contextlib.suppress(OSError):  # if it fails, MLflow's start says so
            Path(runs_root).mkdir(parents=True, exist_ok=True)
    return MLflowTracker(uri, experiment=cfg.mlflow_experiment, background=background)


def wandb_tracker(cfg: Any) -> WandbTracker:
    cfg = as_tracking_config(cfg)
    return WandbTracker(project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode)


# -- secrets -----------------------------------------------------------------------------------
MASK = "***"
# Key words that always mark a secret (matched against whole words of the key).
_SECRET_WORDS = set(
    """
    secret secrets password passwords passwd credential credentials auth authorization
    authentication apikey bearer
    """.split()  # noqa: SIM905 (a word list reads better as text)
)
# A key ending in `key` / `token` is a secret unless the word before says it is something else
# (`question_key` names a column, `pad_token` a vocabulary item, `max_new_tokens` a length).
_BENIGN_QUALIFIERS = set(
    """
    question answer label prompt response text column field sort cache group dict primary
    foreign pad eos bos unk sep cls mask special start end stop think image chat
    """.split()  # noqa: SIM905 (a word list reads better as text)
)
_SECRET_VALUE = re.compile(
    r"(?<![A-Za-z0-9_\-])(?:[0-9a-f]{40}"  # a W&B API key
    r"|[a-z0-9]+-[0-9a-f]{40}"  # a W&B key of a self-hosted server (local-...)
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|sk-[A-Za-z0-9_\-]{16,}"  # OpenAI-style
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}"  # GitHub
    r"|AKIA[0-9A-Z]{16})(?![A-Za-z0-9_\-])"  # AWS access key id
)
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.\-]*://[^:/@\s]+:)([^@\s/]+)(@)")
_COMMIT_WORDS = {"commit", "revision", "sha", "hash", "digest", "checksum"}


def _key_words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", str(key))  # camelCase -> camel Case
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """Whether a config key names a secret: `api_key`, `WANDB_API_KEY`, `hf_token`, `token`,
    `password`, `client_secret`, `authToken`, `credentials`, ... but not `question_key`,
    `pad_token` or `max_new_tokens` (whole words are matched, not substrings)."""
    words = _key_words(key)
    if not words:
        return False
    if any(w in _SECRET_WORDS or w.startswith("passw") for w in words):
        return True
    last, before = words[-1], (words[-2] if len(words) > 1 else None)
    if last in ("key", "token"):
        return before not in _BENIGN_QUALIFIERS
    if last in ("keys", "tokens"):
        return before in {"api", "access", "secret", "private", "hf", "wandb"}
    return last.endswith(("apikey", "accesskey", "secretkey", "privatekey", "accesstoken"))


def _mask_string(value: str, key_words: list[str]) -> str:
    # A 40-hex value under `commit` / `revision` is a git SHA, not a W&B key.
    if _COMMIT_WORDS & set(key_words) and re.fullmatch(r"\s*[0-9a-f]{40}\s*", value):
        return value
    value = _SECRET_VALUE.sub(MASK, value)
    return _URL_PASSWORD.sub(rf"\1{MASK}\3", value)


def redact(config: Any) -> Any:
    """A copy of `config` safe to hand to a tracker.

    Values under secret-looking keys (see `is_secret_key`; matched on whole words, case
    insensitive) become "***" (None and booleans are kept: they reveal nothing); anything in a
    string that looks like a credential (40-hex W&B keys, `hf_...`, `sk-...`, GitHub and AWS
    keys) becomes "***" wherever it is, and so do passwords in URLs (`scheme://user:pw@host`).
    """
    return _redact(config, [])


def _redact(value: Any, key_words: list[str]) -> Any:
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if is_secret_key(str(k)):
                out[k] = v if v is None or isinstance(v, bool) else MASK
            else:
                out[k] = _redact(v, _key_words(str(k)))
        return out
    if isinstance(value, tuple):
        return tuple(_redact(v, key_words) for v in value)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):  # lists, ListConfig
        return [_redact(v, key_words) for v in value]
    if isinstance(value, str):
        return _mask_string(value, key_words)
    return value


# -- metric values and names -------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Tensors / numpy scalars to Python."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def as_float(value: Any) -> float | None:
    """The value as a finite float, or None (strings, None, NaN, inf, arrays)."""
    value = _plain(value)
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        value = float(value)
        return value if math.isfinite(value) else None
    return None


_REPLACEMENTS = {
    "@": "_at_",
    "&": "_and_",
    "=": "_eq_",
    "%": "_pct_",
    "+": "_plus_",
    "<": "_lt_",
    ">": "_gt_",
    "#": "_n_",
    "(": "_",
    ")": "_",
    "[": "_",
    "]": "_",
    " ": "_",
    ":": "_",  # allowed by MLflow except on Windows
}
_ALLOWED = re.compile(r"[A-Za-z0-9_\-./]")


def sanitize_metric_name(name: str) -> str:
    """`name` as MLflow accepts it: only letters, digits, `_ - . /`, no empty or `.`/`..` path
    segments, at most 250 characters. `@` becomes `_at_`, `&` `_and_`, `=` `_eq_`, spaces and
    brackets `_`; anything else `_`. Names of the metric contract map to themselves except
    `val/pass@k` -> `val/pass_at_k` (injective on them; MLflowTracker also disambiguates any
    runtime collision).

    >>> sanitize_metric_name("val/pass@4")
    'val/pass_at_4'
    """
    out = "".join(c if _ALLOWED.fullmatch(c) else _REPLACEMENTS.get(c, "_") for c in str(name))
    # MLflow treats names as paths: no empty, "." or ".." segments.
    parts = [p.replace(".", "_") if p in (".", "..") else p for p in out.split("/") if p]
    out = "/".join(parts) or "_"
    if len(out) > 250:
        out = out[:233] + "_" + hashlib.sha1(str(name).encode()).hexdigest()[:16]
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to `a.b.c` keys (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 6000 else text[:5985] + "...[truncated]"


def run_scale(config: Mapping[str, Any]) -> str:
    """`toy` for the tiny toy model, else the base model's folder name."""
    path = (config.get("model") or {}).get("path") if isinstance(config, Mapping) else None
    return "toy" if not path else Path(str(path)).name or str(path)


def run_method(config: Mapping[str, Any]) -> str:
    return str(config.get("method") or (config.get("run") or {}).get("variant") or "unknown")


def run_dir_key(run_dir: Path) -> str:
    return str(Path(run_dir).expanduser().resolve())


def stable_run_id(run_dir: Path) -> str:
    """A W&B run id derived from the run directory: a resumed or synced run lands in the same
    W&B run."""
    return hashlib.sha1(run_dir_key(run_dir).encode()).hexdigest()[:16]


# -- MLflow ------------------------------------------------------------------------------------
_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
_READY_STORES: set[str] = set()
_READY_LOCK = threading.Lock()


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///") :].split("?")[0])
    return Path(path) if path and path != ":memory:" else None


def mlflow_client(uri: str):
    """An MlflowClient for `uri`. A SQLite store is created or upgraded once per process,
    behind an exclusive `fcntl.flock` on `<db>.lock`: parallel runs starting on a fresh DB
    would otherwise race on the alembic migration (~7 s) and crash."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    with _READY_LOCK:
        if uri in _READY_STORES:
            return MlflowClient(tracking_uri=uri)
        db = _sqlite_path(uri)
        if db is None:
            client = MlflowClient(tracking_uri=uri)
        else:
            _check_sqlite(db)
            with _file_lock(db.with_name(db.name + ".lock")):
                client = _open_sqlite_store(uri)
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


def _open_sqlite_store(uri: str):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return MlflowClient(tracking_uri=uri)  # creates the tables of a fresh DB
    except MlflowException as e:
        if "out-of-date database schema" not in str(e):
            raise
    # A DB written by an older MLflow: upgrade it (we hold the lock), then open it again.
    import sqlalchemy
    from mlflow.store.db.utils import _upgrade_db

    engine = sqlalchemy.create_engine(uri)
    try:
        _upgrade_db(engine)
    finally:
        engine.dispose()
    return MlflowClient(tracking_uri=uri)


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _filter_literal(value: str) -> str:
    quote = "'" if "'" not in value else '"'
    return f"{quote}{value}{quote}"


class _Worker:
    """Runs calls in order on one daemon thread, so a slow backend does not hold up the
    training loop. The first error is re-raised on the caller's next `submit` / `wait`
    (where FanOutTracker catches it); calls queued after an error are dropped. `wait` gives up
    once no call has completed for `stall_s` seconds (a locked database): the thread is left
    to finish or die with the process."""

    def __init__(self, name: str):
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.abandoned = False
        self.last_progress = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> None:
        self.raise_error()
        self.queue.put((fn, args))

    def wait(self, stall_s: float | None = None) -> bool:
        """Whether every call submitted so far has run (re-raising the first error); False
        if no call completed for `stall_s` seconds (None: wait for ever)."""
        done = threading.Event()
        self.queue.put((done, ()))
        self.last_progress = time.monotonic()
        while not done.wait(0.05):
            if stall_s is not None and time.monotonic() - self.last_progress > stall_s:
                return False
        self.raise_error()
        return True

    def close(self) -> None:
        """Stop the thread after the calls queued so far (without waiting for them)."""
        self.queue.put(None)

    def abandon(self) -> None:
        """Drop every call not started yet (the one running cannot be interrupted)."""
        self.abandoned = True
        self.close()

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            fn, args = item
            if isinstance(fn, threading.Event):  # a wait() marker
                fn.set()
                continue
            try:
                if self.error is None and not self.abandoned:
                    fn(*args)
            except BaseException as e:
                self.error = e
            self.last_progress = time.monotonic()


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
    `config.yaml`; rollouts as `rollouts/step_XXXXXX.parquet`. The run carries the tag
    `omgrpo.run_dir`; each start opens a new run and retires the older ones of the same run
    directory (`_open_run`), so a resumed or re-synced run is one active run with one value per
    step.
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
        self._worker: _Worker | None = None
        self._pending: list = []  # Metric points not yet sent
        self._pending_lock = threading.Lock()
        self._tmp: str | None = None

    # -- Tracker ------------------------------------------------------------------------------
    def start(self, run_dir, config, *, name, group, tags, resume_step=None) -> None:
        """Open a new MLflow run for `run_dir` and retire the runs it replaces (see
        `_open_run`), in the caller's thread (a fresh SQLite store is created, ~7 s, once; a
        locked one raises after STALL_TIMEOUT_S, where MLflow's own retries would take ~20 s).
        Later calls run on the worker thread with `background=True`."""
        _quiet_mlflow_db_errors()
        self.client = mlflow_client(self.uri)
        if db := _sqlite_path(self.uri):
            _check_sqlite(db)
        self._open_run(Path(run_dir), redact(config), name, group, list(tags), resume_step)
        self._tmp = tempfile.mkdtemp(prefix="omgrpo-mlflow-")
        if self.background:
            self._worker = _Worker(f"omgrpo-mlflow-{self.run_id[:8]}")

    def _open_run(self, run_dir: Path, config, name, group, tags, resume_step) -> None:
        """A new run holding the config (params, `config.yaml`) and tags; the active runs of
        the same run directory (found by the tag `omgrpo.run_dir`, or by the id the run store
        recorded, for a run directory that was moved) are soft-deleted and tagged
        `omgrpo.superseded_by`: MLflow cannot delete single points, and the new run gets the
        run store's history replayed, so exactly one active run shows each step once."""
        from mlflow.entities import Param

        client = self.client
        self.experiment_id = self._experiment(self.experiment or group or "omgrpo")
        run_tags = {
            RUN_DIR_TAG: run_dir_key(run_dir),
            "mlflow.runName": name,
            "group": str(group),
            "method": run_method(config),
            "scale": run_scale(config),
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
            Param(sanitize_metric_name(k), _param_value(v)) for k, v in flatten(config).items()
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
        with self._pending_lock:
            idle = not self._pending
            self._pending += points
        if idle:  # otherwise a flush is queued already and will take these too
            self._call(self._send_pending)

    def log_rollouts(self, step, table) -> None:
        path = Path(self._tmp) / f"step_{int(step):06d}.parquet"
        table.to_parquet(path, index=False)
        self._call(self._log_file, path, "rollouts")

    def log_artifact(self, path) -> None:
        path = Path(path)
        if path.is_dir():
            self._call(lambda: self.client.log_artifacts(self.run_id, str(path), path.name))
        else:
            self._call(lambda: self.client.log_artifact(self.run_id, str(path)))

    def finish(self, status) -> None:
        """Send what is queued and set the run's status. Gives up (TimeoutError) when the
        store has not answered for STALL_TIMEOUT_S: the run then stays RUNNING in MLflow
        until `omgrpo sync` replaces it."""
        status = _MLFLOW_STATUS[_check_status(status)]
        worker, self._worker = self._worker, None
        try:
            if worker is None:
                if self.run_id is not None:
                    self.client.set_terminated(self.run_id, status)
                return
            try:
                worker.submit(lambda: self.client.set_terminated(self.run_id, status))
                if not worker.wait(stall_s=STALL_TIMEOUT_S):
                    worker.abandon()
                    raise TimeoutError(
                        f"the MLflow store {self.uri} did not answer for {STALL_TIMEOUT_S:.0f} s "
                        "(locked or unreachable); its run is left as it is"
                    )
            finally:
                worker.close()
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _call(self, fn, *args) -> None:
        if self._worker is not None:
            self._worker.submit(fn, *args)
        else:
            fn(*args)

    def _send_pending(self) -> None:
        with self._pending_lock:
            points, self._pending = self._pending, []
        for chunk in _chunks(points, 1000):
            self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)

    def _log_file(self, path: Path, artifact_path: str) -> None:
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        finally:
            path.unlink(missing_ok=True)

    # -- helpers ------------------------------------------------------------------------------
    def find_runs(self, run_dir: Path) -> list:
        """The active runs (in any experiment) of this run directory: tagged with its path,
        or recorded in its run store (`trackers.json`, so a moved run directory is found)."""
        from mlflow.entities import ViewType

        client = self.client or mlflow_client(self.uri)
        experiments = [e.experiment_id for e in _all_experiments(client)]
        flt = f"tags.`{RUN_DIR_TAG}` = {_filter_literal(run_dir_key(run_dir))}"
        runs = {}
        for chunk in _chunks(experiments, 100):
            for run in client.search_runs(
                chunk, filter_string=flt, run_view_type=ViewType.ACTIVE_ONLY, max_results=1000
            ):
                runs[run.info.run_id] = run
        recorded = RunStore(run_dir).tracker_ids().get("mlflow")
        if recorded and recorded not in runs:
            with contextlib.suppress(Exception):  # recorded in another store, or deleted
                run = client.get_run(recorded)
                if run.info.lifecycle_stage == "active":
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
        client = self.client
        db = _sqlite_path(self.uri)
        lock = _file_lock(db.with_name(db.name + ".lock")) if db else contextlib.nullcontext()
        with lock:  # two runs creating the same experiment at once
            exp = client.get_experiment_by_name(name)
            if exp is not None:
                if exp.lifecycle_stage == "deleted":
                    client.restore_experiment(exp.experiment_id)
                return exp.experiment_id
            location = None
            if db is not None:  # next to the DB, not in the working directory
                slug = re.sub(r"[^\w.\-]+", "_", name)
                location = (db.resolve().parent / "mlartifacts" / slug).as_uri()
            return client.create_experiment(name, artifact_location=location)


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


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _check_status(status: str) -> str:
    if status not in STATUSES:
        raise ValueError(f"unknown run status {status!r}; valid: {', '.join(STATUSES)}")
    return status


# -- Weights & Biases --------------------------------------------------------------------------
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

    The W&B run id is derived from the run directory (`stable_run_id`) and recorded in the run
    store (`trackers.json`), so a resumed, moved or synced run keeps it (not under a sweep
    agent, which assigns its own id). Rows are logged with W&B's step = `train/step`, and every
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
            None if sweep else store.tracker_ids().get("wandb") or stable_run_id(run_dir)
        )
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
            value = _plain(value)
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
        run.finish(exit_code=_WANDB_EXIT_CODE[_check_status(status)])


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
