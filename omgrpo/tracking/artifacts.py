"""`log_report_artifacts`: `omgrpo report`'s output logged to the MLflow runs it describes.

Each run of the report whose run store records an MLflow run id (`trackers.json`) gets, under
the artifact folder `report/`, the report's figures (`report/figures/*.png`), `report.md`,
`summary.json` and any per-problem table the report wrote (`problems*`), plus the run's own
per-problem table (`problems.parquet` in the run store) when it has one. The store is the
one the run logged to: its config's `tracking.mlflow_uri`, else $MLFLOW_TRACKING_URI, else
`<run_dir>/../mlflow.db` (the trainer's default); a SQLite store that does not exist is not
created. A later report replaces the files of the same names. A run that cannot be reached
(no such store, a deleted run, a server that does not answer) gets one TrackerWarning and is
skipped: the report on disk is complete either way.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

from omgrpo.tracking.base import TrackerWarning
from omgrpo.tracking.mlflow_tracker import MLflowTracker, mlflow_client, sqlite_db_path
from omgrpo.tracking.naming import redact
from omgrpo.tracking.retry import quiet_mlflow_http_retries, retrying
from omgrpo.tracking.store import RunStore

REPORT_ARTIFACT_DIR = "report"
"""The artifact folder of an MLflow run that holds the report's files."""
REPORT_FILES = ("report.md", "summary.json")
PROBLEM_TABLE = "problems.parquet"
"""The run store's per-problem table (one row per problem and validation), if written."""


def report_files(report_dir: Path) -> list[tuple[Path, str]]:
    """(file, artifact folder) of what a report in `report_dir` logs to each of its runs."""
    report_dir = Path(report_dir)
    out = [(report_dir / n, REPORT_ARTIFACT_DIR) for n in REPORT_FILES]
    out += [(p, REPORT_ARTIFACT_DIR) for p in sorted(report_dir.glob("problems*")) if p.is_file()]
    figures = report_dir / "figures"
    out += [(p, f"{REPORT_ARTIFACT_DIR}/figures") for p in sorted(figures.glob("*.png"))]
    return [(p, where) for p, where in out if p.is_file()]


def run_mlflow_target(run_dir: Path) -> tuple[str, str] | None:
    """(tracking URI, MLflow run id) of the run in `run_dir`, or None when its run store records
    no MLflow run."""
    store = RunStore(run_dir)
    run_id = store.tracker_ids().get("mlflow")
    if not run_id:
        return None
    try:
        tracking = store.read_config().get("tracking") or {}
    except (OSError, ValueError):
        tracking = {}
    tracking = {k: v for k, v in dict(tracking).items() if k in ("mlflow_uri", "mlflow")}
    return MLflowTracker.from_config(tracking, Path(run_dir).parent).uri, run_id


def log_report_artifacts(run_dirs: Iterable[str | Path], report_dir: str | Path) -> dict[str, str]:
    """Log the report in `report_dir` to the MLflow run of each of `run_dirs` that has one (see
    the module docstring); returns {run directory: MLflow run id} of the runs that got it. The
    runs that could not be reached are named in one TrackerWarning."""
    files = report_files(Path(report_dir))
    logged: dict[str, str] = {}
    failed: list[str] = []
    for run_dir in map(Path, run_dirs):
        target = run_mlflow_target(run_dir)
        if target is None:
            continue
        uri, run_id = target
        own = [(run_dir / PROBLEM_TABLE, REPORT_ARTIFACT_DIR)]
        todo = files + [(p, where) for p, where in own if p.is_file()]
        if not todo:
            continue
        try:
            _log_files(uri, run_id, todo)
        except Exception as e:  # the report on disk stands; say why this run lacks it
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            failed.append(f"{run_dir} (run {run_id} at {uri}: {type(e).__name__}: {why})")
            continue
        logged[str(run_dir)] = run_id
    if failed:
        shown = "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
        warnings.warn(
            redact(
                f"the report was not logged to the MLflow runs of {len(failed)} run(s): {shown}"
            ),
            TrackerWarning,
            stacklevel=2,
        )
    return logged


def _log_files(uri: str, run_id: str, files: list[tuple[Path, str]]) -> None:
    """Log `files` to run `run_id` in one `log_artifacts` call per folder (transient errors
    retried as the tracker does)."""
    db = sqlite_db_path(uri)
    if db is not None and not db.is_file():
        raise FileNotFoundError(f"no MLflow database {db}")
    quiet_mlflow_http_retries()
    client = mlflow_client(uri)
    for attempt in retrying():
        with attempt:
            client.get_run(run_id)  # a run of another store, or deleted for good, fails here
    tmp = Path(tempfile.mkdtemp(prefix="omgrpo-report-"))
    try:
        for path, where in files:  # one folder tree, then one upload per top folder
            (tmp / where).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, tmp / where / path.name)
        for attempt in retrying():
            with attempt:
                client.log_artifacts(run_id, str(tmp / REPORT_ARTIFACT_DIR), REPORT_ARTIFACT_DIR)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
