"""Trackers against the real backends: a SQLite MLflow store and offline W&B runs (no mocks).

One MLflow database is shared by the session (its first migration takes ~7 s); every test
uses its own experiment and run directory.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest

from omgrpo.tracking import (
    FanOutTracker,
    MLflowTracker,
    NullTracker,
    Tracker,
    TrackerWarning,
    TrackingConfig,
    WandbTracker,
    as_float,
    build_trackers,
    is_secret_key,
    mlflow_client,
    redact,
    resolve_wandb_mode,
    sanitize_metric_name,
    stable_run_id,
)
from omgrpo.tracking.store import RunStore
from omgrpo.tracking.sync import sync_run

REPO = Path(__file__).resolve().parents[2]
WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"  # shaped like a W&B API key
HF_TOKEN = "hf_" + "Ab1" * 10
PASSWORD = "hunter2-pw"

# The metric contract (DESIGN.md), with the pass@k values actually logged.
DESIGN_NAMES = [
    "train/step", "train/epoch", "train/skipped_steps", "reward/total", "reward/soft_vote",
    "reward/format", "reward/majority_vote", "reward/gt", "reward/self_certainty",
    "reward/entropy", "reward/coreward", "acc/train", "answers/unique_per_prompt",
    "answers/unique_per_batch", "answers/batch_mode", "answers/batch_mode_share",
    "answers/vote_entropy", "answers/extract_rate", "answers/top_vote_acc",
    "answers/confidently_wrong", "answers/label_flip_rate", "kl/answer", "kl/reasoning",
    "entropy/answer", "entropy/reasoning", "answer/frac", "loss/pg", "loss/kl", "loss/total",
    "clip/frac", "ratio/mean", "grad/norm", "lr", "response/length_mean",
    "car/position_bias", "car/select_correct", "car/incorrect_pair_first",
    "car/anchor_entropy_correct", "car/anchor_entropy_incorrect", "car/pool_size",
    "car/top_vote_acc_without_car", "car/truncated", "val/acc", "val/pass@k", "val/pass@1",
    "val/pass@2", "val/pass@4", "val/pass@8", "val/pass@16", "val/pass@64",
    "val/unique_answers", "val/extract_rate", "recovery/zero_pass_prompts",
    "recovery/cum_pass", "recovery/cum_avg", "time/gen", "time/car", "time/reward",
    "time/old_logprob", "time/ref_logprob", "time/adv", "time/update", "time/step",
    "mem/peak_gb", "perf/tokens_per_s",
]  # fmt: skip


def readme_metric_names() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return [m for m in re.findall(r"`([^`\s]+)`", section) if "/" in m or m == "lr"]


def fake_config(run_dir: Path, experiment: str) -> dict:
    return {
        "run": {
            "experiment": experiment,
            "variant": "om_grpo",
            "name": run_dir.name,
            "root": str(run_dir.parent),
            "resume": False,
            "tags": ["smoke", "owner=ci"],
        },
        "task": {"name": "toy", "question_key": "question", "answer_key": "answer"},
        "model": {"path": None, "hidden_size": 32},
        "rollout": {"n": 4, "max_new_tokens": 24},
        "reward": {"parts": ["soft_vote", "format"], "weights": {"soft_vote": 1.0}},
        "tracking": {"wandb_api_key": WANDB_KEY, "mlflow_uri": f"postgresql://me:{PASSWORD}@db/x"},
        "hub": {"token": HF_TOKEN, "mirror": HF_TOKEN},
        "notes": f"key {WANDB_KEY}",
        "pasted_key_value": [WANDB_KEY],
        "method": "om_grpo",
        "seed": 0,
    }


def metric_rows() -> list[tuple[int, dict]]:
    """5 rows as the trainer logs them: validation at step 0, a string metric, a NaN."""
    rows = [(0, {"val/acc": 0.25, "val/pass@4": 0.5, "val/unique_answers": 3.0})]
    for step in range(1, 5):
        rows.append(
            (
                step,
                {
                    "train/epoch": 0,
                    "reward/total": 1.0 + step / 10,
                    "answers/batch_mode": str(40 + step),
                    "answers/unique_per_prompt": 2 + step,
                    "acc/train": float("nan") if step == 2 else step / 8,
                    "loss/pg": -0.01 * step,
                    "lr": 1e-3,
                    **({"val/acc": 0.5, "val/pass@4": 0.75} if step == 4 else {}),
                },
            )
        )
    return rows


def rollouts(step: int, n: int = 6) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "step": step,
            "prompt_id": [f"p{i // 3}" for i in range(n)],
            "text": [f"... \\boxed{{{i}}}" for i in range(n)],
            "answer": [str(i) if i else None for i in range(n)],
            "correct": pd.array([True, False, None, True, False, True][:n], dtype="boolean"),
            "reward": [1.0] * n,
        }
    )


def write_run(run_dir: Path, experiment: str, tracker: Tracker | None = None) -> RunStore:
    """Write a fake run to the local store, logging the same to `tracker` as the trainer would."""
    store = RunStore(run_dir)
    config = fake_config(run_dir, experiment)
    store.write_config(config)
    store.write_status(state="running", step=0)
    if tracker is not None:
        tracker.start(run_dir, config, name=run_dir.name, group=experiment, tags=["smoke"])
    for step, metrics in metric_rows():
        store.log_metrics(step, metrics)
        if tracker is not None:
            tracker.log_metrics(step, metrics)
        if step in (1, 3):
            store.log_rollouts(step, rollouts(step))
            if tracker is not None:
                tracker.log_rollouts(step, rollouts(step))
    store.write_status(state="finished", step=4)
    if tracker is not None:
        tracker.finish("finished")
    return store


def assert_history_equals_store(uri: str, run_id: str, store: RunStore) -> None:
    """Every finite numeric value of metrics.jsonl is in MLflow at its step, nothing else."""
    client = mlflow_client(uri)
    df = store.read_metrics()
    expected_keys = set()
    for col in df.columns:
        if col == "train/step":
            continue
        expected = [
            (int(s), as_float(v))
            for s, v in zip(df["train/step"], df[col])
            if as_float(v) is not None
        ]
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(run_id, sanitize_metric_name(col))
        )
        assert history == expected, col
        if expected:
            expected_keys.add(sanitize_metric_name(col))
    assert set(client.get_run(run_id).data.metrics) == expected_keys


def assert_no_secret(text: str | bytes) -> None:
    for secret in (WANDB_KEY, HF_TOKEN, PASSWORD):
        needle = secret.encode() if isinstance(text, bytes) else secret
        assert needle not in text, secret


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One migrated SQLite MLflow store for the session."""
    uri = "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    mlflow_client(uri)
    return uri


@pytest.fixture
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_SWEEP_ID", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def offline_run_dirs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def wandb_file_bytes(offline_dir: Path, expect: bytes, timeout: float = 20.0) -> bytes:
    """The run's `.wandb` file once it holds `expect`: `run.finish()` returns before W&B's
    service has flushed the file (it closes the stream asynchronously)."""
    (path,) = offline_dir.glob("*.wandb")
    deadline = time.monotonic() + timeout
    while expect not in (data := path.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return data


# -- MLflow --------------------------------------------------------------------------------
@pytest.mark.slow
def test_mlflow_metrics_params_tags_artifacts_match_the_store(tmp_path, mlflow_uri, monkeypatch):
    import mlflow

    run_dir = tmp_path / "runs" / "unit__om_grpo__s0"
    tracker = MLflowTracker(mlflow_uri)
    store = write_run(run_dir, "mlflow-roundtrip", tracker)
    assert_history_equals_store(mlflow_uri, tracker.run_id, store)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)  # for the fluent search_runs
    runs = mlflow.search_runs(experiment_names=["mlflow-roundtrip"])
    assert len(runs) == 1
    row = runs.iloc[0]
    assert row["run_id"] == tracker.run_id and row["status"] == "FINISHED"
    assert row["metrics.val/pass_at_4"] == 0.75  # the last value
    assert row["tags.omgrpo.run_dir"] == str(run_dir.resolve())
    assert row["tags.mlflow.runName"] == run_dir.name
    assert (row["tags.group"], row["tags.method"], row["tags.scale"]) == (
        "mlflow-roundtrip",
        "om_grpo",
        "toy",
    )
    assert row["tags.smoke"] == ""
    assert row["params.rollout.max_new_tokens"] == "24"
    assert row["params.task.question_key"] == "question"
    assert row["params.reward.parts"] == '["soft_vote", "format"]'

    client = mlflow_client(mlflow_uri)
    run = client.get_run(tracker.run_id)
    assert run.data.params["tracking.wandb_api_key"] == "***"
    for text in [*run.data.params.values(), *run.data.tags.values()]:
        assert_no_secret(text)
    assert [a.path for a in client.list_artifacts(tracker.run_id, "rollouts")] == [
        "rollouts/step_000001.parquet",
        "rollouts/step_000003.parquet",
    ]
    local = Path(client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path)))
    assert "question_key: question" in local.read_text()
    assert_no_secret(local.read_text())
    table = pd.read_parquet(
        client.download_artifacts(tracker.run_id, "rollouts/step_000003.parquet", str(tmp_path))
    )
    pd.testing.assert_frame_equal(table, rollouts(3))


def test_mlflow_resume_replaces_the_run_with_one_value_per_step(tmp_path, mlflow_uri):
    """Killed after step 3 with a checkpoint at 2: the resumed run recomputes step 3. MLflow
    cannot delete points, so the resume opens a new run holding the store's steps <= 2 plus the
    new ones, and soft-deletes the old run."""
    run_dir = tmp_path / "r"
    store = RunStore(run_dir)
    config = fake_config(run_dir, "mlflow-resume")
    first = FanOutTracker([MLflowTracker(mlflow_uri)])
    first.start(run_dir, config, name="r", group="mlflow-resume", tags=[])
    for step in (1, 2, 3):
        store.log_metrics(step, {"loss/pg": float(step)})
        first.log_metrics(step, {"loss/pg": float(step)})
    first.finish("killed")
    old_id = first.trackers[0].run_id

    store.truncate_metrics(2)  # what the trainer does when it resumes from step 2
    config["run"]["resume"] = True  # a changed param must not trip MLflow's immutability
    second = FanOutTracker([MLflowTracker(mlflow_uri)])
    second.start(run_dir, config, name="r", group="mlflow-resume", tags=[], resume_step=2)
    second.log_metrics(3, {"loss/pg": 30.0})
    second.log_metrics(4, {"loss/pg": 40.0})
    second.finish("finished")
    new_id = second.trackers[0].run_id

    client = mlflow_client(mlflow_uri)
    history = client.get_metric_history(new_id, "loss/pg")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    run = client.get_run(new_id)
    assert run.info.status == "FINISHED" and run.data.params["run.resume"] == "true"
    assert run.data.tags["omgrpo.resumed_from_step"] == "2"
    old = client.get_run(old_id)
    assert old.info.lifecycle_stage == "deleted" and old.info.status == "KILLED"
    assert old.data.tags["omgrpo.superseded_by"] == new_id
    exp = client.get_experiment_by_name("mlflow-resume")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [new_id]
    assert store.tracker_ids()["mlflow"] == new_id


@pytest.mark.slow
def test_mlflow_locked_during_a_run_warns_once_and_finishes_in_bounded_time(tmp_path, mlflow_uri):
    """Another process takes an exclusive lock on the SQLite store after the run started and
    holds it: one short warning, `finish` returns within STALL_TIMEOUT_S + 1 s, the local store
    has every step, and `omgrpo sync` afterwards gives MLflow the finished run."""
    import sqlite3

    from omgrpo.tracking import STALL_TIMEOUT_S, sqlite_db_path

    run_dir = tmp_path / "runs" / "locked"
    store = RunStore(run_dir)
    fan = build_trackers(TrackingConfig(mlflow_uri=mlflow_uri, wandb=False), tmp_path)
    lock = sqlite3.connect(sqlite_db_path(mlflow_uri), isolation_level=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fan.start(run_dir, fake_config(run_dir, "locked-exp"), name="locked", group="g", tags=[])
        lock.execute("BEGIN EXCLUSIVE")
        try:
            for step, metrics in metric_rows():
                store.log_metrics(step, metrics)
                fan.log_metrics(step, metrics)
            tic = time.perf_counter()
            fan.finish("finished")
            seconds = time.perf_counter() - tic
        finally:
            lock.rollback()
            lock.close()
    store.write_config(fake_config(run_dir, "locked-exp"))
    store.write_status(state="finished", step=4)
    ours = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(ours) == 1, ours
    assert "'mlflow' failed" in ours[0] and "omgrpo sync" in ours[0]
    assert len(ours[0]) < 600 and "[SQL:" not in ours[0]  # the gist, not SQLAlchemy's dump
    assert seconds < STALL_TIMEOUT_S + 10, seconds  # not MLflow's 20 s busy timeout; room for load
    assert list(store.read_metrics()["train/step"]) == [0, 1, 2, 3, 4]

    assert store.unsynced() == ["mlflow"]
    # `omgrpo sync` runs after the training process ended; here, in the same process, the
    # abandoned writer's call blocked on the lock may still land: let it end first
    for thread in threading.enumerate():
        if thread.name.startswith("omgrpo-mlflow-"):
            thread.join(timeout=30)
    # the sync fills in the run the training opened (in its experiment, "g"), keeping its id
    run_id = sync_run(run_dir, "mlflow", TrackingConfig(mlflow_uri=mlflow_uri))
    assert run_id == store.tracker_ids()["mlflow"] and store.unsynced() == []
    assert_history_equals_store(mlflow_uri, run_id, store)
    client = mlflow_client(mlflow_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    exp = client.get_experiment_by_name("g")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [run_id]


@pytest.mark.slow
def test_mlflow_locked_before_the_run_warns_once_within_the_stall_timeout(tmp_path, mlflow_uri):
    import sqlite3

    from omgrpo.tracking import STALL_TIMEOUT_S, sqlite_db_path

    run_dir = tmp_path / "runs" / "locked-early"
    fan = build_trackers(TrackingConfig(mlflow_uri=mlflow_uri, wandb=False), tmp_path)
    lock = sqlite3.connect(sqlite_db_path(mlflow_uri), isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tic = time.perf_counter()
            store = write_run(run_dir, "locked-early", fan)
            seconds = time.perf_counter() - tic
    finally:
        lock.rollback()
        lock.close()
    ours = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(ours) == 1 and "failed in start()" in ours[0] and "locked" in ours[0], ours
    assert seconds < STALL_TIMEOUT_S + 10, seconds  # not MLflow's 20 s busy timeout; room for load
    assert list(store.read_metrics()["train/step"]) == [0, 1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.e2e
def test_parallel_runs_on_a_fresh_database_do_not_race(tmp_path):
    """Two processes start on the same new DB at once: the flock serialises the migration."""
    uri = "sqlite:///" + str(tmp_path / "fresh.db")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from omgrpo.tracking import MLflowTracker\n"
        "t = MLflowTracker(sys.argv[1])\n"
        "t.start(Path(sys.argv[2]), {'seed': 0}, name=Path(sys.argv[2]).name, group='race',"
        " tags=[])\n"
        "t.log_metrics(1, {'x': 1.0})\n"
        "t.finish('finished')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, uri, str(tmp_path / f"run{i}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name("race")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["mlflow.runName"] for r in runs) == ["run0", "run1"]
    assert all(r.info.status == "FINISHED" for r in runs)


# -- W&B -----------------------------------------------------------------------------------
def test_wandb_offline_run_dir_and_no_secret(tmp_path, offline_wandb):
    run_dir = tmp_path / "unit__om_grpo__s0"
    tracker = WandbTracker()
    store = write_run(run_dir, "wandb-offline", tracker)
    (offline,) = offline_run_dirs(run_dir)
    expected = stable_run_id(store.run_uuid())
    assert offline.name.endswith(expected) and tracker.run_id == expected
    data = wandb_file_bytes(offline, b"val/pass@4")
    assert b"question_key" in data and b"val/pass@4" in data  # config and metrics are in it
    for path in (run_dir / "wandb").rglob("*"):
        if path.is_file():
            assert_no_secret(path.read_bytes())


# -- fan-out, failures, sync ---------------------------------------------------------------
class Recorder(NullTracker):
    name = "recorder"

    def __init__(self, fail_in: str | None = None, fail_at_step: int = 0):
        self.calls: list[tuple] = []
        self.fail_in, self.fail_at_step = fail_in, fail_at_step

    def start(self, run_dir, config, *, name, group, tags, resume_step=None):
        self.config = config
        self.calls.append(("start",))
        if self.fail_in == "start":
            raise ConnectionError("no route to host")

    def log_metrics(self, step, metrics):
        if self.fail_in == "log_metrics" and step >= self.fail_at_step:
            raise RuntimeError("boom")
        self.calls.append(("log_metrics", step))

    def finish(self, status):
        self.calls.append(("finish", status))


def test_fanout_disables_a_failing_backend_with_one_warning(tmp_path):
    broken, healthy = Recorder("log_metrics", fail_at_step=2), Recorder()
    fan = FanOutTracker([broken, healthy])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fan.start(tmp_path, {"api_key": "x"}, name="n", group="g", tags=[])
        for step in range(1, 5):
            fan.log_metrics(step, {"loss/pg": 1.0})
        fan.log_rollouts(1, rollouts(1))
        fan.finish("finished")
    ours = [w for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(ours) == 1
    assert "'recorder' failed in log_metrics()" in str(ours[0].message) and "boom" in str(
        ours[0].message
    )
    assert broken.calls == [("start",), ("log_metrics", 1), ("finish", "failed")]
    assert healthy.calls[-1] == ("finish", "finished") and len(healthy.calls) == 6
    assert healthy.config == {"api_key": "***"}  # redacted before any backend sees it
    assert fan.active == ["recorder"] and isinstance(fan.failed["recorder"], RuntimeError)


def test_fanout_buffers_log_every_steps_and_flushes_at_finish(tmp_path):
    rec = Recorder()
    fan = FanOutTracker([rec], log_every=3)
    fan.start(tmp_path, {}, name="n", group="g", tags=[])
    for step in range(1, 6):
        fan.log_metrics(step, {"x": step})
        if step == 2:
            assert rec.calls == [("start",)]
    assert [c for c in rec.calls if c[0] == "log_metrics"] == [
        ("log_metrics", s) for s in (1, 2, 3)
    ]
    fan.finish("killed")
    assert [c[1] for c in rec.calls[1:]] == [1, 2, 3, 4, 5, "killed"]


def test_mlflow_error_in_the_background_writer_reaches_the_fanout(tmp_path, mlflow_uri):
    """MLflow writes on a worker thread; its error surfaces on the next call, once."""
    mlflow = MLflowTracker(mlflow_uri, experiment="deleted-mid-run")
    rec = Recorder()
    fan = FanOutTracker([rec, mlflow])
    fan.start(tmp_path, {}, name="d", group="g", tags=[])
    fan.log_metrics(1, {"x": 1.0})
    mlflow._worker.wait()
    mlflow_client(mlflow_uri).delete_run(mlflow.run_id)  # later writes are refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2, 6):
            fan.log_metrics(step, {"x": float(step)})
            time.sleep(0.05)
        fan.finish("finished")
    ours = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(ours) == 1 and "'mlflow' failed in log_metrics" in ours[0], ours
    assert "must be in the 'active' state" in ours[0]
    assert fan.active == ["recorder"] and rec.calls[-1] == ("finish", "finished")
    assert mlflow._worker is None  # the worker thread was stopped


def test_mlflow_on_a_directory_path_fails_softly(tmp_path):
    (tmp_path / "isadir.db").mkdir()
    fan = build_trackers(
        TrackingConfig(mlflow_uri=f"sqlite:///{tmp_path / 'isadir.db'}", wandb=False), tmp_path
    )
    with pytest.warns(TrackerWarning, match="'mlflow' failed in start"):
        fan.start(tmp_path / "run", {}, name="n", group="g", tags=[])
    fan.log_metrics(1, {"x": 1.0})
    fan.finish("finished")
    assert fan.active == []


def test_broken_mlflow_keeps_wandb_then_sync_replays_everything(
    tmp_path, mlflow_uri, offline_wandb
):
    run_dir = tmp_path / "runs" / "unit__om_grpo__s0"
    cfg = TrackingConfig(mlflow_uri="sqlite:////nonexistent/dir/x.db", log_every=1)
    fan = build_trackers(cfg, tmp_path / "runs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = write_run(run_dir, "sync-exp", fan)
    ours = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(ours) == 1 and "'mlflow' failed in start()" in ours[0], ours
    assert "/nonexistent/dir" in ours[0] and "omgrpo sync" in ours[0]
    assert fan.active == ["wandb"]
    assert len(offline_run_dirs(run_dir)) == 1  # W&B kept logging

    good = TrackingConfig(mlflow_uri=mlflow_uri)
    run_id = sync_run(run_dir, "mlflow", good)
    assert_history_equals_store(mlflow_uri, run_id, store)
    client = mlflow_client(mlflow_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["group"] == "sync-exp"
    assert run.data.params["tracking.wandb_api_key"] == "***"
    assert len(client.list_artifacts(run_id, "rollouts")) == 2

    # Syncing again replaces the run: still one active run, each point once.
    again = sync_run(run_dir, "mlflow", good)
    assert_history_equals_store(mlflow_uri, again, store)
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [again]


def test_sync_a_partial_run_into_wandb(tmp_path, offline_wandb):
    run_dir = tmp_path / "partial"
    store = write_run(run_dir, "sync-wandb")
    store.write_status(state="running", step=4)
    with store.metrics_path.open("a") as f:
        f.write('{"train/step": 5, "loss/p')  # killed mid-write
    run_id = sync_run(run_dir, "wandb", TrackingConfig())
    assert run_id == stable_run_id(store.run_uuid())
    (offline,) = offline_run_dirs(run_dir)
    assert b"val/pass@4" in wandb_file_bytes(offline, b"val/pass@4")


# -- units ---------------------------------------------------------------------------------
def test_sanitize_metric_name_is_valid_and_injective_on_the_contract():
    from mlflow.utils.validation import path_not_unique, validate_param_and_metric_name

    names = sorted(set(DESIGN_NAMES) | set(readme_metric_names()))
    assert "val/pass@k" in names and "answers/batch_mode" in names
    out = [sanitize_metric_name(n) for n in names]
    assert len(set(out)) == len(names)
    for name, safe in zip(names, out):
        assert validate_param_and_metric_name(safe) and not path_not_unique(safe), safe
        if re.fullmatch(r"[\w./-]+", name):
            assert safe == name  # plain names are left alone
    assert sanitize_metric_name("val/pass@4") == "val/pass_at_4"
    assert sanitize_metric_name("a=b & c (d)") == "a_eq_b__and__c__d_"
    assert sanitize_metric_name("/x//y/../z/") == "x/y/__/z"
    assert len(sanitize_metric_name("m" * 400)) <= 250


def test_mlflow_keeps_colliding_names_apart(tmp_path, mlflow_uri):
    tracker = MLflowTracker(mlflow_uri, experiment="collide")
    tracker.start(tmp_path, {}, name="c", group="g", tags=[])
    with pytest.warns(TrackerWarning, match="sanitise to the same name"):
        tracker.log_metrics(1, {"val/pass@4": 1.0, "val/pass_at_4": 2.0})
    assert tracker.metric_key("val/pass@4") == "val/pass_at_4"
    assert tracker.metric_key("val/pass_at_4").startswith("val/pass_at_4_")
    tracker.finish("finished")
    metrics = mlflow_client(mlflow_uri).get_run(tracker.run_id).data.metrics
    assert sorted(metrics.values()) == [1.0, 2.0]


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("api_key", True),
        ("WANDB_API_KEY", True),
        ("hf_token", True),
        ("token", True),
        ("key", True),
        ("apiKey", True),
        ("authToken", True),
        ("client_secret", True),
        ("db_password", True),
        ("passwd", True),
        ("credentials", True),
        ("Authorization", True),
        ("question_key", False),
        ("answer_key", False),
        ("max_new_tokens", False),
        ("pad_token", False),
        ("token_budget", False),
        ("num_kv_heads", False),
        ("author", False),
        ("monkey", False),
    ],
)
def test_is_secret_key(key, secret):
    assert is_secret_key(key) is secret


def test_redact():
    config = {
        "run": {"name": "x", "tags": ["a", HF_TOKEN]},
        "task": {"question_key": "question", "max_new_tokens": 24},
        "wandb": {"api_key": "anything", "API_KEY": None, "use_auth": True},
        "hub": {"token": {"nested": "dict"}, "password": 1234},
        "free_text": WANDB_KEY,
        "openai": "sk-" + "x" * 30,
        "db": f"postgresql://me:{PASSWORD}@host:5432/db",
        "model": {"revision": WANDB_KEY},  # a git SHA, not a key
        "nan": math.nan,
    }
    out = redact(config)
    assert out["run"] == {"name": "x", "tags": ["a", "***"]}
    assert out["task"] == config["task"]
    assert out["wandb"] == {"api_key": "***", "API_KEY": None, "use_auth": True}
    assert out["hub"] == {"token": "***", "password": "***"}
    assert out["free_text"] == out["openai"] == "***"
    assert out["db"] == "postgresql://me:***@host:5432/db"
    assert out["model"]["revision"] == WANDB_KEY
    assert math.isnan(out["nan"])
    assert config["wandb"]["api_key"] == "anything"  # the input is not modified
    assert_no_secret(str(redact(fake_config(Path("/r/x"), "e"))))


def test_resolve_wandb_mode(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login u password p\n")
    monkeypatch.setenv("NETRC", str(netrc))
    assert resolve_wandb_mode(None) == "offline"
    netrc.write_text("machine api.wandb.ai login user password " + "f" * 40 + "\n")
    assert resolve_wandb_mode(None) == "online"
    assert resolve_wandb_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode(None) == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert resolve_wandb_mode(None) == "online"
    with pytest.raises(ValueError, match="unknown W&B mode"):
        resolve_wandb_mode("sometimes")


def test_build_trackers_from_a_dict(tmp_path):
    fan = build_trackers({"wandb": False, "log_every": 5}, tmp_path / "runs")
    assert fan.active == ["mlflow"] and fan.log_every == 5
    assert fan.trackers[0].uri == f"sqlite:///{(tmp_path / 'runs').resolve()}/mlflow.db"
    assert build_trackers({"mlflow": False, "wandb": False}, tmp_path).active == []
    with pytest.raises(ValueError, match="unknown tracking fields"):
        build_trackers({"wandb_projcet": "x"}, tmp_path)
    assert isinstance(NullTracker(), Tracker) and isinstance(MLflowTracker("x"), Tracker)


# -- faults: retries, the bounded writer queue ----------------------------------------------
@pytest.mark.slow
def test_transient_errors_are_retried_with_backoff_and_others_raise_at_once():
    from mlflow.exceptions import MlflowException
    from mlflow.protos import databricks_pb2 as codes

    from omgrpo.tracking.retry import is_transient, retrying

    def mlflow_error(code):
        return MlflowException("x", error_code=code)

    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    for code in (codes.INTERNAL_ERROR, codes.TEMPORARILY_UNAVAILABLE, codes.REQUEST_LIMIT_EXCEEDED):
        assert is_transient(mlflow_error(code)), code  # down server, locked SQLite, 429
    for code in (codes.INVALID_PARAMETER_VALUE, codes.RESOURCE_DOES_NOT_EXIST):
        assert not is_transient(mlflow_error(code)), code
    assert not is_transient(ValueError("a bug"))
    assert not is_transient(FileNotFoundError("no such folder"))  # a typo in a path stays one

    calls = []

    def flaky(fails: int, error: Exception):
        calls.append(time.monotonic())
        if len(calls) <= fails:
            raise error

    for attempt in retrying(seconds=5):
        with attempt:
            flaky(2, ConnectionResetError("reset"))
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert len(calls) == 3 and gaps[0] >= 0.25 and gaps[1] >= 0.5, gaps  # backoff 0.25, 0.5
    calls.clear()
    with pytest.raises(ValueError):
        for attempt in retrying(seconds=5):
            with attempt:
                flaky(5, ValueError("not transient"))
    assert len(calls) == 1
    calls.clear()
    tic = time.monotonic()
    with pytest.raises(ConnectionRefusedError):  # still down when the time is up
        for attempt in retrying(seconds=1):
            with attempt:
                flaky(99, ConnectionRefusedError())
    assert time.monotonic() - tic >= 1 and 2 <= len(calls) <= 5  # 0.25 + 0.5 + 1 s apart


def test_the_writer_queue_is_bounded_and_never_blocks():
    from omgrpo.tracking.worker import Worker

    release, ran = threading.Event(), []
    worker = Worker("test-writer", maxsize=2)
    assert worker.submit(release.wait)  # taken by the thread, which now waits
    deadline = time.monotonic() + 10
    while worker.queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.submit(ran.append, 1) and worker.submit(ran.append, 2)
    tic = time.perf_counter()
    assert not worker.submit(ran.append, 3)  # full: refused at once, not queued
    assert time.perf_counter() - tic < 1  # refused at once, not after blocking
    release.set()
    assert worker.wait(stall_s=5) and ran == [1, 2]
    worker.close()


@pytest.mark.slow
def test_an_unreachable_server_at_start_costs_the_retry_time_once(tmp_path):
    """Nothing listens on the port: `start` gives up after RETRY_S (MLflow's own HTTP retries,
    ~4 min a call, are off), one warning, and the run goes on without MLflow."""
    import socket

    from omgrpo.tracking.retry import RETRY_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fan = build_trackers(
        TrackingConfig(mlflow_uri=f"http://127.0.0.1:{port}", wandb=False), tmp_path
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tic = time.perf_counter()
        fan.start(tmp_path / "run", {}, name="n", group="g", tags=[])
        seconds = time.perf_counter() - tic
        for step in range(3):
            fan.log_metrics(step, {"x": 1.0})
        fan.finish("finished")
    ours = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(ours) == 1 and "failed in start()" in ours[0] and "omgrpo sync" in ours[0], ours
    assert RETRY_S <= seconds < RETRY_S + 30, seconds  # not MLflow's ~4 min
    assert fan.active == []
