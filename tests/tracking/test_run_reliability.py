"""Runs that survive what happens to real runs: kill -9 and resume (the trackers show each step
once), a damaged checkpoint, an exception mid-run, a moved run directory. Real components only:
training subprocesses, the SQLite MLflow store, W&B's offline files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import wandb_records  # tests/ is on sys.path (pytest's rootdir conftest)
import yaml
from mlflow.tracking import MlflowClient
from run_values import logged_values

from omgrpo.backends.native.trainer import train
from omgrpo.config import compose
from omgrpo.core import step as step_module  # where the step computes its rewards
from omgrpo.sweep import main as sweep_main
from omgrpo.sweep import plan_runs, status_if_readable
from omgrpo.tracking.store import RunStore

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# Self-Certainty beside OM-GRPO's vote and format parts: a continuous reward, so every group
# has reward spread and every step updates the weights and the optimizer state a resume must
# restore (the 5-step tiny base earns the vote and format parts 0 everywhere on some machines:
# nothing trains, and a resume that lost the weights or the optimizer state still matched)
SPREAD = "reward.parts=[soft_vote,format,self_certainty]"


def _train_cli(overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # an earlier in-process W&B run exports its service's socket: a child attached to it would
    # leave its run's files to this process's service, which writes them late
    env.pop("WANDB_SERVICE", None)
    cmd = [sys.executable, "-m", "omgrpo", "train", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def test_sigkill_mid_step_then_resume_trackers_show_each_step_once(tiny_overrides, tmp_path):
    common = [
        *[o for o in tiny_overrides if not o.startswith("tracking.")],
        "trainer.steps=8",
        "trainer.save_every=4",
        "trainer.threads=1",
        "tracking.mlflow=true",
        "tracking.wandb=true",
        SPREAD,
    ]
    root = tmp_path / "runs"
    # The reference: the same run, uninterrupted (trackers do not change training).
    reference = train(
        compose([*common, "run.name=reference", "tracking.mlflow=false", "tracking.wandb=false"])
    )
    expected = logged_values(reference)
    assert sorted(expected) == list(range(9))
    assert all(expected[s]["grad/norm"] > 0 for s in range(1, 9))  # every step trained

    run_dir = root / "killed"
    proc = _train_cli([*common, "run.name=killed"])
    deadline = time.monotonic() + 300
    # Kill once step 5 is done and in MLflow (its writer is asynchronous): then in step 6, with
    # steps 5.. to recompute from the checkpoint at 4.
    while status_if_readable(run_dir).get("step", 0) < 5 or 5 not in _logged_steps(
        root / "mlflow.db"
    ):
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert RunStore(run_dir).latest_checkpoint().name == "step_000004"

    resumed = _train_cli([*common, "run.name=killed", "run.resume=true"])
    out = resumed.communicate(timeout=600)[0].decode()
    assert resumed.returncode == 0, out[-3000:]
    assert "resuming" in out and "from step 4" in out
    got = logged_values(run_dir)
    assert got == expected  # the local store, as before

    # MLflow: one active run of this directory; each step once, with the resumed values.
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`omgrpo.run_dir` = '{run_dir.resolve()}'",
    )
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    for key in ("reward/total", "loss/pg", "val/acc", "lr", "answers/unique_per_prompt"):
        history = client.get_metric_history(runs[0].info.run_id, key)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{key}: a step twice: {sorted(steps)}"
        want = {s: row[key] for s, row in expected.items() if key in row}
        assert {m.step: m.value for m in history} == pytest.approx(want), key

    # W&B offline: one folder to upload for this run id (the killed segment is superseded),
    # holding each step once, with the resumed values.
    (segment,) = sorted((run_dir / "wandb").glob("offline-run-*"))
    (wandb_file,) = segment.glob("*.wandb")
    rows = [r for r in _wandb_history(wandb_file) if "reward/total" in r or "val/acc" in r]
    steps = [r["train/step"] for r in rows]
    assert steps == sorted(set(steps)) == list(range(9)), steps
    for row in rows:
        want = expected[row["train/step"]]
        for key in ("reward/total", "loss/pg", "val/acc"):
            if key in want:
                assert row[key] == pytest.approx(want[key]), (row["train/step"], key)
    assert wandb_records.config(wandb_file)["_resumed_from_step"] == 4
    assert segment.name.endswith(RunStore(run_dir).tracker_ids()["wandb"])
    assert len(list((run_dir / "wandb" / "superseded").glob("offline-run-*"))) == 1


def _logged_steps(db: Path) -> set[int]:
    """Steps of `reward/total` in an MLflow SQLite store, read directly (MLflow's `metrics`
    table): polling through MlflowClient is too slow to stop a run mid-way."""
    if not db.exists():
        return set()
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            rows = conn.execute("SELECT step FROM metrics WHERE key = 'reward/total'").fetchall()
    except sqlite3.Error:  # not migrated yet, or busy
        return set()
    return {step for (step,) in rows}


def _wandb_history(path: Path, timeout: float = 30) -> list[dict]:
    """History rows once W&B's service has written the exit record (it flushes the file
    asynchronously after `finish` returns)."""
    deadline = time.monotonic() + timeout
    while wandb_records.exit_code(path) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return wandb_records.history(path)


def test_truncated_latest_checkpoint_is_named_and_resume_falls_back(tiny_overrides):
    common = [*tiny_overrides, "trainer.steps=4", "trainer.save_every=1", "run.name=trunc", SPREAD]
    reference = train(compose([*tiny_overrides, "trainer.steps=4", "run.name=reference", SPREAD]))
    assert all(logged_values(reference)[s]["grad/norm"] > 0 for s in (1, 2, 3, 4))  # it trained
    run_dir = train(compose(common), stop_after=3)  # checkpoints at 2 and 3 (keep 2)
    latest = run_dir / "checkpoints" / "step_000003" / "state.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a full disk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(compose([*common, "run.resume=true"]))
    named = [str(w.message) for w in caught if str(latest) in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]
    assert logged_values(run_dir) == logged_values(reference)  # resumed from step 2, exactly
    assert RunStore(run_dir).read_status()["state"] == "finished"


def test_exception_marks_failed_and_sweep_skips_it_unless_retry_failed(
    tiny_overrides, tmp_path, monkeypatch, capsys
):
    overrides = [*tiny_overrides, "trainer.steps=3", "trainer.save_every=1", "run.name=boom"]
    real, calls = step_module.compute_rewards, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("reward server unreachable")
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "compute_rewards", flaky)
    with pytest.raises(RuntimeError, match="reward server unreachable"):
        train(compose(overrides))
    monkeypatch.undo()
    run_dir = tmp_path / "runs" / "boom"
    status = RunStore(run_dir).read_status()
    assert status["state"] == "failed"
    assert status["error"]["type"] == "RuntimeError"
    assert status["error"]["message"] == "reward server unreachable"
    assert status["error"]["step"] == 1  # the last step that completed

    sweep = tmp_path / "one.yaml"
    sweep.write_text(yaml.safe_dump({"method": "grid", "parameters": {"seed": {"value": 0}}}))
    (run,) = plan_runs(sweep, overrides)
    assert run.state == "skip"
    assert sweep_main([str(sweep), *overrides]) == 0
    err = capsys.readouterr().err
    assert "skipped boom (failed: RuntimeError: reward server unreachable" in err
    assert "--retry-failed" in err
    assert sweep_main([str(sweep), "--retry-failed", *overrides]) == 0
    assert RunStore(run_dir).read_status()["state"] == "finished"
    assert sorted(logged_values(run_dir)) == [0, 1, 2, 3]


def test_a_refused_resume_leaves_the_status_alone(tiny_overrides, tmp_path):
    common = [*tiny_overrides, "trainer.steps=2", "trainer.save_every=1", "run.name=keep"]
    run_dir = train(compose(common), stop_after=1)
    before = json.loads((run_dir / "status.json").read_text())
    with pytest.raises(ValueError, match=r"optim\.lr"):
        train(compose([*common, "run.resume=true", "optim.lr=0.5"]))
    assert json.loads((run_dir / "status.json").read_text()) == before


def test_resume_accepts_a_moved_run_and_tracking_changes_but_not_lr(tiny_overrides, tmp_path):
    common = [o for o in tiny_overrides if not o.startswith("run.root=")]
    common += ["trainer.steps=3", "trainer.save_every=1", "run.name=moved"]
    first = tmp_path / "first"
    run_dir = train(compose([*common, f"run.root={first}"]), stop_after=2)
    second = tmp_path / "second"
    shutil.move(first, second)
    moved = [*common, f"run.root={second}", "run.resume=true"]
    with pytest.raises(ValueError, match=r"optim\.lr: 0\.001 -> 0\.5") as refused:
        train(compose([*moved, "optim.lr=0.5"]))
    assert "run.root" not in str(refused.value) and "tracking" not in str(refused.value)

    run_dir = train(compose([*moved, "tracking.wandb=true", "tracking.log_every=2"]))
    assert run_dir == second / "moved"
    assert sorted(logged_values(run_dir)) == [0, 1, 2, 3]
    assert RunStore(run_dir).read_status()["state"] == "finished"
