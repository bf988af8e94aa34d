"""Many agents, one MLflow server, nothing lost or overwritten: a real `mlflow server` on 127.0.0.1,
started, killed, restarted and stopped by the test; `omgrpo train` processes that find it through
$MLFLOW_TRACKING_URI and $MLFLOW_EXPERIMENT_NAME alone, and `omgrpo sync` afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from omgrpo import cli
from omgrpo.sweep import status_if_readable
from omgrpo.tracking.naming import as_float, sanitize_metric_name
from omgrpo.tracking.retry import MLFLOW_HTTP_DEFAULTS, RETRY_S
from omgrpo.tracking.store import RunStore

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` (SQLite backend, local artifact root) on a free loopback port, as a
    context manager that stops it (the whole process group: the server and its uvicorn
    worker) however the test ends; `kill()` and `start()` take it down and bring it back on
    the same port and database, as a crashed and restarted server."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.db = root / "server.db"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill(signal.SIGTERM)

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.db}",
            "--default-artifact-root", (self.root / "artifacts").as_uri(),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        # MLflow 3's server jobs (GenAI job runners: ~6 huey consumer processes, ~5 CPU-s of
        # imports each) are never used by omgrpo; docs/tracking.md's server command turns them off
        env = {
            **os.environ,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        with (self.root / "server.log").open("a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        # bounded, with room for a loaded 2-core CI machine (90 s once ran out there while two
        # suites shared the cores); a healthy start takes a few seconds
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{self.uri}/health", timeout=2).status == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill(signal.SIGTERM)
                raise AssertionError((self.root / "server.log").read_text()[-2000:])
            time.sleep(0.5)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train_in(cwd: Path, name: str, overrides: list[str], env: dict) -> subprocess.Popen:
    """`omgrpo train` in `cwd`, its output in `cwd/<name>.out` (a pipe that nobody reads while
    it runs could fill up and stall the run)."""
    cmd = [sys.executable, "-m", "omgrpo", "train", *overrides, "run.root=runs", f"run.name={name}"]
    with (cwd / f"{name}.out").open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.out = cwd / f"{name}.out"  # type: ignore[attr-defined]
    return proc


def wait_ok(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Wait for `train_in` processes; their outputs, asserting each exited 0."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    outputs = [p.out.read_text() for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), [o[-3000:] for o in outputs]
    return outputs


def local_points(run_dir: Path) -> dict[tuple[str, int], float]:
    """(MLflow key, step) -> value of every finite number in a run's metrics.jsonl."""
    out = {}
    for step, metrics in RunStore(run_dir).metric_rows():
        for name, value in metrics.items():
            value = as_float(value)
            if value is not None and name != "train/step":
                out[sanitize_metric_name(name), step] = value
    return out


def server_points(db: Path, run_id: str) -> list[tuple[str, int, float]]:
    """(key, step, value) of every metric point of an MLflow run, read from the server's SQLite
    store (MLflow's `metrics` table holds one row per logged point: a point logged twice shows
    twice, which the client's views would not all show; and one query is much quicker than a
    `get_metric_history` per key)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        query = "SELECT key, step, value FROM metrics WHERE run_uuid = ?"
        return [(k, int(s), float(v)) for k, s, v in conn.execute(query, (run_id,))]


def server_steps(db: Path, run_id: str | None) -> set[int]:
    """Steps of `reward/total` the server has for a run ({} before it has the run)."""
    if run_id is None or not db.exists():
        return set()
    try:
        return {s for k, s, _ in server_points(db, run_id) if k == "reward/total"}
    except sqlite3.OperationalError:  # the table is created or written just now
        return set()


def shared_env(uri: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": uri,
           "MLFLOW_EXPERIMENT_NAME": "shared", "WANDB_MODE": "offline",
           "OMGRPO_MLFLOW_PROBE_S": str(PROBE_S)}  # fmt: skip
    env.pop("WANDB_SERVICE", None)  # not the W&B service of an earlier in-process run
    return env


def run_overrides(tiny_overrides: list[str], steps: int) -> list[str]:
    return [
        *(o for o in tiny_overrides if not o.startswith(("tracking.", "run.root="))),
        f"trainer.steps={steps}",
        "trainer.threads=1",
        "tracking.wandb=false",
    ]


DOWN_WARNING = "is not taking this run's writes"
PROBE_S = 1.0  # the runs try the server again at most this often while it is down
OUTAGE_S = 10.0
STEPS = 20
"""Enough for every run to train on after the restart whatever the machine's speed: the test
paces the runs around the crash (`crash_mid_run`), so each has trained about 10 steps at most
when the server comes back (4 on a loaded 2-core machine)."""


def test_agents_share_one_server_through_a_crash_and_a_reused_path(
    tiny_overrides, tmp_path, monkeypatch
):
    """2 runs at once from two working directories with identical relative run paths, into
    one experiment found through $MLFLOW_TRACKING_URI / $MLFLOW_EXPERIMENT_NAME. The server is
    killed (SIGKILL) once every run has logged 2 steps to it and comes back 10 s later on the
    same port and database: the runs carry on, each warns once and logs live again once the
    server answers; `omgrpo sync` then adds exactly the steps the server missed to the same
    MLflow runs. Then a third run at the absolute path of a finished run moved away (a second
    container with the same layout). In the end: 3 active runs, none superseded or deleted,
    each with every point of its metrics.jsonl exactly once."""
    dirs = [tmp_path / "agent_a", tmp_path / "agent_b"]
    for d in dirs:
        d.mkdir()
    # one run per agent (2 per agent took twice the CPU and tested nothing more: every run
    # meets the crash alone, paced by `crash_mid_run`)
    runs = [d / "runs" / "r0" for d in dirs]
    overrides = run_overrides(tiny_overrides, STEPS)
    prepare_base(overrides)
    with MlflowServer(tmp_path) as server:
        env = shared_env(server.uri)
        procs = [train_in(d, "r0", overrides, env) for d in dirs]
        before = crash_mid_run(server, runs, procs)
        outputs = wait_ok(procs)
        # each run: one warning; steps in the server from before the kill and after the
        # restart (the server has none from the outage: it was dead; every run was still
        # training at the restart); and a gap between them that the sync fills. Not "up to the
        # last step": `finish` waits at most STALL_TIMEOUT_S for an answer, and a loaded CI
        # machine's server once took longer for a run's last batch (steps 59-60 of 60 went to
        # the sync, as designed)
        resumed = []
        for run_dir, out, old in zip(runs, outputs, before, strict=True):
            assert out.count(DOWN_WARNING) == 1, out[-3000:]
            assert "failed in" not in out, out[-3000:]  # MLflow was never switched off
            assert RunStore(run_dir).unsynced() == ["mlflow"]
            logged = server_steps(server.db, mlflow_id(run_dir))
            assert len(old) >= 2 and old <= logged
            resumed.append(len(logged - old))
            assert len(logged) < STEPS + 1, (run_dir, sorted(logged))  # ... and a gap
        assert any(resumed), resumed  # live again after the restart

        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        for var, value in MLFLOW_HTTP_DEFAULTS.items():  # what `omgrpo sync` would set
            monkeypatch.setenv(var, os.environ.get(var, value))
        ids = [mlflow_id(r) for r in runs]
        for run_dir in runs:
            assert cli.main(["sync", str(run_dir), "--to", "mlflow"]) == 0
        assert [mlflow_id(r) for r in runs] == ids  # the same MLflow runs, filled in
        counted = len(server_points(server.db, ids[0]))
        assert cli.main(["sync", str(runs[0]), "--to", "mlflow"]) == 0  # nothing left to add
        assert len(server_points(server.db, ids[0])) == counted
        assert all(RunStore(r).unsynced() == [] for r in runs)

        moved = tmp_path / "archive" / "r0"
        moved.parent.mkdir()
        shutil.move(runs[0], moved)
        wait_ok([train_in(dirs[0], "r0", run_overrides(tiny_overrides, 3), env)])
        runs = [moved, *runs[1:], dirs[0] / "runs" / "r0"]
        assert_each_run_once_as_stored(server, runs)


def prepare_base(overrides: list[str]) -> None:
    """Train the runs' toy base here, once, before they start (runs starting at once
    would each train it)."""
    from omgrpo.config import compose
    from omgrpo.models.loading import base_model_dir
    from omgrpo.tasks.registry import load_task

    cfg = compose(overrides)
    base_model_dir(cfg.model, cfg.task, load_task(cfg.task))


def crash_mid_run(server: MlflowServer, runs: list[Path], procs) -> list[set[int]]:
    """Kill the server once every run has logged 2 steps to it, restart it OUTAGE_S later with
    every run still training; the steps each run had in the server at the kill.

    Whether a run is still training at the restart must not depend on the machine's speed (on
    a fast CI machine the runs all ran 150 steps within the outage; on a loaded one they started
    a minute apart), so the runs are paced with SIGSTOP / SIGCONT and STEPS need only cover
    the few steps each trains around the crash: a run that has logged 2 steps to the server
    waits (stopped) for the slowest to do so; after the kill, a run that has trained 2 steps
    past the server's waits until its writer has retried the dead server for RETRY_S (its
    writes stay queued meanwhile), then trains until it has found the server down (the warning,
    `missed_writes`) and waits again until the server is back."""
    stopped: set[int] = set()

    def stop(i: int) -> None:
        if i not in stopped:
            os.kill(procs[i].pid, signal.SIGSTOP)
            stopped.add(i)

    def resume(i: int) -> None:
        if i in stopped:
            os.kill(procs[i].pid, signal.SIGCONT)
            stopped.discard(i)

    def running() -> None:
        assert all(p.poll() is None for p in procs), [p.out.read_text()[-2000:] for p in procs]
        assert time.monotonic() < deadline, "the runs did not get through the crash in 300 s"

    deadline = time.monotonic() + 300
    try:
        while True:
            logged = [len(server_steps(server.db, mlflow_id(r))) for r in runs]
            for i in (i for i, n in enumerate(logged) if n >= 2):
                stop(i)
            if min(logged) >= 2:
                break
            running()
            time.sleep(0.05)
        server.kill()  # SIGKILL: no goodbye to the clients
        down_at = time.monotonic()
        before = [server_steps(server.db, mlflow_id(r)) for r in runs]
        for i in range(len(runs)):
            resume(i)
        noticed = [False] * len(runs)
        retried = RETRY_S + 2.5  # from the kill: every writer has retried for RETRY_S
        while not all(noticed):
            for i, (run_dir, old) in enumerate(zip(runs, before, strict=True)):
                if noticed[i]:
                    continue
                if missed_writes(run_dir, old):
                    stop(i)
                    noticed[i] = True
                elif time.monotonic() - down_at >= retried:
                    resume(i)
                elif local_step(run_dir) >= max(old) + 2:
                    stop(i)
            running()
            time.sleep(0.05)
        time.sleep(max(OUTAGE_S - (time.monotonic() - down_at), 0))
        server.start()
    finally:
        for i in range(len(runs)):
            resume(i)
    return before


def assert_each_run_once_as_stored(server: MlflowServer, runs: list[Path]) -> None:
    """The experiment holds exactly these runs, active and finished, none superseded or
    deleted, each holding every point of its metrics.jsonl once (and nothing else)."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("shared")
    active = client.search_runs([exp.experiment_id])
    assert len(active) == len(runs)
    assert all("omgrpo.superseded_by" not in r.data.tags for r in active)
    assert all(r.info.status == "FINISHED" for r in active)
    assert client.search_runs([exp.experiment_id], run_view_type=ViewType.DELETED_ONLY) == []
    by_uuid = {r.data.tags["omgrpo.run_uuid"]: r.info.run_id for r in active}
    for run_dir in runs:
        run_id = by_uuid.pop(RunStore(run_dir).run_uuid())
        assert run_id == mlflow_id(run_dir)
        points = server_points(server.db, run_id)
        keys = [(k, s) for k, s, _ in points]
        assert len(keys) == len(set(keys)), f"{run_dir}: a point twice"
        assert {(k, s): v for k, s, v in points} == pytest.approx(local_points(run_dir))
    assert by_uuid == {}


def missed_writes(run_dir: Path, in_server: set[int]) -> bool:
    """The run has trained 2 steps past those in the server and noticed (in its run store)
    that MLflow missed writes (its MLflow writes are sent from a background thread, so a step
    done is not yet a write lost)."""
    return local_step(run_dir) >= max(in_server) + 2 and RunStore(run_dir).unsynced() == ["mlflow"]


def mlflow_id(run_dir: Path) -> str | None:
    return RunStore(run_dir).tracker_ids().get("mlflow") if run_dir.exists() else None


def local_step(run_dir: Path) -> int:
    return int(status_if_readable(run_dir).get("step", 0))
