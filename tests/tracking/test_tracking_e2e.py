"""Trackers wired into the trainer: a broken MLflow URI never stops training, and `omgrpo sync`
replays the run afterwards with nothing lost."""

import subprocess
import sys
import time
import warnings
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from mlflow.tracking._tracking_service import utils as mlflow_uri_state

from omgrpo.backends.native.trainer import train
from omgrpo.config import compose
from omgrpo.tracking import sanitize_metric_name
from omgrpo.tracking.store import RunStore

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_mlflow_uri(monkeypatch):
    # mlflow.set_tracking_uri also exports $MLFLOW_TRACKING_URI, which training honours
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    before = mlflow_uri_state._tracking_uri
    yield
    mlflow_uri_state._tracking_uri = before


def test_broken_mlflow_uri_trains_to_the_end_then_syncs(tiny_overrides, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the DB folder should be")
    overrides = [o for o in tiny_overrides if not o.startswith("tracking.")]
    cfg = compose(
        [
            *overrides,
            "trainer.steps=3",
            "run.name=broken",
            "tracking.wandb=false",
            f"tracking.mlflow_uri=sqlite:///{blocker}/mlflow.db",
        ]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train(cfg)
    assert any("mlflow" in str(w.message).lower() for w in caught)
    local = RunStore(run).read_metrics()
    assert list(local["train/step"]) == [0, 1, 2, 3]
    assert RunStore(run).read_status()["state"] == "finished"

    good = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run(
        [sys.executable, "-m", "omgrpo", "sync", str(run), "--to", "mlflow", "--mlflow-uri", good],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    mlflow.set_tracking_uri(good)
    runs = mlflow.search_runs(
        search_all_experiments=True, filter_string="tags.`omgrpo.run_dir` LIKE '%broken'"
    )
    assert len(runs) == 1
    client = MlflowClient(good)
    run_id = runs.iloc[0]["run_id"]
    for key in ("reward/total", "val/acc", "answers/unique_per_prompt"):
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(run_id, sanitize_metric_name(key))
        )
        expected = local[["train/step", key]].dropna()
        assert [s for s, _ in history] == list(expected["train/step"])
        assert [v for _, v in history] == pytest.approx(list(expected[key]))


def test_default_trackers_record_a_run(tiny_overrides, tmp_path):
    overrides = [o for o in tiny_overrides if not o.startswith("tracking.")]
    run = train(compose([*overrides, "trainer.steps=2", "run.name=tracked"]))
    assert list((run / "wandb").glob("offline-run-*"))  # W&B offline by default
    uri = f"sqlite:///{run.parent / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(search_all_experiments=True)
    assert len(runs) == 1 and runs.iloc[0]["status"] == "FINISHED"
    assert runs.iloc[0]["params.algorithm.answer_weight"] == "0.0"


def test_provenance_reaches_the_run_store_mlflow_and_wandb(tiny_overrides, tmp_path):
    """A toy run records what produced it: provenance.json beside config.yaml, the same as
    MLflow tags and in the W&B config; a fresh run gets an identity both trackers carry."""
    import torch

    from omgrpo.tracking import RUN_UUID_TAG, stable_run_id

    overrides = [o for o in tiny_overrides if not o.startswith("tracking.")]
    run = train(compose([*overrides, "trainer.steps=1", "run.name=prov"]))
    store = RunStore(run)
    prov = store.read_provenance()
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert prov["git_commit"] == commit and isinstance(prov["git_dirty"], bool)
    assert prov["versions"]["torch"] == torch.__version__
    assert set(prov["versions"]) >= {"omgrpo", "torch", "transformers", "verl", "vllm"}
    assert prov["torch_build"] == (f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu")
    assert prov["device_count"] >= 1 and prov["device_names"]

    client = MlflowClient(f"sqlite:///{run.parent / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    tags = mlrun.data.tags
    assert tags["provenance.git_commit"] == commit
    assert tags["provenance.versions.torch"] == torch.__version__
    assert tags["provenance.torch_build"] == prov["torch_build"]
    assert tags[RUN_UUID_TAG] == store.run_uuid()

    (offline,) = (run / "wandb").glob(f"offline-run-*-{stable_run_id(store.run_uuid())}")
    data = b""
    for _ in range(300):  # W&B's service writes the file asynchronously after finish()
        (path,) = offline.glob("*.wandb")
        if commit.encode() in (data := path.read_bytes()):
            break
        time.sleep(0.1)
    assert commit.encode() in data and b"torch_build" in data
