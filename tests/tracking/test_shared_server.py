"""Many agents, one MLflow server (issue 27): a real `mlflow server` on 127.0.0.1, started and
stopped by the test; `omgrpo train` processes that find it through $MLFLOW_TRACKING_URI and
$MLFLOW_EXPERIMENT_NAME alone."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
KEYS = ("reward/total", "loss/pg", "answers/unique_per_prompt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path):
    """`mlflow server` (SQLite backend, local artifact root) on a free loopback port; yields its
    URI; the whole process group (the server and its uvicorn worker) is stopped afterwards."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
        "--default-artifact-root", (root / "artifacts").as_uri(),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        # bounded, with room for a loaded 2-core CI machine (90 s once ran out there while two
        # suites shared the cores); a healthy start takes a few seconds
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not start in 300 s"
            time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def train_in(cwd: Path, name: str, overrides: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "omgrpo", "train", *overrides, "run.root=runs", f"run.name={name}"]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def local_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["train/step"], float(r[key])) for r in rows if isinstance(r.get(key), int | float)]


def test_four_agents_and_a_reused_path_share_one_server(tiny_overrides, tmp_path):
    """4 runs at once from two working directories with identical relative run paths, then a
    fifth at the absolute path of a finished run moved away (a second container with the same
    layout): 5 active runs in one experiment, none superseded, each with every step once and
    equal to its own metrics.jsonl."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    overrides = [
        *(o for o in tiny_overrides if not o.startswith(("tracking.", "run.root="))),
        "trainer.steps=3",
        "trainer.threads=1",
        "tracking.wandb=false",
    ]
    dirs = [tmp_path / "agent_a", tmp_path / "agent_b"]
    for d in dirs:
        d.mkdir()
    with mlflow_server(tmp_path) as uri:
        env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": uri,
               "MLFLOW_EXPERIMENT_NAME": "shared", "WANDB_MODE": "offline"}  # fmt: skip
        env.pop("WANDB_SERVICE", None)  # not the W&B service of an earlier in-process run
        procs = [train_in(d, name, overrides, env) for d in dirs for name in ("r0", "r1")]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, outputs
        runs = [d / "runs" / name for d in dirs for name in ("r0", "r1")]
        moved = tmp_path / "archive" / "r0"
        moved.parent.mkdir()
        shutil.move(runs[0], moved)
        fifth = train_in(dirs[0], "r0", overrides, env)
        out = fifth.communicate(timeout=300)[0]
        assert fifth.returncode == 0, out
        runs = [moved, *runs[1:], dirs[0] / "runs" / "r0"]

        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("shared")
        active = client.search_runs([exp.experiment_id])
        assert len(active) == 5
        assert all("omgrpo.superseded_by" not in r.data.tags for r in active)
        assert client.search_runs([exp.experiment_id], run_view_type=ViewType.DELETED_ONLY) == []
        by_uuid = {r.data.tags["omgrpo.run_uuid"]: r for r in active}
        for run_dir in runs:
            run_uuid = json.loads((run_dir / "identity.json").read_text())["uuid"]
            run = by_uuid.pop(run_uuid)
            for key in KEYS:
                history = sorted(
                    (m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)
                )
                expected = local_history(run_dir, key)
                assert [s for s, _ in history] == [s for s, _ in expected], (run_dir, key)
                assert [v for _, v in history] == pytest.approx([v for _, v in expected])
        assert by_uuid == {}
